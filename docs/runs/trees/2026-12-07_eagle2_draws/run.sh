#!/usr/bin/env bash
# EAGLE-2's tree with the authors' point candidates (the preset) against the same tree of sampled draws (draws
# without replacement from the head's q, ranked by calibrated acceptance; this project's option, lossless), and
# EAGLE's chain of 6: tokens per pass, batch 1, 32 images x 2 seeds, interleaved, +experiment=eagle_digits's head.
# Run from the repository root; writes metrics.json and summary.md here.
set -e
here=$(dirname "$0")
python -m decode "decode.methods=[ar,eagle,eagle2,eagle2_sampled]" \
  +method@decode.presets.eagle2_sampled=eagle2 decode.presets.eagle2_sampled.draws=sampled \
  decode.presets.eagle2_sampled.confidence=calibrated \
  decode.batch_size=1 decode.num_images=32 decode.seeds=2 decode.out=/tmp/eagle2_draws
cp /tmp/eagle2_draws/metrics.json /tmp/eagle2_draws/summary.md "$here/"
