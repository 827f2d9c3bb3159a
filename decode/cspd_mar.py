"""CSpD on MAR: a smaller MAR drafts whole generation steps, the target MAR verifies them in one pass.

The same for Harmon (backbones/harmon.py, MAR with an LLM reading the prompt): Harmon-0.5B drafts for
Harmon-1.5B. Both families give the generator the same few things (`MARBackbone` and `HarmonBackbone`):
`condition_state` (class embeddings or the prompts' KV cache), `repeat_condition`, `conditions`,
`conditions_at`, `sample_positions`, and `load_drafter`.

Wang et al., 2026, "Continuous Speculative Decoding for Autoregressive Image
Generation"; code at MarkXCloud/CSpD (`spec_decode/spec_decode_runner.py` on top
of LTH14/mar; its demo `demo/run_mar.ipynb` drafts with MAR-B for MAR-H, 256
steps, so every step reveals one token). MAR generates in a random order, a
step sampling the positions its cosine schedule reveals; a *draft* here is one
such step of the drafter. Steps:

1. One random order per image and every position's trajectory noise (``x_T``
   and each reverse step's) are drawn once; drafter and target share both
   (trajectory alignment: a token's noise belongs to its position).
2. Pre-fill: the target runs the first ``prefill_fraction`` of the steps itself
   (the reference: ``floor(ratio * num_iter) + 1`` steps; the demo's 5%).
3. Draft: the drafter runs the next steps one after another, each conditioned
   on the tokens so far and its own earlier drafts, keeping every token's
   final-step Gaussian q (mean, std) and its trajectory's summed log stds.
4. Verify, in one batched target pass, then judge (`rules.gaussian_acceptance`:
   ``min(1, p(x) / q(x))``, the reference's tau and std-ratio factor when set):

   - ``verification="prefix"`` (exact, this project's): the pass holds one row
     per draft prefix, row r knowing the tokens before the round and the first
     r drafted steps, so the target scores step r exactly as its own sampler
     would have conditioned it, plus the step after the round (the bonus).
     Tokens of one step are independent given their conditions, so each is
     judged on its own; an image's round is cut after its first step with a
     rejection, whose rejected tokens are drawn from the residual
     ``norm(max(0, p - q))`` (`rules.gaussian_residual_sample`,
     acceptance-rejection with envelope p, bound 1). When every step is kept,
     the target's own sample of the next step is the bonus. The batch commits
     the steps every image has; an image that got further keeps its extra
     verified steps (`AheadOfTheBatch`) and re-feeds them next round as drafts
     that need no test, as the raster generator's images do (decode/cspd.py).
     Lossless with tau 1, no correction and a last reverse step that adds its
     noise on both models (`MARConfig.final_step_noise`: otherwise a token is
     its final mean and has no density; the official sampler adds none).
   - ``verification="window"`` (the reference's): one target pass over the
     tokens known before the round predicts every drafted token at once (the
     target does not see the earlier drafts of the round), guided at the
     round's last step's scale; each token is judged on its own, a rejected one
     replaced by a residual draw, nothing is cut, no bonus. Rounds end at the
     steps whose index is a multiple of `gamma` (and at the last step), as the
     reference checks ``step % num_draft == 0``. Not lossless. Unlike the
     reference, a rejected token is always resampled (never left at zeros
     after 100 tries) and only rejected tokens are.

The pass counts: the target's passes (pre-fill steps + one per round) are
``forward_passes``; the drafter's steps are ``extras["drafter_passes"]`` and the
rows of the target's verification passes ``extras["verify_rows"]`` (prefix
verification batches gamma + 1 rows of every image in its one pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import Condition
from backbones.diffusion_head import DiffusionSample
from backbones.mar import MARBackbone, RevealStep, gather_positions, reveal, reveal_steps
from decode.cspd import check_gamma, check_verification
from decode.gamma_choice import GammaChooser
from decode.masked_baseline import masked_inputs
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import gaussian_verdicts, resample_rejected
from decode.sampling import SamplingConfig

VERIFICATIONS = ("prefix", "window")


@dataclass(frozen=True)
class CSpDMARConfig:
    """CSpD-on-MAR settings (defaults: exact; the reference demo's gamma 4 and 5% pre-fill)."""

    # drafted steps per verification (the demo's num_draft); auto (prefix verification): per round by measured cost
    gamma: int | Literal["auto"] = 4
    max_gamma: int = 8  # gamma auto: the longest round it may choose
    prefill_fraction: float = 0.05  # of the steps, run by the target first (the demo's ratio)
    verification: str = "prefix"  # "prefix": exact (module doc); "window": the reference's (not lossless)
    tau: float = 1.0  # 1: exact. The reference's relaxed test widens both Gaussians by 42 (not lossless)
    reference_correction: bool = False  # the reference's factor exp(sum log std_p - sum log std_q) (not lossless)
    trajectory_alignment: bool = True  # drafter and target share every position's trajectory noise

    def __post_init__(self):
        check_gamma(self.gamma, self.max_gamma, "cspd_mar")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"cspd_mar verification must be one of {VERIFICATIONS}, got {self.verification!r}")
        if self.gamma == "auto" and self.verification != "prefix":
            raise ValueError(
                "cspd_mar gamma auto needs verification prefix: the reference's rounds end at steps divisible by "
                "a fixed gamma (set gamma to an int)"
            )
        check_verification(self.prefill_fraction, self.tau, "cspd_mar")

    @property
    def exact(self) -> bool:
        return self.verification == "prefix" and self.tau == 1.0 and not self.reference_correction


