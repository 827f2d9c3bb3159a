#!/usr/bin/env bash
# ssd_ragged (and eagle_ragged_auto at batch 16) against ar with longer queues than the compare_digits job's 32
# images, so that a queue's slowest images weigh less: batch 16 with 64-image queues, batch 64 with 128-image
# queues, 2 seeds, interleaved; the main job's heads and +experiment=eagle_digits's head. From the repository
# root, the machine to itself. Arguments (for reruns of the same commands): the output folder and batch 16's
# methods.
set -euo pipefail
OUT=${1:-docs/runs/batching/2026-12-07_long_queues}
B16_METHODS=${2:-[ar,ssd_ragged,eagle_ragged_auto]}
python -m decode hydra.mode=RUN "decode.methods=$B16_METHODS" decode.batch_size=16 \
  decode.queue_batches=4 decode.num_images=64 decode.seeds=2 decode.out=$OUT/b16
python -m decode hydra.mode=RUN "decode.methods=[ar,ssd_ragged]" decode.batch_size=64 \
  decode.queue_batches=2 decode.num_images=128 decode.seeds=2 decode.out=$OUT/b64
