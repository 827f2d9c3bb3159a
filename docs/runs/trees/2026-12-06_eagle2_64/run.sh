#!/usr/bin/env bash
# EAGLE-2's dynamic tree (the authors' 60 nodes, 6 levels, top-10) against EAGLE's chain of 6, batch 1, 64 images x 2
# seeds, interleaved, +experiment=eagle_digits's head: tokens per pass (issue 29's >= 1.3x target). Run from the
# repository root; writes metrics.json and summary.md here.
set -e
here=$(dirname "$0")
python -m decode "decode.methods=[ar,eagle,eagle2]" decode.batch_size=1 decode.num_images=64 decode.seeds=2 \
  decode.out=/tmp/eagle2_64
cp /tmp/eagle2_64/metrics.json /tmp/eagle2_64/summary.md "$here/"
