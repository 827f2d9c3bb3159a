#!/usr/bin/env python
"""ssd_tree's passes per image against its node budget and the heads' training length (batch 1, seeds 0-7), and
the digits backbone's step_tree cost by node count (mid-image, CFG twins).

Usage: probe.py HEADS_DIR (passes, one JSON line per setting) | probe.py --cost (milliseconds per tree pass)."""

import json
import sys

import torch

from backbones.digits import DigitsBackbone
from decode import Condition, SamplingConfig, SSDDecodeConfig, generate_ssd
from decode.ssd_tree import SSDTreeConfig, generate_ssd_tree
from decode.tree_budget import tree_pass_seconds
from heads.export import load_heads

torch.set_num_threads(2)
backbone = DigitsBackbone.from_pretrained("checkpoints/digits-backbone")
sampling = SamplingConfig(cfg_scale=3.0)
IMAGES = 8
SSD_EXACT = SSDDecodeConfig(mode="exact", grid_steps=6, lookahead=True, lookahead_confidence=0.05)  # the preset
TREES = [
    dict(nodes=64, top_k=2, beam=8),  # the ssd_tree preset
    dict(nodes=128, top_k=2, beam=16),
    dict(nodes=256, top_k=2, beam=32),
    dict(nodes=128, top_k=3, beam=16),
    dict(nodes=256, top_k=3, beam=32),
]

if sys.argv[1] == "--cost":
    counts = [1, 24, 64, 128, 256]
    seconds = tree_pass_seconds(backbone, Condition(class_ids=torch.tensor([3])), True, counts, repeats=15)
    print(json.dumps({"step_tree_ms": {n: round(1e3 * t, 2) for n, t in zip(counts, seconds)}}), flush=True)
    sys.exit()
heads = load_heads(sys.argv[1], backbone)
for tree in [None, *TREES]:
    passes = 0
    with torch.inference_mode():
        for i in range(IMAGES):
            generator, condition = torch.Generator().manual_seed(i), Condition(class_ids=torch.tensor([i % 10]))
            if tree is None:
                result = generate_ssd(backbone, heads, condition, sampling, generator, SSD_EXACT)
            else:
                result = generate_ssd_tree(backbone, heads, condition, sampling, generator, SSDTreeConfig(**tree))
            passes += result.forward_passes
    method = "ssd_exact" if tree is None else "ssd_tree"
    print(json.dumps(dict(heads=sys.argv[1], method=method, **(tree or {}), passes_per_image=passes / IMAGES)))
