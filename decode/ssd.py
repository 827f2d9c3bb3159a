"""SSD decoding: draft a whole row with latent heads, verify it in one backbone pass.

Spatially Speculative Decoding (Xiang et al., 2026). The image is generated row
by row. For row ``r``:

1. The first token of the row is drawn from the backbone's own distribution
   (the hidden state after the previous row is known), so it is always right.
2. Every other position is drafted: the vertical head predicts the hidden state
   of each position from the state and token directly above (row ``r - 1``); the
   horizontal head predicts the first ``horizontal_steps`` positions after a
   token the backbone has just given (row 0 has nothing above, so it is drafted
   horizontally end to end). Draft logits are the backbone's frozen final norm
   and head applied to the predicted states, guided by CFG exactly as the
   baseline's; draft tokens are drawn from them with the baseline's sampling
   settings. Heads with a grid head (``head.grid``) draft rows below the first
   along the row instead, each position from the state above it and the state
   drafted to its left, and re-draft the rest of the row the same way from each
   correction, or only its next ``grid_steps`` positions (``horizontal_steps``
   then only matters for row 0).
3. One backbone pass over the row (all images of the batch together, the cache
   rolled back to the row's start) gives the target distribution ``p`` at every
   position. Then, per mode:

   - ``exact``: standard speculative sampling (Leviathan et al., 2023; Chen et
     al., 2023). Left to right, accept draft ``x`` with probability
     ``min(1, p(x) / q(x))``; at the first rejection draw from the residual
     ``norm(max(0, p - q))`` and stop. The positions after it are re-drafted
     (horizontal head from the corrected token) and the row is verified again
     until every image has its whole row. Lossless: greedy output is the greedy
     baseline's token for token, sampled output has the baseline's distribution.
     A row costs 1 + (most rejections of any image in the batch) passes.
   - ``autocorrect``: at most ``rounds + 1`` passes per row. With correction
     ``residual`` (the paper's wording): test every position in parallel
     against ``p``, resample *every* rejected position from its residual in the
     same pass, re-verify the corrected row with the cache rolled back.
     ``target`` redraws the rejected positions right of the first rejection
     from ``p`` instead. ``prefix`` (the default) runs the exact rule and, when
     the budget is spent, keeps the re-drafted rest of the row unverified.
     Approximation in all three: tokens not verified against their final left
     context are kept, so the output distribution is not exactly the
     backbone's (``rounds`` large enough makes it exact). On the digits
     backbone the parallel corrections (``residual``, ``target``) oscillate
     into stripes when drafts are rejected densely; see docs/results_log.md.
     The reports put the quality metrics beside the baseline's.

Lookahead (``lookahead``, exact and prefix): a pass that reaches the row's end
may also feed the next row's drafts, drafted from this row as it stands (exact
states left of the first open position, the heads' predicted states from
there). If every image's row passes whole, the next row starts already
verified against that pass (its first token is then a draft too); otherwise the
extra tokens are dropped with the cache rollback. Lossless either way: it only
changes which positions a pass verifies.

Batching: all images of a batch work on the same row, so every pass feeds the
same number of tokens and one cache length serves them all; an image that has
finished its row re-feeds it unchanged until the others finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition, DecodeState
from decode.method import MethodSpec
from decode.passes import verification_pass, write_block_states
from decode.result import GenerationResult
from decode.rules import (
    accept_drafts,
    autocorrect_distributions,
    first_true,
    latent_neighbours,
    pooled_neighbour_mass,
    probability_of,
    residual_distribution,
)
from decode.sampling import SamplingConfig
from decode.ssd_drafting import DraftedRow, SSDRowDrafter
from heads.ssd import SSDHeads


@dataclass(frozen=True)
class SSDDecodeConfig:
    """How SSD drafts and verifies."""

    mode: Literal["exact", "autocorrect"] = "exact"
    rounds: int = 1  # autocorrect: re-verification passes per row after the first (a row costs <= rounds + 1)
    horizontal_steps: int = 1  # positions drafted by the horizontal head after a token the backbone gave
    # autocorrect: what a rejected token right of an image's first rejection is redrawn from: "target" (p given
    # the drafted context) or "residual" (norm(max(0, p - q)), the exact rule's correction, applied everywhere)
    # "prefix": verify exactly like `exact` but stop after rounds + 1 passes and keep the rest of the row's drafts
    correction: Literal["target", "residual", "prefix"] = "prefix"
    # exact / prefix: verify at most this many positions after the first open one per pass (0: the row's rest).
    # A pass costs compute per token fed; where that is not free (CPU, large batches) a window near the mean
    # accepted run saves the compute spent verifying positions a rejection further left invalidates anyway.
    window: int = 0
    # grid heads: positions re-drafted along the row with the grid head after a token the backbone gave (the
    # row's first token, each correction); the positions after them keep their earlier drafts (0: to the row's
    # end). In autocorrect the last correction of a row always re-drafts to the end: that tail is kept unverified.
    grid_steps: int = 0
    # Verify the next row's drafts in the same pass as the end of this one, when this row's open drafts look
    # likely to pass (the product of their own probabilities q(x) >= lookahead_confidence; 0: whenever the
    # pass reaches the row's end). The next row is drafted from this row's states, exact where known and the
    # heads' predictions elsewhere. Saves the pass that would start the next row whenever this row completes
    # in that pass; costs a row of tokens per pass it is added to (free on a GPU at small batch, not on a CPU).
    lookahead: bool = False
    lookahead_confidence: float = 0.0
    # LANTERN relaxation of the acceptance test (decode/rules.py): a draft also counts the target mass of its
    # relax_k nearest codebook neighbours, up to relax_delta. 0 keeps the exact test (and exactness); > 0 trades
    # exactness for acceptance. Sampled decoding only (greedy verification compares argmaxes).
    relax_k: int = 0
    relax_delta: float = 0.0

    def __post_init__(self):
        if self.mode not in ("exact", "autocorrect"):
            raise ValueError(f"SSD mode must be 'exact' or 'autocorrect', got {self.mode!r}")
        if self.correction not in ("target", "residual", "prefix"):
            raise ValueError(f"SSD correction must be 'target', 'residual' or 'prefix', got {self.correction!r}")
        if min(self.rounds, self.horizontal_steps, self.window, self.grid_steps) < 0:
            raise ValueError(
                f"SSD rounds, horizontal_steps, window and grid_steps must be >= 0, got {self.rounds}, "
                f"{self.horizontal_steps}, {self.window}, {self.grid_steps}"
            )
        if not 0 <= self.lookahead_confidence <= 1:
            raise ValueError(f"SSD lookahead_confidence must be in [0, 1], got {self.lookahead_confidence}")
        if self.relax_k < 0 or not 0 <= self.relax_delta <= 1:  # a probability budget: above 1 accepts anything
            raise ValueError(
                f"SSD relax_k must be >= 0 and relax_delta in [0, 1], got {self.relax_k}, {self.relax_delta}"
            )
        if self.lookahead and (self.window or (self.mode == "autocorrect" and self.correction != "prefix")):
            raise ValueError(
                "decode.ssd.lookahead needs window 0 and mode exact or correction prefix (it extends a "
                "pass that reaches the row's end)"
            )
        if self.relax_k < 0 or self.relax_delta < 0:
            raise ValueError(f"SSD relax_k and relax_delta must be >= 0, got {self.relax_k}, {self.relax_delta}")
        if self.window and self.mode == "autocorrect" and self.correction != "prefix":
            raise ValueError(
                "decode.ssd.window works with mode exact or correction prefix; set it to 0 for "
                f"correction {self.correction!r}"
            )


@dataclass
class SSDProgress:
    """What one generation carries from row to row (B images, G cache rows)."""

    tokens: torch.Tensor  # (B, rows * cols) the image so far
    first_state: torch.Tensor | None  # (G, 1, H) predicts the next row's first token; None: that token was never fed
    first_exact: torch.Tensor  # (B,) bool: first_state came from the image's committed tokens
    cache_valid: int = 0  # grid positions whose cached keys/values are final for every image
    above: tuple[torch.Tensor, torch.Tensor] | None = None  # the finished row above: states (G, C, H), tokens (B, C)
    handed_over: tuple[DraftedRow, torch.Tensor] | None = None  # lookahead: the next row and that pass's states
    passes: int = 1  # backbone passes, the prefill included
    drafted: int = 0
    accepted: int = 0


@dataclass
class SSDRow:
    """The row being verified."""

    index: int
    start: int  # its first grid position
    drafts: DraftedRow  # tokens (B, C) and q (B, C, V), corrected in place
    states: torch.Tensor  # (G, C, H): states[:, i] predicts position i, exact where a pass gave it
    committed: torch.Tensor  # (B,) long: positions of the row already final, per image
    above_prepared: torch.Tensor | None  # the grid head's share of the row above (None: no grid drafting)
    handed_over: torch.Tensor | None = None  # states from the pass that already fed this row (lookahead)
    cached: int = 0  # positions whose cached keys/values are final for every image
    passes: int = 0  # verification passes spent on this row
    fed: tuple[torch.Tensor, int, int] | None = None  # the last pass: its states, first and end fed positions


@dataclass
class _Verdict:
    """The test of one pass: which drafts stand, where each image's first rejection is."""

    passed: torch.Tensor  # (B, C) bool, committed positions included
    first_rejected: torch.Tensor  # (B,) long, C where none
    is_committed: torch.Tensor  # (B, C) bool: final before this pass
    open_images: torch.Tensor  # (B,) bool: images whose row was not final before this pass
    extent: int  # row positions < extent were verified by this pass
    p: torch.Tensor  # (B, C, V) the target distributions


