#!/usr/bin/env bash
# The batch sweep of 2026-12-06 at 3001931 (the main job's 300-step SSD heads, `+experiment=eagle_digits`'s head),
# one seed, each batch size one process with the methods interleaved; batch 4-64 as one 64-image queue per turn.
set -e
M="decode.methods=[ar,ssd_exact,ssd_autocorrect,ssd_ragged,ssd_ragged_lookahead,eagle,eagle_ragged]"
python -m decode "$M" decode.batch_size=1 decode.num_images=16 decode.out=b1
for b in 4 16 64; do
  python -m decode "$M" decode.batch_size=$b decode.queue_batches=$((64 / b)) decode.num_images=64 decode.out=b$b
done
python -m decode.throughput_plot b1 b4 b16 b64 --out throughput_batch.png
