"""CSpD (decode/cspd.py) and its Gaussian rules (decode/rules.py) on tiny continuous backbones."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import TINY_CONTINUOUS, tiny_continuous
from scipy import stats

from backbones.base import Condition
from backbones.digits_continuous import random_continuous_digits_backbone
from decode.continuous_ar import generate_continuous_ar
from decode.cspd import CSpDConfig, generate_cspd
from decode.rules import gaussian_acceptance, gaussian_residual_sample
from decode.sampling import SamplingConfig


def residual_density(xs, p, q):
    """norm(max(0, p - q)) of 1-D Gaussians p = (mean, std), q = (mean, std), on a grid xs."""
    density = np.maximum(stats.norm.pdf(xs, *p) - stats.norm.pdf(xs, *q), 0)
    return density / np.trapezoid(density, xs)


def histogram_pvalue(samples: np.ndarray, density, low=-6.0, high=6.0, bins=40) -> float:
    """Chi-square of samples' histogram against an analytic density's bin masses (empty-expectation bins merged)."""
    edges = np.linspace(low, high, bins + 1)
    fine = np.linspace(low, high, 20001)
    values = density(fine)
    cumulative = np.concatenate([[0], np.cumsum((values[1:] + values[:-1]) / 2 * np.diff(fine))])
    masses = np.diff(np.interp(edges, fine, cumulative))
    masses = masses / masses.sum()
    observed = np.histogram(np.clip(samples, low, high - 1e-9), edges)[0]
    keep = masses * len(samples) >= 5
    expected = masses[keep] * len(samples)
    observed = observed[keep]
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.mark.parametrize("q", [(1.0, 0.7), (0.3, 1.5), (-2.0, 1.0)])
def test_residual_sampler_draws_the_residual(q):
    p = (0.0, 1.0)
    count = 40_000
    target = (torch.full((count, 1), p[0], dtype=torch.float64), torch.full((count, 1), p[1], dtype=torch.float64))
    draft = (torch.full((count, 1), q[0], dtype=torch.float64), torch.full((count, 1), q[1], dtype=torch.float64))
    tokens, settled = gaussian_residual_sample(target, draft, torch.Generator().manual_seed(0))
    assert bool(settled.all())
    samples = tokens[:, 0].numpy()
    assert histogram_pvalue(samples, lambda xs: residual_density(xs, p, q)) > 1e-3
    # Power: the target itself (what a residual without its clamp at 0 amounts to) is refused.
    plain = torch.randn(count, generator=torch.Generator().manual_seed(1), dtype=torch.float64).numpy()
    assert histogram_pvalue(plain, lambda xs: residual_density(xs, p, q)) < 1e-6


def speculative_draws(p, q, count, seed, residual=True):
    """x ~ q accepted with min(1, p/q), else a residual draw (or, residual=False, a draw from p): 1-D samples."""
    generator = torch.Generator().manual_seed(seed)
    full = lambda value: torch.full((count, 1), value, dtype=torch.float64)  # noqa: E731
    target, draft = (full(p[0]), full(p[1])), (full(q[0]), full(q[1]))
    x = q[0] + q[1] * torch.randn((count, 1), generator=generator, dtype=torch.float64)
    kept = torch.rand(count, generator=generator, dtype=torch.float64) < gaussian_acceptance(x, target, draft)
    if residual:
        other, _ = gaussian_residual_sample(target, draft, generator)
    else:
        other = p[0] + p[1] * torch.randn((count, 1), generator=generator, dtype=torch.float64)
    return torch.where(kept[:, None], x, other)[:, 0].numpy()


def test_gaussian_speculative_sampling_returns_the_target():
    p, q = (0.2, 0.8), (0.9, 0.6)
    target_density = lambda xs: stats.norm.pdf(xs, *p)  # noqa: E731
    assert histogram_pvalue(speculative_draws(p, q, 40_000, seed=0), target_density) > 1e-3
    # Planted bias: a rejection redrawn from p instead of the residual over-weights the overlap.
    assert histogram_pvalue(speculative_draws(p, q, 40_000, seed=0, residual=False), target_density) < 1e-6


def test_relaxed_test_accepts_more_and_tau_one_is_exact():
    x = torch.tensor([[0.1, 0.0]])
    target, draft = (
        (torch.zeros(1, 2), torch.full((1, 2), 0.01)),
        (torch.tensor([[0.1, 0.0]]), torch.full((1, 2), 0.01)),
    )
    exact = float(gaussian_acceptance(x, target, draft))
    relaxed = float(gaussian_acceptance(x, target, draft, tau=42.0))
    assert exact < 1e-10 < 0.9 < relaxed  # ten stds apart: exact rejects; 42x wider kernels accept
    assert float(gaussian_acceptance(x, draft, draft)) == 1.0
    # The reference's correction exp(sum log std_p - sum log std_q) is one number per token.
    halved = float(gaussian_acceptance(x, draft, draft, log_correction=torch.tensor([np.log(0.5)])))
    assert halved == pytest.approx(0.5)
    with pytest.raises(ValueError, match="log_correction must be shaped"):
        gaussian_acceptance(x, draft, draft, log_correction=torch.zeros(1, 2))


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("gamma,prefill", [(1, 0.0), (3, 0.05), (7, 0.3)])
def test_drafter_equal_to_backbone_accepts_every_draft(cfg_scale, gamma, prefill):
    backbone = tiny_continuous()
    condition = Condition(class_ids=torch.tensor([1, 4, 9]))
    sampling = SamplingConfig(cfg_scale=cfg_scale)
    noise = backbone.draw_noise(3, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, condition, sampling, noise=noise)
    result = generate_cspd(
        backbone, backbone, condition, sampling, torch.Generator().manual_seed(1),
        CSpDConfig(gamma=gamma, prefill_fraction=prefill), noise=noise,
    )  # fmt: skip
    assert result.accepted_tokens == result.drafted_tokens > 0
    # Equal up to float32 rounding: a pass over several tokens rounds its sums otherwise than one-token steps.
    torch.testing.assert_close(result.tokens, ar.tokens, rtol=0, atol=1e-5)
    prefilled = max(1, int(np.ceil(prefill * 16)))
    rounds = int(np.ceil((16 - prefilled) / (gamma + 1)))  # gamma drafts + the bonus token per pass
    assert result.forward_passes == prefilled + rounds


def test_with_cost_aware_rounds_a_drafter_equal_to_the_backbone_gives_its_tokens():
    backbone = tiny_continuous()
    condition = Condition(class_ids=torch.tensor([1, 4, 9]))
    sampling = SamplingConfig(cfg_scale=3.0)
    noise = backbone.draw_noise(3, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, condition, sampling, noise=noise)
    result = generate_cspd(
        backbone, backbone, condition, sampling, torch.Generator().manual_seed(1),
        CSpDConfig(gamma="auto", max_gamma=5, prefill_fraction=0.0), noise=noise,
    )  # fmt: skip
    assert result.accepted_tokens == result.drafted_tokens > 0
    torch.testing.assert_close(result.tokens, ar.tokens, rtol=0, atol=1e-5)
    rounds = result.extras["window_passes"]
    assert rounds >= 2 and 1 <= result.extras["window_sum"] / rounds <= 5


class TakingTurnsDrafter:
    """The backbone drafting for itself (every draft kept), except that each round one image, in turn, gets
    hopeless drafts (always rejected): no round lets the whole batch through."""

    def __init__(self, backbone, condition, sampling, gamma: int):
        self.model, self.sampling, self.gamma, self.round = copy.deepcopy(backbone), sampling, gamma, 0
        self.state, _ = self.model.prefill(condition, sampling.guided)

    def draft(self, run, pending: int):
        from decode.cspd import _draft_sequential

        count = min(self.gamma, run.tokens.shape[1] - 1 - pending)
        drafts = _draft_sequential(self.model, self.state, run, pending, count, run.noise, self.sampling.cfg_scale)
        hopeless = self.round % len(run.tokens)
        self.round += 1
        # A Gaussian a thousand times too sure of each draft: p(x) / q(x) < 1e-12, the draft is rejected (and
        # so would a re-fed verified token be, were it judged again).
        drafts.mean[hopeless] = drafts.tokens[hopeless]
        drafts.std[hopeless] *= 1e-3
        return drafts

    def rollback(self, last: int) -> None:
        self.model.rollback(self.state, min(last, self.state.num_image_tokens))


def test_each_image_of_a_batch_keeps_what_it_verified_when_another_image_stops():
    """Two images rejecting in turn: committing only what both accepted gives one token per pass (16 passes);
    each image keeping its verified tokens for the next round, re-fed without a second test (which would reject
    them here), takes 7, and the image that never stops gets the backbone's own tokens."""
    from decode.cspd import speculate

    backbone = tiny_continuous()
    condition, sampling = Condition(class_ids=torch.tensor([3, 8])), SamplingConfig(cfg_scale=2.0)
    noise = backbone.draw_noise(2, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, condition, sampling, noise=noise)
    drafter = TakingTurnsDrafter(backbone, condition, sampling, gamma=3)
    result = speculate(
        backbone, condition, sampling, torch.Generator().manual_seed(1), (drafter.draft, drafter.rollback), noise,
        prefill_fraction=0.0, tau=1.0,
    )  # fmt: skip
    # Round 1: image 0 stops at its first draft (a residual draw), image 1 keeps its 3 drafts and a bonus.
    # Round 2: image 1 re-feeds those 4 tokens (no test, no drafts), image 0 keeps 3 drafts and a bonus, while
    # image 1's drafts, hopeless this time, are never needed. 5 tokens per 2 passes after the first token.
    assert result.forward_passes == 1 + 6
    assert (result.drafted_tokens, result.accepted_tokens) == (3 * (6 + 3), 6 * 3)  # re-fed tokens are not drafts
    # Image 1 never stops: each of its tokens is a kept draft or a bonus, the backbone's own on this noise.
    torch.testing.assert_close(result.tokens[1], ar.tokens[1], rtol=0, atol=1e-5)
    assert result.extras["residual_fallbacks"] == 0


