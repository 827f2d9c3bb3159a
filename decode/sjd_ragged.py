"""SJD (and GSD) with ragged frontiers and continuous batching: every image runs its own Jacobi window from its
own last committed token, in one shared pass, and an image that is done hands its slot to the next of the queue.

decode/sjd.py batches like the reference code batches a prompt's CFG twins: a pass feeds every image's window
from the slowest image's last committed token, so an image ahead re-feeds its committed tokens (tested as
certain) and its window holds fewer drafts; at batch 16 every image pays for the slowest one's position. Here,
per pass:

1. one ragged pass (`ARImageBackbone.step_ragged`) feeds each image ``window`` positions from its own last
   committed token: that token and ``window - 1`` drafts (the pass gives each image the states `step` would
   give it alone);
2. each image's drafts are tested left to right with `accept` against its own target distributions
   (speculative sampling's ``min(1, p_now(x) / p_prev(x))``; GSD's pooled test in decode/gsd_ragged.py); at the
   first rejection the token comes from ``norm(max(0, p_now - p_prev))``, and if every draft inside the image
   passes, the pass's last state gives one more token;
3. the positions the pass predicted but did not commit become the image's next drafts, each drawn from this
   pass's ``p_now`` there and kept as its ``p_prev`` (the Jacobi update); positions new to the window get
   uniform random image tokens (``init: random``) or the token to their left (``repeat_left``), point
   proposals (one-hot ``p_prev``), exactly as in decode/sjd.py;
4. an image whose last token is committed leaves its slot to the next condition of the queue (prompts
   prefilled up to ``slots`` at a time: `decode.conditions.PromptQueue`).

Exactness: each image's drafts are draws from the ``p_prev`` they are tested against, made with uniforms no
earlier decision read, and tested with the exact rule against the image's own target, so every image's output
has the backbone's distribution and greedy output is greedy AR's (the argument of decode/sjd.py, image by image).

Randomness: every uniform is keyed by the image's seed and the event (grid position, how many drafts the position
has had, what the uniform is for; `decode.sampling.keyed_uniforms`). An image's windows depend on its own
history only (its own frontier, its own drafts), so it gets the same tokens whatever images share its batch,
how many slots there are and when it enters (bit-identical where the backbone's batched pass is; float32 results
can depend on the batch's shape by rounding, which flips a token only at a near-tie). This is not decode/sjd.py's
stream: the same seed gives other images than the batched SJD, from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from backbones.base import ARImageBackbone, Condition
from decode.conditions import PromptQueue, condition_rows, refill_slots
from decode.drain import drain_finished
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import judge_chains
from decode.sampling import SamplingConfig, image_seeds, keyed_uniforms, sample_with, token_distribution
from decode.sjd import AcceptRule, SJDDecodeConfig, speculative_accept

_DRAFT, _TEST, _RESIDUAL, _TARGET = 0, 1, 2, 3  # what a keyed uniform is for


@dataclass(frozen=True)
class RaggedSJDConfig:
    """SJD's window and initialisation (decode/sjd.py), and how many images are decoded at once."""

    window: int = 16  # positions fed per image and pass: its last committed token and window - 1 drafts
    init: Literal["random", "repeat_left"] = "random"  # new drafts: uniform image tokens, or the token to the left
    slots: int = 0  # images decoded at once (continuous batching over the queue); 0: all the conditions
    # once the queue is empty, drop finished images' slots when at most this share still decodes (decode/drain.py;
    # 0: never)
    drain: float = 0.75

    def __post_init__(self):
        SJDDecodeConfig(self.window, self.init)  # the same checks
        if self.init not in ("random", "repeat_left"):
            raise ValueError(f"init must be 'random' or 'repeat_left', got {self.init!r}")
        if self.slots < 0:
            raise ValueError(f"ragged SJD needs slots >= 0 (0: all the conditions), got {self.slots}")
        if not 0 <= self.drain < 1:
            raise ValueError(f"ragged SJD drain must be in [0, 1) (0: never drain), got {self.drain}")


