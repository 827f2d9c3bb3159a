"""Each ragged pass of an ssd_ragged queue run twice on the same inputs, once with attention over each row group's
own keys (backbones/ragged_attention.py) and once as one masked call up to the furthest slot, in alternating order
(both_ways.py). Prints the passes' total seconds each way and the largest difference between their hidden states.

    python docs/runs/batching/2026-12-07_own_keys/paired_passes.py   # from the repository root, machine idle
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "2026-12-07_profile_b16"))
from both_ways import both_ways, summary  # noqa: E402
from ssd_ragged_setup import ssd_ragged_setup  # noqa: E402

import backbones.base as base  # noqa: E402
import decode.ssd_ragged as ragged  # noqa: E402
from backbones.base import Condition  # noqa: E402

torch.set_num_threads(2)
original_ragged_pass = base.ContinuousBatching._ragged_pass
figures = []
for slots, images in ((16, 64), (64, 128), (4, 32)):
    backbone, heads, sampling, config = ssd_ragged_setup(slots=slots)
    queue = Condition(class_ids=torch.arange(images) % 10)
    ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(1), config)  # warm-up
    totals = {}
    base.ContinuousBatching._ragged_pass = both_ways(original_ragged_pass, totals)
    ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(0), config)
    base.ContinuousBatching._ragged_pass = original_ragged_pass
    row = dict(slots=slots, images=images, **summary(totals))
    figures.append(row)
    print(json.dumps(row), flush=True)
(Path(__file__).parent / "paired_passes.json").write_text(json.dumps(figures, indent=1))
