#!/usr/bin/env bash
# Ragged lossless MuLo-SD (mulo_ragged) beside batched mulo_exact, relaxed mulo and the KV-cached baseline, the
# drafter of `python -m train +experiment=mulo_digits` at its operating point (the experiment's presets: bicubic
# upsampling, mulo's k 6 and delta 0.9). Batch 16: each turn is a 64-image queue
# (decode.queue_batches=4: mulo_ragged decodes it over 16 slots, the others batch by batch); batch 1: 16 images.
# 2 seeds, methods interleaved. Run from the repository root, the machine to itself.
set -euo pipefail
OUT=docs/runs/batching/2026-12-07_mulo_ragged
METHODS="decode.methods=[ar,mulo,mulo_exact,mulo_ragged]"
python -m decode +experiment=mulo_digits "$METHODS" decode.batch_size=16 decode.queue_batches=4 decode.num_images=64 decode.seeds=2 \
  decode.out=$OUT/b16
python -m decode +experiment=mulo_digits "$METHODS" decode.batch_size=1 decode.num_images=16 decode.seeds=2 decode.out=$OUT/b1
