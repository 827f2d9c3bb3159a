#!/usr/bin/env bash
# Ragged EAGLE at a fixed depth (6, the authors') and with cost-aware depth (2026-12-06), `+experiment=eagle_digits`'s
# head, one seed, each batch size one process with the methods interleaved; batch 4 and 16 as one 64-image queue.
set -e
M="decode.methods=[ar,eagle,eagle_ragged,eagle_ragged_auto]"
python -m decode "$M" decode.batch_size=1 decode.num_images=16 decode.out=b1
for b in 4 16; do
  python -m decode "$M" decode.batch_size=$b decode.queue_batches=$((64 / b)) decode.num_images=64 decode.out=b$b
done
for b in 1 4 16; do mv b$b/metrics.json metrics_b$b.json; mv b$b/summary.md summary_b$b.md; rm -r b$b; done
