"""How much of ragged SSD's attention work reads each image's own keys: per pass, the queries times the keys up to
each active image's furthest query, against what the padded pass computes (every row up to the batch's furthest
slot). Window 8, the main job's heads, 64 slots over 128 and 64 images, 16 slots over 64.

    python docs/runs/batching/2026-12-07_profile_b16/attention_share.py   # from the repository root
"""

import dataclasses

import torch
from ssd_ragged_setup import ssd_ragged_setup

import decode.ssd_ragged as ragged
from backbones.base import Condition

torch.set_num_threads(2)
backbone, heads, sampling, preset = ssd_ragged_setup()
original_pass = ragged._ragged_pass

for slots, count in ((64, 128), (64, 64), (16, 64)):
    config = dataclasses.replace(preset, slots=slots, window=8)
    work = dict(own=0.0, done=0.0)

    def measured_pass(backbone, state, run, *rest, work=work):
        out, lengths, starts, ahead = original_pass(backbone, state, run, *rest)
        reach = (starts + lengths).float()  # the grid position each image's queries read up to
        work["own"] += float(reach[run.active].sum()) * out.shape[1]
        work["done"] += float(reach.max()) * out.shape[1] * run.image.shape[0]
        return out, lengths, starts, ahead

    ragged._ragged_pass = measured_pass
    queue = Condition(class_ids=torch.arange(count) % 10)
    ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(0), config)
    ragged._ragged_pass = original_pass
    print(
        f"slots {slots}, queue {count}: attention on the active images' own keys / attention computed = "
        f"{work['own'] / work['done']:.3f}"
    )
