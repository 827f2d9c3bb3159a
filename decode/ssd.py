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
     into stripes when drafts are rejected densely; see the README's figures.
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

import math
from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition, DecodeState
from decode.relaxed import latent_neighbours, pooled_neighbour_mass
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_from, sample_with, token_distribution
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
    # LANTERN relaxation of the acceptance test (decode/relaxed.py): a draft also counts the target mass of its
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
            raise ValueError(f"SSD rounds, horizontal_steps, window and grid_steps must be >= 0, got {self.rounds}, "
                             f"{self.horizontal_steps}, {self.window}, {self.grid_steps}")
        if not 0 <= self.lookahead_confidence <= 1:
            raise ValueError(f"SSD lookahead_confidence must be in [0, 1], got {self.lookahead_confidence}")
        if self.lookahead and (self.window or (self.mode == "autocorrect" and self.correction != "prefix")):
            raise ValueError("decode.ssd.lookahead needs window 0 and mode exact or correction prefix (it extends a "
                             "pass that reaches the row's end)")
        if self.relax_k < 0 or self.relax_delta < 0:
            raise ValueError(f"SSD relax_k and relax_delta must be >= 0, got {self.relax_k}, {self.relax_delta}")
        if self.window and self.mode == "autocorrect" and self.correction != "prefix":
            raise ValueError("decode.ssd.window works with mode exact or correction prefix; set it to 0 for "
                             f"correction {self.correction!r}")


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; where p <= q everywhere (only by rounding), p itself."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