def perturbed_drafter(backbone, scale: float, seed: int = 7):
    """The backbone with its diffusion head's weights nudged: drafts close to, not equal to, the backbone's."""
    drafter = tiny_continuous()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.diffusion.net.output.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return drafter


def first_tokens(result, count: int = 3) -> np.ndarray:
    return result.tokens.flatten(1, 2)[:, :count].flatten(1).numpy()  # (B, count * token_dim)


def ks_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Bonferroni-corrected smallest p-value of per-channel two-sample KS tests, (N, C) against (M, C)."""
    return min(stats.ks_2samp(a[:, d], b[:, d]).pvalue for d in range(a.shape[1])) * a.shape[1]


class CSpDRuns:
    """CSpD on `count` images of one class, `chunk` per batch (a batch commits its slowest image's tokens: small
    batches let runs of accepted drafts through), with the acceptance over all of them."""

    def __init__(self, backbone, drafter, sampling):
        self.backbone, self.drafter, self.sampling = backbone, drafter, sampling

    def __call__(self, settings: CSpDConfig, count: int, chunk: int, seed: int) -> tuple[np.ndarray, float]:
        tokens, drafted, accepted = [], 0, 0
        for k in range(count // chunk):
            condition = Condition(class_ids=torch.full((chunk,), 2))
            generator = torch.Generator().manual_seed(seed + k)
            result = generate_cspd(self.backbone, self.drafter, condition, self.sampling, generator, settings)
            tokens.append(first_tokens(result))
            drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens
        return np.concatenate(tokens), accepted / drafted


@pytest.mark.slow  # statistical (6,000 samples); the planted-bias checks below run in the fast tier
def test_exact_cspd_has_the_backbones_distribution():
    """Per position and channel, two-sample KS tests of CSpD's first tokens against AR's (fixed seeds, 2,000 each):
    a drafter near the backbone (about half its drafts accepted), one draft and three per pass."""
    backbone = tiny_continuous()
    sampling = SamplingConfig(cfg_scale=2.0)
    count = 2000
    condition = Condition(class_ids=torch.full((count,), 2))
    ar = first_tokens(generate_continuous_ar(backbone, condition, sampling, torch.Generator().manual_seed(10)))
    runs = CSpDRuns(backbone, perturbed_drafter(backbone, scale=1e-3), sampling)
    one, acceptance = runs(CSpDConfig(gamma=1, prefill_fraction=0), count, chunk=count, seed=11)
    assert 0.2 < acceptance < 0.8, acceptance  # the acceptance and the residual paths both carry weight
    assert ks_pvalue(ar, one) > 1e-3
    three, acceptance = runs(CSpDConfig(gamma=3, prefill_fraction=0), count, chunk=16, seed=12)
    assert acceptance > 0.1, acceptance
    assert ks_pvalue(ar, three) > 1e-3


def standardized_tokens(backbone, tokens, class_ids, noise, sampling) -> torch.Tensor:
    """(x - mean) / std of every token under the backbone's own final-step Gaussian given the tokens before it
    and its trajectory noise: exactly N(0, 1), independent, when `tokens` have the backbone's distribution."""
    flat = tokens.flatten(1, 2)  # (B, N, D)
    state, hidden = backbone.prefill(Condition(class_ids=class_ids), sampling.guided)
    states = torch.cat([hidden[:, -1:], backbone.step(state, flat[:, :-1])], dim=1)  # states[:, i] conditions i
    gaussian = backbone.sample_tokens(state, states, noise, sampling.cfg_scale, sampling.temperature)
    return ((flat - gaussian.final_mean) / gaussian.final_std).flatten()


