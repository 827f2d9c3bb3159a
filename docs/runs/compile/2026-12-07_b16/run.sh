#!/usr/bin/env bash
# Batch 16 (a 64-image queue per turn): ar, ssd_exact and ssd_ragged with eager and with compiled backbone passes
# (decode.compile), alternating runs; the main job's heads.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=docs/runs/compile/2026-12-07_b16
for compile in false true; do
  python -m decode "decode.methods=[ar,ssd_exact,ssd_ragged]" decode.batch_size=16 decode.queue_batches=4 \
    decode.num_images=64 decode.seeds=1 decode.compile=$compile decode.heads=checkpoints/ssd_digits \
    decode.out=/tmp/compile_b16/$compile
  cp /tmp/compile_b16/$compile/metrics.json $here/metrics_compile_$compile.json
  cp /tmp/compile_b16/$compile/summary.md $here/summary_compile_$compile.md
done
