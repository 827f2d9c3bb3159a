#!/usr/bin/env bash
# Draining finished slots (decode/drain.py) against keeping them, ragged SSD and ragged EAGLE (depth by cost), two
# seeds, the methods interleaved, at 64 slots for 64 images (no queue: the batch drains to its slowest image) and
# at 16 slots over a 64-image queue (the queue's last images drain). The main job's 300-step SSD heads,
# +experiment=eagle_digits's head. Run from the repository root; writes metrics_b*.json and summary_b*.md here.
set -e
here=$(dirname "$0")
keep="+method@decode.presets.ssd_ragged_keep=ssd_ragged decode.presets.ssd_ragged_keep.drain=0
  +method@decode.presets.eagle_ragged_auto_keep=eagle_ragged_auto decode.presets.eagle_ragged_auto_keep.drain=0"
methods="decode.methods=[ar,ssd_ragged,ssd_ragged_keep,eagle_ragged_auto,eagle_ragged_auto_keep]"
python -m decode "$methods" $keep decode.batch_size=64 decode.num_images=64 decode.seeds=2 decode.out=/tmp/drain_b64
python -m decode "$methods" $keep decode.batch_size=16 decode.queue_batches=4 decode.num_images=64 decode.seeds=2 \
  decode.out=/tmp/drain_b16
for b in 64 16; do cp /tmp/drain_b$b/metrics.json "$here/metrics_b$b.json"; cp /tmp/drain_b$b/summary.md "$here/summary_b$b.md"; done