def cspd_exactness(drafter, settings: CSpDConfig, batch: int, images: int = 512) -> tuple[float, float]:
    """KS p-value of the standardized tokens of `images` CSpD images (batches of `batch`, class 2, CFG 2) against
    N(0, 1), and the draft acceptance."""
    backbone = tiny_continuous()
    sampling = SamplingConfig(cfg_scale=2.0)
    standardized, drafted, accepted = [], 0, 0
    for k in range(images // batch):
        class_ids = torch.full((batch,), 2)
        noise = backbone.draw_noise(batch, 16, torch.Generator().manual_seed(100 + k))
        result = generate_cspd(
            backbone, drafter, Condition(class_ids=class_ids), sampling, torch.Generator().manual_seed(k), settings,
            noise=noise,
        )  # fmt: skip
        standardized.append(standardized_tokens(backbone, result.tokens, class_ids, noise, sampling))
        drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens
    return stats.kstest(torch.cat(standardized).numpy(), "norm").pvalue, accepted / drafted


def test_the_standardized_tokens_of_the_backbones_own_samples_are_its_last_step_noise():
    backbone, sampling = tiny_continuous(), SamplingConfig(cfg_scale=2.0)
    class_ids = torch.tensor([1, 5, 7])
    noise = backbone.draw_noise(3, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, Condition(class_ids=class_ids), sampling, noise=noise)
    u = standardized_tokens(backbone, ar.tokens, class_ids, noise, sampling)
    torch.testing.assert_close(u, noise[:, :, -1].flatten(), rtol=0, atol=1e-3)


@pytest.mark.slow  # statistical (8,192 values per batch size); the fast tier keeps the planted-bias check
@pytest.mark.parametrize("batch,gamma", [(4, 4), (16, 4), (16, "auto")])
def test_exact_cspd_tokens_are_the_backbones_final_step_gaussians(batch, gamma):
    """Each token, standardized by the backbone's final-step Gaussian given the image's own earlier tokens, is
    N(0, 1) (KS, 8,192 values each): at batch 16 images re-feed the tokens they verified ahead of the others;
    gamma auto chooses each round's length from the rounds before it (decode/gamma_choice.py)."""
    settings = CSpDConfig(gamma=gamma)
    p_value, acceptance = cspd_exactness(perturbed_drafter(tiny_continuous(), scale=1e-3), settings, batch)
    assert 0.1 < acceptance < 0.9, acceptance  # kept drafts and residual draws both carry weight
    assert p_value > 1e-3, p_value


def test_the_final_step_check_catches_a_rejected_draft_kept(monkeypatch):
    import decode.cspd as cspd

    monkeypatch.setattr(cspd, "resample_rejected", lambda drafts, rejected, p, q, generator: (drafts.clone(), 0))
    p_value, _ = cspd_exactness(perturbed_drafter(tiny_continuous(), scale=1e-3), CSpDConfig(), batch=16)
    assert p_value < 1e-6, p_value


def test_shifted_drafter_is_corrected_and_caught_without_correction():
    """A drafter whose tokens are clearly off: exact CSpD still gives the backbone's tokens; accepting its drafts
    without the test (an infinitely relaxed tau) gives the drafter's, and the same KS test refuses them."""
    backbone = tiny_continuous()
    sampling = SamplingConfig(cfg_scale=2.0)
    count = 2000
    condition = Condition(class_ids=torch.full((count,), 2))
    ar = first_tokens(generate_continuous_ar(backbone, condition, sampling, torch.Generator().manual_seed(10)))
    runs = CSpDRuns(backbone, perturbed_drafter(backbone, scale=0.3), sampling)
    exact, _ = runs(CSpDConfig(gamma=3, prefill_fraction=0), count, chunk=count, seed=11)
    assert ks_pvalue(ar, exact) > 1e-3
    uncorrected, acceptance = runs(CSpDConfig(gamma=3, prefill_fraction=0, tau=1e6), count, chunk=count, seed=11)
    assert acceptance > 0.99
    assert ks_pvalue(ar, uncorrected) < 1e-6


def test_settings_are_checked():
    with pytest.raises(ValueError, match="gamma"):
        CSpDConfig(gamma=0)
    with pytest.raises(ValueError, match="tau"):
        CSpDConfig(tau=float("nan"))
    with pytest.raises(ValueError, match="prefill_fraction"):
        CSpDConfig(prefill_fraction=1.0)
    backbone = tiny_continuous()
    with pytest.raises(ValueError, match="diffusion head"):
        generate_continuous_ar(backbone, Condition(class_ids=torch.tensor([1])), SamplingConfig(greedy=True))


def test_exact_cspd_refuses_models_whose_last_step_is_their_mean():
    """The exact test compares the last reverse step's Gaussians (MAR's own heads return that step's mean, which
    has no density): refused by name for the drafter, the backbone or both; the relaxed test (tau > 1) runs."""
    condition, sampling = Condition(class_ids=torch.tensor([1, 4])), SamplingConfig(cfg_scale=3.0)
    for which in (("drafter",), ("backbone",), ("drafter", "backbone")):
        backbone, drafter = tiny_continuous(), perturbed_drafter(tiny_continuous(), 0.1)
        for model in [drafter] * ("drafter" in which) + [backbone] * ("backbone" in which):
            model.diffusion.config = dataclasses.replace(model.diffusion.config, final_step_noise=False)
        with pytest.raises(ValueError, match="final_step_noise=True"):
            generate_cspd(backbone, drafter, condition, sampling, torch.Generator().manual_seed(0), CSpDConfig())
    relaxed = generate_cspd(  # both without the last step's noise: the trajectories have the same steps
        backbone, drafter, condition, sampling, torch.Generator().manual_seed(0), CSpDConfig(tau=42.0)
    )
    assert relaxed.tokens.shape[0] == 2


@pytest.fixture(scope="session")
def continuous_classifier_cache(tmp_path_factory):
    """A checkpoints dir with the 8x8 classifier of 16 levels that scores the tiny continuous backbone's images."""
    from train.digits_classifier import train_and_save

    directory = tmp_path_factory.mktemp("checkpoints")
    train_and_save(directory / "digits-classifier", 8, 16, log=lambda _: None)
    return directory


# A corpus of 32 of the tiny backbone's own samples (one training shard, one held out), generated in seconds.
TINY_CONTINUOUS_CORPUS = [
    "data.spec.num_images=32", "data.spec.shard_size=16", "data.spec.batch_size=16", "data.batch_size=4",
]  # fmt: skip


def tiny_continuous_experiment(experiment: str, export, tmp_path, checkpoints_dir, data=None) -> list[str]:
    """Overrides that run a continuous experiment end to end in seconds: tiny backbone and data (`data`, default
    the tiny digits patches), 3 steps, a sample grid at step 2, a 2-image evaluation scored by the 8x8 classifier
    in `checkpoints_dir`."""
    return [
        f"+experiment={experiment}",
        "backbone=digits_continuous_tiny",
        *(data if data is not None else ["data=digits_continuous_tiny"]),
        "trainer=debug",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=1",
        "callbacks.samples.every_n_steps=2",
        "callbacks.samples.num_images=2",
        f"export.dir={export}",
        f"paths.root_dir={tmp_path}",
        f"paths.checkpoints_dir={checkpoints_dir}",
        "train.evaluate.num_images=2",
    ]


@pytest.mark.slow
def test_cspd_experiment_trains_exports_and_decodes(tmp_path, continuous_classifier_cache):
    from conftest import compose_config

    from heads.export import load_heads
    from train.pipeline import run_training

    export = tmp_path / "export"
    tiny = tiny_continuous_experiment(
        "cspd_digits", export, tmp_path, continuous_classifier_cache, data=TINY_CONTINUOUS_CORPUS
    )
    metrics = run_training(compose_config(tiny, tmp_path / "run"))
    assert metrics["train/diffusion_loss"] > 0
    drafter = load_heads(export, kind="cspd")
    assert drafter.config.hidden_size == 96 and drafter.config.sampling_steps == 4  # the backbone's steps
    assert drafter.config.guidance_scale == 1.0  # self-distilled on guided samples: it drafts unguided
    # ... from the backbone's own generations: a corpus of token vectors, built on first use.
    (corpus,) = (tmp_path / "corpora").iterdir()
    manifest = json.loads((corpus / "corpus.json").read_text())
    assert manifest["complete"] and manifest["backbone"]["token_dim"] == 4 and not manifest["spec"]["store_hidden"]
    assert (tmp_path / "run" / "samples" / "step_000002.png").is_file()
    report = json.loads((tmp_path / "run" / "evaluation" / "metrics.json").read_text())
    assert report["methods"]["cspd"]["lossless"] and not report["methods"]["cspd_relaxed"]["lossless"]
    assert report["methods"]["cspd_relaxed"]["settings"]["tau"] == 42.0
    for name in ("ar", "cspd", "cspd_relaxed"):
        figures = report["methods"][name]
        assert 0 <= figures["quality"]["classifier_accuracy"] <= 1 and figures["forward_passes_per_image"] >= 1
    assert report["methods"]["ar"]["forward_passes_per_image"] == 16


def test_drafter_export_round_trip_and_refusals(tmp_path):
    from heads.cspd import CSpDDrafter, CSpDDrafterConfig
    from heads.export import HeadsMismatchError, export_heads, load_heads

    backbone = tiny_continuous()
    drafter = CSpDDrafter(CSpDDrafterConfig.for_backbone(backbone, hidden_size=16, num_heads=2, num_layers=1,
                                                         intermediate_size=32, head_width=16))  # fmt: skip
    export_heads(drafter, tmp_path, backbone.identity())
    loaded = load_heads(tmp_path, backbone, kind="cspd")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="'cspd' heads, but 'ssd'"):
        load_heads(tmp_path, backbone, kind="ssd")
    other = random_continuous_digits_backbone(**{**TINY_CONTINUOUS, "image_size": 12})
    with pytest.raises(HeadsMismatchError, match="geometry"):
        load_heads(tmp_path, other, kind="cspd")
    fewer_steps = random_continuous_digits_backbone(**{**TINY_CONTINUOUS, "sampling_steps": 3})
    with pytest.raises(HeadsMismatchError, match="diffusion noise steps"):
        load_heads(tmp_path, fewer_steps, kind="cspd")


