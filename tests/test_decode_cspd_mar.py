"""CSpD on MAR (decode/cspd_mar.py): a MAR drafter's steps verified by the target MAR, exact and as the reference.

Tiny random MARs (backbones/mar.py), in float64: the untrained head makes tokens ~1e5, and a token's final-step
std is a small fraction of that, so every figure is read at that scale (see `standardized_tokens`).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from mar_statistics import cspd_mar_statistic, draws, standardized_tokens
from scipy.stats import kstest

from backbones.base import Condition
from backbones.mar import MARBackbone, gather_positions, random_mar_backbone, reveal_steps
from decode.cspd_mar import CSpDMARConfig, generate_cspd_mar, load_mar_drafter, prefill_steps
from decode.mar_grouped import MARGroupedConfig, generate_mar_grouped, grouped_steps
from decode.sampling import SamplingConfig

SEQ, DIM = 16, 4


def tiny(seed: int = 0, **overrides) -> MARBackbone:
    return random_mar_backbone(seed=seed, final_step_noise=True, **overrides).double()


@pytest.fixture(scope="module")
def target():
    return tiny()


def near_copy(model: MARBackbone, scale: float, seed: int = 5) -> MARBackbone:
    """`model` with its decoder blocks perturbed by `scale`: a drafter whose drafts are accepted part of the time
    (1e-9 in float64: about a third of the tokens; the random head amplifies every difference ~1e9)."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if name.startswith("decoder_blocks"):
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return drafter


# ---- a drafter equal to the target ----------------------------------------------------------------------


