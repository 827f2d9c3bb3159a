"""The decode loop every token-tree method shares: draft a tree, verify it in one pass, keep the accepted path.

Per pass (decode/draft_tree.py has the rules):

1. the root is the token the backbone gave last (not in the cache yet), with the
   exact state that predicted it;
2. the method's drafter grows a tree from it (`grow_tree` with the drafter's
   draft step and tree size for this position; with a cost-aware budget,
   only the nodes whose expected tokens pay for their place in the pass,
   decode/tree_budget.py);
3. `ARImageBackbone.step_tree` verifies every node in one pass, `walk_tree`
   accepts a path and draws the token after it (the next root), and
   `keep_tree_path` makes the path the cache's continuation.

Batching: the batch shares one tree shape per pass and one cache length, so
every image advances by the shortest accepted path of the batch; an image
whose path went further keeps its first nodes and takes its next accepted node
as the next root (exact: where an image's sequence of exact draws is cut is a
stopping time of that sequence, and the images are independent).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from backbones.base import ARImageBackbone, Condition
from decode.draft_tree import AcceptanceModel, ExpandFn, TreeShape, TreeWalk, grow_tree, walk_tree
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_from
from decode.sjd import target_distributions
from decode.tree_budget import NodeBudget


class TreeDrafter(Protocol):
    """What a tree method supplies: per root position, its tree's size and its draft step."""

    calibrated: bool  # rank nodes by `AcceptanceModel`'s calibrated acceptance, not the draft's probability
    cost_aware: bool  # verify only the nodes that pay for their place in the pass (`decode/tree_budget.py`)

    def shape(self, frontier: int) -> TreeShape:
        """The tree for a root at grid position `frontier` (its depth never past what the method drafts)."""

    def expander(self, frontier: int, tokens: torch.Tensor, predicting: torch.Tensor) -> ExpandFn:
        """The draft step for this pass; `tokens` (B, N) are final before `frontier`, `predicting` (rows, N, H)
        holds the exact state that predicted each final position and the root."""

    def after_tree(self) -> None:
        """Called once the tree is grown (drop the drafter's scratch state)."""


@torch.inference_mode()
def generate_by_trees(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    make_drafter,
) -> GenerationResult:
    """Generate one image per condition by token trees; ``make_drafter(state)`` -> the method's `TreeDrafter`."""
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    total = rows * cols
    state, first_state = backbone.prefill(condition, sampling.guided)  # (G, 1, H) predicts token 0
    drafter = make_drafter(state)
    batch, device = condition.batch_size, first_state.device
    twins = 2 if state.guided else 1
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    # predicting[:, i]: the exact state that predicted position i (drafters read the final ones).
    predicting = first_state.new_zeros(first_state.shape[0], total, first_state.shape[-1])
    predicting[:, 0] = first_state[:, 0]
    root = sample_from(target_distributions(backbone, state, first_state, sampling)[:, 0], generator)
    frontier, passes, drafted, accepted = 0, 1, 0, 0
    counts: dict[str, int] = {"tree_passes": 0, "tree_nodes_fed": 0}
    cache_rows = torch.arange(predicting.shape[0], device=device)
    acceptance = AcceptanceModel(drafter.shape(0).top_k, device=device) if drafter.calibrated else None
    budget = NodeBudget(backbone, condition, state.guided, drafter.shape(0).nodes) if drafter.cost_aware else None
    while True:
        tokens[:, frontier] = root
        if frontier == total - 1:
            break
        expand = drafter.expander(frontier, tokens, predicting)
        began = time.perf_counter()
        min_score = budget.min_log_score() if budget is not None else float("-inf")
        tree = grow_tree(
            root, predicting[:, frontier], expand, drafter.shape(frontier), sampling, generator, acceptance, min_score
        )
        drafter.after_tree()
        verified = backbone.step_tree(state, tree.tokens, tree.parents)
        passes += 1
        walk = walk_tree(tree, target_distributions(backbone, state, verified.hidden, sampling), generator)
        _add_counts(counts, walk, len(tree.depths))
        if acceptance is not None:
            acceptance.update(walk)
        keep = int(walk.length.min())
        if budget is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the round's wall-clock includes its pass
            budget.observe(len(tree.depths), keep, time.perf_counter() - began)
        drafted += batch * (len(tree.depths) - 1)
        accepted += int(walk.length.sum()) - batch
        path = walk.path[:, :keep]  # (B, keep): every image's first `keep` nodes are accepted
        backbone.keep_tree_path(state, verified, path, keep)
        tokens[:, frontier : frontier + keep] = tree.tokens.gather(1, path)
        # The state after each kept node predicts the position after it (exact: the pass computed it).
        after = verified.hidden[cache_rows[:, None], path.repeat(twins, 1)]  # (rows, keep, H)
        end = min(frontier + keep + 1, total)
        predicting[:, frontier + 1 : end] = after[:, : end - frontier - 1]
        root = _next_root(walk, tree.tokens, keep)
        frontier += keep
        if frontier >= total:
            break
    return GenerationResult(
        tokens.view(batch, rows, cols),
        forward_passes=passes,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        extras=counts,
    )


def _next_root(walk: TreeWalk, tree_tokens: torch.Tensor, keep: int) -> torch.Tensor:
    """The token after each image's first `keep` nodes: the one drawn after its path where the path ends there,
    else its next accepted node."""
    longer = walk.length > keep
    if not bool(longer.any()):
        return walk.next_token
    ahead = walk.path[:, min(keep, walk.path.shape[1] - 1)].clamp(min=0)
    return torch.where(longer, tree_tokens.gather(1, ahead[:, None])[:, 0], walk.next_token)


def _add_counts(counts: dict[str, int], walk: TreeWalk, nodes: int) -> None:
    """Accumulate the walk's counts into flat integer keys (summed over batches by the benchmark, in metrics.json):
    candidates of each sibling rank accepted and rejected, paths reaching each depth, nodes fed."""
    counts["tree_passes"] += 1
    counts["tree_nodes_fed"] += nodes
    for prefix, values in (
        ("accepted_rank_", walk.accepted_ranks),
        ("rejected_rank_", walk.rejected_ranks),
        ("paths_reaching_depth_", walk.accepted_depths),
    ):
        for i, value in enumerate(values):
            key = f"{prefix}{i + 1 if prefix.startswith('paths') else i}"
            counts[key] = counts.get(key, 0) + value
