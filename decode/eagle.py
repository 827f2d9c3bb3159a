"""EAGLE decoding (Li et al., ICML 2024 / EMNLP 2024): a trained 1-D draft head proposes a chain, one pass verifies it.

Paper: "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" and
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"; code:
github.com/SafeAILab/EAGLE (``model/cnets.py`` the head, ``model/utils.py`` the
verification). The head is heads/eagle.py, trained by
``python -m train +experiment=eagle_digits``.

Steps, per iteration (one backbone pass):

1. the head catches up on the positions whose backbone states became final in
   the last pass (their true states and tokens, one call through its KV cache);
2. it drafts a chain of `depth` tokens in raster order: from its prediction of
   the next state, the draft distribution q (the backbone's frozen norm, image
   head and CFG, the same temperature / top-k / top-p as the target), a draft
   x ~ q, then (predicted state, x) as its next input;
3. one backbone pass feeds the last committed token and the chain; left to
   right, accept x with probability ``min(1, p(x) / q(x))``; at the first
   rejection draw the token from ``norm(max(0, p - q))`` and drop the rest; if
   every draft passes, the pass's last state gives one more token;
4. the head's cache is rolled back to the positions with true inputs.

This is a chain, EAGLE-1's form: EAGLE-2's dynamic tree (top-k branches
re-ranked by their joint confidence, verified with a tree attention mask) needs
several tokens at one grid position in one pass, which the backbones' position-
addressed cache does not hold. Exact: greedy output is greedy AR's tokens, sampled
output has the backbone's distribution. `accept` is the acceptance rule:
speculative sampling's here; LANTERN (decode/lantern.py) relaxes it.

Batched like SJD (decode/sjd.py): every image keeps its own committed prefix;
a pass starts at the slowest image's last committed token, and an image ahead
re-feeds its committed tokens (tested as certain) before its own drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_from, token_distribution
from decode.sjd import AcceptRule, JacobiWindow, speculative_accept, target_distributions, verify_window
from heads.eagle import EagleHead


@dataclass(frozen=True)
class EagleDecodeConfig:
    """How long a chain the head drafts before each verification pass."""

    depth: int = 6  # drafts per pass (EAGLE-2's default draft depth; docs/results.md measures 3-8 here)

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1 (drafts per pass), got {self.depth}")


@dataclass
class _Drafting:
    """What drafting reads: the image so far, the backbone's true states, the head and its cache."""

    head: EagleHead
    cache: object
    score_draft: object  # backbone.draft_scorer: states (rows, ..., H) -> guided scores (B, ..., V)
    tokens: torch.Tensor  # (B, N)
    true_states: torch.Tensor  # (rows, N, H): states whose context is final, for positions < committed
    twins: int  # cache rows per image (2 under CFG)
    cached: int = 0  # head cache entries computed from true inputs for every image


@torch.inference_mode()
def generate_eagle(
    backbone: ARImageBackbone,
    head: EagleHead,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: EagleDecodeConfig = EagleDecodeConfig(),
    accept: AcceptRule = speculative_accept,
) -> GenerationResult:
    """Generate one image per condition by EAGLE chains (the module docstring's steps)."""
    total = backbone.geometry.num_tokens
    state, first = backbone.prefill(condition, sampling.guided)
    batch, device = condition.batch_size, first.device
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    true_states = first.new_zeros(first.shape[0], total, first.shape[-1])
    true_states[:, 0] = first[:, 0]
    tokens[:, 0] = sample_from(target_distributions(backbone, state, first, sampling), generator)[:, 0]
    committed = torch.ones(batch, dtype=torch.long, device=device)
    score_draft = backbone.draft_scorer(state, sampling.cfg_scale)
    drafting = _Drafting(head, head.new_cache(), score_draft, tokens, true_states, first.shape[0] // batch)
    passes, drafted, accepted = 1, 0, 0
    while int(committed.min()) < total:
        start = int(committed.min()) - 1  # the slowest image's last token, not fed yet
        span = min(config.depth + 1, total - start)
        window = _draft_chain(backbone, drafting, committed, start, span, sampling, generator)
        verdict = verify_window(backbone, state, tokens, committed, window, span, sampling, generator, accept)
        passes, drafted, accepted = passes + 1, drafted + verdict.drafted, accepted + verdict.accepted
        _keep_true_states(true_states, verdict.hidden, start, committed, verdict.committed)
        committed = verdict.committed
    return GenerationResult(
        tokens.view(batch, backbone.geometry.rows, backbone.geometry.cols),
        forward_passes=passes,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
    )


def _draft_chain(
    backbone: ARImageBackbone,
    drafting: _Drafting,
    committed: torch.Tensor,
    start: int,
    span: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> JacobiWindow:
    """The window of positions ``start .. start + span - 1``: committed tokens where an image has them, the
    head's chain elsewhere, with the distribution q each draft was drawn from (B, span, V)."""
    head, cache, tokens, twins = drafting.head, drafting.cache, drafting.tokens, drafting.twins
    dtype, state_dtype = head.fc.weight.dtype, drafting.true_states.dtype

    def head_step(states: torch.Tensor, step_tokens: torch.Tensor) -> torch.Tensor:
        embedded = backbone.embed_image_tokens(step_tokens.repeat(twins, 1)).to(dtype)
        return head(states.to(dtype), embedded, cache)[:, -1:].to(state_dtype)

    # 1. Positions before `start + 1` are final for every image: feed their true inputs in one call.
    predicted = head_step(drafting.true_states[:, drafting.cached : start + 1], tokens[:, drafting.cached : start + 1])
    window_tokens = tokens[:, start : start + span].clone()
    q = torch.zeros(len(tokens), span, backbone.codebook_size, device=tokens.device)
    # 2. The chain: `predicted` is the head's state for position start + j.
    for j in range(1, span):
        position = start + j
        q[:, j] = token_distribution(drafting.score_draft(predicted), sampling)[:, 0]
        is_draft = committed <= position
        window_tokens[:, j] = torch.where(is_draft, sample_from(q[:, j], generator), window_tokens[:, j])
        if j < span - 1:
            known = (~is_draft).repeat(twins)[:, None, None]  # an image ahead feeds its true state and token
            inputs = torch.where(known, drafting.true_states[:, position : position + 1], predicted)
            predicted = head_step(inputs, window_tokens[:, j : j + 1])
    # 4. Only entries from true inputs for every image stay cached.
    cache.crop(-(cache.get_seq_length() - (start + 1)))
    drafting.cached = start + 1
    return JacobiWindow(start, window_tokens, q)


def _keep_true_states(true_states, out, start: int, committed: torch.Tensor, new_committed: torch.Tensor) -> None:
    """Record the pass's states whose context is now final: position i of image b for
    ``committed[b] <= i < new_committed[b]`` (``out[:, j]`` is the state at start + j + 1)."""
    positions = start + 1 + torch.arange(out.shape[1], device=out.device)
    new = (positions[None] >= committed[:, None]) & (positions[None] < new_committed[:, None])  # (B, span)
    new = new.repeat(out.shape[0] // len(committed), 1)  # every cache row of the image
    segment = true_states[:, start + 1 : start + 1 + out.shape[1]]
    width = segment.shape[1]  # the last pass's final state may predict past the image
    segment[new[:, :width]] = out[:, :width][new[:, :width]]


def _generate(backbone, heads, condition, sampling, generator, settings: EagleDecodeConfig) -> GenerationResult:
    return generate_eagle(backbone, heads, condition, sampling, generator, settings)


METHOD = MethodSpec(generate=_generate, settings=EagleDecodeConfig, artefact="heads", artefact_kind="eagle")
