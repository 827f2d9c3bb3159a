#!/usr/bin/env bash
# The main job's comparison (ar, ssd_exact, ssd_autocorrect; batch 1, CFG 3) with eager and with compiled backbone
# passes (decode.compile), alternating runs so that host drift falls on both; the main job's heads.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=docs/runs/compile/2026-12-07_b1
for round in 1 2; do
  for compile in false true; do
    python -m decode "decode.methods=[ar,ssd_exact,ssd_autocorrect]" decode.batch_size=1 decode.num_images=32 \
      decode.seeds=2 decode.compile=$compile decode.heads=checkpoints/ssd_digits \
      decode.out=/tmp/compile_b1/${compile}_$round
    cp /tmp/compile_b1/${compile}_$round/metrics.json $here/metrics_compile_${compile}_$round.json
    cp /tmp/compile_b1/${compile}_$round/summary.md $here/summary_compile_${compile}_$round.md
  done
done