def prefill_steps(fraction: float, steps: int) -> int:
    """Steps the target runs before drafting: the reference's ``step <= ratio * num_iter`` (none at 0)."""
    return 0 if fraction == 0 else min(steps, math.floor(fraction * steps) + 1)


@torch.inference_mode()
def generate_cspd_mar(
    target: MARBackbone,
    drafter: MARBackbone,
    class_ids: torch.Tensor | list[str],
    settings: CSpDMARConfig,
    num_iter: int,
    cfg_scale: float = 1.0,
    cfg_schedule: str = "linear",
    temperature: float = 1.0,
    orders: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate one image per class id (MAR; prompts for Harmon) with `drafter` drafting steps and `target`
    verifying (module doc).

    `orders` (B, seq_len) and `noise` (B, seq_len, noise_steps, token_dim) as `MARBackbone.sample` takes them
    (drawn from `generator` when None): with the same ones and a drafter equal to the target every draft is
    accepted and the tokens are the target's own.
    """
    check_compatible(target, drafter)
    if settings.exact and not (target.config.final_step_noise and drafter.config.final_step_noise):
        raise ValueError(
            "exact CSpD on MAR needs a last reverse step that adds its noise (else a token has no density): "
            "load both models with final_step_noise=true (backbone.final_step_noise=true), or use the "
            "reference's verification (the cspd_mar_reference preset, not lossless)"
        )
    batch, device = len(class_ids), target.z_proj.weight.device
    if isinstance(class_ids, torch.Tensor):
        class_ids = class_ids.to(device)
    steps = reveal_steps(target.seq_len, num_iter, cfg_scale, cfg_schedule)
    orders = target.check_orders(orders, batch, generator, device)
    noise = target.check_noise(noise, batch, generator, device)
    draft_noise = noise if settings.trajectory_alignment else target.check_noise(None, batch, generator, device)
    guided = cfg_scale != 1.0
    run = _Run(target, drafter, orders, noise, draft_noise, temperature, generator, guided, class_ids)

    tokens = torch.zeros(batch, target.seq_len, target.token_dim, device=device, dtype=target.z_proj.weight.dtype)
    known = torch.zeros(batch, target.seq_len, dtype=torch.bool, device=device)
    first = prefill_steps(settings.prefill_fraction, len(steps))
    for step in steps[:first]:  # 2. the target's own steps
        tokens, known = run.target_step(tokens, known, step)
    counts = {"passes": first, "drafter_passes": 0, "verify_rows": 0, "drafted": 0, "accepted": 0, "unsettled": 0}
    longest = settings.max_gamma if settings.gamma == "auto" else settings.gamma
    counts.update({f"{kind}_at_draft_step_{r + 1}": 0 for r in range(longest) for kind in ("drafted", "accepted")})
    counts.update(window_sum=0, window_passes=0)
    chooser = GammaChooser(settings.max_gamma, torch.device(device)) if settings.gamma == "auto" else None
    index = first
    ahead = AheadOfTheBatch(torch.zeros_like(tokens), torch.zeros(batch, dtype=torch.long, device=device))
    while index < len(steps):
        if settings.verification == "prefix":
            if chooser is not None:
                chooser.start_round()
            window = steps[index : index + (chooser.choose() if chooser is not None else settings.gamma)]
            bonus = steps[index + len(window)] if index + len(window) < len(steps) else None
            tokens, known, advanced = _prefix_round(run, tokens, known, window, bonus, settings, counts, ahead)
            counts["window_sum"] += len(window)
            counts["window_passes"] += 1
            if chooser is not None:  # the batch's steps: kept before the first rejection, and the one judged there
                chooser.end_round(len(window), min(advanced, len(window)), min(advanced - 1, len(window)))
        else:
            window = reference_round(steps, index, settings.gamma)
            tokens, known = _window_round(run, tokens, known, window, settings, counts)
            advanced = len(window)
        index += advanced
    grid = target.geometry
    return GenerationResult(
        tokens.view(batch, grid.rows, grid.cols, target.token_dim),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        extras={
            "drafter_passes": counts["drafter_passes"],
            "verify_rows": counts["verify_rows"],
            "residual_fallbacks": counts["unsettled"],
            "window_sum": counts["window_sum"],  # drafted steps per round: window_sum / window_passes
            "window_passes": counts["window_passes"],
            # Tokens judged and kept at each step of a round (1: the round's first drafted step), summed.
            **{key: value for key, value in counts.items() if "_at_draft_step_" in key},
        },
    )


def reference_round(steps: list[RevealStep], index: int, gamma: int) -> list[RevealStep]:
    """The steps of the reference's round that starts at step `index`: up to the next step whose index is a
    multiple of `gamma` (``step % num_draft == 0``), or the last step."""
    end = next(k for k in range(index, len(steps)) if (k % gamma == 0 and k) or k == len(steps) - 1)
    return steps[index : end + 1]


@dataclass
class AheadOfTheBatch:
    """Steps an image has verified past the batch's committed step, waiting for the others (prefix rounds).

    The batch commits steps together (one `known` mask per step index); an image that got further in a round
    keeps its next `steps[b]` steps' tokens in `tokens` (at their positions) and re-feeds them next round as
    drafts that need no test, as the raster generator's images do (decode/cspd.py).
    """

    tokens: torch.Tensor  # (B, seq_len, D), valid at the positions of each image's steps ahead
    steps: torch.Tensor  # (B,) long


@dataclass
class _Run:
    """What every round reads: both models, the shared orders and noise, the sampling settings."""

    target: MARBackbone
    drafter: MARBackbone
    orders: torch.Tensor
    noise: torch.Tensor
    draft_noise: torch.Tensor
    temperature: float
    generator: torch.Generator | None
    guided: bool
    class_ids: torch.Tensor | list[str]  # (prompts for Harmon)

    def __post_init__(self):
        # What each model's `conditions` reads (class embeddings; Harmon: the prompts' KV cache), made once.
        self.target_condition = self.target.condition_state(self.class_ids, self.guided)
        self.drafter_condition = self.drafter.condition_state(self.class_ids, self.guided)

    def positions(self, step: RevealStep) -> torch.Tensor:
        return self.orders[:, step.start : step.end]

    def target_step(self, tokens, known, step: RevealStep):
        """One step of the target's own sampler (the pre-fill)."""
        positions = self.positions(step)
        z = self.target.conditions_at(tokens, known, self.target_condition, positions)
        noise = gather_positions(self.noise, positions)
        drawn = self.target.sample_positions(z, noise, step.cfg_scale, self.temperature)
        return reveal(tokens, known, positions, drawn.tokens)

    def draft(
        self, tokens, known, window: list[RevealStep], counts: dict, ahead: AheadOfTheBatch | None = None
    ) -> list[DiffusionSample]:
        """3. The drafter's steps of `window`, each on the tokens so far and its earlier drafts; an image's
        steps `ahead` are the tokens it verified before, in place of drafts."""
        drafts = []
        for r, step in enumerate(window):
            positions = self.positions(step)
            z = self.drafter.conditions_at(tokens, known, self.drafter_condition, positions)
            noise = gather_positions(self.draft_noise, positions)
            drawn = self.drafter.sample_positions(z, noise, step.cfg_scale, self.temperature)
            if ahead is not None and bool((ahead.steps > r).any()):
                verified = gather_positions(ahead.tokens, positions).to(drawn.tokens.dtype)
                drawn.tokens = torch.where((ahead.steps > r)[:, None, None], verified, drawn.tokens)
            tokens, known = reveal(tokens, known, positions, drawn.tokens)
            drafts.append(drawn)
        counts["drafter_passes"] += len(window)
        return drafts

    def judge(
        self,
        drafted: DiffusionSample,
        target: DiffusionSample,
        settings: CSpDMARConfig,
        counts: dict,
        verified: torch.Tensor | None = None,
    ):
        """4. Each token's acceptance (B, n) and the residual draws for every token (used where rejected); the
        images `verified` (B,) hold tokens verified before, kept without a test."""
        p, q = (target.final_mean, target.final_std), (drafted.final_mean, drafted.final_std)
        correction = (target.log_std_sum - drafted.log_std_sum).sum(-1) if settings.reference_correction else None
        kept = gaussian_verdicts(drafted.tokens, p, q, self.generator, settings.tau, correction)
        if verified is not None:
            kept = kept | verified[:, None]
        replaced, fallbacks = resample_rejected(drafted.tokens, ~kept, p, q, self.generator)
        counts["unsettled"] += fallbacks
        return kept, replaced


def _prefix_round(
    run: _Run, tokens, known, window, bonus, settings: CSpDMARConfig, counts: dict, ahead: AheadOfTheBatch
):
    """One exact round: draft `window`, verify every prefix in one pass; each image keeps its steps up to its
    first rejection, the batch commits the steps every image has (`ahead` keeps the rest)."""
    batch, target = tokens.shape[0], run.target
    drafts = run.draft(tokens, known, window, counts, ahead)
    # Row r knows the round's first r drafted steps; row len(window) also conditions the bonus step.
    row_steps = window + ([bonus] if bonus is not None else [])
    row_tokens, row_known = [tokens], [known]
    for step, drawn in zip(window[: len(row_steps) - 1], drafts, strict=False):
        next_tokens, next_known = reveal(row_tokens[-1], row_known[-1], run.positions(step), drawn.tokens)
        row_tokens.append(next_tokens)
        row_known.append(next_known)
    rows = len(row_steps)
    twins = 2 if run.guided else 1
    stacked_conditions = target.repeat_condition(run.target_condition, rows, run.guided)
    # [cond rows 0..R-1; uncond rows 0..R-1], each block of B images: the twins' layout of `conditions`.
    all_tokens, all_known = torch.cat(row_tokens), torch.cat(row_known)
    z = target.conditions(all_tokens.repeat(twins, 1, 1), all_known.repeat(twins, 1), stacked_conditions)
    z = z.view(twins, rows, batch, target.seq_len, -1)
    counts["passes"] += 1
    counts["verify_rows"] += rows
    # Every row's own step's positions, flattened as the diffusion head takes them ([cond; uncond]).
    positions = [run.positions(step) for step in row_steps]
    conditions = torch.cat(
        [gather_positions(z[t, r], at).flatten(0, 1) for t in range(twins) for r, at in enumerate(positions)]
    )
    noises = torch.cat([gather_positions(run.noise, at).flatten(0, 1) for at in positions])
    scales = torch.cat(
        [
            torch.full((at.numel(), 1), step.cfg_scale, device=z.device, dtype=z.dtype)
            for at, step in zip(positions, row_steps)
        ]
    )
    # One diffusion run for every row's tokens, each at its own step's guidance: (1, sum_r B * n_r, D).
    sampled = target.sample_positions(conditions, noises[None], scales, run.temperature)
    per_row = _split_rows(sampled, [at.shape[1] for at in positions], batch)

    size = len(window)
    rejected_at = torch.full((batch,), size, device=tokens.device)  # each image's first step with a rejection
    judged = []
    for r, drawn in enumerate(drafts):
        kept, replaced = run.judge(drawn, per_row[r], settings, counts, verified=ahead.steps > r)
        judged.append((kept, replaced))
        rejected_at = torch.where((~kept.all(1)) & (rejected_at == size), r, rejected_at)
        if bool((rejected_at <= r).all()):  # every image has stopped: nothing after this step is needed
            break
    # Drafted: every drawn token (the cut ones too), not an image's re-fed verified steps.
    counts["drafted"] += sum(int((ahead.steps <= r).sum()) * drawn.tokens.shape[1] for r, drawn in enumerate(drafts))
    for r, (kept, _) in enumerate(judged):
        counted = (ahead.steps <= r) & (r <= rejected_at)  # drafts of this step that were judged for the image
        counts["accepted"] += int((kept & counted[:, None]).sum())
        counts[f"accepted_at_draft_step_{r + 1}"] += int((kept & counted[:, None]).sum())
        counts[f"drafted_at_draft_step_{r + 1}"] += int(counted.sum()) * kept.shape[1]
    # Each image has its steps before the rejection, the rejection's step (residual draws where rejected) or,
    # when it kept every step, the target's own sample of the next one.
    reach = torch.where(rejected_at < size, rejected_at + 1, size + int(bonus is not None))
    advanced = int(reach.min())
    for r in range(int(reach.max())):
        if r < size:
            _, replaced = judged[r]  # (judged: every image reaching step r had it judged)
            values = torch.where((r < rejected_at)[:, None, None], drafts[r].tokens, replaced)
        else:
            values = per_row[size].tokens
        positions = run.positions(row_steps[r])
        if r < advanced:
            tokens, known = reveal(tokens, known, positions, values)
        else:  # ahead of the batch: kept for the next round
            ahead.tokens, _ = reveal(ahead.tokens, known, positions, values)
    ahead.steps = reach - advanced
    return tokens, known, advanced


def _window_round(run: _Run, tokens, known, window, settings: CSpDMARConfig, counts: dict):
    """One round as the reference verifies: the target sees only the tokens before the round."""
    target = run.target
    drafts = run.draft(tokens, known, window, counts)
    positions = torch.cat([run.positions(step) for step in window], dim=1)
    z = target.conditions_at(tokens, known, run.target_condition, positions)
    counts["passes"] += 1
    counts["verify_rows"] += 1
    noise = gather_positions(run.noise, positions)
    predicted = target.sample_positions(z, noise, window[-1].cfg_scale, run.temperature)
    drafted = DiffusionSample.cat(drafts, dim=1)
    kept, replaced = run.judge(drafted, predicted, settings, counts)
    counts["drafted"] += kept.numel()
    counts["accepted"] += int(kept.sum())
    start = 0
    for r, drawn in enumerate(drafts):
        count = drawn.tokens.shape[1]
        counts[f"accepted_at_draft_step_{r + 1}"] += int(kept[:, start : start + count].sum())
        counts[f"drafted_at_draft_step_{r + 1}"] += kept[:, start : start + count].numel()
        start += count
    return reveal(tokens, known, positions, replaced)


def _split_rows(sampled: DiffusionSample, counts: list[int], batch: int) -> list[DiffusionSample]:
    """The (1, sum_r B * n_r, D) sample of all rows back into one (B, n_r, D) sample per row."""
    out, start = [], 0
    for count in counts:
        size = batch * count
        out.append(sampled.map(lambda value, s=start, size=size, n=count: value[0, s : s + size].view(batch, n, -1)))
        start += size
    return out


def check_compatible(target: MARBackbone, drafter: MARBackbone) -> None:
    """A drafter must be of the target's family and share its grid, token size, classes and diffusion steps
    (they share noise)."""
    if type(drafter) is not type(target):
        raise ValueError(
            f"the CSpD drafter {drafter.name} ({type(drafter).__name__}) cannot draft for {target.name} "
            f"({type(target).__name__}): give a smaller model of the same family"
        )
    keys = ("grid_size", "token_dim", "num_classes", "sampling_steps", "final_step_noise")
    pairs = {key: (getattr(drafter.config, key), getattr(target.config, key)) for key in keys}
    pairs["seq_len"] = (drafter.seq_len, target.seq_len)  # the grid in use (Harmon's differs from its learned one)
    for key, (mine, theirs) in pairs.items():
        if mine != theirs:
            raise ValueError(
                f"the CSpD drafter {drafter.name} has {key}={mine}, the target {target.name} {theirs}: a drafter "
                "must share the target's grid, tokens, classes and diffusion sampling (load it with the same settings)"
            )


def load_mar_drafter(path, backbone: MARBackbone, device=None, kind: str = "cspd_mar") -> MARBackbone:
    """The registry's loader for `drafter:` (an official checkpoint of the backbone's family, its size read off
    its weights; `MARBackbone.load_drafter`, `HarmonBackbone.load_drafter`), loaded in the target's dtype,
    steps and last-step setting, and checked against it."""
    drafter = backbone.load_drafter(path, device)
    check_compatible(backbone, drafter)
    return drafter


def _generate(backbone, drafter, condition: Condition, sampling: SamplingConfig, generator, settings):
    inputs = masked_inputs(backbone, condition, sampling)
    return generate_cspd_mar(
        backbone, drafter, inputs, settings, backbone.num_iter, sampling.cfg_scale,
        backbone.cfg_schedule, sampling.temperature, generator=generator,
    )  # fmt: skip


METHOD = MethodSpec(
    generate=_generate,
    settings=CSpDMARConfig,
    artefact="drafter",
    artefact_kind="cspd_mar",
    lossless=lambda s: s.exact,
    token_kind="masked",
    load_artefact=load_mar_drafter,
)