class _RowDrafter:
    """Drafting and target distributions for one generation: heads + backbone + sampling settings."""

    def __init__(self, backbone: ARImageBackbone, heads: SSDHeads, state: DecodeState, sampling: SamplingConfig,
                 generator: torch.Generator | None, device: torch.device):
        self.backbone, self.heads, self.state, self.sampling, self.generator = backbone, heads, state, sampling, generator
        self.twins = 2 if state.guided else 1
        grid = getattr(heads, "grid", None)
        # The grid head's share of every possible left token, looked up per drafted token (see prepare_left_tokens).
        self.left_token_share = None if grid is None else grid.prepare_left_tokens(
            backbone.embed_image_tokens(torch.arange(backbone.codebook_size, device=device)))
        self.grid_step = None if grid is None else grid.drafting_step()
        self.draft_scores = backbone.draft_scorer(state, sampling.cfg_scale)

    def twin(self, images: torch.Tensor) -> torch.Tensor:
        """Image indices (k,) -> their cache rows ([cond; uncond] under guidance)."""
        return torch.cat([images, images + self.state.batch_size]) if self.state.guided else images

    def distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of cache rows (G, T, H) -> token distributions of images (G / twins, T, V)."""
        return token_distribution(self.backbone.scores(self.state, hidden, self.sampling.cfg_scale), self.sampling)

    def draft_distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted states of cache rows (G, ..., H) -> the draft distributions of their images (G / twins, ..., V).

        `distribution` up to float rounding, in fewer kernels (the backbone's `draft_scorer`).
        """
        return token_distribution(self.draft_scores(hidden), self.sampling)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens of images (k, ...) -> embeddings for their cache rows (G, ..., H)."""
        embedded = self.backbone.embed_image_tokens(tokens)
        return torch.cat([embedded, embedded]) if self.state.guided else embedded

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return sample_from(probs, self.generator)

    def vertical(self, hidden_above: torch.Tensor, tokens_above: torch.Tensor):
        """Drafts for a whole row from the row above: (tokens (B, C), q (B, C, V), predicted states (G, C, H))."""
        states = self.heads.vertical(hidden_above, self.embed(tokens_above))
        q = self.draft_distribution(states)
        return self.sample(q), q, states

    def horizontal(self, row_tokens, row_q, images, positions, hidden, tokens, steps: int, row_states=None) -> None:
        """Re-draft `steps` positions after `positions` (one per image in `images`), in place.

        `hidden` (rows of `images`, H) predicts the token at `positions`, which is `tokens`.
        `row_states` (G, C, H), if given, receives the predicted states of the re-drafted positions.
        """
        self._chain(row_tokens, row_q, images, positions, hidden, tokens, steps,
                    lambda left, left_tokens, step: self.heads.horizontal(left, self.embed(left_tokens)), row_states)

    def along(self, row_tokens, row_q, images, positions, hidden, tokens, above_prepared, limit: int = 0,
              row_states=None) -> None:
        """Re-draft the positions after `positions` to the row's end (at most `limit`, 0: all) with the grid head.

        Each position is drafted from the row above (`above_prepared`: the grid
        head's `prepare_above` of the whole row, (G, C, width)) and the state and
        token to its left, the left ones drafted the step before (exact at
        `positions`: `hidden` (rows of `images`, H) predicts the token there, `tokens`).
        """
        cols = row_tokens.shape[1]
        steps = min(limit or cols, cols - 1 - int(positions.min()))
        if steps <= 0:
            return
        # Each step reads one column of the prepared row per cache row: gather those columns once.
        columns = (positions[:, None] + torch.arange(1, steps + 1, device=positions.device)).clamp(max=cols - 1)
        above = above_prepared[self.twin(images)[:, None], columns.repeat(self.twins, 1)]  # (rows, steps, width)
        share, grid_step, twins = self.left_token_share, self.grid_step, self.twins

        def predict(left, left_tokens, step):
            return grid_step(above[:, step], left, share[left_tokens].repeat(twins, 1))

        self._chain(row_tokens, row_q, images, positions, hidden, tokens, steps, predict, row_states)

    def prepare_above(self, hidden_above: torch.Tensor, tokens_above: torch.Tensor) -> torch.Tensor:
        """The grid head's share of the row above, once per row: (G, C, H), (B, C) -> (G, C, width)."""
        return self.heads.grid.prepare_above(hidden_above, self.embed(tokens_above))

    def _chain(self, row_tokens, row_q, images, positions, hidden, tokens, steps: int, predict, row_states=None) -> None:
        """Draft up to `steps` positions one after another to the right of `positions`, each from the one before.

        `predict(left state, left tokens, step)` gives the states `step + 1` positions right of `positions`.
        Drafts past the row's end (images whose `positions` are further right) are computed and dropped.
        """
        cols = row_tokens.shape[1]
        steps = min(steps, cols - 1 - int(positions.min()))
        if steps <= 0:
            return
        uniforms = torch.rand(steps, len(images), generator=self.generator, device=row_tokens.device)
        drafted_tokens, drafted_q, drafted_states = [], [], []
        for step in range(steps):
            hidden = predict(hidden, tokens, step)  # (rows, H)
            q = self.draft_distribution(hidden)  # (k, V)
            tokens = sample_with(q, uniforms[step])
            drafted_tokens.append(tokens)
            drafted_q.append(q)
            drafted_states.append(hidden)
        # One write for the whole chain: indexed writes cost as much as a drafting step's kernels.
        columns = positions[:, None] + torch.arange(1, steps + 1, device=positions.device)  # (k, steps)
        chain_tokens, chain_q = torch.stack(drafted_tokens, 1), torch.stack(drafted_q, 1)
        image_rows = images[:, None].expand_as(columns)
        inside = columns < cols if steps > cols - 1 - int(positions.max()) else None  # None: no image ran past the end
        if row_states is not None:
            twin_columns = columns.repeat(self.twins, 1)
            state_rows, chain_states = self.twin(images)[:, None].expand_as(twin_columns), torch.stack(drafted_states, 1)
            if inside is not None:
                twin_inside = inside.repeat(self.twins, 1)
                state_rows, twin_columns, chain_states = state_rows[twin_inside], twin_columns[twin_inside], chain_states[twin_inside]
            row_states[state_rows, twin_columns] = chain_states
        if inside is not None:
            image_rows, columns, chain_tokens, chain_q = image_rows[inside], columns[inside], chain_tokens[inside], chain_q[inside]
        row_tokens[image_rows, columns] = chain_tokens
        row_q[image_rows, columns] = chain_q


def _horizontal_steps(config: SSDDecodeConfig, row: int, cols: int) -> int:
    """Positions the horizontal head drafts after a token the backbone gave: row 0 has nothing above."""
    return cols - 1 if row == 0 else config.horizontal_steps


def _draft_row(drafter: "_RowDrafter", config: SSDDecodeConfig, row: int, h_first, hidden_above, tokens_above,
               above_prepared, grid_limit: int, state_template: torch.Tensor, batch: int, cols: int, keep_states: bool):
    """Steps 1-2 for one row: its first token from the backbone where its state is known, drafts for the rest.

    Returns tokens (B, C), their draft distributions q (B, C, V) and, with `keep_states`, the heads' predicted
    states (G, C, H) (the exact state at position 0), else None.
    """
    device = state_template.device
    row_tokens = torch.empty(batch, cols, dtype=torch.long, device=device)
    row_q = torch.zeros(batch, cols, drafter.backbone.codebook_size, device=device)
    row_states = state_template.new_zeros(state_template.shape[0], cols, state_template.shape[-1]) if keep_states else None
    if row > 0:
        row_tokens[:], row_q[:], states = drafter.vertical(hidden_above, tokens_above)
        if keep_states:
            row_states[:] = states
    if h_first is not None:  # None: the row above ended unfed (window); its vertical draft stands
        row_q[:, 0] = drafter.distribution(h_first)[:, 0]
        row_tokens[:, 0] = drafter.sample(row_q[:, 0])
        if keep_states:
            row_states[:, 0] = h_first[:, 0]
        _draft_after_first(drafter, config, row, row_tokens, row_q, h_first[:, 0], above_prepared, grid_limit,
                           row_states)
    return row_tokens, row_q, row_states


def _draft_after_first(drafter: "_RowDrafter", config: SSDDecodeConfig, row: int, row_tokens, row_q, first_state,
                       above_prepared, grid_limit: int, row_states) -> None:
    """Re-draft a row along from its first token (state `first_state` (G, H)), in place: with the grid head
    when `above_prepared` is given (up to `grid_limit`), else with the horizontal head; the rest keeps its
    vertical drafts."""
    every_image = torch.arange(row_tokens.shape[0], device=row_tokens.device)
    first = torch.zeros_like(every_image)
    if above_prepared is not None:
        drafter.along(row_tokens, row_q, every_image, first, first_state, row_tokens[:, 0], above_prepared,
                      grid_limit, row_states)
    else:
        drafter.horizontal(row_tokens, row_q, every_image, first, first_state, row_tokens[:, 0],
                           _horizontal_steps(config, row, row_tokens.shape[1]), row_states)


def _likely_complete(row_tokens: torch.Tensor, row_q: torch.Tensor, committed: torch.Tensor, threshold: float) -> bool:
    """Whether every image's open drafts have a product of own probabilities q(x) >= `threshold` (0: always)."""
    if threshold <= 0:
        return True
    draft_probability = row_q.gather(-1, row_tokens[..., None])[..., 0]  # (B, C)
    is_open = torch.arange(row_tokens.shape[1], device=row_tokens.device)[None] >= committed[:, None]
    log_product = torch.where(is_open, draft_probability.clamp(min=1e-30).log(), 0.0).sum(1)
    return bool((log_product >= math.log(threshold)).all())


def _draft_next_row(drafter: "_RowDrafter", config: SSDDecodeConfig, row: int, row_hidden, row_states, row_tokens,
                    committed, grid_limit: int):
    """Row `row + 1`'s drafts before row `row` is verified: (tokens, q, predicted states).

    The row above is this row as it stands: exact states left of each image's first open position (their
    context is final), the heads' predictions from there on. The next row's first token is a draft too
    (vertical head), verified like the rest once the pass gives its state.
    """
    cols = row_tokens.shape[1]
    known = torch.arange(cols, device=row_tokens.device)[None] < committed.repeat(drafter.twins)[:, None]  # (G, C)
    above = torch.where(known[..., None], row_hidden, row_states)
    next_tokens, next_q, next_states = drafter.vertical(above, row_tokens)
    above_prepared = drafter.prepare_above(above, row_tokens) if getattr(drafter.heads, "grid", None) is not None else None
    _draft_after_first(drafter, config, row + 1, next_tokens, next_q, next_states[:, 0], above_prepared, grid_limit,
                       next_states)
    return next_tokens, next_q, next_states


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
    state, h_first = backbone.prefill(condition, sampling.guided)  # h_first: (G, 1, H) predicts the row's first token
    drafter = _RowDrafter(backbone, heads, state, sampling, generator, h_first.device)
    batch, device = condition.batch_size, h_first.device
    tokens = torch.empty(batch, rows * cols, dtype=torch.long, device=device)
    passes, drafted, accepted = 1, 0, 0  # the prefill is a pass
    cache_valid = 0  # grid tokens whose cached keys/values belong to the committed tokens of every image
    first_exact = torch.ones(batch, dtype=torch.bool, device=device)  # h_first came from the committed context
    hidden_above = tokens_above = None
    state_template = h_first  # (G, 1, H): shape and dtype of the states, kept while h_first may be None
    relaxed = config.relax_k > 0 and config.relax_delta > 0 and not sampling.greedy
    neighbours = latent_neighbours(backbone.codebook_latents().to(device), config.relax_k) if relaxed else None

    # Grid re-drafts stop after `grid_steps`, and after `window` (a pass verifies no further; drafts beyond can
    # wait for the correction after it).
    grid_limit = min(limit for limit in (config.window, config.grid_steps, cols) if limit)

    lookahead = None  # set by a pass that completed its row: the next row's drafts and that pass's states for them
    for row in range(rows):
        row_start = row * cols
        grid = getattr(heads, "grid", None) is not None and row > 0  # draft along the row: above + left
        above_prepared = drafter.prepare_above(hidden_above, tokens_above) if grid else None
        if lookahead is not None:  # drafted and fed with the row above; verified below without a new pass
            row_tokens, row_q, row_states, lookahead_out = lookahead
            lookahead = None
        else:
            row_tokens, row_q, row_states = _draft_row(drafter, config, row, h_first, hidden_above, tokens_above,
                                                       above_prepared, grid_limit, state_template, batch, cols,
                                                       keep_states=config.lookahead)
            lookahead_out = None
        committed = torch.zeros_like(first_exact, dtype=torch.long) if lookahead_out is not None else first_exact.long()
        # committed: (B,) positions of this row already final
        row_hidden = state_template.new_zeros(state_template.shape[0], cols, state_template.shape[-1])
        if h_first is not None:
            row_hidden[:, 0] = h_first[:, 0]  # row_hidden[:, i] predicts position i
        row_cached = 0  # positions of this row whose cached keys/values are final for every image
        verify_passes = 0

        # 3. Verify until the row is complete (exact) or the rounds are spent (autocorrect).
        while True:
            next_row = None  # the next row's drafts, when this pass verifies them too
            if lookahead_out is not None:  # the pass that fed this row with the row above
                out, start, feed_end, lookahead_out = lookahead_out, row_start, row_start + cols, None
            else:
                # Feed from the first position whose cache entry is not final: re-feeding a finished prefix
                # would cost compute and change nothing.
                start = cache_valid if cache_valid < row_start else row_start + row_cached
                backbone.rollback(state, start)
                feed_end = row_start + cols  # grid positions [start, feed_end) are fed
                if config.window:  # exact or prefix only (SSDDecodeConfig refuses the rest)
                    feed_end = min(feed_end, row_start + int(committed.min()) + config.window)
                feed = [tokens[:, start:row_start], row_tokens[:, max(0, start - row_start) : feed_end - row_start]]
                if (config.lookahead and row < rows - 1 and feed_end == row_start + cols
                        and _likely_complete(row_tokens, row_q, committed, config.lookahead_confidence)):
                    next_row = _draft_next_row(drafter, config, row, row_hidden, row_states, row_tokens, committed,
                                               grid_limit)
                    feed.append(next_row[0])
                out = backbone.step(state, torch.cat(feed, dim=1))  # out[:, j] predicts grid position start + j + 1
                passes += 1
            verify_passes += 1
            first_fresh = max(row_start, start + 1)  # the first row position whose state this pass gives
            fresh = first_fresh - row_start
            extent = min(cols, feed_end - row_start + 1)  # row positions < extent are verified by this pass
            row_hidden[:, fresh:extent] = out[:, first_fresh - start - 1 : first_fresh - start - 1 + extent - fresh]
            if fresh == 0:  # the previous row was re-fed: the first-token state is now exact
                h_first = row_hidden[:, :1]
            cache_valid = row_start
            p = drafter.distribution(row_hidden)  # (B, C, V)
            px = p.gather(-1, row_tokens[..., None])[..., 0]
            if neighbours is not None:
                px = px + pooled_neighbour_mass(p, row_tokens, neighbours, config.relax_delta)
            qx = row_q.gather(-1, row_tokens[..., None])[..., 0]
            uniform = torch.rand(px.shape, generator=generator, device=device)
            passed = uniform * qx < px  # accept with probability min(1, p/q)
            is_committed = torch.arange(cols, device=device)[None] < committed[:, None]
            passed |= is_committed
            passed[:, extent:] &= is_committed[:, extent:]  # not verified yet: stop there without correcting
            open_images = committed < cols
            drafted += int((~is_committed & open_images[:, None]).sum())
            first_rejected = torch.where(passed.all(1), cols, (~passed).float().argmax(1))  # (B,)
            # Fed tokens left of every image's first rejection are final, and so are their cache entries.
            row_cached = max(row_cached, min(int(first_rejected.min()), feed_end - row_start))

            if config.mode == "exact" or config.correction == "prefix":
                accepted += int(((first_rejected - committed).clamp(min=0) * open_images).sum())
                rejected_images = torch.nonzero(first_rejected < extent)[:, 0]
                if len(rejected_images) == 0:
                    committed = committed.clamp(min=extent)
                    if bool((committed >= cols).all()):
                        if next_row is not None:  # every image's row stands as fed: the next row's part is valid
                            lookahead = (*next_row, out[:, row_start + cols - start :])
                        break
                    if config.mode == "autocorrect" and verify_passes > config.rounds:
                        break
                    continue
                position = first_rejected[rejected_images]
                residual = residual_distribution(p[rejected_images, position], row_q[rejected_images, position])
                row_tokens[rejected_images, position] = drafter.sample(residual)
                committed = torch.where(first_rejected < extent, first_rejected + 1, committed.clamp(min=extent))
                if row == rows - 1 and bool((committed >= cols).all()):
                    break  # the image is complete; no next row needs the state after the correction
                exact_state = row_hidden[drafter.twin(rejected_images), position.repeat(1 + state.guided)]
                budget_spent = config.mode == "autocorrect" and verify_passes > config.rounds
                if grid:  # the rest of the row again, each position now seeing the correction to its left
                    drafter.along(row_tokens, row_q, rejected_images, position, exact_state,
                                  row_tokens[rejected_images, position], above_prepared,
                                  0 if budget_spent else grid_limit, row_states)
                else:
                    drafter.horizontal(row_tokens, row_q, rejected_images, position, exact_state,
                                       row_tokens[rejected_images, position], _horizontal_steps(config, row, cols),
                                       row_states)
                if budget_spent:
                    break  # budget spent ("prefix" correction): the re-drafted rest of the row stays unverified
            else:
                still_open = open_images & ~passed.all(1)
                accepted += int((passed & ~is_committed & open_images[:, None]).sum())
                resample = ~passed & still_open[:, None]  # (B, C)
                if resample.any():
                    # At an image's first rejection the context is final: the residual is the exact
                    # correction. Further right the context holds rejected drafts; there the
                    # correction is drawn from p itself ("target") or, as the paper words it, from
                    # the residual too ("residual", which excludes the draft's mass and, with weak
                    # drafts, turns rejections into anti-correlated noise).
                    exact_context = torch.arange(cols, device=device)[None] == first_rejected[:, None]
                    use_residual = resample & (exact_context | (config.correction == "residual"))
                    correction = p.clone()
                    correction[use_residual] = residual_distribution(p[use_residual], row_q[use_residual])
                    row_tokens[resample] = drafter.sample(correction[resample])
                    row_q[resample] = correction[resample]
                # Left of its first rejection an image's tokens passed against their final context: final.
                committed = torch.where(still_open, torch.maximum(committed, first_rejected), cols)
                if not still_open.any() or verify_passes > config.rounds:
                    break

        tokens[:, row_start : row_start + cols] = row_tokens
        # Which images' cache rows now hold exactly their final row (autocorrect may have resampled after the pass).
        fed_is_final = committed >= cols
        last_fed = feed_end == row_start + cols
        if not last_fed:  # windowed: the row's last token was never fed; the next row's first token is drafted
            first_exact = torch.zeros_like(first_exact)
            cache_valid = row_start + row_cached
        elif config.mode == "autocorrect" and not bool(fed_is_final.all()):
            first_exact = fed_is_final  # their next first token is exact; the others are drafted and re-checked
            cache_valid = row_start + row_cached  # the next pass re-feeds the rest of this row for everyone
        else:  # also after a lookahead pass: the next row is fed too, and starts with its first token to verify
            first_exact = torch.ones_like(first_exact)
            cache_valid = row_start + cols
        # The state after this row's last token (a lookahead pass fed the next row after it).
        h_first = out[:, row_start + cols - start - 1 : row_start + cols - start] if last_fed else None
        hidden_above, tokens_above = row_hidden, row_tokens

    return GenerationResult(tokens.view(batch, rows, cols), forward_passes=passes, drafted_tokens=drafted,
                            accepted_tokens=accepted)
