"""CSpD with ragged frontiers and continuous batching: every image drafts and verifies from its own last committed
token, in shared passes, and an image that is done hands its slot to the next of the queue.

decode/cspd.py batches images on one cache length: a round commits up to the image that got least far, and the
images ahead re-feed what they verified past that point (no second test, but a pass's width spent on it). Here,
per round (continuous raster backbones: `ContinuousARBackbone.step_ragged`):

1. Pre-fill: an image's first ``prefill_fraction`` of tokens (the paper's ~5%) come from the backbone itself,
   one per round (a round in which the image drafts nothing);
2. Draft: the drafter's cache catches up with each image's committed tokens (one ragged drafter pass from where
   it holds them), then the drafter samples up to ``gamma`` tokens per image one after another, each image at
   its own positions, on the image's own trajectory noise (CSpD's alignment);
3. Verify: one ragged backbone pass feeds each image [its last committed token; its drafts] from its own
   position, and one batched run of the backbone's diffusion head on the same noise gives every drafted
   position's final-step Gaussian p (and the one after them);
4. Accept each image's drafts left to right with probability ``min(1, p(x) / q(x))``
   (`rules.gaussian_acceptance`; the reference's relaxed test with ``tau > 1``, not lossless); at an image's
   first rejection draw its token from ``norm(max(0, p - q))`` (`rules.gaussian_residual_sample`); when every
   draft passes, the backbone's own sample at the next position is the bonus token;
5. an image whose last token is committed leaves its slot to the next condition of the queue (prompts
   prefilled up to ``slots`` at a time: `decode.conditions.PromptQueue`; the drafter prefills the same
   conditions), and once the queue is empty finished slots leave the batch (`decode/drain.py`).

Exactness (``tau = 1``, no reference correction), image by image: a draft at position i is tested against the
backbone's final-step Gaussian given the image's own committed tokens before i (the ragged pass gives each image
the states `step` would give it alone) and i's trajectory noise, which the draft shares; given that trajectory up
to its last step the backbone's token is exactly that Gaussian, and speculative sampling between it and the
drafter's returns it (decode/cspd.py). The test's uniform is keyed by the image's seed and the position; a
position is judged in one round only (the round where it is the first rejection or is kept), and the uniforms of
positions past a round's first rejection decide nothing, so a later round's test of that position reads a
uniform no decision has read. The residual's draws come from a generator keyed the same way.

Randomness: every draw of an image depends on its seed and the event only: its trajectory noise is drawn by a
generator seeded with the image's seed, its uniforms are `keyed_uniforms(seed, position)`. So with a fixed
``gamma`` an image gets the same tokens whatever images share its batch, how many slots there are and when it
enters, up to float rounding: a batched pass sums in another order than a lone one, so token vectors agree to
~1e-6, and a test whose ratio lies within that of its uniform can flip (a near-tie; counted by the tests).

Cost-aware rounds (``gamma: auto``, decode/gamma_choice.py as `cspd_auto`): each round's draft count, the same for
every image that drafts in it, is the one that maximises the expected committed tokens per second, from the
drafts kept so far and the rounds' wall-clock fitted as a line in their length. Lossless for the reasons above (a
round's length is fixed before it, from earlier rounds only); but which positions get the backbone's bonus sample
rather than a tested draft depends on the rounds' lengths, so with ``auto`` an image's tokens depend on the lengths
chosen (the machine's timings and the images beside it), as `cspd_auto`'s and `eagle_ragged_auto`'s do. With a
fixed ``gamma`` they do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from backbones.base import Condition
from backbones.continuous import ContinuousARBackbone
from decode.conditions import PromptQueue, condition_rows, refill_slots
from decode.continuous_ar import check_continuous_sampling
from decode.cspd import (
    DraftRound,
    check_drafter_cfg_scale,
    check_gamma,
    check_last_step_drawn,
    check_verification,
    exact_test,
)
from decode.drain import drain_finished
from decode.gamma_choice import GammaChooser
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import first_true, gaussian_acceptance, gaussian_residual_sample
from decode.sampling import SamplingConfig, image_seeds, keyed_uniforms

_TEST, _RESIDUAL = 0, 1  # what a keyed uniform is for


@dataclass(frozen=True)
class RaggedCSpDConfig:
    """CSpD's settings (decode/cspd.py; defaults: the authors' MAR demo) and how many images are decoded at once."""

    # drafts per image and round; auto: per round by measured cost (decode/gamma_choice.py; an image's tokens then
    # depend on the lengths chosen, module docstring)
    gamma: int | Literal["auto"] = 4
    max_gamma: int = 8  # gamma auto: the longest round it may choose
    prefill_fraction: float = 0.05  # tokens the backbone samples itself first, per image
    tau: float = 1.0  # 1: exact; the reference's relaxed test widens both Gaussians by tau (not lossless)
    reference_correction: bool = False  # the reference's std-ratio factor (not lossless)
    drafter_cfg_scale: float | None = None  # the drafter's own guidance (None: what its export says)
    slots: int = 0  # images decoded at once (continuous batching over the queue); 0: all the conditions
    # once the queue is empty, drop finished images' slots when at most this share still decodes (decode/drain.py;
    # 0: never)
    drain: float = 0.75

    def __post_init__(self):
        check_gamma(self.gamma, self.max_gamma, "cspd_ragged")
        check_verification(self.prefill_fraction, self.tau, "cspd_ragged")
        check_drafter_cfg_scale(self.drafter_cfg_scale, "cspd_ragged")
        if self.slots < 0:
            raise ValueError(f"cspd_ragged needs slots >= 0 (0: all the conditions), got {self.slots}")
        if not 0 <= self.drain < 1:
            raise ValueError(f"cspd_ragged drain must be in [0, 1) (0: never drain), got {self.drain}")


class _Slots:
    """Per slot: its image (-1: empty), seed, tokens, trajectory noise, committed tokens (`done`) and how many of
    them the drafter's cache holds (`fed`)."""

    def __init__(self, backbone: ContinuousARBackbone, slots: int, device, dtype):
        total, steps, dim = backbone.geometry.num_tokens, backbone.diffusion.noise_steps, backbone.token_dim
        self.image = torch.arange(slots, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, total, dim, device=device, dtype=dtype)
        self.noise = torch.zeros(slots, total, steps, dim, device=device, dtype=dtype)
        self.done = torch.zeros(slots, dtype=torch.long, device=device)
        self.fed = torch.zeros(slots, dtype=torch.long, device=device)

    def at(self, what: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`what` (B, N, ...) at each slot's positions (B, T) -> (B, T, ...)."""
        return what[torch.arange(len(positions), device=positions.device)[:, None], positions]


def keyed_generator(seed: torch.Tensor, position: torch.Tensor, device) -> torch.Generator:
    """A generator for one image's event, seeded by 48 bits of (its seed, position)."""
    high, low = (int(keyed_uniforms(seed, position, _RESIDUAL, half) * (1 << 24)) for half in (0, 1))
    return torch.Generator(device=device).manual_seed((high << 24) | low)


@torch.inference_mode()
def generate_cspd_ragged(
    backbone: ContinuousARBackbone,
    drafter: ContinuousARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedCSpDConfig = RaggedCSpDConfig(),
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate one image per condition, `drafter` drafting for `backbone` over ``config.slots`` slots (module doc).

    `noise` (count, N, noise_steps, token_dim): each image's trajectory noise (default: drawn by a generator
    seeded with the image's seed). ``forward_passes`` counts the backbone's passes (ragged passes and prefills).
    """
    check_continuous_sampling(sampling)
    check_last_step_drawn(exact_test(config), "cspd_ragged", backbone, drafter)
    count, total = condition.batch_size, backbone.geometry.num_tokens
    slots = min(config.slots or count, count)
    cfg, temperature = sampling.cfg_scale, sampling.temperature
    draft_cfg = cfg if config.drafter_cfg_scale is None else config.drafter_cfg_scale
    prefilled = min(total, max(1, math.ceil(config.prefill_fraction * total)))
    seeds = image_seeds(count, generator)
    state, first = backbone.prefill(condition_rows(condition, list(range(slots))), sampling.guided)
    draft_state, _ = drafter.prefill(condition_rows(condition, list(range(slots))), draft_cfg != 1.0)
    device = first.device
    chooser = GammaChooser(config.max_gamma, device) if config.gamma == "auto" else None
    run = _Slots(backbone, slots, device, first.dtype)
    output = torch.zeros(count, total, backbone.token_dim, device=device, dtype=first.dtype)
    queue = PromptQueue(backbone, condition, range(slots, count), sampling.guided, ahead=slots)
    counts = dict.fromkeys(("drafted", "accepted", "fallbacks", "drains", "window_passes"), 0)
    counts["passes"] = 1

    def start(started: torch.Tensor, images: torch.Tensor, first_states: torch.Tensor) -> None:
        """Slots `started` begin images `images`: their noise, and their first token from the backbone."""
        run.image[started], run.seed[started] = images, seeds[images.to(seeds.device)].to(device)
        if noise is not None:
            run.noise[started] = noise[images.to(noise.device)].to(device, run.noise.dtype)
        else:
            run.noise[started] = torch.cat(
                [
                    backbone.draw_noise(1, total, torch.Generator(device=device).manual_seed(int(seed)), device)
                    for seed in run.seed[started].tolist()
                ]
            ).to(run.noise.dtype)
        drawn = backbone.sample_tokens(state, first_states, run.noise[started, :1], cfg, temperature)
        run.tokens[started, 0] = drawn.tokens[:, 0]
        run.done[started], run.fed[started] = 1, 0

    start(torch.arange(slots, device=device), torch.arange(slots, device=device), first)
    while bool((run.image >= 0).any()):
        active = run.image >= 0
        done = run.done.clone()
        # Drafts per image this round: none in its pre-fill, none past its end.
        drafting = active & (done >= prefilled)
        timed = chooser is not None and bool(drafting.any())  # a round without drafts tells the chooser nothing
        gamma = config.gamma if chooser is None else (chooser.choose() if timed else 1)
        if timed:
            chooser.start_round()
        want = torch.where(drafting, (total - done).clamp(max=gamma), 0)
        width = int(want.max())
        drafts = _draft(drafter, draft_state, run, active, width, draft_cfg, temperature) if width else None
        # One ragged pass over [last committed; drafts]: out[:, j] conditions position done + j.
        feed = run.at(run.tokens, (done - 1).clamp(min=0)[:, None])
        if drafts is not None:
            feed = torch.cat([feed, drafts.tokens], dim=1)
        out = backbone.step_ragged(state, feed, torch.where(active, done - 1, 0))
        counts["passes"] += 1
        positions = (done[:, None] + torch.arange(width + 1, device=device)).clamp(max=total - 1)
        target = backbone.sample_tokens(state, out, run.at(run.noise, positions), cfg, temperature)
        # Each image's drafts up to its first rejection.
        cut = want.clone()
        if drafts is not None:
            p = (target.final_mean[:, :width], target.final_std[:, :width])
            correction = None
            if config.reference_correction:
                correction = (target.log_std_sum[:, :width] - drafts.log_std_sum).sum(-1)
            ratio = gaussian_acceptance(drafts.tokens, p, (drafts.mean, drafts.std), config.tau, correction)
            uniform = keyed_uniforms(run.seed[:, None], positions[:, :width], _TEST)
            passed = uniform < ratio
            cut = torch.minimum(first_true(~passed, none=width), want)
            kept = torch.arange(width, device=device)[None] < cut[:, None]
            write = kept & active[:, None]
            slot_index = torch.arange(len(done), device=device)[:, None].expand_as(positions[:, :width])
            run.tokens[slot_index[write], positions[:, :width][write]] = drafts.tokens[write]
            rejected = torch.nonzero(active & (cut < want))[:, 0]
            for slot in rejected.tolist():
                at, position = int(cut[slot]), int(done[slot] + cut[slot])
                token, settled = gaussian_residual_sample(
                    (p[0][slot, at], p[1][slot, at]),
                    (drafts.mean[slot, at], drafts.std[slot, at]),
                    keyed_generator(run.seed[slot], torch.tensor(position), device),
                )
                run.tokens[slot, position] = token.to(run.tokens.dtype)
                counts["fallbacks"] += int(not bool(settled))
            # The drafter's cache holds the kept drafts it was fed (all but a round's last).
            run.fed = torch.where(active, done + cut.clamp(max=width - 1), run.fed)
            counts["drafted"] += int(want.sum())
            counts["accepted"] += int(cut[active].sum())
            counts["window_passes"] += int((want > 0).sum())  # image-rounds with drafts
        # Every draft kept (or none drafted): the backbone's own sample at the next position, if there is one.
        whole = torch.nonzero(active & (cut == want) & (done + want < total))[:, 0]
        run.tokens[whole, done[whole] + want[whole]] = target.tokens[whole, want[whole]]
        run.done = torch.where(active, (done + cut + 1).clamp(max=total), run.done)
        if timed:  # the round's drafted width (below gamma near images' ends), as cspd.py times it; reached: each
            # drafting image's drafts up to its first rejection
            chooser.end_round(width, int(torch.minimum(cut + 1, want)[drafting].sum()), int(cut[drafting].sum()))
        # Images that are done: written out, their slots to the next of the queue.
        finished = torch.nonzero(active & (run.done >= total))[:, 0]
        if len(finished):
            output[run.image[finished]] = run.tokens[finished]
            refill, images, fresh_first, prefill_pass = refill_slots(backbone, state, queue, finished)
            counts["passes"] += int(prefill_pass)
            if len(refill):
                fresh_drafter, _ = drafter.prefill(condition_rows(condition, images.tolist()), draft_cfg != 1.0)
                drafter.replace_images(draft_state, refill, fresh_drafter)
                start(refill, images, fresh_first)
            run.image[finished[len(refill) :]] = -1
            if config.drain and not len(queue):  # the queue is dry: finished slots leave both batches
                kept_slots = drain_finished(backbone, state, run.image >= 0, [run], config.drain)
                if kept_slots is not None:
                    drafter.keep_images(draft_state, kept_slots)
                    counts["drains"] += 1
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    return GenerationResult(
        output.view(count, rows, cols, -1),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        # window_sum / window_passes: the mean drafts per image and round (the report prints it)
        extras={
            "drains": counts["drains"],
            "window_sum": counts["drafted"],
            "window_passes": counts["window_passes"],
            "residual_fallbacks": counts["fallbacks"],
        },
    )


def _draft(drafter, draft_state, run: _Slots, active, width: int, cfg: float, temperature: float) -> DraftRound:
    """Step 2: the drafter catches up with each image's committed tokens (one ragged pass from what its cache
    holds), then samples `width` tokens per image one after another, each on the image's trajectory noise."""
    device, total = run.done.device, run.tokens.shape[1]
    lacking = torch.where(active, run.done - run.fed, 1)  # >= 1: at least the last committed token
    span = int(lacking.max())
    catch_up = (run.fed[:, None] + torch.arange(span, device=device)).clamp(max=total - 1)
    hidden = drafter.step_ragged(draft_state, run.at(run.tokens, catch_up), torch.where(active, run.fed, 0))
    last = (lacking - 1).repeat(hidden.shape[0] // len(lacking))  # the state after each image's last token
    hidden = hidden[torch.arange(hidden.shape[0], device=device), last][:, None]  # (rows, 1, H)
    run.fed = torch.where(active, run.done, run.fed)
    drafts = []
    for j in range(width):
        position = (run.done + j).clamp(max=total - 1)
        drafts.append(
            drafter.sample_tokens(draft_state, hidden, run.at(run.noise, position[:, None]), cfg, temperature)
        )
        if j + 1 < width:  # past an image's end a draft lands on its last slot: no later query reads it
            hidden = drafter.step_ragged(draft_state, drafts[-1].tokens, position)
    return DraftRound.of(drafts)


def _generate(backbone, drafter, condition, sampling, generator, settings: RaggedCSpDConfig) -> GenerationResult:
    if settings.drafter_cfg_scale is None:
        settings = replace(settings, drafter_cfg_scale=drafter.config.guidance_scale)
    return generate_cspd_ragged(backbone, drafter.model, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=RaggedCSpDConfig,
    artefact="drafter",
    artefact_kind="cspd",
    lossless=exact_test,
    token_kind="continuous",
    continuous=True,
)
