"""Ragged LANTERN (decode/lantern_ragged.py): ragged EAGLE's rounds with LANTERN's relaxed test.

With no budget it is ragged EAGLE token for token; with one it accepts more of the same drafts; an image gets the
same tokens whatever images share its batch (keyed uniforms); greedy decoding is not relaxed.
"""

import torch
from conftest import random_eagle_head

from backbones.base import Condition
from decode.ar import generate_ar
from decode.eagle_ragged import RaggedEagleConfig, generate_eagle_ragged
from decode.lantern_ragged import RaggedLanternConfig, generate_lantern_ragged
from decode.sampling import SamplingConfig

QUEUE = Condition(class_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))
SAMPLED = SamplingConfig(cfg_scale=3.0)


def _run(generate, backbone, head, config, sampling=SAMPLED):
    return generate(backbone, head, QUEUE, sampling, torch.Generator().manual_seed(3), config)


def test_ragged_lantern_without_a_budget_is_ragged_eagle_and_with_one_accepts_more(tiny_backbone):
    head = random_eagle_head(tiny_backbone, std=0.2)
    eagle = _run(generate_eagle_ragged, tiny_backbone, head, RaggedEagleConfig(depth=4, slots=4))
    exact = _run(generate_lantern_ragged, tiny_backbone, head, RaggedLanternConfig(depth=4, delta=0.0, slots=4))
    assert torch.equal(eagle.tokens, exact.tokens) and eagle.forward_passes == exact.forward_passes
    relaxed = _run(generate_lantern_ragged, tiny_backbone, head, RaggedLanternConfig(depth=4, delta=0.3, slots=4))
    assert relaxed.accepted_tokens / relaxed.drafted_tokens > eagle.accepted_tokens / eagle.drafted_tokens + 0.05
    assert relaxed.forward_passes < eagle.forward_passes


def test_an_image_gets_the_same_ragged_lantern_tokens_whatever_its_batch(tiny_backbone):
    head = random_eagle_head(tiny_backbone, std=0.2)
    alone = _run(generate_lantern_ragged, tiny_backbone, head, RaggedLanternConfig(depth=4, delta=0.3, slots=1))
    for slots in (4, 10):
        config = RaggedLanternConfig(depth=4, delta=0.3, slots=slots)
        assert torch.equal(_run(generate_lantern_ragged, tiny_backbone, head, config).tokens, alone.tokens)


def test_greedy_ragged_lantern_is_greedy_ar(tiny_backbone):
    greedy = SamplingConfig(cfg_scale=3.0, greedy=True)
    head = random_eagle_head(tiny_backbone)
    result = _run(generate_lantern_ragged, tiny_backbone, head, RaggedLanternConfig(depth=4, slots=3), greedy)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, greedy).tokens)
