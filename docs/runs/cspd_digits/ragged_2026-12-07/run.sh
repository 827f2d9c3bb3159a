#!/usr/bin/env bash
# Ragged CSpD (cspd_ragged, gamma 4 and 1) beside batched CSpD (gamma 4 and auto) and the KV-cached baseline on the
# embedded continuous backbone, the drafter of `python -m train +experiment=cspd_digits`. Batch 16: each turn is a
# 64-image queue (decode.queue_batches=4: the ragged methods decode it over 16 slots, the others batch by batch);
# batch 1: 16 images. 2 seeds, methods interleaved. Run from the repository root, the machine to itself.
set -euo pipefail
OUT=docs/runs/cspd_digits/ragged_2026-12-07
G1=(+method@decode.presets.cspd_ragged_g1=cspd_ragged decode.presets.cspd_ragged_g1.gamma=1)
METHODS="decode.methods=[ar,cspd,cspd_auto,cspd_ragged,cspd_ragged_g1]"
python -m decode +experiment=cspd_digits "$METHODS" "${G1[@]}" decode.batch_size=16 decode.queue_batches=4 \
  decode.num_images=64 decode.seeds=2 decode.out=$OUT/b16
python -m decode +experiment=cspd_digits "$METHODS" "${G1[@]}" decode.batch_size=1 decode.num_images=16 \
  decode.seeds=2 decode.out=$OUT/b1
