#!/usr/bin/env bash
# Lighter SSD heads for batch decoding on a CPU: the main job's recipe at head width 128 instead of 256 (the
# vertical head's row attention and the grid head's MLP cost ~1/4 and ~1/2 the multiply-adds), against the main
# job's heads, in ssd_ragged at batch 16, 32-image queues, 2 seeds, interleaved with ar. Run from the repository
# root with the main job's heads in checkpoints/ssd_digits, the machine to itself.
set -euo pipefail
OUT=docs/runs/batching/2026-12-07_light_heads_b16
python -m train train.evaluate=null head.width=128 experiment_name=ssd_digits_w128
python -m decode hydra.mode=RUN "decode.methods=[ar,ssd_ragged,ssd_ragged_w128]" \
  +method@decode.presets.ssd_ragged_w128=ssd_ragged decode.presets.ssd_ragged_w128.heads=checkpoints/ssd_digits_w128 \
  decode.batch_size=16 decode.queue_batches=2 decode.num_images=32 decode.seeds=2 decode.out=$OUT
