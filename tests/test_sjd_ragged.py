"""Ragged SJD and GSD with continuous batching (decode/sjd_ragged.py, decode/gsd_ragged.py) are what they claim:
ragged SJD is lossless and an image gets the same tokens whatever images share its batch.

Greedy: equal to greedy AR with images finishing at different times and slots refilled, on the digits backbone
and every adapter. Sampled: chi-square on the enumerated 3x3 grid with 2,000 slots over 40,000 images (slow tier);
a residual without the draft, and a leak between images (a run fed at another image's frontier, a refilled slot
keeping the previous prompt), are caught in the fast tier. GSD: a group of one is ragged SJD; wide groups accept
more; greedy GSD is greedy AR.
"""

import pytest
import torch
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution
from ragged_leaks import PLANTED_LEAKS, record_ragged_batch_sizes
from tiny_adapters import ADAPTERS, queue_of_four

from backbones.base import Condition
from decode.ar import generate_ar
from decode.gsd_ragged import RaggedGSDConfig, generate_gsd_ragged
from decode.sampling import SamplingConfig
from decode.sjd_ragged import RaggedSJDConfig, generate_jacobi_ragged

QUEUE = Condition(class_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))
SAMPLED = SamplingConfig(cfg_scale=3.0)


def _sjd(backbone, condition, sampling, seed=0, **settings):
    return generate_jacobi_ragged(
        backbone, condition, sampling, torch.Generator().manual_seed(seed), RaggedSJDConfig(**settings)
    )


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize(
    "slots,window,init", [(1, 16, "random"), (4, 3, "repeat_left"), (10, 16, "repeat_left"), (3, 2, "random")]
)
def test_greedy_ragged_sjd_equals_greedy_ar(tiny_backbone, slots, window, init, cfg_scale):
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _sjd(tiny_backbone, QUEUE, sampling, slots=slots, window=window, init=init)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)
    assert 0 < result.accepted_tokens < result.drafted_tokens


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_greedy_ragged_sjd_equals_greedy_ar_on_every_adapter(family):
    make_backbone, make_condition, cfg_scale = ADAPTERS[family]
    backbone = make_backbone()
    queue = queue_of_four(make_condition())
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _sjd(backbone, queue, sampling, slots=2, window=5, init="repeat_left")
    assert torch.equal(result.tokens, generate_ar(backbone, queue, sampling).tokens)


@pytest.mark.parametrize("init", ["random", "repeat_left"])
def test_an_image_gets_the_same_sjd_tokens_whatever_its_batch(tiny_backbone, init):
    alone = _sjd(tiny_backbone, QUEUE, SAMPLED, slots=1, window=4, init=init)
    for slots in (4, 10):
        assert torch.equal(_sjd(tiny_backbone, QUEUE, SAMPLED, slots=slots, window=4, init=init).tokens, alone.tokens)
    # the queue's order decides which seed an image gets, not which images run beside it
    reordered = _sjd(tiny_backbone, QUEUE, SAMPLED, slots=3, window=4, init=init)
    assert torch.equal(reordered.tokens, alone.tokens)


@pytest.mark.parametrize("leak", PLANTED_LEAKS)
def test_a_planted_leak_between_sjd_images_is_caught(leak, monkeypatch):
    """The tiny backbone's random weights barely read the context (fed at another frontier, its sampled tokens do
    not change); weights scaled by 2 make each token depend on its context, and the leak shows."""
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    alone = _sjd(backbone, QUEUE, SAMPLED, slots=1, window=4).tokens
    assert torch.equal(_sjd(backbone, QUEUE, SAMPLED, slots=4, window=4).tokens, alone)
    leak(monkeypatch)
    assert not torch.equal(_sjd(backbone, QUEUE, SAMPLED, slots=4, window=4).tokens, alone), "leak unnoticed"


def test_a_draining_sjd_batch_computes_no_finished_image_and_changes_no_token(monkeypatch):
    """Ten images over ten slots, no queue: the passes shrink to the images still decoding, with the same tokens
    and passes as a batch that keeps every slot."""
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    kept = _sjd(backbone, QUEUE, SAMPLED, slots=10, window=4, drain=0)
    batch_sizes = record_ragged_batch_sizes(monkeypatch)
    drained = _sjd(backbone, QUEUE, SAMPLED, slots=10, window=4)
    assert torch.equal(drained.tokens, kept.tokens) and drained.forward_passes == kept.forward_passes
    assert drained.extras["drains"] >= 1 and kept.extras["drains"] == 0
    assert batch_sizes[-1] < 10 and batch_sizes == sorted(batch_sizes, reverse=True)


CLASS_ID = 4


def _sample(init: str):
    """A window of 3 on the 3x3 grid leaves room for rejections, Jacobi updates and new drafts."""
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    condition = Condition(class_ids=torch.full((40_000,), CLASS_ID))
    result = _sjd(backbone, condition, sampling, slots=2_000, window=3, init=init)
    return result, image_distribution(backbone, CLASS_ID, sampling)


@pytest.mark.slow  # the planted-bias check below keeps the test's power in the fast tier
@pytest.mark.parametrize("init", ["random", "repeat_left"])
def test_sampled_ragged_sjd_has_the_backbone_distribution(init):
    result, truth = _sample(init)
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95  # drafts pass and fail: the rules run
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def test_the_ragged_sjd_distribution_test_catches_a_residual_without_the_draft(monkeypatch):
    monkeypatch.setattr("decode.rules.residual_distribution", lambda p, q: p)
    result, truth = _sample("random")
    pvalue = fit_pvalue(result.tokens.flatten(1).tolist(), truth)
    assert pvalue < 1e-6, f"the planted bias went unnoticed (p = {pvalue:.2e})"


def _gsd(backbone, condition, sampling=SAMPLED, **settings):
    return generate_gsd_ragged(
        backbone, condition, sampling, torch.Generator().manual_seed(5), RaggedGSDConfig(**settings)
    )


def test_ragged_gsd_with_a_group_of_one_is_ragged_sjd_and_wide_groups_accept_more():
    backbone = enumerable_backbone(grid_size=3, levels=3)
    condition = Condition(class_ids=torch.full((500,), CLASS_ID))
    sjd = _sjd(backbone, condition, SAMPLED, seed=5, window=4, slots=64)
    single = _gsd(backbone, condition, window=4, slots=64, rank_radius=0)
    assert torch.equal(sjd.tokens, single.tokens) and sjd.forward_passes == single.forward_passes
    wide = _gsd(backbone, condition, window=4, slots=64, rank_radius=3, probability_gap=1.0, max_distance=1e9)
    assert wide.accepted_tokens / wide.drafted_tokens > sjd.accepted_tokens / sjd.drafted_tokens + 0.05


def test_ragged_gsd_keeps_an_image_independent_of_its_batch_and_greedy_gsd_is_greedy_ar(tiny_backbone):
    alone = _gsd(tiny_backbone, QUEUE, window=4, slots=1)
    assert torch.equal(_gsd(tiny_backbone, QUEUE, window=4, slots=4).tokens, alone.tokens)
    greedy = SamplingConfig(cfg_scale=3.0, greedy=True)
    result = _gsd(tiny_backbone, QUEUE, greedy, window=4, slots=3)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, greedy).tokens)


@pytest.mark.parametrize("settings", [dict(window=1), dict(slots=-1), dict(init="left")])
def test_bad_ragged_sjd_settings_name_the_problem(settings):
    with pytest.raises(ValueError, match="window|slots|init"):
        RaggedSJDConfig(**settings)
