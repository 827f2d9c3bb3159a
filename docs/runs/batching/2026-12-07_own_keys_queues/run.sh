#!/usr/bin/env bash
# ssd_ragged against ar with the ragged attention over each row group's own keys (backbones/ragged_attention.py),
# the same commands as docs/runs/batching/2026-12-07_long_queues/run.sh without EAGLE: batch 16 with 64-image
# queues, batch 64 with 128-image queues, 2 seeds, interleaved, the main job's heads. From the repository root, the
# machine to itself.
set -euo pipefail
OUT=docs/runs/batching/2026-12-07_own_keys_queues
python -m decode hydra.mode=RUN "decode.methods=[ar,ssd_ragged]" decode.batch_size=16 \
  decode.queue_batches=4 decode.num_images=64 decode.seeds=2 decode.out=$OUT/b16
python -m decode hydra.mode=RUN "decode.methods=[ar,ssd_ragged]" decode.batch_size=64 \
  decode.queue_batches=2 decode.num_images=128 decode.seeds=2 decode.out=$OUT/b64