def test_row_heads_export_round_trip_and_refusals(tmp_path):
    from heads.cspd import ContinuousRowHeads
    from heads.export import HeadsMismatchError, export_heads, load_heads
    from heads.ssd import SSDHeadConfig

    backbone = tiny_continuous()
    heads = ContinuousRowHeads(SSDHeadConfig(hidden_size=32, width=16, row_attention_layers=1))
    export_heads(heads, tmp_path, backbone.identity())
    loaded = load_heads(tmp_path, backbone, kind="cspd_rows")
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="'cspd_rows' heads, but 'cspd'"):
        load_heads(tmp_path, backbone, kind="cspd")
    with pytest.raises(HeadsMismatchError, match="hidden_size"):
        load_heads(tmp_path, random_continuous_digits_backbone(**{**TINY_CONTINUOUS, "hidden_size": 64}))


def test_discrete_methods_are_refused_on_a_continuous_backbone():
    from omegaconf import OmegaConf

    from decode.registry import check_methods, load_artefacts

    decode_cfg = OmegaConf.create(
        {"methods": ["ar", "sjd"], "presets": {"ar": {"generator": "decode.ar"}, "sjd": {"generator": "decode.sjd"}}}
    )
    with pytest.raises(ValueError, match="decodes discrete tokens, but digits-continuous has continuous tokens"):
        load_artefacts(check_methods(decode_cfg), tiny_continuous())