@torch.inference_mode()
def generate_ssd(
    backbone: ARImageBackbone,
    heads: SSDHeads,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: SSDDecodeConfig = SSDDecodeConfig(),
) -> GenerationResult:
    """Generate one image per condition with SSD row drafting and verification (see the module docstring)."""
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    state, first_state = backbone.prefill(condition, sampling.guided)  # (G, 1, H) predicts token 0
    drafter = SSDRowDrafter(backbone, heads, state, sampling, generator, config, first_state.device)
    batch, device = condition.batch_size, first_state.device
    run = SSDProgress(
        tokens=torch.empty(batch, rows * cols, dtype=torch.long, device=device),
        first_state=first_state,
        first_exact=torch.ones(batch, dtype=torch.bool, device=device),
    )
    relaxed = config.relax_k > 0 and config.relax_delta > 0 and not sampling.greedy
    neighbours = latent_neighbours(backbone.codebook_latents().to(device), config.relax_k) if relaxed else None
    for index in range(rows):
        row = _start_row(run, drafter, config, index)  # steps 1-2: the first token and the drafts
        while not _verify(run, row, drafter, config, state, neighbours):  # step 3: pass, test, correct
            pass
        _finish_row(run, row, config)
    return GenerationResult(
        run.tokens.view(batch, rows, cols),
        forward_passes=run.passes,
        drafted_tokens=run.drafted,
        accepted_tokens=run.accepted,
    )


