"""CSpD: continuous speculative decoding for diffusion-head (continuous-token) AR image models.

Wang et al., 2026, "Continuous Speculative Decoding for Autoregressive Image
Generation"; code for MAR at MarkXCloud/CSpD (`spec_decode/spec_decode_runner.py`,
`DistributionProcessor`). A continuous token has no distribution to read off,
but given the rest of its denoising trajectory the last reverse step is a
Gaussian; CSpD compares the drafter's and the backbone's at the same
trajectory noise. Steps, for a causal raster-order backbone:

1. Pre-fill: the backbone samples the first ``prefill_fraction`` of the tokens
   itself (the paper's ~5%), the drafter's cache follows.
2. Trajectory alignment: every position's trajectory noise (``x_T`` and each
   reverse step's) is drawn once; the drafter and the backbone both use it.
3. Draft: the drafter samples `gamma` tokens one after another through its own
   transformer and diffusion head, keeping each one's final-step Gaussian q.
4. Verify: one backbone pass over [the last committed token; the drafts] gives
   the conditions of the drafted positions (and of the one after them); one
   batched run of the backbone's diffusion head on the same noise gives each
   position's final-step Gaussian p.
5. Accept left to right with probability ``min(1, p(x) / q(x))``
   (`rules.gaussian_acceptance`); at an image's first rejection draw the token
   from ``norm(max(0, p - q))`` by acceptance-rejection
   (`rules.gaussian_residual_sample`) and drop the drafts after it. When every
   draft is kept, the backbone's own sample at the next position is the bonus
   token. Roll both caches back to the committed tokens.

Lossless with ``tau = 1`` and no reference correction: given a position's
trajectory up to its last step, the backbone's token is exactly
``N(mean, std^2)`` (`DiffusionHeadConfig.final_step_noise`), and speculative
sampling between that and the drafter's Gaussian returns the backbone's. The
reference code's relaxed test (``tau = 42``: both kernels 42x wider, times the
trajectories' std ratio) is the `cspd_relaxed` preset, not lossless. Unlike the
reference, a rejected token is always resampled from the residual (never left
at zeros) and the drafts after it are cut, as speculative sampling requires.

Batched: the images of a batch share one cache length, so the batch commits
per round up to the image that got least far; every other image keeps the
tokens it already has verified past that point (its accepted drafts and its
residual or bonus token) and re-feeds them next round as drafts that need no
test, drafting new ones only after them, as SSD's rows do. So each image
advances at its own pace within a window of ``gamma`` tokens, and a batch costs
about as many passes as its slowest image would alone, not one per token of
the slowest image's worst rounds. Exact: each image's tokens are judged once,
each against the backbone given its own verified prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from backbones.base import Condition
from backbones.continuous import ContinuousARBackbone
from backbones.diffusion_head import DiffusionSample
from decode.continuous_ar import check_continuous_sampling
from decode.gamma_choice import GammaChooser
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import first_true, gaussian_verdicts, resample_rejected
from decode.sampling import SamplingConfig


@dataclass(frozen=True)
class CSpDConfig:
    """CSpD's settings (defaults: the authors' MAR demo, `demo/run_mar.ipynb`)."""

    # drafts per verification (the demo's num_draft); auto: per round by measured cost (decode/gamma_choice.py)
    gamma: int | Literal["auto"] = 4
    max_gamma: int = 8  # gamma auto: the longest round it may choose
    prefill_fraction: float = 0.05  # tokens the backbone samples itself first (the demo's ratio)
    tau: float = 1.0  # 1: exact. The reference code's relaxed test widens both Gaussians by 42 (not lossless)
    reference_correction: bool = False  # the reference's factor exp(sum log std_p - sum log std_q) (not lossless)
    trajectory_alignment: bool = True  # drafter and backbone share every trajectory's noise
    # The drafter's own guidance. None: what its export says (`CSpDDrafterConfig.guidance_scale`; else the run's,
    # for a drafter trained on data); 1.0: none, for a drafter self-distilled on the backbone's guided samples.
    drafter_cfg_scale: float | None = None

    def __post_init__(self):
        check_gamma(self.gamma, self.max_gamma, "cspd")
        check_drafter_cfg_scale(self.drafter_cfg_scale, "cspd")
        check_verification(self.prefill_fraction, self.tau, "cspd")


def check_drafter_cfg_scale(scale: float | None, method: str) -> None:
    """The drafter's own guidance: a finite number >= 0, or None (what its export says)."""
    if scale is not None and not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"{method} drafter_cfg_scale must be a finite number >= 0 or null, got {scale}")


