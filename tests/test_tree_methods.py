"""Every token-tree method is lossless on every backbone adapter: greedy ssd_tree and eagle2 give greedy AR's
tokens at batch 1 and 4, from random heads (drafts often wrong: siblings, end-of-line nodes and the batch's
shortest path all matter)."""

import pytest
import torch
from conftest import random_eagle_head, random_ssd_heads
from tiny_adapters import ADAPTERS

from backbones.base import Condition
from decode.ar import generate_ar
from decode.eagle2 import Eagle2DecodeConfig, generate_eagle2
from decode.sampling import SamplingConfig
from decode.ssd_tree import SSDTreeConfig, generate_ssd_tree


def _batch_of(condition: Condition, batch: int) -> Condition:
    """The adapter's two conditions as a batch of `batch` (1: the first; 4: both, then both swapped)."""
    rows = [0] if batch == 1 else [0, 1, 1, 0]
    if condition.class_ids is not None:
        return Condition(class_ids=torch.tensor([1, 8, 3, 5])[:batch])
    return Condition(token_ids=condition.token_ids[rows])


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_greedy_tree_methods_equal_greedy_ar_on_every_adapter(family, batch):
    make_backbone, make_condition, cfg_scale = ADAPTERS[family]
    backbone = make_backbone()
    condition = _batch_of(make_condition(), batch)
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    baseline = generate_ar(backbone, condition, sampling)
    heads = random_ssd_heads(backbone.hidden_size, seed=0, std=0.3, grid=True)
    for lookahead in (0, 3):  # 3: trees past the row's end too (end-of-line nodes where the backbone has them)
        config = SSDTreeConfig(nodes=8, top_k=2, beam=2, lookahead=lookahead)
        trees = generate_ssd_tree(backbone, heads, condition, sampling, config=config)
        assert torch.equal(trees.tokens, baseline.tokens), f"lookahead {lookahead}"
    # EAGLE-2 trees across rows (end-of-line nodes) and up to the image's end.
    eagle2 = generate_eagle2(
        backbone,
        random_eagle_head(backbone),
        condition,
        sampling,
        config=Eagle2DecodeConfig(nodes=10, depth=5, top_k=3),
    )
    assert torch.equal(eagle2.tokens, baseline.tokens)
