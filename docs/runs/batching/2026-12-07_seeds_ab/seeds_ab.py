"""Passes per image of ssd_ragged at batch 16 (32-image queues, window 8: no timing in the choice) with the image
seeds drawn independently (as before e21e7d1) and as a base plus the index (since), three generator seeds.

    python docs/runs/batching/2026-12-07_seeds_ab/seeds_ab.py   # from the repository root
"""

import torch

import decode.ssd_ragged as ragged
from backbones.base import Condition
from backbones.digits import DigitsBackbone
from decode.sampling import SamplingConfig
from heads.export import load_heads

torch.set_num_threads(2)
backbone = DigitsBackbone.from_pretrained("checkpoints/digits-backbone").eval()
heads = load_heads("checkpoints/ssd_digits", backbone)
sampling = SamplingConfig(cfg_scale=3.0)
distinct_seeds = ragged.image_seeds


def independent_seeds(count, generator):
    return torch.randint(0, 2**31 - 1, (count,), generator=generator)


config = ragged.RaggedSSDConfig(slots=16, window=8)
queue = Condition(class_ids=torch.arange(32) % 10)
for seed in range(3):
    row = []
    for name, seeds in (("old", independent_seeds), ("new", distinct_seeds)):
        ragged.image_seeds = seeds
        generator = torch.Generator().manual_seed(seed)
        result = ragged.generate_ssd_ragged(backbone, heads, queue, sampling, generator, config)
        acceptance = result.accepted_tokens / result.drafted_tokens
        row.append(f"{name} passes/img {result.forward_passes * 16 / 32:.1f} acc {acceptance:.3f}")
    print(seed, " | ".join(row))
