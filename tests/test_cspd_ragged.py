"""CSpD with ragged frontiers and continuous batching (decode/cspd_ragged.py) on tiny continuous backbones: a drafter
equal to the backbone gives its tokens, an image's tokens do not depend on its batch, planted leaks between images
are caught, draining changes nothing, and the tokens are the backbone's final-step Gaussians."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import test_decode_cspd
import torch
from conftest import tiny_continuous
from scipy import stats
from test_decode_cspd import perturbed_drafter, standardized_tokens

from backbones.base import Condition
from backbones.continuous import ContinuousARBackbone
from decode.continuous_ar import generate_continuous_ar
from decode.cspd_ragged import RaggedCSpDConfig, generate_cspd_ragged
from decode.sampling import SamplingConfig

QUEUE = Condition(class_ids=torch.tensor([1, 4, 9, 2, 7, 0, 5]))
SAMPLED = SamplingConfig(cfg_scale=2.0)
continuous_classifier_cache = test_decode_cspd.continuous_classifier_cache  # the fixture, shared


def _cspd(backbone, drafter, condition=QUEUE, sampling=SAMPLED, noise=None, seed=1, **settings):
    return generate_cspd_ragged(
        backbone, drafter, condition, sampling, torch.Generator().manual_seed(seed), RaggedCSpDConfig(**settings),
        noise=noise,
    )  # fmt: skip


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("slots", [7, 3, 1])
def test_a_drafter_equal_to_the_backbone_gives_its_tokens_at_every_batch_size(cfg_scale, slots):
    """Every draft is kept, and each image gets the backbone's own tokens on its noise; with every image in one batch
    a round gives each image gamma drafts and a bonus token: 1 + ceil(15 / 4) passes."""
    backbone = tiny_continuous()
    sampling = SamplingConfig(cfg_scale=cfg_scale)
    noise = backbone.draw_noise(7, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, QUEUE, sampling, noise=noise)
    result = _cspd(backbone, backbone, sampling=sampling, noise=noise, gamma=3, slots=slots)
    assert result.accepted_tokens == result.drafted_tokens == 7 * 15 - 7 * 3  # the bonus tokens are not drafts
    # Equal up to float32 rounding (guidance amplifies it): a pass over several tokens rounds its sums otherwise.
    torch.testing.assert_close(result.tokens, ar.tokens, rtol=0, atol=1e-4)
    if slots == 7:
        assert result.forward_passes == 1 + 4


def test_the_pre_fill_is_the_backbones_own_tokens():
    """With a hopeless drafter (every draft rejected) the pre-fill's tokens are still the backbone's own samples."""
    backbone = tiny_continuous()
    noise = backbone.draw_noise(7, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, QUEUE, SAMPLED, noise=noise)
    result = _cspd(backbone, perturbed_drafter(backbone, scale=1.0), noise=noise, slots=3, prefill_fraction=0.3)
    torch.testing.assert_close(result.tokens.flatten(1, 2)[:, :5], ar.tokens.flatten(1, 2)[:, :5], rtol=0, atol=1e-5)
    assert result.drafted_tokens > 0 and result.accepted_tokens < result.drafted_tokens


def _alone_and_batched(backbone, drafter, slots: int, **settings):
    return _cspd(backbone, drafter, slots=1, **settings).tokens, _cspd(backbone, drafter, slots=slots, **settings)


@pytest.mark.parametrize("slots", [3, 7])
def test_an_image_gets_the_same_cspd_tokens_whatever_its_batch(slots):
    """Each image's noise and uniforms are keyed by its seed: alone, beside others, refilled into a slot, the same
    token vectors up to float32 rounding. The drafter keeps about half its drafts, so tests pass and fail."""
    backbone = tiny_continuous()
    drafter = perturbed_drafter(backbone, scale=1e-3)
    alone, batched = _alone_and_batched(backbone, drafter, slots)
    assert 0.2 < batched.accepted_tokens / batched.drafted_tokens < 0.9
    torch.testing.assert_close(batched.tokens, alone, rtol=0, atol=1e-4)


def feed_from_the_next_image(monkeypatch):
    original = ContinuousARBackbone.step_ragged
    monkeypatch.setattr(
        ContinuousARBackbone,
        "step_ragged",
        lambda self, state, tokens, starts: original(self, state, tokens, starts.roll(1)),
    )


def keep_the_previous_prompt(monkeypatch):
    monkeypatch.setattr(
        ContinuousARBackbone, "replace_images", lambda self, state, images, fresh, fresh_images=None: None
    )


def drain_into_other_images_rows(monkeypatch):
    original = ContinuousARBackbone.keep_images
    monkeypatch.setattr(
        ContinuousARBackbone, "keep_images", lambda self, state, images: original(self, state, images.roll(1))
    )


def noise_of_the_next_image(monkeypatch):
    """A started image draws its trajectory noise with the next image's seed."""
    import decode.cspd_ragged as ragged

    original = ragged._Slots.at

    def shifted(self, what, positions):
        taken = original(self, what, positions)
        return taken.roll(1, dims=0) if what is self.noise else taken

    monkeypatch.setattr(ragged._Slots, "at", shifted)


