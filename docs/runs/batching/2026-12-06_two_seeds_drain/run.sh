#!/usr/bin/env bash
# ssd_ragged (draining, cost-aware windows) against the baseline with two seeds (issue 28's setting) at batch 16 and
# 64, a 64-image queue per turn, the methods interleaved, the main job's 300-step SSD heads. Run from the repository
# root; writes metrics_b*.json and summary_b*.md here.
set -e
here=$(dirname "$0")
for b in 16 64; do
  python -m decode "decode.methods=[ar,ssd_ragged]" decode.batch_size=$b decode.queue_batches=$((64 / b)) \
    decode.num_images=64 decode.seeds=2 decode.out=/tmp/two_seeds/b$b
  cp /tmp/two_seeds/b$b/metrics.json "$here/metrics_b$b.json"; cp /tmp/two_seeds/b$b/summary.md "$here/summary_b$b.md"
done