class OracleRowHeads:
    """Row 'heads' that return the backbone's own states of a known image's rows (found by the row above)."""

    def __init__(self, backbone, tokens, class_ids, guided: bool):
        flat = tokens.flatten(1, 2)
        states = [backbone.teacher_forced_hidden_states(flat, class_ids)]
        if guided:
            states.append(backbone.teacher_forced_hidden_states(flat, torch.full_like(class_ids, backbone.num_classes)))
        self.states, self.cols = torch.cat(states), backbone.geometry.cols

    def __call__(self, above, _embedding):
        rows = self.states.view(*self.states.shape[:1], -1, self.cols, self.states.shape[-1])
        index = int((rows - above[:, None]).abs().amax(dim=(0, 2, 3)).argmin())
        return rows[:, index + 1]


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_row_drafts_of_the_backbones_own_states_are_all_accepted(cfg_scale):
    from decode.cspd_rows import CSpDRowsConfig, generate_cspd_rows

    backbone = tiny_continuous()
    class_ids = torch.tensor([2, 6])
    condition, sampling = Condition(class_ids=class_ids), SamplingConfig(cfg_scale=cfg_scale)
    noise = backbone.draw_noise(2, 16, torch.Generator().manual_seed(0))
    ar = generate_continuous_ar(backbone, condition, sampling, noise=noise)
    oracle = OracleRowHeads(backbone, ar.tokens, class_ids, sampling.guided)
    result = generate_cspd_rows(backbone, oracle, condition, sampling, torch.Generator().manual_seed(1),
                                CSpDRowsConfig(), noise=noise)  # fmt: skip
    assert result.accepted_tokens == result.drafted_tokens > 0
    torch.testing.assert_close(result.tokens, ar.tokens, rtol=0, atol=1e-4)
    assert (
        result.forward_passes == 4 + 3
    )  # the first row by the backbone, then one pass per row (bonus: next row's first)


