#!/usr/bin/env bash
# ssd_ragged at batch 16 (32-image queues, 2 seeds, interleaved with ar) with the code at 2901403 (before keyed
# uniforms in uint32 and distinct image seeds) against this commit's, alternating old/new twice; then the passes
# per image of both seed schemes on three queues at a fixed window (seeds_ab.py). From the repository root, with the
# main job's heads in checkpoints/ssd_digits, the machine to itself.
set -euo pipefail
OUT=docs/runs/batching/2026-12-07_seeds_ab
ROOT=$(pwd)
git worktree add -f /tmp/ssd_ragged_2901403 2901403
for round in 1 2; do
  for side in old new; do
    dir=$ROOT; [ $side = old ] && dir=/tmp/ssd_ragged_2901403
    (cd $dir && python -m decode hydra.mode=RUN "decode.methods=[ar,ssd_ragged]" decode.batch_size=16 \
      decode.queue_batches=2 decode.num_images=32 decode.seeds=2 paths.checkpoints_dir=$ROOT/checkpoints \
      decode.heads=$ROOT/checkpoints/ssd_digits decode.out=/tmp/seeds_ab/${side}_$round)
    cp /tmp/seeds_ab/${side}_$round/summary.md $OUT/summary_${side}_$round.md
    cp /tmp/seeds_ab/${side}_$round/metrics.json $OUT/metrics_${side}_$round.json
  done
done
git worktree remove --force /tmp/ssd_ragged_2901403
python $OUT/seeds_ab.py | tee $OUT/seeds_ab.txt
