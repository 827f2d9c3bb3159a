"""Each ragged pass of an ssd_ragged queue run twice on the same inputs, once with attention over each row group's
own keys (backbones/ragged_attention.py) and once as one masked call up to the furthest slot, in alternating order;
both write the same keys and values, so the run goes on as it would. Prints the passes' total seconds each way and
the largest difference between their hidden states.

    python docs/runs/batching/2026-12-07_own_keys/paired_passes.py   # from the repository root, machine idle
"""

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "2026-12-07_profile_b16"))
from ssd_ragged_setup import ssd_ragged_setup  # noqa: E402

import backbones.base as base  # noqa: E402
import decode.ssd_ragged as ragged  # noqa: E402
from backbones.base import Condition  # noqa: E402

torch.set_num_threads(2)
grouped = base.own_keys
totals = {}


def paired(row_ends, queries):
    """Stands in for `own_keys` inside `_ragged_pass`: the caller's forward runs under it once; see `run_twice`."""
    return grouped(row_ends, queries)


original_ragged_pass = base.ContinuousBatching._ragged_pass


def run_twice(self, state, inputs, starts, forward):
    order = ("own keys", "one call") if totals.get("passes", 0) % 2 else ("one call", "own keys")
    outputs = {}
    for name in order:
        base.own_keys = grouped if name == "own keys" else (lambda row_ends, queries: contextlib.nullcontext())
        began = time.perf_counter()
        outputs[name] = original_ragged_pass(self, state, inputs, starts, forward)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - began
    base.own_keys = grouped
    totals["passes"] = totals.get("passes", 0) + 1
    difference = (outputs["own keys"] - outputs["one call"]).abs().max().item()
    totals["max_difference"] = max(totals.get("max_difference", 0.0), difference)
    return outputs["own keys"]


figures = []
for slots, images in ((16, 64), (64, 128), (4, 32)):
    backbone, heads, sampling, config = ssd_ragged_setup(slots=slots)
    queue = Condition(class_ids=torch.arange(images) % 10)
    ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(1), config)  # warm-up
    totals.clear()
    base.ContinuousBatching._ragged_pass = run_twice
    ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(0), config)
    base.ContinuousBatching._ragged_pass = original_ragged_pass
    row = dict(
        slots=slots,
        images=images,
        passes=totals["passes"],
        one_call_s=totals["one call"],
        own_keys_s=totals["own keys"],
        saved=1 - totals["own keys"] / totals["one call"],
        max_hidden_difference=totals["max_difference"],
    )
    figures.append(row)
    print(json.dumps(row), flush=True)
(Path(__file__).parent / "paired_passes.json").write_text(json.dumps(figures, indent=1))
