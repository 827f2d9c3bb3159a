"""SSD with token trees: the heads' drafts of a row as a tree, verified in one pass (lossless).

Lossless SSD (decode/ssd.py) verifies one candidate per position: the first
rejection ends what a pass gives, and a row costs 1 + (its rejections) passes.
Here each pass verifies a tree of candidates drawn from the same heads:

1. The root is the token the backbone gave last (drawn from its own state, so
   always right; not in the cache yet). The tree grows right of it along the
   root's row, never past the row's end: the grid head (rows below the first;
   heads without one: the horizontal head) predicts the state of the next
   position from the state and token of a node and the row above (exact,
   finished), and the node's children are the `top_k` most likely tokens
   there. Which nodes are expanded and kept is EAGLE-2's rule
   (decode/draft_tree.py, `grow_tree`): the highest joint draft confidence,
   `beam` expansions per depth, `nodes` nodes per pass. With ``top_k = 1`` the
   tree is lossless SSD's grid chain.
2. One backbone pass (`ARImageBackbone.step_tree`) gives the target after every
   node: each node sees the image so far and its own ancestors, at the position
   and 2D layout a single candidate gets there.
3. `walk_tree` accepts a path by multi-candidate speculative sampling and draws
   the token after it (the next root); the cache keeps the path only
   (`keep_tree_path`). A pass that reaches the row's end gives the next row's
   first token, so a row costs one pass when every rejection in it was covered
   by a sibling the target accepts.

Lookahead (``lookahead = n``): a tree whose nodes reach the row's last column
grows on `n` positions into the next row. For each expanded node at the last
column, the row as that node's path has it (exact states and tokens up to the
root, the heads' predicted states and the path's tokens after it) is the row
above of the next row: the vertical head drafts the next row's first position
from it and the grid head (heads without one: the horizontal head) the rest,
as lossless SSD's lookahead drafts a row ahead (decode/ssd_drafting.py,
`draft_next_row`), but per path. Where the walk accepts a whole row, the same
pass verifies the next row's first tokens instead of ending at the row's
last token. Lossless either way: it only changes which candidates a tree holds.

Exactness: the candidates are deterministic given the drafts (point
proposals), and every token of a path has the backbone's distribution given
the path before it (decode/draft_tree.py), so greedy output is greedy AR's token
for token and sampled output has the backbone's distribution.

Batching: the batch shares one tree shape per pass (nodes ranked by the mean
confidence over images) and one cache length, so every image advances by the
shortest accepted path of the batch; the longer paths' extra tokens are
dropped and re-verified (exact: the cut is a stopping time of each image's own
sequence of exact draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.draft_tree import TreeShape
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig
from decode.ssd_drafting import SSDRowDrafter
from decode.tree_decoding import generate_by_trees
from heads.ssd import SSDHeads


@dataclass(frozen=True)
class SSDTreeConfig:
    """How large a tree each pass verifies (EAGLE-2's total_token / top_k, along SSD's rows)."""

    nodes: int = 64  # tree nodes per pass, the root included
    top_k: int = 2  # candidates per expanded node
    beam: int = 8  # nodes expanded per position along the row
    depth: int = 0  # positions drafted right of the root (0: to the row's end)
    # "sampled": candidates drawn without replacement from the heads' draft distribution, so the first one is
    # lossless SSD's draft; "top_k": the heads' most likely tokens as point proposals (EAGLE-2's candidates)
    draws: str = "sampled"
    # How nodes are ranked: "calibrated" (the acceptance rate measured so far in this image per sibling rank and
    # draft-probability bin, decode/draft_tree.py's AcceptanceModel) or "draft" (EAGLE-2: the draft's probability)
    confidence: str = "calibrated"
    # "fixed": every pass verifies `nodes`; "cost": at most `nodes`, only those whose expected tokens pay for
    # their place in the pass at this machine's measured pass cost (decode/tree_budget.py; not the authors')
    budget: str = "fixed"
    # Positions of the next row a tree may hold past its root's row end (drafted per path from the row as the
    # path has it; 0: trees end at the row's end)
    lookahead: int = 0

    def __post_init__(self):
        if self.depth < 0:
            raise ValueError(f"ssd_tree depth must be >= 0 (0: to the row's end), got {self.depth}")
        if self.lookahead < 0:
            raise ValueError(f"ssd_tree lookahead must be >= 0 (0: trees end at the row's end), got {self.lookahead}")
        TreeShape(self.nodes, self.depth, self.top_k, self.beam, self.draws)  # the other checks
        if self.confidence not in ("calibrated", "draft"):
            raise ValueError(f"ssd_tree confidence must be 'calibrated' or 'draft', got {self.confidence!r}")
        if self.budget not in ("fixed", "cost"):
            raise ValueError(f"ssd_tree budget must be 'fixed' or 'cost', got {self.budget!r}")


def generate_ssd_tree(
    backbone: ARImageBackbone,
    heads: SSDHeads,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: SSDTreeConfig = SSDTreeConfig(),
) -> GenerationResult:
    """Generate one image per condition by SSD token trees (see the module docstring)."""
    return generate_by_trees(
        backbone, condition, sampling, generator, lambda state: SSDTreeDrafter(backbone, heads, state, sampling, config)
    )


class SSDTreeDrafter:
    """SSD's heads as a `TreeDrafter`: trees along the root's row, drafted by the grid head from the finished row
    above (heads without one, and row 0: the horizontal head)."""

    def __init__(self, backbone: ARImageBackbone, heads: SSDHeads, state, sampling: SamplingConfig, config):
        device = next(heads.parameters()).device
        # SSD's row drafter supplies the heads' shared pieces (guided draft scores, embeddings, the grid head's
        # per-token shares); its own re-drafting settings are unused here.
        self.drafter = SSDRowDrafter(backbone, heads, state, sampling, None, SSDDecodeConfig(), device)
        self.heads, self.config = heads, config
        self.rows, self.cols = backbone.geometry.rows, backbone.geometry.cols
        self.prepared_row, self.above_prepared = -1, None
        self.calibrated = config.confidence == "calibrated"
        self.cost_aware = config.budget == "cost"

    def shape(self, frontier: int) -> TreeShape:
        row, column = divmod(frontier, self.cols)
        # Never past the row's end, where the grid head's row above would not be final; a root that ends its row
        # finishes it, so its tree drafts the next row (the vertical head for its first token).
        reach = self.cols - 1 - column
        if self._crosses(row, column):
            reach = self.cols
        elif self._looks_ahead(row):
            reach += min(self.config.lookahead, self.cols)
        config = self.config
        return TreeShape(config.nodes, min(config.depth or reach, reach), config.top_k, config.beam, config.draws)

    def _crosses(self, row: int, column: int) -> bool:
        return column == self.cols - 1 and row + 1 < self.rows and self.drafter.has_grid

    def _looks_ahead(self, row: int) -> bool:
        return self.config.lookahead > 0 and row + 1 < self.rows

    def expander(self, frontier: int, tokens: torch.Tensor, predicting: torch.Tensor):
        row, column = divmod(frontier, self.cols)
        drafter, heads = self.drafter, self.heads
        crosses = self._crosses(row, column)
        if crosses:  # the tree sits in the next row: its root is a virtual column -1 there
            row, column = row + 1, -1
        if row > 0 and self.prepared_row != row and drafter.has_grid:  # once per row: the row above is final
            span = slice((row - 1) * self.cols, row * self.cols)
            self.above_prepared, self.prepared_row = drafter.prepare_above(predicting[:, span], tokens[:, span]), row
        if row == 0 or not drafter.has_grid:

            def in_row(nodes, pool_parents, states, node_tokens, depth):
                predicted = heads.horizontal(states, drafter.embed(node_tokens))
                return predicted, drafter.draft_scores(predicted)

        else:
            above_prepared, first_of_row = self.above_prepared, None
            if crosses:  # the vertical head's state for the next row's first position, from the finished row
                span = slice((row - 1) * self.cols, row * self.cols)
                first_of_row = heads.vertical(predicting[:, span], drafter.embed(tokens[:, span]))[:, :1]

            def in_row(nodes, pool_parents, states, node_tokens, depth):
                if depth == 0 and first_of_row is not None:
                    predicted = first_of_row.expand(-1, states.shape[1], -1)
                    return predicted, drafter.draft_scores(predicted)
                above = above_prepared[:, column + depth + 1]  # (rows, width): the column the children sit in
                return self._grid_children(above[:, None].expand(-1, states.shape[1], -1), states, node_tokens)

        if crosses or not self._looks_ahead(row):
            return in_row
        return self._with_lookahead(in_row, frontier, tokens, predicting)

    def _grid_children(self, above: torch.Tensor, states: torch.Tensor, node_tokens: torch.Tensor):
        """The grid head's draft step for n parents: the prepared row-above share of each child's column (rows, n,
        width), the parents' states (rows, n, H) and tokens (B, n) -> the children's states and draft scores."""
        drafter = self.drafter
        left_share = drafter.left_token_share[node_tokens].repeat(drafter.twins, 1, 1)  # (rows, n, width)
        predicted = drafter.grid_step(above, states, left_share)
        return predicted, drafter.draft_scores(predicted)

    def _with_lookahead(self, in_row, frontier: int, tokens: torch.Tensor, predicting: torch.Tensor):
        """`in_row` (the draft step along the root's row) up to the row's last column; past it, each path's own
        next row, drafted from the row as that path has it (the module docstring's lookahead)."""
        cols, heads, drafter = self.cols, self.heads, self.drafter
        row, column = divmod(frontier, cols)
        last = cols - 1 - column  # the depth of the nodes at the row's last column
        span = slice(row * cols, frontier + 1)  # the row up to the root: exact states, final tokens (and the root)
        known_states, known_tokens = predicting[:, span], tokens[:, span]
        # The nodes expanded at each depth up to the row's last column: their input states (rows, n, H) and tokens
        # (B, n), and pool node -> its column there. A path's states are gathered a depth at a time.
        level_states: list[torch.Tensor] = []
        level_tokens: list[torch.Tensor] = []
        column_of: dict[int, int] = {}
        row_of_path: dict[int, int] = {}  # an expanded node at or past the last column -> its path's row in `prepared`
        prepared = None  # the grid head's prepared rows above, one per path (rows, paths, C, width)

        def expand(nodes, pool_parents, states, node_tokens, depth):
            nonlocal prepared
            if depth <= last:
                level_states.append(states)
                level_tokens.append(node_tokens)
                column_of.update((node, i) for i, node in enumerate(nodes))
            if depth < last or (depth > last and not drafter.has_grid):  # no grid head: the next row as this one
                return in_row(nodes, pool_parents, states, node_tokens, depth)
            if depth == last:  # the parents end the row: each path's row is the next row's row above
                row_of_path.update((node, i) for i, node in enumerate(nodes))
                paths = [_ancestors(node, pool_parents, depth) for node in nodes]  # depths 1..last, root excluded
                n = len(nodes)
                above_states = known_states[:, None].expand(-1, n, -1, -1)
                above_tokens = known_tokens[:, None].expand(-1, n, -1)
                if depth:
                    # columns[d][p]: path p's node at depth d + 1, as a column of the nodes expanded at that depth
                    columns = torch.tensor(
                        [[column_of[path[d]] for path in paths] for d in range(depth)], device=states.device
                    )
                    path_states = torch.stack([level_states[d + 1][:, at] for d, at in enumerate(columns)], 2)
                    path_tokens = torch.stack([level_tokens[d + 1][:, at] for d, at in enumerate(columns)], 2)
                    above_states = torch.cat([above_states, path_states], 2)  # (rows, n, C, H)
                    above_tokens = torch.cat([above_tokens, path_tokens], 2)  # (B, n, C)
                embedded = drafter.embed(above_tokens)
                if drafter.has_grid:
                    prepared = heads.grid.prepare_above(above_states, embedded)
                predicted = heads.vertical(above_states, embedded)[:, :, 0]  # the next row's first position
                return predicted, drafter.draft_scores(predicted)
            # In the next row: the children sit in its column depth - last.
            for node in nodes:  # a node's path row is its parent's (each parent was expanded the level before)
                row_of_path[node] = row_of_path[pool_parents[node]]
            which = torch.tensor([row_of_path[node] for node in nodes], device=states.device)
            return self._grid_children(prepared[:, which, depth - last], states, node_tokens)

        return expand

    def after_tree(self) -> None:
        pass


def _ancestors(node: int, pool_parents: list[int], depth: int) -> list[int]:
    """The pool nodes on `node`'s path at depths 1..`depth` (its own depth), root excluded, in path order."""
    path = []
    for _ in range(depth):
        path.append(node)
        node = pool_parents[node]
    return path[::-1]


def _generate(backbone, heads, condition, sampling, generator, settings: SSDTreeConfig) -> GenerationResult:
    return generate_ssd_tree(backbone, heads, condition, sampling, generator, settings)


# Lossless with either draws: a sampled draw is ranked by what its rank could draw, never by its own value
# (decode/draft_tree.py, `_candidates`), so which draws a tree keeps does not depend on them (until 2026-12-04 it
# did, and batch-1 trees were biased: docs/runs/tree_batch1/results.txt); top-k point candidates are fixed by the
# context.
METHOD = MethodSpec(
    generate=_generate,
    settings=SSDTreeConfig,
    artefact="heads",
    artefact_kind="ssd",
)
