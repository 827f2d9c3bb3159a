"""SSD's drafter: a row's drafts from the latent heads, and re-drafts after each correction.

The heads (heads/ssd.py) predict the backbone's pre-norm hidden state at a
spatial offset; a draft token is drawn from the backbone's frozen final norm and
head applied to that prediction, guided like the baseline. Three ways to draft,
all here so that decode/ssd.py only verifies:

- vertical: a whole row at once from the row above (its states and tokens);
- horizontal: a chain to the right of a token the backbone gave, each position
  from the one before (row 0 has nothing above, so it is a chain end to end);
- grid (heads with ``head.grid``): a chain along the row, each position from the
  row above (prepared once per row) and the state drafted to its left; after a
  correction it re-drafts ``grid_steps`` positions (0: to the row's end).

Lookahead drafts the next row before this one is verified, from this row as it
stands (`draft_next_row`, `lookahead_now`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, DecodeState
from decode.sampling import SamplingConfig, sample_from, sample_with, token_distribution
from heads.ssd import SSDHeads

# uniforms(steps) -> (steps, images): the uniforms of a chain's draws, where a caller keys them itself
UniformSource = Callable[[int], torch.Tensor]


@dataclass
class DraftedRow:
    """A row's drafts: tokens (B, C), the distribution each was drawn from q (B, C, V), and, when lookahead
    needs them, the heads' predicted states (G, C, H) (exact at position 0 once the backbone gave it)."""

    tokens: torch.Tensor
    q: torch.Tensor
    predicted: torch.Tensor | None = None


