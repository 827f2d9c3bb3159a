"""The embedded MAR (checkpoints/mar-digits) and its drafter (checkpoints/mar-digits-drafter), trained here.

They load as released MARs do (official names, `load_mar_backbone`), their samples are digits of their class,
and exact CSpD between them has the target's distribution: the standardized final-step statistic of
tests/test_decode_cspd_mar.py, on trained weights, in float32 as `python -m decode` runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mar_statistics import cspd_mar_statistic, draws

from backbones.mar import load_mar_backbone
from decode.cspd_mar import CSpDMARConfig, check_compatible, generate_cspd_mar
from decode.quality import DigitsQuality

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = ROOT / "checkpoints" / "mar-digits", ROOT / "checkpoints" / "mar-digits-drafter"
STEPS = 16  # the statistic re-runs the target step by step: fewer steps than the 144 of decoding keep it short


@pytest.fixture(scope="module")
def models():
    return tuple(load_mar_backbone(path, num_iter=STEPS, final_step_noise=True) for path in (TARGET, DRAFTER))


def per_token_macs(model) -> int:
    """Multiply-accumulates of the encoder-decoder's linears per position and pass (MAR-B : MAR-H is ~0.22)."""
    c = model.config
    block = lambda dim: 12 * dim * dim  # noqa: E731  (qkv, proj, and the 4x MLP)
    return c.encoder_depth * block(c.encoder_dim) + c.decoder_depth * block(c.decoder_dim)


def test_the_embedded_mar_and_its_drafter_load_as_released_mars_do(models):
    target, drafter = models
    check_compatible(target, drafter)  # one grid, tokens, classes and diffusion sampling
    assert (target.seq_len, target.token_dim, target.num_classes) == (144, 4, 10)
    assert per_token_macs(drafter) <= 0.22 * per_token_macs(target)  # the paper's MAR-B : MAR-H or smaller
    assert target.tokens_to_pixels(torch.zeros(1, 12, 12, 4)).shape == (1, 1, 24, 24)


@pytest.mark.slow  # 20 images at the 144 steps of decoding
def test_its_samples_are_digits_of_their_class():
    target = load_mar_backbone(TARGET, num_iter=144, final_step_noise=True)
    class_ids = torch.arange(20) % 10
    tokens = target.sample(class_ids, num_iter=144, cfg_scale=3.0, generator=torch.Generator().manual_seed(0))
    images = target.tokens_to_pixels(tokens.view(20, 12, 12, 4))
    images = torch.round(images * 15) / 15  # as `python -m decode` scores continuous digits (16 levels)
    quality = DigitsQuality(24, 16, ROOT / "checkpoints" / "digits-classifier")(images, class_ids)
    assert quality["classifier_accuracy"] >= 0.9, quality


def exactness_statistic(target, drafter, settings, batch: int, cfg: float = 1.0):
    class_ids = torch.arange(batch) % 10
    return cspd_mar_statistic(target, drafter, settings, STEPS, cfg, class_ids, dtype=torch.float32)


@pytest.mark.slow  # statistical; the planted bias below runs in the fast tier
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_exact_cspd_on_the_embedded_mar_has_the_targets_distribution(models, cfg):
    p_value, result = exactness_statistic(*models, CSpDMARConfig(), batch=60, cfg=cfg)
    assert 0 < result.accepted_tokens < result.drafted_tokens  # kept drafts and residual draws both exercised
    assert p_value > 1e-3, p_value


def test_the_statistic_catches_a_rejected_draft_kept_on_the_embedded_mar(models, monkeypatch):
    import decode.rules as rules

    monkeypatch.setattr(
        rules, "gaussian_residual_sample", lambda p, q, generator: (q[0], torch.ones(len(q[0]), dtype=torch.bool))
    )
    p_value, _ = exactness_statistic(*models, CSpDMARConfig(), batch=12)
    assert p_value < 1e-6, p_value


def test_a_drafter_equal_to_the_embedded_mar_keeps_every_draft_and_gives_its_tokens(models):
    target = models[0]
    class_ids = torch.tensor([3, 8])
    orders, noise = draws(2, target, seed=5, dtype=torch.float32)
    own = target.sample(class_ids, num_iter=STEPS, cfg_scale=3.0, orders=orders, noise=noise)
    result = generate_cspd_mar(target, target, class_ids, CSpDMARConfig(), STEPS, 3.0, orders=orders, noise=noise)
    assert result.accepted_tokens == result.drafted_tokens > 0
    torch.testing.assert_close(result.tokens.view(2, 144, 4), own, rtol=0, atol=1e-5)