class _Windows:
    """Per slot: its image, committed tokens and Jacobi window (B slots; positions ``committed - 1`` on)."""

    def __init__(self, backbone: ARImageBackbone, slots: int, config: RaggedSJDConfig, device):
        total, width = backbone.geometry.num_tokens, config.window
        self.total, self.width, self.cols, self.vocab = total, width, backbone.geometry.cols, backbone.codebook_size
        self.init = config.init
        self.image = torch.arange(slots, device=device)  # -1: empty
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, total, dtype=torch.long, device=device)
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)  # tokens fixed per image
        # drafts each position has had (the window runs past the image's end: those positions are never tested)
        self.attempts = torch.zeros(slots, total + width, dtype=torch.long, device=device)
        self.feed = torch.zeros(slots, width, dtype=torch.long, device=device)  # the last committed token, drafts
        self.q = torch.zeros(slots, width, self.vocab, device=device)  # what each draft was drawn from

    def draft(self, rows: torch.Tensor, previous_start: torch.Tensor | None, p: torch.Tensor | None) -> None:
        """The windows of images `rows` from their last committed token: that token, the Jacobi updates of the
        positions their last pass (window from `previous_start`, target distributions `p` (k, W, V)) predicted,
        new drafts after them. ``previous_start`` None: no pass yet (an image just started)."""
        device, width = rows.device, self.width
        start = self.committed[rows] - 1
        positions = start[:, None] + torch.arange(width, device=device)  # (k, W)
        clamped = positions.clamp(max=self.total + width - 1)
        rows_2d = rows[:, None].expand_as(positions)
        self.attempts[rows_2d[:, 1:], clamped[:, 1:]] += 1  # every draft position gets a new draft
        uniforms = keyed_uniforms(self.seed[rows][:, None], positions, self.attempts[rows_2d, clamped], _DRAFT)
        feed = torch.zeros_like(positions)
        feed[:, 0] = self.tokens[rows, start]
        q = torch.zeros(len(rows), width, self.vocab, device=device)
        predicted = torch.zeros_like(positions, dtype=torch.bool)
        if previous_start is not None:  # p[:, j] predicts previous_start + j + 1
            index = positions - previous_start[:, None] - 1
            predicted = (index >= 0) & (index < width) & (positions < self.total)
            predicted[:, 0] = False
            jacobi_q = p.gather(1, index.clamp(0, width - 1)[..., None].expand(-1, -1, self.vocab))
            feed = torch.where(predicted, sample_with(jacobi_q, uniforms), feed)
            q = torch.where(predicted[..., None], jacobi_q, q)
        fresh = ~predicted
        fresh[:, 0] = False
        random_tokens = (uniforms * self.vocab).long().clamp(max=self.vocab - 1)
        for column in range(1, width):
            initial = random_tokens[:, column]
            if self.init == "repeat_left":
                row_start = positions[:, column] % self.cols == 0
                initial = torch.where(row_start, initial, feed[:, column - 1])
            feed[:, column] = torch.where(fresh[:, column], initial, feed[:, column])
        q = torch.where(fresh[..., None], F.one_hot(feed, self.vocab).to(q.dtype), q)
        self.feed[rows], self.q[rows] = feed, q


