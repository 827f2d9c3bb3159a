#!/usr/bin/env bash
# Batch 16, two seeds (the setting), a 64-image queue per turn, the methods interleaved (2026-12-06 at f83ee00):
# the main job's 300-step SSD heads, +experiment=eagle_digits's head.
set -e
python -m decode "decode.methods=[ar,ssd_exact,ssd_ragged,eagle_ragged,eagle_ragged_auto,sjd,sjd_ragged]" \
  decode.batch_size=16 decode.queue_batches=4 decode.num_images=64 decode.seeds=2 decode.out=b16
mv b16/metrics.json metrics_b16.json; mv b16/summary.md summary_b16.md; rm -r b16
