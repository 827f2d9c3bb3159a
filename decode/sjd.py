"""Speculative Jacobi decoding (SJD; Teng et al., ICLR 2025), training-free and lossless.

Paper: "Accelerating Auto-regressive Text-to-Image Generation with Training-free
Speculative Jacobi Decoding"; code: github.com/tyshiwo1/Accelerating-T2I-AR-with-SJD
(`jacobi_iteration_*.py`: `SpeculativeSampler`, `get_multi_token_for_preparation`).

Steps, per iteration (one backbone pass):

1. feed a window of `window` positions: the last committed token and the
   drafts after it (``max_num_new_tokens = 16`` in the reference code);
2. left to right, accept draft x with probability ``min(1, p_now(x) / p_prev(x))``,
   p_now the backbone's distribution given the window before x, p_prev the one x
   was drawn from; at the first rejection draw the token from
   ``norm(max(0, p_now - p_prev))`` and drop the drafts after it; if every draft
   passes, the pass's last state gives one more token;
3. the dropped positions become the next iteration's drafts, each drawn from
   this pass's p_now there (the Jacobi update: a distribution given a stale
   context, kept as that draft's p_prev), and new positions fill the window:
   uniform random image tokens (`init: random`, the paper's and GSD's setting)
   or the token to their left (`init: repeat_left`, the reference code's
   `repeat_horizon`), both point proposals (p_prev one-hot).

Every draft is a draw from the p_prev it is tested against, independent of the
test's uniform, so the output has the backbone's distribution (greedy: its
tokens). CFG and top-k/top-p act on p_now exactly as in the baseline.

Batched here (the reference code runs one prompt with its CFG twin): every
image keeps its own committed prefix; a pass feeds each image's window from the
slowest image's first open position, so an image ahead re-feeds its committed
tokens (tested as certain) before its drafts. The reference batches by cutting
every image at the batch's first rejection instead.

`accept` is the acceptance rule: speculative sampling's here; GSD (decode/gsd.py)
pools it over groups of similar tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import accept_drafts, first_true, probability_of, residual_distribution
from decode.sampling import SamplingConfig, sample_from, token_distribution

# accept(p (B, n, V), q (B, n, V), drafts (B, n), uniforms (B, n)) -> accepted (B, n)
AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SJDDecodeConfig:
    """How SJD drafts: the window it verifies per pass and how new positions are initialised."""

    window: int = 16  # positions fed per pass: the last committed token and window - 1 drafts
    init: Literal["random", "repeat_left"] = "random"  # new drafts: uniform image tokens, or the token to the left

    def __post_init__(self):
        if self.window < 2:
            raise ValueError(f"window must be >= 2 (the committed token and at least one draft), got {self.window}")


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's test on each draft: ``u * p_prev(x) < p_now(x)`` (decode/rules.py)."""
    return accept_drafts(probability_of(p, drafts), probability_of(q, drafts), uniforms)


@dataclass
class JacobiWindow:
    """The positions one pass feeds, from the slowest image's last committed token on.

    `tokens` (B, W) are each image's committed tokens where the position is below
    its `committed` count and drafts elsewhere; `q` (B, W, V) the distribution
    each draft was drawn from (one-hot for a point proposal; unused where committed).
    """

    start: int  # grid position of window column 0 (the cache holds the positions before it)
    tokens: torch.Tensor
    q: torch.Tensor


@dataclass
class WindowVerdict:
    """What one verification pass over a window gives: its states and targets, the new committed counts."""

    hidden: torch.Tensor  # (cache rows, span, H): hidden[:, j] predicts window.start + j + 1
    p: torch.Tensor  # (B, span, V) the target distributions of those states
    committed: torch.Tensor  # (B,) tokens fixed per image after the pass
    drafted: int  # drafts tested (up to and including each image's first rejection)
    accepted: int  # drafts kept


def verify_window(
    backbone: ARImageBackbone,
    state,
    tokens: torch.Tensor,
    committed: torch.Tensor,
    window: JacobiWindow,
    span: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    accept: AcceptRule,
) -> WindowVerdict:
    """One pass over the window's first `span` positions (from the slowest image's last committed token):
    test each image's drafts left to right with `accept`, commit up to its first rejection and the token
    after it (`commit_accepted`), and roll the cache back to the slowest image's last committed token.
    Shared by SJD, GSD, EAGLE and LANTERN; `tokens` (B, N) is updated in place."""
    batch, device = tokens.shape[0], tokens.device
    feed = window.tokens[:, :span]
    hidden = backbone.step(state, feed)
    p = target_distributions(backbone, state, hidden, sampling)  # p[:, j] predicts window.start + j + 1
    positions = window.start + torch.arange(1, span, device=device)  # what the window's drafts stand for
    is_draft = positions[None] >= committed[:, None]  # (B, span - 1)
    uniforms = torch.rand(batch, span - 1, generator=generator, device=device)
    passed = accept(p[:, :-1], window.q[:, 1:span], feed[:, 1:], uniforms) | ~is_draft
    rejected_at = first_true(~passed, none=span - 1)  # window offset - 1 of the first rejection
    offsets = torch.arange(span - 1, device=device)
    drafted = int((is_draft & (offsets <= rejected_at[:, None])).sum())
    accepted = int((is_draft & (offsets < rejected_at[:, None])).sum())
    new_committed = commit_accepted(tokens, committed, window, p, feed, rejected_at, span, generator)
    backbone.rollback(state, int(new_committed.min()) - 1)
    return WindowVerdict(hidden, p, new_committed, drafted, accepted)


