#!/usr/bin/env bash
# ssd_tree with lookahead (trees that grow past their row's end into the next row) against ssd_tree and ssd_exact,
# batch 1, 32 images x 2 seeds, interleaved, CFG 3, with the main job's 300-step heads (EAGLE and EAGLE-2 beside
# them) and with 900-step heads (trained here if absent: `python -m train trainer.max_steps=900
# experiment_name=ssd_digits_900 train.evaluate=null`). Run from the repository root; writes metrics.json and
# summary.md per heads here.
set -e
here=$(dirname "$0")
[ -d checkpoints/ssd_digits_900 ] || python -m train trainer.max_steps=900 experiment_name=ssd_digits_900 train.evaluate=null
for steps in 300 900; do
  heads=checkpoints/ssd_digits; methods=ar,ssd_exact,ssd_tree,ssd_tree_lookahead,ssd_tree_fewest_passes,eagle,eagle2
  [ $steps = 900 ] && heads=checkpoints/ssd_digits_900 && methods=ar,ssd_exact,ssd_tree,ssd_tree_lookahead,ssd_tree_fewest_passes
  python -m decode "decode.methods=[$methods]" \
    +method@decode.presets.ssd_tree_lookahead=ssd_tree decode.presets.ssd_tree_lookahead.lookahead=24 \
    decode.heads=$heads decode.batch_size=1 decode.num_images=32 decode.seeds=2 decode.out=/tmp/tree_lookahead_$steps
  mkdir -p "$here/heads_$steps"
  cp /tmp/tree_lookahead_$steps/metrics.json /tmp/tree_lookahead_$steps/summary.md "$here/heads_$steps/"
done