def check_gamma(gamma, max_gamma: int, method: str) -> None:
    """A draft length: an int >= 1, or "auto" with max_gamma >= 1."""
    if not (gamma == "auto" or (isinstance(gamma, int) and gamma >= 1)) or max_gamma < 1:
        raise ValueError(f"{method} gamma must be an int >= 1 or 'auto' (max_gamma >= 1), got {gamma!r}, {max_gamma}")


def exact_test(settings) -> bool:
    """Whether CSpD settings verify exactly (lossless): tau 1 and no reference correction."""
    return settings.tau == 1.0 and not settings.reference_correction


def check_last_step_drawn(exact: bool, method: str, *models) -> None:
    """Exact CSpD tests each token against the last reverse step's Gaussians of the drafter and the target: a
    model whose last step returns its mean (`DiffusionHeadConfig.final_step_noise` off, MAR's own default) gives
    a token no density there, and the test would not be lossless. Refuse it by name."""
    if exact and not all(model.diffusion.config.final_step_noise for model in models):
        raise ValueError(
            f"exact {method} needs diffusion heads whose last reverse step adds its noise (else a token has no "
            "density): build the backbone and the drafter with DiffusionHeadConfig(final_step_noise=True), or "
            "verify with the relaxed test (tau > 1, e.g. the cspd_relaxed preset; not lossless)"
        )


def check_verification(prefill_fraction: float, tau: float, method: str) -> None:
    """The settings of `speculate` every CSpD drafter shares: a pre-fill fraction in [0, 1), tau finite and >= 1."""
    if not 0 <= prefill_fraction < 1:
        raise ValueError(f"{method} prefill_fraction must be in [0, 1), got {prefill_fraction}")
    if not (math.isfinite(tau) and tau >= 1):
        raise ValueError(f"{method} tau must be a finite number >= 1 (1 is exact), got {tau}")


@dataclass
class DraftRound:
    """One round's drafts and the Gaussians they were drawn from, (B, g, D) each."""

    tokens: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_std_sum: torch.Tensor

    @classmethod
    def of(cls, samples: list[DiffusionSample]) -> DraftRound:
        """Concatenate `DiffusionSample`s (B, t, D) along the position axis."""
        joined = DiffusionSample.cat(samples, dim=1)
        return cls(joined.tokens, joined.final_mean, joined.final_std, joined.log_std_sum)


@dataclass
class Speculation:
    """What a drafter sees: the committed tokens, the backbone's states and the trajectory noise."""

    backbone: ContinuousARBackbone
    state: object  # the backbone's DecodeState
    tokens: torch.Tensor  # (B, N, D); positions <= pending are committed
    states: torch.Tensor  # (rows, N, hidden): states[:, i] conditions token i (valid for i <= pending)
    noise: torch.Tensor  # (B, N, noise_steps, D), the backbone's
    sampling: SamplingConfig
    generator: torch.Generator | None
    verified: torch.Tensor  # (B,): each image's last verified position, >= the batch's last committed one

    def verified_at(self, first: int, count: int) -> torch.Tensor:
        """(B, count) bool: which of positions first ... first + count - 1 each image has verified already."""
        positions = torch.arange(first, first + count, device=self.verified.device)
        return positions[None, :] <= self.verified[:, None]

    def keep_verified(self, first: int, drafts: torch.Tensor) -> torch.Tensor:
        """`drafts` (B, n, D) of positions first ... first + n - 1 with each image's verified tokens in place."""
        forced = self.verified_at(first, drafts.shape[1])
        return torch.where(forced[..., None], self.tokens[:, first : first + drafts.shape[1]], drafts)


# draft(speculation, pending) -> the drafts of positions pending + 1 ... (at least one); rollback(last): after a
# round the drafter keeps what it needs of the tokens committed before position `last`.
Drafter = tuple[Callable[[Speculation, int], DraftRound], Callable[[int], None]]