# On the digits (the experiment's data) and on the backbone's own samples (the corpus, batches of dicts).
@pytest.mark.slow
@pytest.mark.parametrize("data", [None, ["data=corpus_continuous", *TINY_CONTINUOUS_CORPUS]], ids=["digits", "corpus"])
def test_row_heads_experiment_trains_exports_and_decodes(tmp_path, continuous_classifier_cache, data):
    from conftest import compose_config

    from heads.export import load_heads
    from train.pipeline import run_training

    export = tmp_path / "export"
    tiny = tiny_continuous_experiment("cspd_rows_digits", export, tmp_path, continuous_classifier_cache, data=data)
    tiny.append("module.head.width=16")
    metrics = run_training(compose_config(tiny, tmp_path / "run"))
    assert metrics["train/latent_loss"] > 0 and metrics["train/diffusion_loss"] > 0
    heads = load_heads(export, kind="cspd_rows")
    assert heads.config.row_attention_layers == 1 and heads.config.hidden_size == 32
    report = json.loads((tmp_path / "run" / "evaluation" / "metrics.json").read_text())
    rows = report["methods"]["cspd_rows"]
    assert rows["lossless"] and rows["forward_passes_per_image"] <= 16
    assert report["methods"]["ar"]["forward_passes_per_image"] == 16


