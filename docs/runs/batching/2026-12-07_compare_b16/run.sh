#!/usr/bin/env bash
# Issue 28's comparison at batch 16 in one run: every batched method of compare_digits beside its ragged form and
# the KV-cached baseline, the main job's SSD heads (`python -m train`), `+experiment=eagle_digits`'s head (EAGLE,
# LANTERN) and `+experiment=mulo_digits`'s drafter at its operating point (compare_digits' presets). Each turn is a
# 32-image queue (decode.queue_batches=2: a ragged method decodes it over 16 slots, the others batch by batch),
# 2 seeds, methods interleaved turn by turn. Left out: ssd_tree, eagle2, eagle_depth3, eagle_ragged (depth 6) and
# gsd (it draws sjd's tokens on this backbone, docs/results.md). Run from the repository root, the machine to itself.
set -euo pipefail
OUT=docs/runs/batching/2026-12-07_compare_b16
python -m decode +experiment=compare_digits hydra.mode=RUN \
  "decode.methods=[ar,ssd_exact,ssd_ragged,ssd_autocorrect,ssd_ragged_autocorrect,mulo,mulo_exact,mulo_ragged,sjd,sjd_ragged,gsd_ragged,zipar,eagle,eagle_ragged_auto,lantern,lantern_ragged]" \
  decode.batch_size=16 decode.queue_batches=2 decode.num_images=32 decode.seeds=2 decode.out=$OUT