def _start_row(run: SSDProgress, drafter: SSDRowDrafter, config: SSDDecodeConfig, index: int) -> SSDRow:
    """Steps 1-2: the row's drafts (or the ones lookahead verified already) and its verification state."""
    cols = drafter.cols
    hidden_above, tokens_above = run.above if run.above is not None else (None, None)
    above_prepared = drafter.prepare_above(hidden_above, tokens_above)
    handed_over = None
    if run.handed_over is not None:  # drafted and fed with the row above; verified without a new pass
        drafts, handed_over = run.handed_over
        run.handed_over = None
    else:
        drafts = drafter.draft_row(
            index, run.first_state, hidden_above, tokens_above, above_prepared, keep_states=config.lookahead
        )
    # A row handed over has its first token drafted too; otherwise the first token is final where its state was.
    committed = (
        torch.zeros_like(run.first_exact, dtype=torch.long) if handed_over is not None else run.first_exact.long()
    )
    template = run.first_state if run.first_state is not None else hidden_above  # dtype, device, hidden size
    states = template.new_zeros(template.shape[0], cols, template.shape[-1])
    if run.first_state is not None:
        states[:, 0] = run.first_state[:, 0]
    return SSDRow(index, index * cols, drafts, states, committed, above_prepared, handed_over)