# ---- the self-distillation corpus ---------------------------------------------------------------------------


def test_continuous_corpus_holds_the_backbones_own_samples(tmp_path):
    from data.corpus import CorpusSpec, _class_ids_for_shard, build_corpus, corpus_dataset, shard_name

    backbone = tiny_continuous()
    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=4, store_hidden=False)
    directory = build_corpus(backbone, tmp_path / "corpus", spec)
    samples = list(corpus_dataset(directory, [shard_name(0)], split_by_rank=False))
    stored = torch.stack([sample["tokens"] for sample in samples])
    assert stored.dtype == torch.float32 and stored.shape == (4, 16, 4)  # (images, tokens, token_dim)
    # Shard 0 is the baseline generator's output for its classes, from the shard's own seed.
    classes = _class_ids_for_shard(spec, 0)
    assert [int(sample["class_id"]) for sample in samples] == classes.tolist()
    sampling = SamplingConfig(cfg_scale=spec.cfg_scale)
    again = generate_continuous_ar(backbone, Condition(class_ids=classes), sampling, torch.Generator().manual_seed(0))
    torch.testing.assert_close(stored, again.tokens.view(4, 16, 4).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="store_hidden=false"):
        build_corpus(backbone, tmp_path / "other", CorpusSpec(num_images=4, shard_size=4, store_hidden=True))