@pytest.mark.parametrize(
    "leak", [feed_from_the_next_image, keep_the_previous_prompt, drain_into_other_images_rows, noise_of_the_next_image]
)
def test_a_planted_leak_between_cspd_images_is_caught(leak, monkeypatch):
    backbone = tiny_continuous()
    drafter = perturbed_drafter(backbone, scale=1e-3)
    alone, batched = _alone_and_batched(backbone, drafter, slots=4, drain=0.9)
    torch.testing.assert_close(batched.tokens, alone, rtol=0, atol=1e-4)
    leak(monkeypatch)
    leaky = _cspd(backbone, drafter, slots=4, drain=0.9).tokens
    assert not torch.allclose(leaky, alone, rtol=0, atol=1e-3), "leak unnoticed"


def test_a_draining_cspd_batch_changes_no_token_and_no_pass():
    backbone = tiny_continuous()
    drafter = perturbed_drafter(backbone, scale=1e-3)
    kept = _cspd(backbone, drafter, slots=7, drain=0)
    drained = _cspd(backbone, drafter, slots=7)
    assert drained.extras["drains"] >= 1 and kept.extras["drains"] == 0
    torch.testing.assert_close(drained.tokens, kept.tokens, rtol=0, atol=1e-5)
    assert drained.forward_passes == kept.forward_passes


def ragged_exactness(drafter, slots: int, images: int, **settings) -> tuple[float, float]:
    """KS p-value of the standardized tokens (test_decode_cspd.standardized_tokens) of `images` class-2 images over
    `slots` slots against N(0, 1), and the draft acceptance."""
    backbone = tiny_continuous()
    class_ids = torch.full((images,), 2)
    noise = backbone.draw_noise(images, 16, torch.Generator().manual_seed(100))
    result = _cspd(backbone, drafter, Condition(class_ids=class_ids), noise=noise, seed=3, slots=slots, **settings)
    standardized = standardized_tokens(backbone, result.tokens, class_ids, noise, SAMPLED)
    return stats.kstest(standardized.numpy(), "norm").pvalue, result.accepted_tokens / result.drafted_tokens


@pytest.mark.slow  # statistical (8,192 values); the planted-bias check below keeps its power in the fast tier
def test_ragged_cspd_tokens_are_the_backbones_final_step_gaussians():
    """Each token, standardized by the backbone's final-step Gaussian given the image's own earlier tokens, is
    N(0, 1): 512 images over 16 slots, with refills and drains."""
    p_value, acceptance = ragged_exactness(perturbed_drafter(tiny_continuous(), scale=1e-3), slots=16, images=512)
    assert 0.1 < acceptance < 0.9, acceptance
    assert p_value > 1e-3, p_value


def test_the_ragged_final_step_check_catches_a_rejected_draft_kept(monkeypatch):
    import decode.cspd_ragged as ragged

    monkeypatch.setattr(ragged, "gaussian_residual_sample", lambda p, q, generator: (q[0], torch.tensor(True)))
    p_value, _ = ragged_exactness(perturbed_drafter(tiny_continuous(), scale=1e-3), slots=16, images=128)
    assert p_value < 1e-6, p_value


def test_the_ragged_final_step_check_passes_the_unplanted_run_at_the_same_size():
    """The planted check's own size (128 images) without the plant: the statistic is N(0, 1) there too."""
    p_value, acceptance = ragged_exactness(perturbed_drafter(tiny_continuous(), scale=1e-3), slots=16, images=128)
    assert 0.1 < acceptance < 0.9 and p_value > 1e-3, (p_value, acceptance)


def test_cost_aware_rounds_keep_the_final_step_gaussians_and_report_their_lengths():
    """gamma auto: each round's length is chosen from earlier rounds' timings and acceptance (decode/gamma_choice.py),
    so it stays lossless: the standardized tokens are N(0, 1) (128 images over 16 slots); the report's mean drafts per
    image and round lies in 1 .. max_gamma."""
    drafter = perturbed_drafter(tiny_continuous(), scale=1e-3)
    p_value, acceptance = ragged_exactness(drafter, slots=16, images=128, gamma="auto", max_gamma=6)
    assert 0.1 < acceptance < 0.9 and p_value > 1e-3, (p_value, acceptance)
    result = _cspd(tiny_continuous(), drafter, slots=3, gamma="auto", max_gamma=6)
    assert 1.0 <= result.extras["window_sum"] / result.extras["window_passes"] <= 6.0


