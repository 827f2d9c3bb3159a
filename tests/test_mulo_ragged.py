"""Lossless MuLo-SD with ragged frontiers and continuous batching (decode/mulo_ragged.py): greedy output is greedy
AR's with images finishing at different times, an image's tokens do not depend on its batch, planted leaks between
images and a residual without the draft are caught, draining changes nothing, and (slow tier) sampled images have
the backbone's distribution."""

import pytest
import torch
from distribution_check import enumerable_backbone, fit_pvalue, image_distribution, marginal
from ragged_leaks import PLANTED_LEAKS, record_ragged_batch_sizes
from tiny_adapters import ADAPTERS, queue_of_four

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode.ar import generate_ar
from decode.mulo_ragged import RaggedMuLoConfig, generate_mulo_ragged
from decode.sampling import SamplingConfig
from heads.mulo import MuLoDrafter, MuLoDrafterConfig

QUEUE = Condition(class_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2]))
SAMPLED = SamplingConfig(cfg_scale=3.0)


def drafter_for(backbone, scale: int = 2, seed: int = 1) -> MuLoDrafter:
    """A random one-layer drafter at r = `scale` for `backbone`."""
    torch.manual_seed(seed)
    config = MuLoDrafterConfig.for_backbone(
        backbone, scale=scale, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32
    )
    return MuLoDrafter(config).eval()


def _mulo(backbone, drafter, condition=QUEUE, sampling=SAMPLED, seed=5, **settings):
    return generate_mulo_ragged(
        backbone, drafter, condition, sampling, torch.Generator().manual_seed(seed), RaggedMuLoConfig(**settings)
    )


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("slots,window", [(7, 0), (3, 0), (1, 0), (3, 2), (7, 5)])
def test_greedy_ragged_mulo_equals_greedy_ar(cfg_scale, slots, window):
    backbone = random_digits_backbone(seed=0, grid_size=12, levels=8, hidden_size=32, num_layers=2, num_heads=2,
                                      intermediate_size=64)  # fmt: skip
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _mulo(backbone, drafter_for(backbone, scale=3), sampling=sampling, slots=slots, window=window)
    assert torch.equal(result.tokens, generate_ar(backbone, QUEUE, sampling).tokens)
    assert result.drafted_tokens > 0  # a random drafter's greedy drafts: rejected, corrected from p without them


def test_greedy_ragged_mulo_with_an_interpolating_upsampler_equals_greedy_ar():
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    sampling = SamplingConfig(greedy=True, cfg_scale=2.0)
    result = _mulo(backbone, drafter_for(backbone), sampling=sampling, slots=3, upsample_mode="bilinear")
    assert torch.equal(result.tokens, generate_ar(backbone, QUEUE, sampling).tokens)


def test_an_image_gets_the_same_mulo_tokens_whatever_its_batch():
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    drafter = drafter_for(backbone)
    alone = _mulo(backbone, drafter, slots=1)
    assert 0 < alone.accepted_tokens < alone.drafted_tokens  # drafts pass and fail
    for slots in (3, 7):
        assert torch.equal(_mulo(backbone, drafter, slots=slots).tokens, alone.tokens)
    # a window changes which positions a pass verifies, never with the batch
    windowed = _mulo(backbone, drafter, slots=1, window=3).tokens
    assert torch.equal(_mulo(backbone, drafter, slots=5, window=3).tokens, windowed)


@pytest.mark.parametrize("leak", PLANTED_LEAKS)
def test_a_planted_leak_between_mulo_images_is_caught(leak, monkeypatch):
    """Images of one queue advance at similar paces here, so a run fed at the next image's frontier sees a context
    shifted by a few tokens: weights scaled by 4 make the tokens depend on it enough to show."""
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=4.0)
    drafter = drafter_for(backbone)
    alone = _mulo(backbone, drafter, slots=1).tokens
    assert torch.equal(_mulo(backbone, drafter, slots=4).tokens, alone)
    leak(monkeypatch)
    assert not torch.equal(_mulo(backbone, drafter, slots=4).tokens, alone), "leak unnoticed"


def test_a_draining_mulo_batch_computes_no_finished_image_and_changes_no_token(monkeypatch):
    backbone = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
    drafter = drafter_for(backbone)
    kept = _mulo(backbone, drafter, slots=7, drain=0)
    batch_sizes = record_ragged_batch_sizes(monkeypatch)
    drained = _mulo(backbone, drafter, slots=7)
    assert torch.equal(drained.tokens, kept.tokens) and drained.forward_passes == kept.forward_passes
    assert drained.extras["drains"] >= 1 and kept.extras["drains"] == 0
    assert min(batch_sizes) < 7


