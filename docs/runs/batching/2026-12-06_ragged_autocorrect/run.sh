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
# The budget: rounds 6 (the preset), 3, 2 and 1 at batch 16 (metrics_rounds_b16.json, summary_rounds_b16.md)
python -m decode "decode.methods=[ar,ssd_ragged_autocorrect,sra_r3,sra_r2,sra_r1]" \
  +method@decode.presets.sra_r3=ssd_ragged_autocorrect decode.presets.sra_r3.rounds=3 \
  +method@decode.presets.sra_r2=ssd_ragged_autocorrect decode.presets.sra_r2.rounds=2 \
  +method@decode.presets.sra_r1=ssd_ragged_autocorrect decode.presets.sra_r1.rounds=1 \
  decode.batch_size=16 decode.queue_batches=4 decode.num_images=64 decode.seeds=2 decode.out=/tmp/sra_rounds_b16
cp /tmp/sra_rounds_b16/metrics.json "$here/metrics_rounds_b16.json"
cp /tmp/sra_rounds_b16/summary.md "$here/summary_rounds_b16.md"