def _verify(
    run: SSDProgress,
    row: SSDRow,
    drafter: SSDRowDrafter,
    config: SSDDecodeConfig,
    state: DecodeState,
    neighbours: torch.Tensor | None,
) -> bool:
    """One verification pass over the row and its verdict; True when the row is done."""
    out, start, feed_end, next_row = _feed(run, row, drafter, config, state)
    row.passes += 1
    row.fed = (out, start, feed_end)
    fresh, extent = write_block_states(row.states, out, start, row.start, feed_end)
    if fresh == 0:  # the previous row was re-fed: the first-token state is now exact
        run.first_state = row.states[:, :1]
    run.cache_valid = row.start
    verdict = _test_drafts(row, drafter, extent, neighbours)
    run.drafted += int((~verdict.is_committed & verdict.open_images[:, None]).sum())
    # Fed tokens left of every image's first rejection are final, and so are their cache entries.
    row.cached = max(row.cached, min(int(verdict.first_rejected.min()), feed_end - row.start))
    if config.mode == "exact" or config.correction == "prefix":
        return _commit_prefix(run, row, drafter, config, verdict, next_row, out, start)
    return _autocorrect_in_parallel(run, row, drafter, config, verdict)


def _feed(run: SSDProgress, row: SSDRow, drafter: SSDRowDrafter, config: SSDDecodeConfig, state: DecodeState):
    """The pass itself: (states, first fed position, end of the row's feed, the next row's drafts or None)."""
    cols = drafter.cols
    if row.handed_over is not None:  # the pass that fed this row with the row above
        out, row.handed_over = row.handed_over, None
        return out, row.start, row.start + cols, None
    # Feed from the first position whose cache entry is not final: re-feeding a finished prefix costs compute.
    start = run.cache_valid if run.cache_valid < row.start else row.start + row.cached
    feed_end = row.start + cols
    if config.window:  # exact or prefix only (SSDDecodeConfig refuses the rest)
        feed_end = min(feed_end, row.start + int(row.committed.min()) + config.window)
    next_row = None
    last_row = row.index == run.tokens.shape[1] // cols - 1
    if (
        config.lookahead
        and not last_row
        and feed_end == row.start + cols
        and drafter.lookahead_now(row.drafts, row.committed)
    ):
        next_row = drafter.draft_next_row(row.index, row.states, row.drafts, row.committed)
    out = verification_pass(
        drafter.backbone,
        state,
        run.tokens,
        start,
        row.start,
        row.drafts.tokens,
        feed_end,
        extra=next_row.tokens if next_row is not None else None,
    )
    run.passes += 1
    return out, start, feed_end, next_row


def _test_drafts(row: SSDRow, drafter: SSDRowDrafter, extent: int, neighbours: torch.Tensor | None) -> _Verdict:
    """Speculative sampling's test of every open draft the pass verified (LANTERN-relaxed with `neighbours`)."""
    cols, drafts = drafter.cols, row.drafts
    p = drafter.distribution(row.states)  # (B, C, V)
    p_of_draft = probability_of(p, drafts.tokens)
    if neighbours is not None:
        p_of_draft = p_of_draft + pooled_neighbour_mass(p, drafts.tokens, neighbours, drafter.config.relax_delta)
    uniform = torch.rand(p_of_draft.shape, generator=drafter.generator, device=p.device)
    passed = accept_drafts(p_of_draft, probability_of(drafts.q, drafts.tokens), uniform)
    is_committed = torch.arange(cols, device=p.device)[None] < row.committed[:, None]
    passed |= is_committed
    passed[:, extent:] &= is_committed[:, extent:]  # not verified yet: stop there without correcting
    return _Verdict(passed, first_true(~passed, cols), is_committed, row.committed < cols, extent, p)