def test_a_distilled_drafter_drafts_unguided(monkeypatch):
    """`guidance_scale` 1.0 in its export: no CFG twins in the drafter's cache, whatever the run's CFG."""
    from heads.cspd import CSpDDrafter, CSpDDrafterConfig

    backbone = tiny_continuous()
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, head_width=32)
    drafter = CSpDDrafter(CSpDDrafterConfig.for_backbone(backbone, guidance_scale=1.0, **sizes)).eval()
    seen = []
    original = drafter.model.prefill
    monkeypatch.setattr(drafter.model, "prefill", lambda c, guided: seen.append(guided) or original(c, guided))
    from decode.cspd import METHOD

    result = METHOD.generate(
        backbone, drafter, Condition(class_ids=torch.tensor([1, 2])), SamplingConfig(cfg_scale=3.0),
        torch.Generator().manual_seed(0), CSpDConfig(),
    )  # fmt: skip
    assert seen == [False] and result.tokens.shape == (2, 4, 4, 4)
    seen.clear()
    METHOD.generate(
        backbone, drafter, Condition(class_ids=torch.tensor([1])), SamplingConfig(cfg_scale=3.0),
        torch.Generator().manual_seed(0), CSpDConfig(drafter_cfg_scale=3.0),  # the preset's value wins
    )  # fmt: skip
    assert seen == [True]