@pytest.mark.parametrize("num_iter,cfg,gamma", [(16, 1.0, 4), (8, 3.0, 3), (5, 2.0, 1), (6, 1.0, 8)])
def test_drafter_equal_to_the_target_accepts_every_draft_and_gives_the_targets_tokens(target, num_iter, cfg, gamma):
    class_ids = torch.tensor([1, 4, 7])
    orders, noise = draws(3, target)
    own = target.sample(class_ids, num_iter=num_iter, cfg_scale=cfg, orders=orders, noise=noise)
    result = generate_cspd_mar(
        target, target, class_ids, CSpDMARConfig(gamma=gamma), num_iter, cfg,
        orders=orders, noise=noise, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    torch.testing.assert_close(result.tokens.view(3, SEQ, DIM), own, rtol=1e-7, atol=0)
    assert result.accepted_tokens == result.drafted_tokens > 0
    steps = len(reveal_steps(SEQ, num_iter))
    first = prefill_steps(0.05, steps)
    # Every round keeps its gamma steps and the bonus step: ceil((steps - pre-fill) / (gamma + 1)) verifications.
    assert result.forward_passes == first + math.ceil((steps - first) / (gamma + 1))
    assert result.extras["residual_fallbacks"] == 0


def test_with_cost_aware_rounds_a_drafter_equal_to_the_target_gives_the_targets_tokens(target):
    class_ids = torch.tensor([1, 4, 7])
    orders, noise = draws(3, target)
    own = target.sample(class_ids, num_iter=16, cfg_scale=3.0, orders=orders, noise=noise)
    result = generate_cspd_mar(
        target, target, class_ids, CSpDMARConfig(gamma="auto", max_gamma=5), 16, 3.0,
        orders=orders, noise=noise, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    torch.testing.assert_close(result.tokens.view(3, SEQ, DIM), own, rtol=1e-7, atol=0)
    assert result.accepted_tokens == result.drafted_tokens > 0
    rounds = result.extras["window_passes"]
    assert rounds >= 2 and 1 <= result.extras["window_sum"] / rounds <= 5


def test_each_image_keeps_the_steps_it_verified_when_another_image_stops(target, monkeypatch):
    """The target drafting for itself, but each round one of two images, in turn, gets hopeless drafts (a
    Gaussian a thousand times too sure of each token: rejected). Committing only the steps both kept takes one
    step per pass (16); each image keeping its verified steps for the next round, re-fed without a second test
    (which would reject them here), takes 7, and the image that never stops gets the target's own tokens."""
    import decode.cspd_mar as cspd_mar

    original, rounds = cspd_mar._Run.draft, []

    def taking_turns(self, tokens, known, window, counts, ahead=None):
        drafts = original(self, tokens, known, window, counts, ahead)
        hopeless = len(rounds) % len(tokens)
        rounds.append(hopeless)
        for drawn in drafts:
            drawn.final_mean[hopeless] = drawn.tokens[hopeless]
            drawn.final_std[hopeless] *= 1e-3
        return drafts

    monkeypatch.setattr(cspd_mar._Run, "draft", taking_turns)
    class_ids = torch.tensor([3, 8])
    orders, noise = draws(2, target, seed=4)
    own = target.sample(class_ids, num_iter=16, orders=orders, noise=noise)  # one token per step
    result = generate_cspd_mar(
        target, target, class_ids, CSpDMARConfig(gamma=3, prefill_fraction=0.0), 16,
        orders=orders, noise=noise, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    # Rounds alternate: image 0 stops at its first step while image 1 keeps 3 and a bonus; then image 1 re-feeds
    # those and image 0 keeps 3 and a bonus: 5 steps per 2 passes, and a last round of one step.
    assert result.forward_passes == 7 and len(rounds) == 7
    torch.testing.assert_close(result.tokens.view(2, SEQ, DIM)[1], own[1], rtol=1e-7, atol=0)
    assert result.extras["residual_fallbacks"] == 0


def test_one_step_rounds_of_the_reference_verification_are_the_targets_sampler(target):
    class_ids = torch.tensor([0, 5])
    orders, noise = draws(2, target, seed=3)
    own = target.sample(class_ids, num_iter=8, cfg_scale=2.0, orders=orders, noise=noise)
    settings = CSpDMARConfig(gamma=1, verification="window")
    result = generate_cspd_mar(target, target, class_ids, settings, 8, 2.0, orders=orders, noise=noise)
    assert torch.equal(result.tokens.view(2, SEQ, DIM), own)  # a round of one step: the target saw all before it


def test_reference_rounds_end_at_steps_divisible_by_gamma():
    """The authors' demo: 256 steps of one token, 5% pre-fill (steps 0-12), checks at 16, 20, ..., 252, 255."""
    model = random_mar_backbone(seed=0, grid_size=16, final_step_noise=True)
    settings = CSpDMARConfig(gamma=4, verification="window", tau=42.0, reference_correction=True)
    assert prefill_steps(0.05, 256) == 13
    result = generate_cspd_mar(model, model, torch.tensor([3]), settings, 256, 4.0, "constant")
    assert result.forward_passes == 13 + 61 and result.extras["drafter_passes"] == 256 - 13
    assert result.drafted_tokens == 256 - 13


# ---- exactness, with the power to fail -------------------------------------------------------------------


def exactness_statistic(target, drafter, settings, num_iter=8, cfg=1.0, batch=300):
    return cspd_mar_statistic(target, drafter, settings, num_iter, cfg, torch.full((batch,), 3))


@pytest.mark.slow  # statistical; test_the_exactness_check_catches_planted_biases runs in the fast tier
@pytest.mark.parametrize("cfg,gamma", [(1.0, 3), (3.0, 3), (3.0, "auto")])
def test_exact_cspd_on_mar_has_the_targets_distribution(target, cfg, gamma):
    """gamma auto: each round's length chosen by measured cost (decode/gamma_choice.py), from earlier rounds."""
    p_value, result = exactness_statistic(target, near_copy(target, 1e-9), CSpDMARConfig(gamma=gamma), cfg=cfg)
    rate = result.accepted_tokens / result.drafted_tokens
    assert 0.1 < rate < 0.9, rate  # both branches (kept drafts and residual draws) are exercised
    assert p_value > 1e-3, p_value


def test_the_exactness_check_catches_planted_biases(target, monkeypatch):
    drafter = near_copy(target, 1e-9)
    # 1. The reference's verification: the target judges a round's drafts without seeing the earlier ones.
    p_value, _ = exactness_statistic(target, drafter, CSpDMARConfig(gamma=3, verification="window"))
    assert p_value < 1e-6, p_value
    # 2. A rejected draft kept instead of its residual draw.
    import decode.rules as rules

    monkeypatch.setattr(
        rules, "gaussian_residual_sample", lambda p, q, generator: (q[0], torch.ones(len(q[0]), dtype=torch.bool))
    )
    p_value, _ = exactness_statistic(target, drafter, CSpDMARConfig(gamma=3))
    assert p_value < 1e-6, p_value


def test_the_statistic_is_standard_normal_on_the_targets_own_samples(target):
    class_ids = torch.full((300,), 3)
    orders, noise = draws(300, target, seed=11)
    tokens = target.sample(class_ids, num_iter=8, orders=orders, noise=noise)
    u = standardized_tokens(target, tokens, class_ids, orders, noise, 8, 1.0)
    torch.testing.assert_close(u.view(-1), _noise_of_last_steps(noise, orders, 8).view(-1), rtol=0, atol=1e-4)


# ---- the reference verification is MAR's sampler with grouped steps (decode/mar_grouped.py) ---------------


def test_grouped_steps_of_one_are_the_targets_own_sampler(target):
    class_ids = torch.tensor([1, 7])
    orders, noise = draws(2, target, seed=6)
    own = target.sample(class_ids, num_iter=8, cfg_scale=2.0, orders=orders, noise=noise)
    condition, sampling = Condition(class_ids=class_ids), SamplingConfig(cfg_scale=2.0)
    model = copy.copy(target)
    model.num_iter = 8
    result = generate_mar_grouped(model, condition, sampling, MARGroupedConfig(gamma=1), orders=orders, noise=noise)
    assert torch.equal(result.tokens.view(2, SEQ, DIM), own) and result.forward_passes == 8
    grouped = generate_mar_grouped(model, condition, sampling, MARGroupedConfig(gamma=3), orders=orders, noise=noise)
    assert grouped.forward_passes == len(grouped_steps(reveal_steps(SEQ, 8), 3, 0.05)) == 4  # steps 0 | 1-3 | 4-6 | 7


@pytest.mark.slow  # statistical; the grouped statistic's power is checked in the same test
def test_the_reference_verification_at_tau_1_has_the_grouped_samplers_distribution(target):
    """With the exact test, the reference's rounds sample each token given only the tokens before its round:
    MAR's sampler with each round's steps revealed together, whatever the drafter (module doc of mar_grouped)."""
    batch, num_iter, gamma = 300, 8, 3
    class_ids = torch.full((batch,), 3)
    orders, noise = draws(batch, target, seed=11)
    settings = CSpDMARConfig(gamma=gamma, verification="window")
    result = generate_cspd_mar(
        target, near_copy(target, 1e-9), class_ids, settings, num_iter, orders=orders, noise=noise,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    steps = grouped_steps(reveal_steps(SEQ, num_iter), gamma, settings.prefill_fraction)
    u = standardized_tokens(target, result.tokens, class_ids, orders, noise, num_iter, 1.0, steps=steps)
    assert kstest(u.numpy(), "norm").pvalue > 1e-3
    # The statistic can fail: the target's own (step by step) tokens are not of the grouped sampler.
    own = target.sample(class_ids, num_iter=num_iter, orders=orders, noise=noise)
    u = standardized_tokens(target, own, class_ids, orders, noise, num_iter, 1.0, steps=steps)
    assert kstest(u.numpy(), "norm").pvalue < 1e-6


def _noise_of_last_steps(noise, orders, num_iter):
    """The last reverse step's noise of every token, in `standardized_tokens`' order."""
    return torch.cat(
        [gather_positions(noise, orders[:, s.start : s.end])[:, :, -1].flatten() for s in reveal_steps(SEQ, num_iter)]
    )


# ---- settings, refusals, loading ---------------------------------------------------------------------------


def test_exact_setting_refuses_models_without_last_step_noise():
    model = random_mar_backbone(seed=0)  # the released sampler: a token is its final mean, no density
    with pytest.raises(ValueError, match="final_step_noise=true"):
        generate_cspd_mar(model, model, torch.tensor([0]), CSpDMARConfig(), 8)
    relaxed = CSpDMARConfig(verification="window", tau=42.0, reference_correction=True)
    result = generate_cspd_mar(model, model, torch.tensor([0]), relaxed, 8)  # the reference's test runs there
    assert result.tokens.shape == (1, 4, 4, DIM)


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(gamma=0), "gamma must be an int >= 1 or 'auto'"),
        (dict(gamma="auto", verification="window"), "gamma auto needs verification prefix"),
        (dict(verification="rows"), "verification must be one of"),
        (dict(tau=0.5), "tau must be a finite number >= 1"),
        (dict(prefill_fraction=1.0), "prefill_fraction must be in"),
    ],
)
def test_bad_settings_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        CSpDMARConfig(**values)


def test_a_drafter_of_another_grid_or_step_count_is_refused(target):
    with pytest.raises(ValueError, match="sampling_steps"):
        generate_cspd_mar(target, tiny(sampling_steps=5), torch.tensor([0]), CSpDMARConfig(), 8)
    with pytest.raises(ValueError, match="grid_size"):
        generate_cspd_mar(target, tiny(grid_size=2), torch.tensor([0]), CSpDMARConfig(), 8)


def test_the_drafter_loads_from_an_official_checkpoint_in_the_targets_settings(tmp_path):
    from safetensors.torch import save_file

    target = random_mar_backbone(seed=0, num_iter=6, cfg_schedule="constant", final_step_noise=True)
    drafter = random_mar_backbone(seed=1)
    save_file({k: v.contiguous() for k, v in drafter.official_state_dict().items()}, tmp_path / "mar-tiny.safetensors")
    loaded = load_mar_drafter(tmp_path, target)  # size read off the weights
    assert (loaded.num_iter, loaded.cfg_schedule, loaded.config.final_step_noise) == (6, "constant", True)
    assert loaded.weights_fingerprint() == drafter.weights_fingerprint() != target.weights_fingerprint()
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        load_mar_drafter(tmp_path / "missing", target)


# ---- the decode CLI ---------------------------------------------------------------------------------------


def test_decode_experiment_compares_cspd_on_mar_with_the_baseline(tmp_path):
    """`python -m decode +experiment=cspd_mar` on the tiny random MAR without a VAE: both presets, passes and
    speed, no PNGs."""
    from conftest import compose_config
    from safetensors.torch import save_file

    from decode.cli import run_decode

    drafter = random_mar_backbone(seed=0)  # the target's own weights: every draft of the exact preset is kept
    save_file({k: v.contiguous() for k, v in drafter.official_state_dict().items()}, tmp_path / "mar-tiny.safetensors")
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "+experiment=cspd_mar",
            "backbone=mar_tiny",
            "backbone.vae_seed=null",
            "backbone.num_iter=8",
            "backbone.cfg_schedule=constant",
            "backbone.dtype=float64",  # float32 rounding, amplified by the random head, would reject equal drafts
            "decode.methods=[ar,cspd_mar,cspd_mar_reference]",
            f"decode.mar_drafter={tmp_path}",
            "decode.num_images=4",
            "decode.batch_size=2",
            "decode.cfg_scale=2.0",
            f"decode.out={out}",
        ],
        tmp_path / "run",
    )
    report = run_decode(cfg)
    methods = report["methods"]
    assert list(methods) == ["ar", "cspd_mar", "cspd_mar_reference"]
    assert methods["ar"]["forward_passes_per_image"] == 8
    assert methods["cspd_mar"]["lossless"] and not methods["cspd_mar_reference"]["lossless"]
    assert methods["cspd_mar"]["draft_acceptance_rate"] == 1.0  # its drafter is the target
    assert methods["cspd_mar"]["forward_passes_per_image"] < 8
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["backbone"]["family"] == "MARBackbone" and not list(out.glob("*.png"))


