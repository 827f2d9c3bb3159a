"""Cost-aware tree size: how many nodes a token tree's pass verifies, from what a pass costs on this machine.

A node's place in the pass is worth the tokens it is expected to add, its probability of lying on the accepted
path (the exponential of its score in `decode/draft_tree.py`: with calibrated confidence, the measured
acceptance along its path), and costs the time it adds to the pass. The pass that maximises expected tokens per
second E(n) / C(n) keeps a node exactly where its probability is at least

    threshold = C'(n) * E(n) / (C(n) + D)

(the marginal condition: the n-th node's tokens against the tokens per second a round gives), with C(n) the
measured seconds of a tree pass of n nodes, C' its slope there, D the rest of a round (growing the tree,
walking it, keeping the path), E(n) the tokens per pass. `NodeBudget` takes E, n and D from the rounds of this
generation so far (their mean keep, nodes fed, and wall-clock beyond the table's pass) and C from a table
measured once per process on this machine at this batch (`tree_pass_seconds`), and gives `grow_tree` the
threshold before the tree is grown. A fixed threshold keeps the tree blind to a kept draw's own value (scores only fall
along a path, so whether a draw clears it reads its rank and ancestors only), so the method stays lossless; it
only changes which nodes a pass verifies.

What it leaves out: that D grows with the tree's depth (a draft step per level). What it makes depend on the
machine and the run: the tokens drawn at a seed (the timings decide the tree's size, so how many random numbers
a round uses); the distribution does not depend on them.
"""

from __future__ import annotations

import math

import torch

from backbones.base import ARImageBackbone, Condition
from decode.pass_cost import measured_context, median_seconds

# The tree sizes timed at start-up (those up to the method's `nodes`, and `nodes` itself).
TIMED_NODES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)

_MEASURED: dict[tuple, list[float]] = {}


def heap_parents(nodes: int) -> torch.Tensor:
    """A binary tree of `nodes` nodes, parents before children (the shape the table is timed with: a pass's
    cost follows its node count, its shape only sets the positions)."""
    return torch.tensor([-1] + [(node - 1) // 2 for node in range(1, nodes)], dtype=torch.long)


@torch.inference_mode()
def tree_pass_seconds(
    backbone: ARImageBackbone, condition: Condition, guided: bool, counts: list[int], repeats: int = 3
) -> list[float]:
    """Seconds of one `step_tree` pass of each node count, mid-image, at this batch and guidance (median of
    `repeats` after a warm-up). Timed on a state of its own, so the generation's cache is never touched."""
    device = next(backbone.parameters()).device
    state, _ = backbone.prefill(condition, guided)
    context = measured_context(backbone, max(counts))
    tokens = torch.zeros(condition.batch_size, backbone.geometry.num_tokens, dtype=torch.long, device=device)
    for start in range(0, context, backbone.geometry.cols):  # fill the context a row at a time
        backbone.step(state, tokens[:, start : min(context, start + backbone.geometry.cols)])
    seconds = []
    for count in counts:
        nodes, parents = tokens[:, :count], heap_parents(count)
        seconds.append(median_seconds(lambda n=nodes, p=parents: backbone.step_tree(state, n, p), device, repeats, 1))
    return seconds


class NodeBudget:
    """The threshold a tree's nodes must clear to be verified, from the measured pass cost and this generation's
    passes so far (see the module docstring). One per generation: an image's tree sizes do not depend on the
    images decoded before it."""

    def __init__(self, backbone: ARImageBackbone, condition: Condition, guided: bool, max_nodes: int):
        self.counts = sorted({n for n in TIMED_NODES if n < max_nodes} | {max_nodes})
        device = next(backbone.parameters()).device
        key = (id(backbone), str(device), condition.batch_size, guided, tuple(self.counts))
        if key not in _MEASURED:  # measured once per backbone, batch and guidance in this process
            _MEASURED[key] = tree_pass_seconds(backbone, condition, guided, self.counts)
        self.seconds = _MEASURED[key]
        self.passes, self.tokens, self.nodes, self.overhead = 0, 0.0, 0.0, 0.0

    def min_log_score(self) -> float:
        """The log threshold for the next tree (-inf before the first pass: the whole tree, up to `nodes`)."""
        if self.passes == 0:
            return float("-inf")
        mean_nodes, mean_tokens = self.nodes / self.passes, self.tokens / self.passes
        round_seconds = self.pass_seconds(mean_nodes) + self.overhead / self.passes
        threshold = self.slope(mean_nodes) * mean_tokens / round_seconds
        return math.log(max(threshold, 1e-30))

    def observe(self, nodes_fed: int, tokens_kept: int, round_seconds: float | None = None) -> None:
        """Count a round: the nodes its pass fed, the tokens it committed per image and its wall-clock (what
        it took beyond the table's pass is D; None: not timed, D = 0)."""
        self.passes += 1
        self.nodes += nodes_fed
        self.tokens += tokens_kept
        if round_seconds is not None:
            self.overhead += max(0.0, round_seconds - self.pass_seconds(nodes_fed))

    def pass_seconds(self, nodes: float) -> float:
        """The measured table, linearly interpolated (extrapolated along its last segment)."""
        index = self._segment(nodes)
        (a, sa), (b, sb) = (self.counts[index], self.seconds[index]), (self.counts[index + 1], self.seconds[index + 1])
        return sa + (sb - sa) * (nodes - a) / (b - a)

    def slope(self, nodes: float) -> float:
        """Seconds a node adds to the pass at this size: the table's secant from half to twice the size (wider
        than one segment, whose few-millisecond rise is within the timing noise), at least 0."""
        low, high = max(self.counts[0], nodes / 2), min(self.counts[-1], nodes * 2)
        if high <= low:
            low, high = self.counts[-2], self.counts[-1]
        return max(0.0, (self.pass_seconds(high) - self.pass_seconds(low)) / (high - low))

    def _segment(self, nodes: float) -> int:
        if len(self.counts) < 2:
            raise ValueError("a node budget needs a tree of at least 2 nodes to time")
        for index in range(len(self.counts) - 1):
            if nodes <= self.counts[index + 1]:
                return index
        return len(self.counts) - 2