@torch.inference_mode()
def generate_jacobi_ragged(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedSJDConfig = RaggedSJDConfig(),
    accept: AcceptRule = speculative_accept,
) -> GenerationResult:
    """Generate one image per condition by ragged Jacobi windows over ``config.slots`` slots (module docstring).

    `accept` tests the drafts, ``accept(p, q, drafts, uniforms)`` as decode/sjd.py's (GSD's pooled test:
    decode/gsd_ragged.py). ``forward_passes`` counts every backbone pass (ragged passes and prefills).
    """
    count = condition.batch_size
    slots = min(config.slots or count, count)
    total, width = backbone.geometry.num_tokens, config.window
    seeds = image_seeds(count, generator)
    state, first = backbone.prefill(condition_rows(condition, list(range(slots))), sampling.guided)
    device = first.device
    run = _Windows(backbone, slots, config, device)
    run.seed = seeds[:slots].to(device)
    output = torch.zeros(count, total, dtype=torch.long, device=device)
    queue = PromptQueue(backbone, condition, range(slots, count), sampling.guided, ahead=slots)
    counts = {"passes": 1, "drafted": 0, "accepted": 0, "drains": 0}
    rows = torch.arange(slots, device=device)
    offsets = torch.arange(width - 1, device=device)

    def start(started: torch.Tensor, first_states: torch.Tensor) -> None:
        p = token_distribution(backbone.scores(state, first_states, sampling.cfg_scale), sampling)[:, 0]
        zero = torch.zeros_like(started)
        run.attempts[started] = 0
        run.tokens[started, 0] = sample_with(p, keyed_uniforms(run.seed[started], zero, zero, _TARGET))
        run.committed[started] = 1
        run.draft(started, None, None)

    start(rows, first)
    while bool((run.image >= 0).any()):
        active = run.image >= 0
        starts = torch.where(active, run.committed - 1, 0)  # an empty slot feeds from position 0, ignored
        out = backbone.step_ragged(state, run.feed, starts)  # out[:, j] predicts starts + j + 1
        counts["passes"] += 1
        p = token_distribution(backbone.scores(state, out, sampling.cfg_scale), sampling)  # (B, W, V)
        positions = starts[:, None] + 1 + offsets  # what the drafts stand for
        inside = (positions < total) & active[:, None]
        test_uniform = keyed_uniforms(run.seed[:, None], positions, run.attempts.gather(1, positions), _TEST)
        # The drafts up to each image's first rejection, and the next token's distribution: the residual at a
        # rejection, the target after the last accepted draft otherwise.
        kept, rejected, reached, correction = judge_chains(
            accept, p, run.q[:, 1:], run.feed[:, 1:], inside, test_uniform
        )
        counts["drafted"] += int(reached.sum())
        counts["accepted"] += int(kept.sum())
        next_position = starts + 1 + kept
        has_next = active & (next_position < total)
        at = next_position.clamp(max=total - 1)
        kind = torch.where(rejected, _RESIDUAL, _TARGET)
        next_token = sample_with(correction, keyed_uniforms(run.seed, at, run.attempts[rows, at], kind))
        write = (offsets < kept[:, None]) & active[:, None]
        run.tokens[rows[:, None].expand_as(positions)[write], positions[write]] = run.feed[:, 1:][write]
        run.tokens[rows[has_next], next_position[has_next]] = next_token[has_next]
        run.committed = torch.where(active, (next_position + has_next.long()).clamp(max=total), run.committed)
        going = torch.nonzero(active & (run.committed < total))[:, 0]
        if len(going):
            run.draft(going, starts[going], p[going])
        # Images that are done: written out, their slots to the next of the queue.
        done = torch.nonzero(active & (run.committed >= total))[:, 0]
        if len(done):
            output[run.image[done]] = run.tokens[done]
            refill, images, fresh_first, prefilled = refill_slots(backbone, state, queue, done)
            counts["passes"] += int(prefilled)
            if len(refill):
                run.image[refill], run.seed[refill] = images, seeds[images.to(seeds.device)].to(device)
                start(refill, fresh_first)
            run.image[done[len(refill) :]] = -1
            if config.drain and not len(queue):  # the queue is dry: finished slots leave the batch
                if drain_finished(backbone, state, run.image >= 0, [run], config.drain) is not None:
                    rows = torch.arange(run.image.shape[0], device=device)
                    counts["drains"] += 1
    return GenerationResult(
        output.view(count, backbone.geometry.rows, backbone.geometry.cols),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        extras={"drains": counts["drains"]},
    )


def _generate(backbone, _artefact, condition, sampling, generator, settings: RaggedSJDConfig) -> GenerationResult:
    return generate_jacobi_ragged(backbone, condition, sampling, generator, settings)


METHOD = MethodSpec(generate=_generate, settings=RaggedSJDConfig, continuous=True)