def test_decode_on_mar_with_a_vae_writes_pngs_and_fid(tmp_path):
    """With the KL VAE (`backbone.vae_path`; the tiny config's random one) a MAR run decodes its tokens to images:
    a PNG grid per method and FID against the reference folder."""
    from conftest import compose_config
    from safetensors.torch import save_file
    from test_real_quality import save_reference_images

    from decode.cli import run_decode

    save_reference_images(tmp_path / "ref", count=12)
    drafter = random_mar_backbone(seed=1)
    save_file({k: v.contiguous() for k, v in drafter.official_state_dict().items()}, tmp_path / "mar-tiny.safetensors")
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "+experiment=cspd_mar",
            "backbone=mar_tiny",
            "backbone.num_iter=4",
            "decode.methods=[ar,cspd_mar_reference]",
            f"decode.mar_drafter={tmp_path}",
            "decode.num_images=6",
            "decode.batch_size=3",
            f"decode.out={out}",
            f"decode.quality.reference_dir={tmp_path / 'ref'}",
            "decode.quality.fid_features={_target_:test_real_quality.TinyFeatures}",
        ],
        tmp_path / "run",
    )
    run_decode(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["quality_note"].startswith("fid")
    for name in ("ar", "cspd_mar_reference"):
        quality = metrics["methods"][name]["quality"]
        assert set(quality) == {"fid"} and math.isfinite(quality["fid"]) and quality["fid"] >= 0
        assert (out / f"{name}.png").is_file()


def test_discrete_and_raster_methods_are_refused_on_mar():
    from conftest import compose_config

    from decode.registry import check_methods, check_token_kinds

    cfg = compose_config(["backbone=mar_tiny", "decode.methods=[ar,cspd]"], "/tmp/unused")
    with pytest.raises(ValueError, match="masked \\(MAR\\): ar, cspd_mar"):
        check_token_kinds(check_methods(cfg.decode), random_mar_backbone(seed=0))


def test_baseline_reveals_by_the_backbones_schedule(target):
    from backbones.base import Condition
    from decode.masked_baseline import generate_masked
    from decode.sampling import SamplingConfig

    model = random_mar_backbone(seed=0, num_iter=5, cfg_schedule="constant")
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=0, top_p=1.0, greedy=False)
    result = generate_masked(model, Condition(class_ids=torch.tensor([2])), sampling, torch.Generator().manual_seed(4))
    own = model.sample(torch.tensor([2]), 5, 2.0, "constant", generator=torch.Generator().manual_seed(4))
    assert torch.equal(result.tokens.view(1, SEQ, DIM), own) and result.forward_passes == 5


def test_a_missing_drafter_names_the_key_to_set():
    from conftest import compose_config

    from decode.registry import check_methods

    cfg = compose_config(["+experiment=cspd_mar", "backbone=mar_tiny"], "/tmp/unused")  # decode.mar_drafter: null
    with pytest.raises(ValueError, match=r"drafter is not set.*set decode\.mar_drafter=PATH"):
        check_methods(cfg.decode)
