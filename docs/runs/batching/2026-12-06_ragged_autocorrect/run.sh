#!/usr/bin/env bash
# ssd_ragged_autocorrect (ragged SSD, mode prefix: ssd_autocorrect's rule with ragged frontiers and continuous
# batching) beside ar, ssd_autocorrect and ssd_ragged at batch 1, 4, 16 and 64, two seeds, the methods interleaved,
# batch 4 and 16 a 64-image queue per turn, batch 64 64 images, batch 1 16 images. The main job's 300-step SSD heads.
# Run from the repository root; writes metrics_b*.json and summary_b*.md here.
set -e
here=$(dirname "$0")
methods="decode.methods=[ar,ssd_autocorrect,ssd_ragged,ssd_ragged_autocorrect]"
for b in 16 64 4; do
  python -m decode "$methods" decode.batch_size=$b decode.queue_batches=$((64 / b)) decode.num_images=64 \
    decode.seeds=2 decode.out=/tmp/ragged_autocorrect_b$b
done
python -m decode "$methods" decode.batch_size=1 decode.num_images=16 decode.seeds=2 decode.out=/tmp/ragged_autocorrect_b1
for b in 16 64 4 1; do
  cp /tmp/ragged_autocorrect_b$b/metrics.json "$here/metrics_b$b.json"
  cp /tmp/ragged_autocorrect_b$b/summary.md "$here/summary_b$b.md"
done