def test_the_auto_exactness_check_catches_a_rejected_draft_kept(monkeypatch):
    """The check above has the power to fail under gamma auto: a rejected draft kept instead of the residual draw."""
    import decode.cspd_ragged as ragged

    monkeypatch.setattr(ragged, "gaussian_residual_sample", lambda p, q, generator: (q[0], torch.tensor(True)))
    drafter = perturbed_drafter(tiny_continuous(), scale=1e-3)
    p_value, _ = ragged_exactness(drafter, slots=16, images=128, gamma="auto", max_gamma=6)
    assert p_value < 1e-6, p_value


@pytest.mark.parametrize(
    "settings, problem",
    [
        (dict(gamma="fast"), "gamma must be an int >= 1 or 'auto'"),
        (dict(gamma=0), "gamma must be an int >= 1 or 'auto'"),
        (dict(gamma="auto", max_gamma=0), "max_gamma >= 1"),
        (dict(slots=-1), "slots >= 0"),
        (dict(drain=1.0), "drain must be in"),
        (dict(tau=0.5), "tau must be"),
        (dict(prefill_fraction=1.0), "prefill_fraction"),
        (dict(drafter_cfg_scale=-1.0), "cspd_ragged drafter_cfg_scale"),
    ],
)
def test_bad_ragged_cspd_settings_name_the_problem(settings, problem):
    with pytest.raises(ValueError, match=problem):
        RaggedCSpDConfig(**settings)


def test_exact_ragged_cspd_refuses_a_model_whose_last_step_is_its_mean():
    """The exact test reads the last reverse step's Gaussian density: a drafter (or backbone) whose last step
    returns its mean has none there. The relaxed test (not lossless) may still run."""
    backbone, drafter = tiny_continuous(), perturbed_drafter(tiny_continuous(), 0.1)
    drafter.diffusion.config = replace(drafter.diffusion.config, final_step_noise=False)
    with pytest.raises(ValueError, match="final_step_noise=True"):
        _cspd(backbone, drafter, gamma=2, slots=2)
    backbone.diffusion.config = replace(backbone.diffusion.config, final_step_noise=False)  # the same steps
    with pytest.raises(ValueError, match="final_step_noise=True"):
        _cspd(backbone, drafter, gamma=2, slots=2)
    assert _cspd(backbone, drafter, gamma=2, slots=2, tau=42.0).tokens.shape[0] == QUEUE.batch_size


def test_a_family_without_a_ragged_pass_says_which_method_to_use():
    backbone = tiny_continuous()
    state, _ = backbone.prefill(Condition(class_ids=torch.tensor([1])), guided=False)
    with pytest.raises(NotImplementedError, match="cspd, not cspd_ragged"):
        ContinuousARBackbone._forward_tokens_at(backbone, state, None, None, None, None)


def test_ragged_cspd_runs_from_the_command_line(tmp_path, continuous_classifier_cache):
    """The preset through the registry: a continuous-batching method over a 5-image queue at batch 2."""
    import json

    from conftest import compose_config

    from decode.cli import run_decode
    from heads.cspd import CSpDDrafter, CSpDDrafterConfig
    from heads.export import export_heads

    backbone = tiny_continuous(head_std=None)  # the backbone the tiny config builds
    drafter = CSpDDrafter(CSpDDrafterConfig.for_backbone(backbone, hidden_size=16, num_heads=2, num_layers=1,
                                                         intermediate_size=32, head_width=16))  # fmt: skip
    export_heads(drafter, tmp_path / "drafter", backbone.identity())
    cfg = compose_config(
        [
            "backbone=digits_continuous_tiny",
            "decode.methods=[ar,cspd_ragged]",
            f"decode.cspd_drafter={tmp_path / 'drafter'}",
            "decode.num_images=5",
            "decode.batch_size=2",
            f"decode.out={tmp_path / 'out'}",
            f"paths.checkpoints_dir={continuous_classifier_cache}",
        ],
        tmp_path,
    )
    run_decode(cfg)
    figures = json.loads((tmp_path / "out" / "metrics.json").read_text())["methods"]["cspd_ragged"]
    assert figures["lossless"] and figures["generator"] == "decode.cspd_ragged"
    assert 1 <= figures["forward_passes_per_image"] < 16 and np.isfinite(figures["seconds_per_image"])
