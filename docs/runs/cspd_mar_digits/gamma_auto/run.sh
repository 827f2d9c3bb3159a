#!/usr/bin/env bash
# Exact CSpD on the embedded MAR with each round's drafted steps chosen by measured cost (cspd_mar_auto) beside the
# authors' gamma 4 (cspd_mar) and MAR's own sampler (ar), interleaved, one seed: batch 1 (16 images) and batch 16
# (32 images). Run from the repository root; writes metrics_b*.json and summary_b*.md here.
set -e
here=$(dirname "$0")
M="decode.methods=[ar,cspd_mar,cspd_mar_auto]"
python -m decode +experiment=cspd_mar_digits "$M" decode.num_images=16 decode.seeds=1 decode.out=/tmp/cspd_auto_b1
python -m decode +experiment=cspd_mar_digits "$M" decode.batch_size=16 decode.num_images=32 decode.seeds=1 \
  decode.out=/tmp/cspd_auto_b16
for b in 1 16; do cp /tmp/cspd_auto_b$b/metrics.json "$here/metrics_b$b.json"; cp /tmp/cspd_auto_b$b/summary.md "$here/summary_b$b.md"; done
