#!/usr/bin/env bash
# The batch sweep with MuLo-SD in it (issue 28's throughput plot: ar, ssd_exact, ssd_autocorrect, eagle and mulo,
# beside ragged SSD as it is now: draining, cost-aware windows), one seed, each batch size
# one process with the methods interleaved, batch 4-64 as one 64-image queue per turn (batch 1: 16 images). The
# main job's 300-step SSD heads, +experiment=eagle_digits's head, +experiment=mulo_digits's drafter at its
# operating point (the mulo presets of +experiment=mulo_digits, as compare_digits). Run from the repository root.
set -e
here=$(dirname "$0")
M="decode.methods=[ar,ssd_exact,ssd_autocorrect,ssd_ragged,eagle,mulo]"
X="+experiment=mulo_digits"
python -m decode $X "$M" decode.batch_size=1 decode.num_images=16 decode.out=/tmp/sweep/b1
for b in 4 16 64; do
  python -m decode $X "$M" decode.batch_size=$b decode.queue_batches=$((64 / b)) decode.num_images=64 \
    decode.out=/tmp/sweep/b$b
done
for b in 1 4 16 64; do cp /tmp/sweep/b$b/metrics.json "$here/metrics_b$b.json"; cp /tmp/sweep/b$b/summary.md "$here/summary_b$b.md"; done
python -m decode.throughput_plot /tmp/sweep/b1 /tmp/sweep/b4 /tmp/sweep/b16 /tmp/sweep/b64 --out "$here/throughput_batch.png" \
  | tee "$here/throughput_table.md"
