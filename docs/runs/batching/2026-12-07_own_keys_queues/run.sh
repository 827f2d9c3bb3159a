#!/usr/bin/env bash
# ssd_ragged against ar with the ragged attention over each row group's own keys (backbones/ragged_attention.py):
# the long-queue runs' commands without EAGLE (batch 16 with 64-image queues, batch 64 with 128-image queues, 2
# seeds, interleaved, the main job's heads). From the repository root, the machine to itself.
set -euo pipefail
bash docs/runs/batching/2026-12-07_long_queues/run.sh docs/runs/batching/2026-12-07_own_keys_queues "[ar,ssd_ragged]"