@torch.inference_mode()
def generate_jacobi(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    config: SJDDecodeConfig,
    accept: AcceptRule = speculative_accept,
) -> GenerationResult:
    """Generate one image per condition by speculative Jacobi iterations (the module docstring's steps)."""
    total = backbone.geometry.num_tokens
    state, first_state = backbone.prefill(condition, sampling.guided)
    device = first_state.device
    batch = condition.batch_size
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    tokens[:, 0] = sample_from(target_distributions(backbone, state, first_state, sampling), generator)[:, 0]
    committed = torch.ones(batch, dtype=torch.long, device=device)  # tokens fixed per image
    window = _refill(backbone, tokens, committed, 0, None, None, config, generator)
    passes, drafted, accepted = 1, 0, 0
    while int(committed.min()) < total:
        span = min(config.window, total - window.start)
        verdict = verify_window(backbone, state, tokens, committed, window, span, sampling, generator, accept)
        passes, drafted, accepted = passes + 1, drafted + verdict.drafted, accepted + verdict.accepted
        committed = verdict.committed
        window = _refill(backbone, tokens, committed, window.start, verdict.p, span, config, generator)
    return GenerationResult(
        tokens.view(batch, backbone.geometry.rows, backbone.geometry.cols),
        forward_passes=passes,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
    )


def target_distributions(
    backbone: ARImageBackbone, state, hidden: torch.Tensor, sampling: SamplingConfig
) -> torch.Tensor:
    """The target distributions (B, T, V) of the states `hidden` (cache rows, T, H), guided like the baseline."""
    return token_distribution(backbone.scores(state, hidden, sampling.cfg_scale), sampling)


def commit_accepted(
    tokens, committed, window: JacobiWindow, p, feed, rejected_at, span: int, generator
) -> torch.Tensor:
    """Write each image's accepted drafts and its next token; return the new committed counts.

    Shared by every method that verifies a window from the slowest image's last committed token
    (SJD, GSD, EAGLE, LANTERN): `feed` (B, span) the window's tokens, `p` (B, span, V) the pass's target
    distributions, `rejected_at` (B,) each image's first rejected window offset - 1 (span - 1: none).

    At a rejection (offset r: position start + r + 1) the token comes from the residual; where every draft
    passed, from the pass's last state (position start + span), unless the image is further ahead already.
    """
    total = tokens.shape[1]
    batch = tokens.shape[0]
    images = torch.arange(batch, device=tokens.device)
    all_passed = rejected_at == span - 1
    next_position = window.start + rejected_at + 1  # (B,)
    # Accepted drafts: the window's tokens up to the first rejection.
    for offset in range(1, span):
        keep = (window.start + offset < next_position) & (window.start + offset >= committed)
        tokens[keep, window.start + offset] = feed[keep, offset]
    p_next = p[images, rejected_at]  # (B, V): predicts next_position
    q_next = window.q[images, (rejected_at + 1).clamp(max=span - 1)]
    correction = torch.where(all_passed[:, None], p_next, residual_distribution(p_next, q_next))
    new_token = sample_from(correction, generator)
    gets_token = (next_position < total) & (next_position >= committed)
    tokens[gets_token, next_position[gets_token]] = new_token[gets_token]
    return torch.where(gets_token, next_position + 1, torch.maximum(committed, next_position.clamp(max=total)))


def _refill(backbone, tokens, committed, previous_start, p, span, config: SJDDecodeConfig, generator) -> JacobiWindow:
    """The next window from the slowest image's last committed token: committed tokens, Jacobi updates of the
    positions the last pass predicted (drawn from its p, kept as their q), new drafts for the rest."""
    batch, total = tokens.shape
    vocab, cols = backbone.codebook_size, backbone.geometry.cols
    start = int(committed.min()) - 1
    width = config.window
    positions = start + torch.arange(width, device=tokens.device)  # may run past the image: never fed
    window_tokens = torch.zeros(batch, width, dtype=torch.long, device=tokens.device)
    q = torch.zeros(batch, width, vocab, device=tokens.device)
    is_committed = positions[None] < committed[:, None]
    window_tokens[is_committed] = tokens[:, positions.clamp(max=total - 1)][is_committed]
    predicted = torch.zeros_like(is_committed)
    if p is not None:  # the last pass's p[:, j] predicts previous_start + j + 1
        index = positions - previous_start - 1
        predicted = ~is_committed & ((index >= 0) & (index < span))[None]
        jacobi_q = p[:, index.clamp(0, span - 1)]  # (B, W, V)
        jacobi_tokens = sample_from(jacobi_q, generator)
        window_tokens = torch.where(predicted, jacobi_tokens, window_tokens)
        q = torch.where(predicted[..., None], jacobi_q, q)
    fresh = ~is_committed & ~predicted
    random_tokens = torch.randint(0, vocab, (batch, width), generator=generator, device=tokens.device)
    for column in range(width):
        if config.init == "repeat_left" and column > 0 and int(positions[column]) % cols != 0:
            initial = window_tokens[:, column - 1]
        else:
            initial = random_tokens[:, column]
        window_tokens[:, column] = torch.where(fresh[:, column], initial, window_tokens[:, column])
    q = torch.where(fresh[..., None], F.one_hot(window_tokens, vocab).to(q.dtype), q)
    return JacobiWindow(start, window_tokens, q)


def generate_sjd(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: SJDDecodeConfig = SJDDecodeConfig(),
) -> GenerationResult:
    """SJD: speculative Jacobi iterations with speculative sampling's test (lossless)."""
    return generate_jacobi(backbone, condition, sampling, generator, config, speculative_accept)


def _generate(backbone, _artefact, condition, sampling, generator, settings: SJDDecodeConfig) -> GenerationResult:
    return generate_sjd(backbone, condition, sampling, generator, settings)


METHOD = MethodSpec(generate=_generate, settings=SJDDecodeConfig)
