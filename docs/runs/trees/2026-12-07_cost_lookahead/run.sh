#!/usr/bin/env bash
# ssd_tree's cost-aware budget (budget: cost, decode/tree_budget.py) with and without lookahead 24, beside the fixed
# 64-node tree and ssd_exact: is a tree past the row's end worth its drafting on this CPU when only the nodes that pay
# are verified? Batch 1, 16 images x 2 seeds, interleaved, the main job's heads. Run from the repository root.
set -e
here=$(dirname "$0")
python -m decode "decode.methods=[ar,ssd_exact,ssd_tree,ssd_tree_cost,ssd_tree_cost_lookahead]" \
  +method@decode.presets.ssd_tree_cost=ssd_tree decode.presets.ssd_tree_cost.budget=cost \
  +method@decode.presets.ssd_tree_cost_lookahead=ssd_tree decode.presets.ssd_tree_cost_lookahead.budget=cost \
  decode.presets.ssd_tree_cost_lookahead.lookahead=24 \
  decode.batch_size=1 decode.num_images=16 decode.seeds=2 decode.out=/tmp/tree_cost_lookahead
cp /tmp/tree_cost_lookahead/metrics.json /tmp/tree_cost_lookahead/summary.md "$here/"