def _commit_prefix(
    run: SSDProgress,
    row: SSDRow,
    drafter: SSDRowDrafter,
    config: SSDDecodeConfig,
    verdict: _Verdict,
    next_row: DraftedRow | None,
    out: torch.Tensor,
    start: int,
) -> bool:
    """Exact speculative sampling (and autocorrect's ``prefix``): keep each image's accepted prefix, draw its first
    rejection from the residual, re-draft what follows. True when the row is done."""
    cols, first_rejected, extent = drafter.cols, verdict.first_rejected, verdict.extent
    run.accepted += int(((first_rejected - row.committed).clamp(min=0) * verdict.open_images).sum())
    budget_spent = config.mode == "autocorrect" and row.passes > config.rounds
    rejected_images = torch.nonzero(first_rejected < extent)[:, 0]
    if len(rejected_images) == 0:
        row.committed = row.committed.clamp(min=extent)
        if bool((row.committed >= cols).all()):
            if next_row is not None:  # every image's row stands as fed: the next row's part is verified too
                run.handed_over = (next_row, out[:, row.start + cols - start :])
            return True
        return budget_spent
    position = first_rejected[rejected_images]
    drafts = row.drafts
    residual = residual_distribution(verdict.p[rejected_images, position], drafts.q[rejected_images, position])
    drafts.tokens[rejected_images, position] = drafter.sample(residual)
    row.committed = torch.where(first_rejected < extent, first_rejected + 1, row.committed.clamp(min=extent))
    if row.index == run.tokens.shape[1] // cols - 1 and bool((row.committed >= cols).all()):
        return True  # the image is complete; no next row needs the state after the correction
    exact_state = row.states[drafter.twin(rejected_images), position.repeat(drafter.twins)]
    # The rest of the row again, each position now seeing the correction to its left; once the budget is
    # spent ("prefix"), the re-drafted rest of the row stays unverified.
    drafter.redraft(drafts, row.index, rejected_images, position, exact_state, row.above_prepared, to_end=budget_spent)
    return budget_spent


def _autocorrect_in_parallel(
    run: SSDProgress, row: SSDRow, drafter: SSDRowDrafter, config: SSDDecodeConfig, verdict: _Verdict
) -> bool:
    """Autocorrect's ``target`` and ``residual``: resample every rejected position of the row in this pass, then
    re-verify the corrected row (at most ``rounds`` more passes). True when the row is done."""
    passed, cols = verdict.passed, drafter.cols
    still_open = verdict.open_images & ~passed.all(1)
    run.accepted += int((passed & ~verdict.is_committed & verdict.open_images[:, None]).sum())
    resample = ~passed & still_open[:, None]  # (B, C)
    if resample.any():
        corrections = autocorrect_distributions(
            verdict.p,
            row.drafts.q,
            resample,
            verdict.first_rejected,
            everywhere_residual=config.correction == "residual",
        )
        row.drafts.tokens[resample] = drafter.sample(corrections)
        row.drafts.q[resample] = corrections
    # Left of its first rejection an image's tokens passed against their final context: final.
    row.committed = torch.where(still_open, torch.maximum(row.committed, verdict.first_rejected), cols)
    return not still_open.any() or row.passes > config.rounds


def _finish_row(run: SSDProgress, row: SSDRow, config: SSDDecodeConfig) -> None:
    """Write the row into the image and set up the next one: where the cache is final, the next first state."""
    cols = row.drafts.tokens.shape[1]
    out, start, feed_end = row.fed
    run.tokens[:, row.start : row.start + cols] = row.drafts.tokens
    last_fed = feed_end == row.start + cols
    if not last_fed:  # windowed: the row's last token was never fed; the next row's first token is drafted
        run.first_exact = torch.zeros_like(run.first_exact)
        run.cache_valid = row.start + row.cached
    elif config.mode == "autocorrect" and not bool((row.committed >= cols).all()):
        # Only the images whose cache rows hold exactly their final row get an exact next first token; the
        # next pass re-feeds the rest of this row for everyone.
        run.first_exact = row.committed >= cols
        run.cache_valid = row.start + row.cached
    else:  # also after a lookahead pass: the next row is fed too, and starts with its first token to verify
        run.first_exact = torch.ones_like(run.first_exact)
        run.cache_valid = row.start + cols
    # The state after this row's last token (a lookahead pass fed the next row after it).
    run.first_state = out[:, row.start + cols - start - 1 : row.start + cols - start] if last_fed else None
    run.above = (row.states, row.drafts.tokens)


def _generate(backbone, heads, condition, sampling, generator, settings: SSDDecodeConfig) -> GenerationResult:
    return generate_ssd(backbone, heads, condition, sampling, generator, settings)


def _lossless(settings: SSDDecodeConfig) -> bool:
    return settings.mode == "exact" and not (settings.relax_k and settings.relax_delta)


METHOD = MethodSpec(
    generate=_generate, settings=SSDDecodeConfig, artefact="heads", artefact_kind="ssd", lossless=_lossless
)
