"""Ragged EAGLE with continuous batching (decode/eagle_ragged.py) is lossless and gives an image the same tokens
whatever images share its batch.

Greedy: equal to greedy AR with images finishing at different times and slots refilled (random heads), on the
digits backbone and every adapter. Sampled: chi-square on the enumerated 3x3 grid with 2,000 slots over 40,000
images, and a residual without the draft is caught.
"""

import pytest
import torch
from conftest import random_eagle_head
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution
from ragged_leaks import PLANTED_LEAKS, record_ragged_batch_sizes
from tiny_adapters import ADAPTERS, queue_of_four

from backbones.base import Condition
from decode.ar import generate_ar
from decode.eagle_ragged import RaggedEagleConfig, _DepthChooser, generate_eagle_ragged
from decode.sampling import SamplingConfig

QUEUE = Condition(class_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))


def _ragged(backbone, head, condition, sampling, seed=0, **settings):
    return generate_eagle_ragged(
        backbone, head, condition, sampling, torch.Generator().manual_seed(seed), RaggedEagleConfig(**settings)
    )


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("slots,depth", [(1, 6), (4, 3), (10, 6), (3, 1)])
def test_greedy_ragged_eagle_equals_greedy_ar(tiny_backbone, slots, depth, cfg_scale):
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _ragged(tiny_backbone, random_eagle_head(tiny_backbone), QUEUE, sampling, slots=slots, depth=depth)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)
    assert 0 < result.accepted_tokens < result.drafted_tokens


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_greedy_ragged_eagle_equals_greedy_ar_on_every_adapter(family):
    make_backbone, make_condition, cfg_scale = ADAPTERS[family]
    backbone = make_backbone()
    queue = queue_of_four(make_condition())
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _ragged(backbone, random_eagle_head(backbone), queue, sampling, slots=2, depth=5)
    assert torch.equal(result.tokens, generate_ar(backbone, queue, sampling).tokens)


@pytest.mark.parametrize("slots,max_depth", [(1, 5), (4, 8)])
def test_greedy_ragged_eagle_with_cost_aware_depth_equals_greedy_ar(tiny_backbone, slots, max_depth):
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    settings = dict(slots=slots, depth="auto", max_depth=max_depth)
    result = _ragged(tiny_backbone, random_eagle_head(tiny_backbone), QUEUE, sampling, **settings)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)
    depths = result.extras["window_sum"] / result.extras["window_passes"]
    assert 1 <= depths <= max_depth
    reached = [result.extras[f"drafted_at_draft_step_{j}"] for j in range(1, max_depth + 1)]
    assert sum(reached) == result.drafted_tokens and reached[0] > 0


def _chooser(monkeypatch, pass_seconds, max_depth=6):
    monkeypatch.setattr("decode.eagle_ragged.ragged_pass_seconds", lambda *args: pass_seconds[:max_depth])
    return _DepthChooser(None, None, 16, True, max_depth)


def _observe(chooser, rate: float, depth: int, step_seconds: float, rounds: int = 50):
    reached = torch.tensor([100.0 * rate**j for j in range(depth)])
    for _ in range(rounds):
        round_seconds = float(chooser.pass_seconds[depth - 1]) + depth * step_seconds
        chooser.observe(round_seconds, depth * step_seconds, depth, reached, reached * rate)


def test_the_depth_chooser_weighs_acceptance_against_pass_and_head_costs(monkeypatch):
    """Deep chains where drafts pass and cost little, one draft where they fail or each head step costs a pass."""
    flat = [0.010] * 6  # a pass of 2-7 tokens per image costs what one of 2 does (memory-bound)
    chooser = _chooser(monkeypatch, flat)
    _observe(chooser, rate=0.9, depth=6, step_seconds=0.0005)
    assert chooser.choose() == 6
    chooser = _chooser(monkeypatch, flat)
    _observe(chooser, rate=0.05, depth=6, step_seconds=0.0005)
    assert chooser.choose() == 1
    chooser = _chooser(monkeypatch, flat)
    _observe(chooser, rate=0.6, depth=6, step_seconds=0.010)
    assert chooser.choose() <= 2
    rising = [0.010 * (1 + n) for n in range(1, 7)]  # compute-bound: a pass costs what its tokens do
    chooser = _chooser(monkeypatch, rising)
    _observe(chooser, rate=0.6, depth=6, step_seconds=0.0005)
    assert chooser.choose() == 1