class SSDRowDrafter:
    """Drafts for one generation: heads + backbone + sampling settings + the drafting settings of SSDDecodeConfig.

    `G` below is the number of cache rows: ``2 * B`` under guidance ([cond; uncond]), else ``B``.
    """

    def __init__(
        self,
        backbone: ARImageBackbone,
        heads: SSDHeads,
        state: DecodeState,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        config,
        device: torch.device,
    ):
        self.backbone, self.heads, self.state, self.sampling, self.generator = (
            backbone,
            heads,
            state,
            sampling,
            generator,
        )
        self.config, self.cols = config, backbone.geometry.cols
        self.twins = 2 if state.guided else 1
        grid = getattr(heads, "grid", None)
        self.has_grid = grid is not None
        # The grid head's share of every possible left token, looked up per drafted token (see prepare_left_tokens).
        self.left_token_share = (
            None
            if grid is None
            else grid.prepare_left_tokens(
                backbone.embed_image_tokens(torch.arange(backbone.codebook_size, device=device))
            )
        )
        self.grid_step = None if grid is None else grid.drafting_step()
        self.draft_scores = backbone.draft_scorer(state, sampling.cfg_scale)
        # Grid re-drafts stop after `grid_steps`, and after `window` (a pass verifies no further; drafts beyond
        # can wait for the correction after it).
        self.grid_limit = min(limit for limit in (config.window, config.grid_steps, self.cols) if limit)

    # ---- distributions -------------------------------------------------------------------------------

    def twin(self, images: torch.Tensor) -> torch.Tensor:
        """Image indices (k,) -> their cache rows ([cond; uncond] under guidance)."""
        return self.state.rows_of(images)

    def distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of cache rows (G, T, H) -> token distributions of images (B, T, V): the target p."""
        return token_distribution(self.backbone.scores(self.state, hidden, self.sampling.cfg_scale), self.sampling)

    def draft_distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted states (G, ..., H) -> draft distributions (B, ..., V): `distribution` up to float rounding,
        in fewer kernels (the backbone's `draft_scorer`)."""
        return token_distribution(self.draft_scores(hidden), self.sampling)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens of images (k, ...) -> embeddings for their cache rows (G, ..., H)."""
        embedded = self.backbone.embed_image_tokens(tokens)
        return torch.cat([embedded, embedded]) if self.state.guided else embedded

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return sample_from(probs, self.generator)

    # ---- whole rows ----------------------------------------------------------------------------------

    def prepare_above(
        self, hidden_above: torch.Tensor | None, tokens_above: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The grid head's share of the row above, once per row: (G, C, H), (B, C) -> (G, C, width); None
        without a grid head or above row 0 (then rows are drafted vertically and horizontally)."""
        if not self.has_grid or hidden_above is None:
            return None
        return self.heads.grid.prepare_above(hidden_above, self.embed(tokens_above))

    def vertical(
        self, hidden_above: torch.Tensor, tokens_above: torch.Tensor, uniforms: torch.Tensor | None = None
    ) -> DraftedRow:
        """Drafts for a whole row from the row above (states (G, C, H), tokens (B, C)); `uniforms` (B, C): the
        draws' uniforms (default: from the generator)."""
        states = self.heads.vertical(hidden_above, self.embed(tokens_above))
        q = self.draft_distribution(states)
        return DraftedRow(self.sample(q) if uniforms is None else sample_with(q, uniforms), q, states)

    def draft_row(
        self, row: int, first_state: torch.Tensor | None, hidden_above, tokens_above, above_prepared, keep_states: bool
    ) -> DraftedRow:
        """A row's first token from the backbone where its state `first_state` (G, 1, H) is known, drafts for the rest.

        `first_state` is None when the row above ended unfed (window): its vertical draft stands. With
        `keep_states` the heads' predicted states are kept (lookahead drafts the next row from them).
        """
        template = first_state if first_state is not None else hidden_above  # dtype, device, hidden size
        batch, device = self.state.batch_size, template.device
        drafted = DraftedRow(
            torch.empty(batch, self.cols, dtype=torch.long, device=device),
            torch.zeros(batch, self.cols, self.backbone.codebook_size, device=device),
        )
        if keep_states:
            drafted.predicted = template.new_zeros(self.state.cache_rows, self.cols, template.shape[-1])
        if row > 0:
            vertical = self.vertical(hidden_above, tokens_above)
            drafted.tokens[:], drafted.q[:] = vertical.tokens, vertical.q
            if keep_states:
                drafted.predicted[:] = vertical.predicted
        if first_state is not None:
            drafted.q[:, 0] = self.distribution(first_state)[:, 0]
            drafted.tokens[:, 0] = self.sample(drafted.q[:, 0])
            if keep_states:
                drafted.predicted[:, 0] = first_state[:, 0]
            self.draft_after_first(drafted, row, first_state[:, 0], above_prepared)
        return drafted

    def draft_after_first(self, drafted: DraftedRow, row: int, first_state: torch.Tensor, above_prepared) -> None:
        """Re-draft a row along from its first token (state (G, H)), in place: with the grid head when
        `above_prepared` is given (up to `grid_limit`), else with the horizontal head."""
        every_image = torch.arange(drafted.tokens.shape[0], device=drafted.tokens.device)
        self.redraft(drafted, row, every_image, torch.zeros_like(every_image), first_state, above_prepared)

    def redraft(
        self,
        drafted: DraftedRow,
        row: int,
        images: torch.Tensor,
        positions: torch.Tensor,
        exact_state: torch.Tensor,
        above_prepared,
        to_end: bool = False,
        uniforms: UniformSource | None = None,
    ) -> None:
        """After the backbone gave the tokens at `positions` (one per image in `images`), re-draft what follows.

        `exact_state` (rows of `images`, H) predicted those tokens. The grid head re-drafts `grid_limit`
        positions (all of them with `to_end`), the horizontal head `horizontal_steps` (the whole row in row 0).
        `uniforms(steps)` gives the chain's uniforms (steps, images) (default: drawn from the generator).
        """
        given = drafted.tokens[images, positions]
        if above_prepared is not None:
            limit = 0 if to_end else self.grid_limit
            self.along(drafted, images, positions, exact_state, given, above_prepared, limit, uniforms)
        else:
            steps = self.cols - 1 if row == 0 else self.config.horizontal_steps
            self.horizontal(drafted, images, positions, exact_state, given, steps, uniforms)

    # ---- chains along the row ------------------------------------------------------------------------

    def horizontal(self, drafted: DraftedRow, images, positions, hidden, tokens, steps: int, uniforms=None) -> None:
        """Re-draft `steps` positions after `positions` with the horizontal head, in place."""
        self._chain(
            drafted,
            images,
            positions,
            hidden,
            tokens,
            steps,
            lambda left, left_tokens, step: self.heads.horizontal(left, self.embed(left_tokens)),
            uniforms,
        )

    def along(
        self, drafted: DraftedRow, images, positions, hidden, tokens, above_prepared, limit: int = 0, uniforms=None
    ) -> None:
        """Re-draft the positions after `positions` to the row's end (at most `limit`, 0: all) with the grid head.

        Each position is drafted from the row above (`above_prepared`, (G, C, width)) and the state and token
        to its left, the left ones drafted the step before (exact at `positions`: `hidden`, `tokens`).
        """
        steps = min(limit or self.cols, self.cols - 1 - int(positions.min()))
        if steps <= 0:
            return
        # Each step reads one column of the prepared row per cache row: gather those columns once.
        columns = (positions[:, None] + torch.arange(1, steps + 1, device=positions.device)).clamp(max=self.cols - 1)
        above = above_prepared[self.twin(images)[:, None], columns.repeat(self.twins, 1)]  # (rows, steps, width)
        share, grid_step, twins = self.left_token_share, self.grid_step, self.twins

        def predict(left, left_tokens, step):
            return grid_step(above[:, step], left, share[left_tokens].repeat(twins, 1))

        self._chain(drafted, images, positions, hidden, tokens, steps, predict, uniforms)

    def _chain(
        self,
        drafted: DraftedRow,
        images,
        positions,
        hidden,
        tokens,
        steps: int,
        predict: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
        uniforms: UniformSource | None = None,
    ) -> None:
        """Draft up to `steps` positions one after another right of `positions`, each from the one before.

        `predict(left state, left tokens, step)` gives the states `step + 1` positions right of `positions`.
        Drafts past the row's end (images whose `positions` are further right) are computed and dropped.
        """
        cols = self.cols
        steps = min(steps, cols - 1 - int(positions.min()))
        if steps <= 0:
            return
        # One uniform per step and image, drawn up front: each step's draft is an independent draw from its q.
        if uniforms is None:
            uniforms = torch.rand(steps, len(images), generator=self.generator, device=drafted.tokens.device)
        else:
            uniforms = uniforms(steps)
        chain_tokens, chain_q, chain_states = [], [], []
        for step in range(steps):
            hidden = predict(hidden, tokens, step)  # (rows, H)
            q = self.draft_distribution(hidden)  # (k, V)
            tokens = sample_with(q, uniforms[step])
            chain_tokens.append(tokens)
            chain_q.append(q)
            chain_states.append(hidden)
        self._write_chain(
            drafted,
            images,
            positions,
            torch.stack(chain_tokens, 1),
            torch.stack(chain_q, 1),
            torch.stack(chain_states, 1),
        )

    def _write_chain(self, drafted: DraftedRow, images, positions, tokens, q, states) -> None:
        """Write a chain (k, steps, ...) right of `positions` into the row in one indexed write per tensor
        (indexed writes cost as much as a drafting step's kernels), dropping what falls past the row's end."""
        steps = tokens.shape[1]
        columns = positions[:, None] + torch.arange(1, steps + 1, device=positions.device)  # (k, steps)
        image_rows = images[:, None].expand_as(columns)
        overflow = steps > self.cols - 1 - int(positions.max())
        inside = columns < self.cols if overflow else None  # None: no image ran past the end
        if drafted.predicted is not None:
            twin_columns = columns.repeat(self.twins, 1)
            state_rows = self.twin(images)[:, None].expand_as(twin_columns)
            if inside is not None:
                twin_inside = inside.repeat(self.twins, 1)
                state_rows, twin_columns, states = (
                    state_rows[twin_inside],
                    twin_columns[twin_inside],
                    states[twin_inside],
                )
            drafted.predicted[state_rows, twin_columns] = states
        if inside is not None:
            image_rows, columns, tokens, q = image_rows[inside], columns[inside], tokens[inside], q[inside]
        drafted.tokens[image_rows, columns] = tokens
        drafted.q[image_rows, columns] = q

    # ---- lookahead -----------------------------------------------------------------------------------

    def lookahead_now(self, drafted: DraftedRow, committed: torch.Tensor) -> bool:
        """Whether a pass that reaches the row's end should verify the next row too: every image's open drafts
        have a product of their own probabilities q(x) >= `lookahead_confidence` (0: always)."""
        threshold = self.config.lookahead_confidence
        if threshold <= 0:
            return True
        draft_probability = drafted.q.gather(-1, drafted.tokens[..., None])[..., 0]  # (B, C)
        is_open = torch.arange(self.cols, device=committed.device)[None] >= committed[:, None]
        log_product = torch.where(is_open, draft_probability.clamp(min=1e-30).log(), 0.0).sum(1)
        return bool((log_product >= math.log(threshold)).all())

    def draft_next_row(
        self, row: int, row_states: torch.Tensor, drafted: DraftedRow, committed: torch.Tensor
    ) -> DraftedRow:
        """Row `row + 1`'s drafts before row `row` is verified.

        The row above is this row as it stands: exact states (`row_states`, (G, C, H)) left of each image's
        first open position (their context is final), the heads' predictions from there on. The next row's
        first token is a draft too (vertical head), verified like the rest once the pass gives its state.
        """
        known = torch.arange(self.cols, device=committed.device)[None] < committed.repeat(self.twins)[:, None]  # (G, C)
        above = torch.where(known[..., None], row_states, drafted.predicted)
        next_row = self.vertical(above, drafted.tokens)
        self.draft_after_first(next_row, row + 1, next_row.predicted[:, 0], self.prepare_above(above, drafted.tokens))
        return next_row
