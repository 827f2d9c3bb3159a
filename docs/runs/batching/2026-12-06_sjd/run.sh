#!/usr/bin/env bash
# Ragged SJD in the batch sweep (2026-12-06): ar, sjd, sjd_ragged and ssd_ragged (the main job's 300-step SSD heads,
# for reference), one seed, each batch size one process with the methods interleaved; batch 4-64 as one 64-image
# queue per turn. gsd is left out: on the digits backbone its group is the draft alone (docs/results.md), so it
# draws sjd's tokens.
set -e
M="decode.methods=[ar,sjd,sjd_ragged,ssd_ragged]"
python -m decode "$M" decode.batch_size=1 decode.num_images=16 decode.out=b1
for b in 4 16 64; do
  python -m decode "$M" decode.batch_size=$b decode.queue_batches=$((64 / b)) decode.num_images=64 decode.out=b$b
done
python -m decode.throughput_plot b1 b4 b16 b64 --out throughput_batch.png
