#!/usr/bin/env bash
# ssd_tree's passes per image against its node budget (64-256 nodes, top-2 and top-3) and the heads' training
# length (the main job's 300 steps, and 900), ssd_exact beside it, batch 1, 8 images (seeds 0-7), CFG 3; then the
# digits backbone's step_tree cost by node count (mid-image, CFG twins, median of 15). Run from the repository root.
set -e
here=$(dirname "$0")
[ -d checkpoints/ssd_digits_900 ] || python -m train trainer.max_steps=900 experiment_name=ssd_digits_900 train.evaluate=null
PYTHONPATH=. python "$here/probe.py" checkpoints/ssd_digits > "$here/results.jsonl"
PYTHONPATH=. python "$here/probe.py" checkpoints/ssd_digits_900 >> "$here/results.jsonl"
PYTHONPATH=. python "$here/probe.py" --cost >> "$here/results.jsonl"
