#!/usr/bin/env bash
# Ragged CSpD with each round's draft count chosen by cost (cspd_ragged_auto) beside ragged CSpD at gamma 1 (the
# count cspd_auto's chooser settles on here), batched cspd_auto and the KV-cached baseline on the embedded continuous
# backbone, the drafter of `python -m train +experiment=cspd_digits`. Batch 16, each turn a 32-image queue
# (decode.queue_batches=2: the ragged methods decode it over 16 slots, the others batch by batch), 2 seeds, methods
# interleaved. Run from the repository root, the machine to itself.
set -euo pipefail
OUT=docs/runs/cspd_digits/ragged_auto_2026-12-07
G1=(+method@decode.presets.cspd_ragged_g1=cspd_ragged decode.presets.cspd_ragged_g1.gamma=1)
python -m decode +experiment=cspd_digits "decode.methods=[ar,cspd_auto,cspd_ragged_g1,cspd_ragged_auto]" "${G1[@]}" \
  decode.batch_size=16 decode.queue_batches=2 decode.num_images=32 decode.seeds=2 decode.out=$OUT/b16
