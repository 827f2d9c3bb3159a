"""Token trees for speculative decoding: grow one by the draft's confidence, walk it against the target.

Every tree method (SSD's `ssd_tree`, EAGLE-2's `eagle2`) drafts, verifies and accepts through here:

- `grow_tree`: EAGLE-2's dynamic draft tree (Li et al., EMNLP 2024; github.com/SafeAILab/EAGLE,
  ``model/cnets.py`` ``topK_genrate``). From the root (the token the backbone gave last), each depth expands the
  `beam` nodes of highest path score (none that could no longer make the tree: at or below the pool's
  `nodes - 1`-th best score) with one batched draft step and gives each `top_k` candidates: the
  draft's most likely tokens (EAGLE-2's), or draws without replacement from the draft distribution q. Every
  candidate goes into a pool; the tree is the root and the `nodes - 1` candidates of the pool with the highest
  scores (score: the sum along the path of the draft's log-probability, EAGLE-2's, or of the log of the
  calibrated acceptance probability, `AcceptanceModel`; a sampled draw is scored by what its rank could draw,
  never by its own value, see `_candidates`), ancestor-closed and with each node's children a prefix
  of their draw order. One tree shape serves the batch (the backbone verifies one shape per pass): a node is a
  rank path (the root's r-th child's s-th child ...), holding each image's own tokens, scored by the mean over
  images. At batch 1 with top-k candidates and the draft's confidence this is EAGLE-2's tree exactly.
- `walk_tree`: multi-candidate speculative sampling down the verified tree (decode/rules.py,
  `accept_among_siblings`). The children of a node are tested in draw order against the target, the target
  replaced by its residual after each rejection; each child's proposal is what it was drawn from (one-hot for
  a top-k candidate; q without the earlier siblings, renormalised, for a draw without replacement). The
  accepted child becomes the current node. Where every child is rejected the next token is drawn from what is
  left of the target, at a leaf from the target itself. Each token of the path is therefore distributed as the
  backbone's next-token distribution given the path before it (greedy: it is the argmax), which is what makes
  tree methods lossless, provided whether a draw is in the tree never depends on its own value: a score reads
  a draw's rank, its parent's q and its earlier siblings and ancestors, never the draw itself, and it only falls
  along a path and a sibling order, so neither the draw nor its descendants or later siblings can move it in
  or out; the other branches are drawn independently of it given the ancestors they share. Given all it may
  depend on, a kept draw is then distributed as the proposal it is tested with (tests/test_ssd_tree.py:
  batch-1 trees, and the own-value ranking earlier versions had, caught).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decode.rules import accept_among_siblings, point_proposals
from decode.sampling import SamplingConfig, sample_with, token_distribution

# expand(parent nodes, every pool node's parent so far, the parents' input states (rows, n, H), their tokens (B, n),
#        depth of the parents) -> (the draft states predicting each parent's next position (rows, n, H),
#        the draft's scores there (B, n, V)). Pool node 0 is the root; a drafter with its own cache (EAGLE's head)
#        reads the pool's parents to let a node attend to its ancestors only.
ExpandFn = Callable[[list[int], list[int], torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TreeShape:
    """How large a tree `grow_tree` drafts (EAGLE-2's total_token, depth and top_k) and how candidates are drawn."""

    nodes: int  # nodes per tree, the root included: what one verification pass feeds
    depth: int  # draft steps (the tree's deepest node is this many positions after the root)
    top_k: int  # candidates per expanded node
    beam: int  # nodes expanded per depth (EAGLE-2: top_k)
    # "top_k": the draft's k most likely tokens, tested as point proposals (EAGLE-2, at any temperature);
    # "sampled": k draws without replacement from the draft distribution q (the sampling settings applied),
    # each tested against q without the earlier draws (recursive rejection sampling; the first candidate is
    # then plain speculative sampling's draft). Greedy decoding always uses "top_k" (q is one-hot there).
    draws: str = "top_k"

    def __post_init__(self):
        if min(self.nodes, self.top_k, self.beam) < 1 or self.depth < 0:
            raise ValueError(
                f"a draft tree needs nodes, top_k and beam >= 1 and depth >= 0, got nodes {self.nodes}, "
                f"depth {self.depth}, top_k {self.top_k}, beam {self.beam}"
            )
        if self.draws not in ("top_k", "sampled"):
            raise ValueError(f"tree draws must be 'top_k' or 'sampled', got {self.draws!r}")


@dataclass
class DraftTree:
    """A drafted tree, parents before children: node 0 is the root."""

    tokens: torch.Tensor  # (B, T) long: each image's token at each node
    parents: torch.Tensor  # (T,) long: the node each follows, -1 for the root
    depths: list[int]  # (T,) the root is depth 0
    ranks: list[int]  # (T,) the node's place among its siblings (the order they were drawn and are tested)
    # (B, T) the largest draft probability among what its earlier siblings left, as a share of that mass (the
    # acceptance model's feature; a top-k candidate's own probability there), 0 for the root
    features: torch.Tensor | None = None
    # (B, T, V) the draft distribution each node was drawn from, before its earlier siblings were excluded;
    # None: point proposals (deterministic top-k candidates)
    proposals: torch.Tensor | None = None

    def children(self) -> torch.Tensor:
        """(T, K) each node's children in rank order, -1 padded (K: the most children any node has)."""
        lists: list[list[int]] = [[] for _ in self.depths]
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                lists[parent].append(node)
        width = max(1, max(len(kids) for kids in lists))
        return torch.tensor([kids + [-1] * (width - len(kids)) for kids in lists], dtype=torch.long)


def grow_tree(
    root_tokens: torch.Tensor,
    root_state: torch.Tensor,
    expand: ExpandFn,
    shape: TreeShape,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    acceptance: AcceptanceModel | None = None,
    min_score: float = float("-inf"),
) -> DraftTree:
    """EAGLE-2's dynamic draft tree from a root (see the module docstring).

    root_tokens (B,) the token the backbone gave last, not fed yet; root_state (rows, H) the exact state that
    predicted it (rows = B, or 2B under guidance). `expand` runs the draft one step for a set of nodes.

    A candidate's score is the batch's mean log path confidence (EAGLE-2: the draft's log-probability of each
    token along the path, for a sampled draw the best its rank could draw, `_candidates`; with `acceptance`,
    the log of its calibrated probability of being accepted, see `AcceptanceModel`), capped by its parent's
    score and by its earlier siblings' (a no-op for top-k candidates at batch 1), so that whatever is kept is
    a tree whose children are a prefix of their draw order (the order the acceptance rule's proposals assume).

    `min_score` (a log confidence; `decode/tree_budget.py`'s cost-aware budget): candidates scoring below it are
    neither expanded nor kept, so the tree holds at most `nodes`, fewer where the rest would not pay for their
    place in the pass. A fixed threshold keeps selection blind to a kept draw's own value (scores only fall
    along a path), as the cap does.
    """
    batch, device = root_tokens.shape[0], root_tokens.device
    sampled = shape.draws == "sampled" and not sampling.greedy
    # The pool: node 0 is the root; each candidate has a parent, rank, depth, tokens, score, proposal.
    parents, ranks, depths = [-1], [-1], [0]
    tokens = [root_tokens[:, None]]
    scores = [torch.zeros(1, device=device)]
    features = [torch.zeros(batch, 1, device=device)]
    proposals: list[torch.Tensor] = []
    frontier, frontier_states, frontier_tokens, frontier_scores = (
        [0],
        root_state[:, None],
        root_tokens[:, None],
        scores[0],
    )
    for level in range(shape.depth):
        child_states, child_scores = expand(frontier, parents, frontier_states, frontier_tokens, level)
        level_tokens, log_confidence, feature, q = _candidates(child_scores, shape.top_k, sampling, sampled, generator)
        k = level_tokens.shape[-1]
        if acceptance is not None:
            # A draw outside q's support (top-k / top-p sampling) stays out: its proposal would be q = 0.
            calibrated = acceptance.log_path_step(feature)
            log_confidence = torch.where(torch.isfinite(log_confidence), calibrated, float("-inf"))
        first = len(parents)
        for parent in frontier:
            parents += [parent] * k
            ranks += list(range(k))
            depths += [level + 1] * k
        # (n, k): capped by the parent's score and the earlier siblings' (cummin along the draw order)
        level_scores = (frontier_scores[:, None] + log_confidence.mean(0)).cummin(dim=-1).values.reshape(-1)
        tokens.append(level_tokens.reshape(batch, -1))  # parent-major
        features.append(feature.reshape(batch, -1))
        scores.append(level_scores)
        if q is not None:
            proposals.append(q.repeat_interleave(k, dim=1))
        # EAGLE-2 expands the `beam` best candidates of this depth next, but none that could not make the tree:
        # none below the budget's threshold, and none at or below the pool's `nodes - 1`-th best score (a child
        # scores no higher than its parent and loses ties to earlier pool nodes, and the pool's bar only rises).
        # Skipping them leaves the kept tree as it would be, given the same draws for the nodes it keeps, and
        # saves the levels no path can reach.
        bar = _kth_largest(torch.cat(scores[1:]), shape.nodes - 1)
        above_bar = _above(level_scores, min_score).masked_fill(level_scores <= bar, float("-inf"))
        best, best_listed = _stable_top(above_bar, shape.beam)
        if not best_listed:
            break
        frontier = [first + i for i in best_listed]
        # A candidate's input state is the one its parent's expansion predicted (candidates are parent-major).
        frontier_states, frontier_tokens = child_states[:, best // k], tokens[-1][:, best]
        frontier_scores = level_scores[best]
    all_scores = torch.cat(scores)
    # The root and the best `nodes - 1` candidates; ties keep pool order, so a parent comes before its child.
    chosen = [0] + sorted(i + 1 for i in _stable_top(_above(all_scores[1:], min_score), shape.nodes - 1)[1])
    new_index = {old: new for new, old in enumerate(chosen)}
    if any(parents[old] >= 0 and parents[old] not in new_index for old in chosen):
        raise AssertionError("draft tree selection is not ancestor-closed")  # scores only fall along a path
    index = torch.tensor(chosen, device=device)
    proposal = None
    if sampled and proposals:
        every = torch.cat([torch.zeros_like(proposals[0][:, :1]), *proposals], dim=1)  # the root has none
        proposal = every[:, index]
    return DraftTree(
        tokens=torch.cat(tokens, 1)[:, index],
        parents=torch.tensor([new_index[parents[old]] if parents[old] >= 0 else -1 for old in chosen]),
        depths=[depths[old] for old in chosen],
        ranks=[ranks[old] for old in chosen],
        features=torch.cat(features, 1)[:, index],
        proposals=proposal,
    )


def _candidates(scores: torch.Tensor, k: int, sampling: SamplingConfig, sampled: bool, generator):
    """Each expanded node's candidates: tokens (B, n, k) in draw order, their log confidence (B, n, k), their
    feature (B, n, k), and the draft distribution q (B, n, V) they were drawn from, or None for top-k point
    candidates.

    A candidate's confidence is the largest probability q gives a token its earlier siblings did not take, and
    its feature that probability among the mass they left. For a top-k candidate that is its own probability
    (EAGLE-2's score). For a sampled one it is not: its own probability would rank a draw by its value, and a
    draw kept because of its value is not distributed as the proposal the acceptance rule tests it with (at
    batch 1 that biases the output: docs/runs/tree_batch1/). What a rank-r draw is scored by is fixed by q and
    the earlier draws alone, so which draws a tree keeps never depends on their own values (its value may still
    rank its descendants, through their q).

    Sampled: k draws without replacement from q by the Gumbel-top-k trick (the keys' order is the sequential
    draws' order); ranks past q's support get confidence -inf (never kept)."""
    k = min(k, scores.shape[-1])
    if not sampled:  # EAGLE-2: the draft's own softmax ranks and scores the candidates
        probs = scores.float().softmax(-1)
        top = probs.topk(k, dim=-1)
        tokens, chosen, q = top.indices, top.values, None
        best_left = chosen
    else:
        q = token_distribution(scores, sampling)
        uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp(min=1e-20)
        tokens = (q.log() - (-uniform.log()).log()).topk(k, dim=-1).indices
        chosen = q.gather(-1, tokens)
        # The best token each rank could still draw: q's max once the earlier draws are taken out.
        remaining, best = q.clone(), []
        for rank in range(k):
            best.append(remaining.amax(-1))
            remaining.scatter_(-1, tokens[..., rank : rank + 1], 0.0)
        best_left = torch.stack(best, -1)
    left = 1 - (chosen.cumsum(-1) - chosen)  # the mass the earlier candidates left
    feature = (best_left / left.clamp(min=1e-12)).clamp(max=1.0)
    return tokens, best_left.log(), feature, q


def _kth_largest(scores: torch.Tensor, k: int) -> torch.Tensor | float:
    """The k-th largest score, as a 0-d tensor (compared on the device: no host read), -inf while fewer than k
    are given."""
    if k < 1 or len(scores) < k:
        return float("-inf")
    return scores.topk(k).values[-1]


def _above(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The scores, -inf where below the threshold (`_stable_top` never picks those)."""
    if threshold == float("-inf"):
        return scores
    return scores.masked_fill(scores < threshold, float("-inf"))


def _stable_top(values: torch.Tensor, count: int) -> tuple[torch.Tensor, list[int]]:
    """Indices of the `count` largest finite values, ties in index order, as a tensor and as a list: one host
    read (a tree level reads its frontier once; on a GPU each read waits for the device)."""
    negated, order = torch.sort(-values, stable=True)  # the non-finite values sort last
    top = order[:count]
    listed = torch.where(torch.isfinite(negated[:count]), top, -1).tolist()
    kept = listed.index(-1) if -1 in listed else len(listed)
    return top[:kept], listed[:kept]


@dataclass
class TreeWalk:
    """Each image's accepted path through a verified tree and the token after it."""

    path: torch.Tensor  # (B, depth + 1) long: the nodes accepted, root first, -1 after the path's end
    length: torch.Tensor  # (B,) long: nodes on the path (the root counts: >= 1)
    next_token: torch.Tensor  # (B,) long: drawn after the path's last node (residual or bonus token)
    rejected_ranks: list[int]  # per rank: siblings tested and rejected (all images, all depths)
    accepted_ranks: list[int]  # per rank: siblings accepted
    accepted_depths: list[int]  # per depth >= 1: images whose path reached it
    # every candidate tested (all images): its feature (DraftTree.features), rank, and whether it was accepted
    tested: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class AcceptanceModel:
    """How likely a candidate is to be accepted, calibrated on the walks of this generation so far.

    EAGLE-2 ranks nodes by the draft's probability of their tokens, which is what a top-k (point) candidate's
    acceptance probability is when the draft matches the target; a candidate sampled from the draft is
    accepted more often than its own probability (``min(1, p / q)``), and heads are not perfectly calibrated.
    Here the acceptance rate is counted per sibling rank and per bin of the candidate's feature (the largest
    draft probability among what the earlier siblings left, as a share of it: a top-k candidate's own; never a
    sampled draw's own value, `_candidates`), starting from the point-candidate prior (rate = the
    feature) with `prior_weight` pseudo-counts. It only decides which nodes a pass verifies, so it cannot
    change what a lossless method samples; it is reset for every generation (an image's tokens do not
    depend on which images came before it).
    """

    def __init__(self, ranks: int, bins: int = 10, prior_weight: float = 2.0, device=None):
        self.bins = bins
        centers = (torch.arange(bins, device=device) + 0.5) / bins
        self.tested = torch.full((ranks, bins), prior_weight, device=device)
        self.accepted = centers.repeat(ranks, 1) * prior_weight

    def _bin(self, feature: torch.Tensor) -> torch.Tensor:
        return (feature * self.bins).long().clamp(0, self.bins - 1)

    def rates(self, feature: torch.Tensor) -> torch.Tensor:
        """Candidates' features (..., k) in rank order -> their acceptance probability given their earlier
        siblings were rejected (..., k)."""
        ranks = torch.arange(feature.shape[-1], device=feature.device).clamp(max=self.tested.shape[0] - 1)
        bins = self._bin(feature)
        return self.accepted[ranks, bins] / self.tested[ranks, bins]

    def log_path_step(self, feature: torch.Tensor) -> torch.Tensor:
        """The log-probability that the walk goes from a parent into each of its candidates (..., k): the
        earlier siblings rejected, this one accepted."""
        rate = self.rates(feature).clamp(1e-6, 1 - 1e-6)
        log_rejected = (1 - rate).log()
        return rate.log() + log_rejected.cumsum(-1) - log_rejected

    def update(self, walk: TreeWalk) -> None:
        """Count the walk's tested candidates."""
        if walk.tested is None:
            return
        feature, rank, accepted = walk.tested
        index = rank.clamp(max=self.tested.shape[0] - 1) * self.bins + self._bin(feature)
        self.tested.view(-1).index_add_(0, index, torch.ones_like(feature))
        self.accepted.view(-1).index_add_(0, index, accepted.float())


def _sibling_proposals(tree: DraftTree, children: torch.Tensor, sibling_tokens: torch.Tensor, vocabulary: int):
    """What each node's children (B, n, K) were drawn from: one-hot for top-k candidates; for sampled ones,
    the parent's draft distribution without the earlier siblings, renormalised (draws without replacement):
    (B, n, K, V)."""
    points = point_proposals(sibling_tokens, vocabulary)
    if tree.proposals is None:
        return points
    q = tree.proposals[:, children[:, 0].clamp(min=0)]  # (B, n, V): siblings share their parent's q
    earlier = (points.cumsum(-2) - points).clamp(max=1)
    remaining = q[:, :, None] * (1 - earlier)
    return remaining / remaining.sum(-1, keepdim=True).clamp(min=1e-30)


def walk_tree(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None = None) -> TreeWalk:
    """Multi-candidate speculative sampling down a tree: p (B, T, V) is the target after each node.

    Every node's children are tested at once (the test at a node depends only on its own children and its
    target), then each image follows its accepted children from the root; the token after the path is drawn
    from what the last node's tests left of its target.
    """
    batch, device = p.shape[0], p.device
    children = tree.children().to(device)  # (T, K)
    width, vocabulary, rows = children.shape[1], p.shape[-1], torch.arange(batch, device=device)
    inner = torch.nonzero(children[:, 0] >= 0)[:, 0]  # nodes with children
    choice = torch.full((batch, p.shape[1]), width, dtype=torch.long, device=device)  # leaves: none accepted
    target = p.clone()
    uniform = torch.rand(batch, p.shape[1], width + 1, generator=generator, device=device)
    if len(inner):
        kids = children[inner]  # (n, K)
        sibling_tokens = tree.tokens[:, kids.clamp(min=0)]  # (B, n, K)
        accepted, left = accept_among_siblings(
            p[:, inner],
            sibling_tokens,
            _sibling_proposals(tree, kids, sibling_tokens, vocabulary),
            uniform[:, inner, :width],
            (kids >= 0)[None].expand(batch, -1, -1),
        )
        choice[:, inner], target[:, inner] = accepted, left
    # Follow each image's accepted children from the root.
    current = torch.zeros(batch, dtype=torch.long, device=device)
    path, walking = [current], torch.ones(batch, dtype=torch.bool, device=device)
    reached, tested_nodes, tested_accepted = [], [], []
    ranks = torch.arange(width, device=device)
    for _ in range(max(tree.depths) + 1):
        step = choice[rows, current]
        kids = children[current]  # (B, K)
        tested = walking[:, None] & (kids >= 0) & (ranks[None] <= step[:, None])  # (B, K)
        hit = tested & (ranks[None] == step[:, None])
        tested_nodes.append(torch.where(tested, kids, -1))
        tested_accepted.append(hit)
        moves = walking & (step < width)
        current = torch.where(moves, children[current, step.clamp(max=width - 1)], current)
        path.append(torch.where(moves, current, -1))
        walking = moves
        if not bool(walking.any()):  # the walk's one host read per depth
            break
        reached.append(moves.sum())
    path_nodes = torch.stack(path, 1)
    length = (path_nodes >= 0).sum(1)
    next_token = sample_with(target[rows, current], uniform[rows, current, width])
    nodes, hits = torch.stack(tested_nodes, 1), torch.stack(tested_accepted, 1)  # (B, steps, K)
    # Counts for the report, read from the device once: how each sibling rank fares, paths reaching each depth.
    accepted_ranks, rejected = torch.stack([hits.sum((0, 1)), ((nodes >= 0) & ~hits).sum((0, 1))]).tolist()
    reached = torch.stack(reached).tolist() if reached else []
    image, step_index, rank = torch.nonzero(nodes >= 0, as_tuple=True)
    tested = None
    if tree.features is not None and len(image):
        node = nodes[image, step_index, rank]
        tested = (tree.features[image, node], rank, hits[image, step_index, rank])
    return TreeWalk(path_nodes, length, next_token, rejected, accepted_ranks, reached, tested)
