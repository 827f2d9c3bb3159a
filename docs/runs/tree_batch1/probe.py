# python docs/runs/tree_batch1/probe.py "dict(nodes=3, top_k=2, beam=2)" 40000   (about 4 minutes on one core)
"""Does ssd_tree (sampled draws) keep the backbone's distribution at batch 1, where the tree's node selection
depends on the image's own draws? Many batch-1 generations on the enumerable 3x3 grid, chi-square against truth."""

import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
import test_ssd_tree as T
from conftest import random_ssd_heads
from distribution_check import fit_pvalue, image_distribution

from backbones.base import Condition
from decode.sampling import SamplingConfig
from decode.ssd_tree import SSDTreeConfig, generate_ssd_tree

torch.set_num_threads(1)
backbone = T.enumerable_backbone(grid_size=3, levels=2)
sampling = SamplingConfig(cfg_scale=2.0)
truth = image_distribution(backbone, T.CLASS_ID, sampling)
heads = random_ssd_heads(16, seed=1, grid=True)
config = SSDTreeConfig(**eval(sys.argv[1]))
n = int(sys.argv[2])
generator = torch.Generator().manual_seed(0)
cond = Condition(class_ids=torch.full((1,), T.CLASS_ID))
images = []
began = time.time()
for _ in range(n):
    images.append(generate_ssd_tree(backbone, heads, cond, sampling, generator, config).tokens.flatten(1)[0].tolist())
print(sys.argv[1], n, "p =", fit_pvalue(images, truth), f"{time.time() - began:.0f}s")