def test_an_image_gets_the_same_eagle_tokens_whatever_its_batch(tiny_backbone):
    sampling = SamplingConfig(cfg_scale=3.0)
    head = random_eagle_head(tiny_backbone)
    alone = _ragged(tiny_backbone, head, QUEUE, sampling, slots=1, depth=4)
    for slots in (4, 10):
        assert torch.equal(_ragged(tiny_backbone, head, QUEUE, sampling, slots=slots, depth=4).tokens, alone.tokens)


@pytest.mark.parametrize("leak", PLANTED_LEAKS)
def test_a_planted_leak_between_eagle_images_is_caught(leak, monkeypatch):
    """On a backbone whose tokens depend on their context (tests/test_sjd_ragged.py says why not the tiny one), a
    leak between the images of a batch of four changes the tokens they get alone."""
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    head = random_eagle_head(backbone)
    sampling = SamplingConfig(cfg_scale=3.0)
    alone = _ragged(backbone, head, QUEUE, sampling, slots=1, depth=3).tokens
    assert torch.equal(_ragged(backbone, head, QUEUE, sampling, slots=4, depth=3).tokens, alone)
    leak(monkeypatch)
    assert not torch.equal(_ragged(backbone, head, QUEUE, sampling, slots=4, depth=3).tokens, alone), "unnoticed"


def test_a_draining_eagle_batch_computes_no_finished_image_and_changes_no_token(tiny_backbone, monkeypatch):
    """Ten images over ten slots, no queue: the passes shrink to the images still decoding, with the same tokens
    and passes as a batch that keeps every slot (the head's cache drained with the backbone's)."""
    sampling = SamplingConfig(cfg_scale=3.0)
    head = random_eagle_head(tiny_backbone)
    kept = _ragged(tiny_backbone, head, QUEUE, sampling, slots=10, depth=4, drain=0)
    batch_sizes = record_ragged_batch_sizes(monkeypatch)
    drained = _ragged(tiny_backbone, head, QUEUE, sampling, slots=10, depth=4)
    assert torch.equal(drained.tokens, kept.tokens) and drained.forward_passes == kept.forward_passes
    assert drained.extras["drains"] >= 1 and kept.extras["drains"] == 0
    assert batch_sizes[-1] < 10 and batch_sizes == sorted(batch_sizes, reverse=True)


CLASS_ID = 4


def _sample(depth: int):
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    result = generate_eagle_ragged(
        backbone,
        random_eagle_head(backbone, std=0.5),
        Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling,
        torch.Generator().manual_seed(0),
        RaggedEagleConfig(depth=depth, slots=2_000),
    )
    return result, image_distribution(backbone, CLASS_ID, sampling)


@pytest.mark.slow  # the planted-bias check below keeps the test's power in the fast tier
@pytest.mark.parametrize("depth", [2, 5, "auto"])
def test_sampled_ragged_eagle_has_the_backbone_distribution(depth):
    result, truth = _sample(depth)
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def test_the_ragged_eagle_distribution_test_catches_a_residual_without_the_draft(monkeypatch):
    monkeypatch.setattr("decode.rules.residual_distribution", lambda p, q: p)
    result, truth = _sample(3)
    pvalue = fit_pvalue(result.tokens.flatten(1).tolist(), truth)
    assert pvalue < 1e-6, f"the planted bias went unnoticed (p = {pvalue:.2e})"