@torch.inference_mode()
def generate_cspd(
    backbone: ContinuousARBackbone,
    drafter: ContinuousARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    settings: CSpDConfig,
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate one image per condition with `drafter` drafting and `backbone` verifying (module doc).

    `noise` (B, N, noise_steps, token_dim) replays given trajectory noise (drawn from `generator` by default);
    with the same noise and a drafter equal to the backbone every draft is accepted.
    """
    check_last_step_drawn(exact_test(settings), "cspd", backbone, drafter)
    draft_cfg = sampling.cfg_scale if settings.drafter_cfg_scale is None else settings.drafter_cfg_scale
    draft_state, _ = drafter.prefill(condition, draft_cfg != 1.0)
    own_noise = None
    device = next(backbone.parameters()).device
    chooser = GammaChooser(settings.max_gamma, device) if settings.gamma == "auto" else None

    def draft(run: Speculation, pending: int) -> DraftRound:
        nonlocal own_noise
        if settings.trajectory_alignment:
            noise_of_drafts = run.noise
        else:  # the drafter's own trajectories, drawn once
            if own_noise is None:
                own_noise = run.backbone.draw_noise(*run.noise.shape[:2], run.generator, run.noise.device)
            noise_of_drafts = own_noise
        gamma = chooser.choose() if chooser is not None else settings.gamma
        count = min(gamma, run.tokens.shape[1] - 1 - pending)
        return _draft_sequential(drafter, draft_state, run, pending, count, noise_of_drafts, draft_cfg)

    def rollback(last: int) -> None:
        drafter.rollback(draft_state, min(last, draft_state.num_image_tokens))

    return speculate(
        backbone, condition, sampling, generator, (draft, rollback), noise,
        prefill_fraction=settings.prefill_fraction, tau=settings.tau,
        reference_correction=settings.reference_correction, chooser=chooser,
    )  # fmt: skip


def speculate(
    backbone: ContinuousARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    drafter: Drafter,
    noise: torch.Tensor | None = None,
    *,
    prefill_fraction: float,
    tau: float,
    reference_correction: bool = False,
    min_prefill: int = 1,
    chooser: GammaChooser | None = None,
) -> GenerationResult:
    """Steps 1, 4 and 5 of the module doc around any drafter: pre-fill (``prefill_fraction`` of the tokens, at
    least `min_prefill`), then verify each round's drafts. `chooser`: the cost-aware draft lengths the drafter
    asks for (gamma auto), timed here round by round."""
    check_continuous_sampling(sampling)
    draft, drafter_rollback = drafter
    geometry, batch = backbone.geometry, condition.batch_size
    total, cfg, temperature = geometry.num_tokens, sampling.cfg_scale, sampling.temperature
    state, hidden = backbone.prefill(condition, sampling.guided)
    device = hidden.device
    if noise is None:
        noise = backbone.draw_noise(batch, total, generator, device)
    tokens = hidden.new_zeros(batch, total, backbone.token_dim)
    states = hidden.new_zeros(hidden.shape[0], total, hidden.shape[-1])
    prefilled = min(total, max(1, min_prefill, math.ceil(prefill_fraction * total)))
    run = Speculation(
        backbone, state, tokens, states, noise, sampling, generator, torch.full((batch,), prefilled - 1, device=device)
    )

    for position in range(prefilled):  # 1. the backbone's own tokens first
        states[:, position] = hidden[:, -1]
        drawn = backbone.sample_tokens(state, hidden[:, -1:], noise[:, position : position + 1], cfg, temperature)
        tokens[:, position] = drawn.tokens[:, 0]
        if position + 1 < prefilled:
            hidden = backbone.step(state, drawn.tokens)
    passes, drafted, accepted, unsettled, rounds, round_drafts = prefilled, 0, 0, 0, 0, 0
    pending = prefilled - 1  # the batch's last committed token, in neither cache yet
    while pending < total - 1:
        if chooser is not None:
            chooser.start_round()
        round_ = draft(run, pending)
        count = round_.tokens.shape[1]
        first = pending + 1
        # Positions an image verified in an earlier round are fed again as they are, and kept without a test.
        forced = run.verified_at(first, count)  # (B, g)
        drafts = run.keep_verified(first, round_.tokens)
        # 4. One pass over [last committed; drafts]; out[:, j] conditions position pending + 1 + j.
        out = backbone.step(state, torch.cat([tokens[:, pending:first], drafts], dim=1))
        passes += 1
        bonus = pending + count + 1 < total
        judged = count + int(bonus)
        target = backbone.sample_tokens(state, out[:, :judged], noise[:, first : first + judged], cfg, temperature)
        # 5. Accept left to right, each image up to its own first rejection.
        p = (target.final_mean[:, :count], target.final_std[:, :count])
        log_stds = target.log_std_sum[:, :count] - round_.log_std_sum  # (B, g, D): summed over steps
        correction = log_stds.sum(-1) if reference_correction else None
        kept = gaussian_verdicts(drafts, p, (round_.mean, round_.std), generator, tau, correction) | forced
        cut = first_true(~kept, none=count)  # (B,): each image's first rejected position in the round
        tokens[:, first : first + count] = drafts
        columns = torch.arange(count, device=device)[None, :]
        reached = int(((columns <= cut[:, None]) & ~forced).sum())  # tested: up to each image's first rejection
        kept_now = int(((columns < cut[:, None]) & ~forced).sum())
        drafted += int((~forced).sum())
        accepted += kept_now
        rounds, round_drafts = rounds + 1, round_drafts + count
        stopped = (cut < count).nonzero()[:, 0]  # images with a rejection: a residual draw at their cut
        if len(stopped):
            at = cut[stopped]
            tokens[stopped, first + at], fallbacks = resample_rejected(
                drafts[stopped, at],
                torch.ones(len(stopped), dtype=torch.bool, device=device),
                (p[0][stopped, at], p[1][stopped, at]),
                (round_.mean[stopped, at], round_.std[stopped, at]),
                generator,
            )
            unsettled += fallbacks
        whole = cut == count
        if bonus and whole.any():  # every draft kept: the backbone's own sample at the next position
            tokens[whole, first + count] = target.tokens[whole, count]
        run.verified = torch.where(whole, pending + count + int(bonus), first + cut)
        last = int(run.verified.min())
        states[:, first : last + 1] = out[:, : last - pending]
        # Both caches keep the committed tokens before `last` (the drafter feeds what it lacks next round).
        backbone.rollback(state, min(last, state.num_image_tokens))
        drafter_rollback(last)
        pending = last
        if chooser is not None:
            chooser.end_round(count, reached, kept_now)
    return GenerationResult(
        tokens.view(batch, geometry.rows, geometry.cols, -1),
        forward_passes=passes,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        # window_sum / window_passes: the mean drafts per round (the report prints it)
        extras={"residual_fallbacks": unsettled, "window_sum": round_drafts, "window_passes": rounds},
    )


def _draft_sequential(drafter, state, run: Speculation, pending: int, count: int, noise, cfg: float) -> DraftRound:
    """3. `count` drafts after position `pending`, sampled one by one by the drafter (guided at `cfg`) on the
    given noise."""
    sampling, tokens = run.sampling, run.tokens
    hidden = drafter.step(state, tokens[:, state.num_image_tokens : pending + 1])  # what the drafter lacks
    drafts = []
    for j in range(count):
        position = pending + 1 + j
        noise_here = noise[:, position : position + 1]
        drawn = drafter.sample_tokens(state, hidden[:, -1:], noise_here, cfg, sampling.temperature)
        drafts.append(drawn)
        if j + 1 < count:  # an image's next draft follows its verified token where it has one
            hidden = drafter.step(state, run.keep_verified(position, drawn.tokens))
    return DraftRound.of(drafts)


def _generate(backbone, drafter, condition, sampling, generator, settings: CSpDConfig) -> GenerationResult:
    if settings.drafter_cfg_scale is None:
        settings = replace(settings, drafter_cfg_scale=drafter.config.guidance_scale)
    return generate_cspd(backbone, drafter.model, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=CSpDConfig,
    artefact="drafter",
    artefact_kind="cspd",
    lossless=exact_test,
    token_kind="continuous",
)