CLASS_ID = 4


def _sample(images: int = 40_000, slots: int = 2_000):
    """A 4x4 grid of two levels with a 2x2 drafter: two blocks of eight point proposals."""
    backbone = enumerable_backbone(grid_size=4, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    condition = Condition(class_ids=torch.full((images,), CLASS_ID))
    result = _mulo(backbone, drafter_for(backbone, seed=2), condition, sampling, seed=0, slots=slots)
    return result, image_distribution(backbone, CLASS_ID, sampling)


def _worst_pvalue(result, truth) -> float:
    """The smallest chi-square p-value over each block and the pair of rows across their border (256 outcomes)."""
    images = result.tokens.flatten(1)
    return min(
        fit_pvalue(
            images[:, list(range(4 * row, 4 * row + 8))].tolist(), marginal(truth, list(range(4 * row, 4 * row + 8)))
        )
        for row in (0, 1, 2)
    )


@pytest.mark.slow  # 40,000 images; the planted-bias check below keeps the test's power in the fast tier
def test_sampled_ragged_mulo_has_the_backbone_distribution():
    result, truth = _sample()
    assert 0.1 < result.accepted_tokens / result.drafted_tokens < 0.9  # point proposals pass and fail
    pvalue = _worst_pvalue(result, truth)
    assert pvalue > 1e-3 / 3, f"ragged MuLo does not have the backbone's distribution (p = {pvalue:.2e})"


def test_the_ragged_mulo_distribution_test_catches_a_residual_without_the_draft(monkeypatch):
    monkeypatch.setattr("decode.mulo_ragged.point_residual", lambda p, tokens: p)
    result, truth = _sample(images=10_000, slots=1_000)
    pvalue = _worst_pvalue(result, truth)
    assert pvalue < 1e-6, f"the planted bias went unnoticed (p = {pvalue:.2e})"


@pytest.mark.parametrize(
    "settings, problem",
    [
        (dict(slots=-1), "slots >= 0"),
        (dict(window=-1), "window >= 0"),
        (dict(drain=1.0), "drain must be in"),
        (dict(drafter_cfg_scale=-1.0), "drafter_cfg_scale"),
        (dict(upsample_mode="cubic"), "upsample_mode must be one of nearest, bilinear, bicubic"),
    ],
)
def test_bad_ragged_mulo_settings_name_the_problem(settings, problem):
    with pytest.raises(ValueError, match=problem):
        RaggedMuLoConfig(**settings)


@pytest.mark.filterwarnings("ignore:.*no codebook latents")  # tiny LlamaGen has no VQ checkpoint
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_ragged_mulo_equals_greedy_ar_on_every_adapter(name):
    """A queue of four over two slots (refills, the drafter's prompt swapped in beside the backbone's), CFG on."""
    from test_mulo_real import random_drafter

    make_backbone, make_condition, cfg_scale = ADAPTERS[name]
    backbone, queue = make_backbone(), queue_of_four(make_condition())
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    result = _mulo(backbone, random_drafter(backbone), queue, sampling, slots=2)
    assert torch.equal(result.tokens, generate_ar(backbone, queue, sampling).tokens)


def test_ragged_mulo_runs_from_the_command_line(tmp_path, classifier_cache):
    """The preset through the registry: a continuous-batching method over a 5-image queue at batch 2."""
    import json

    import hydra
    from conftest import compose_config

    from decode.cli import run_decode
    from heads.export import export_heads

    overrides = [
        "backbone=digits_tiny",
        "decode.methods=[ar,mulo_ragged]",
        f"decode.drafter={tmp_path / 'drafter'}",
        "decode.num_images=5",
        "decode.batch_size=2",
        f"decode.out={tmp_path / 'out'}",
        f"paths.checkpoints_dir={classifier_cache}",
    ]
    cfg = compose_config(overrides, tmp_path)
    backbone = hydra.utils.instantiate(cfg.backbone)
    export_heads(drafter_for(backbone), tmp_path / "drafter", backbone.identity())
    run_decode(cfg)
    figures = json.loads((tmp_path / "out" / "metrics.json").read_text())["methods"]["mulo_ragged"]
    assert figures["lossless"] and figures["generator"] == "decode.mulo_ragged"
    assert 1 <= figures["forward_passes_per_image"] < 64
    assert 1 <= figures["counts"]["window_sum"] / figures["counts"]["window_passes"] <= 4  # the preset's window
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "mean open positions verified per image and pass: mulo_ragged" in summary
