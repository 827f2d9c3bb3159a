"""SSD token trees (decode/ssd_tree.py, decode/draft_tree.py): lossless, and the tree is EAGLE-2's.

Greedy trees must give greedy AR's tokens (batch 1 and 4, random heads so that drafts are often wrong and
siblings decide; every adapter: tests/test_tree_methods.py); sampled trees must give the backbone's image
distribution on an enumerable 3x3 grid whose target is not peaked, a test that must catch a sibling rule
without its residual update.
"""

import pytest
import torch
from conftest import random_ssd_heads
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution

from backbones.base import Condition
from decode.ar import generate_ar
from decode.draft_tree import TreeShape, grow_tree, walk_tree
from decode.sampling import SamplingConfig
from decode.ssd_tree import SSDTreeConfig, SSDTreeDrafter, generate_ssd_tree

CLASS_ID = 4
GREEDY = SamplingConfig(greedy=True)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(
    "config",
    [
        SSDTreeConfig(nodes=12, top_k=2, beam=3),
        SSDTreeConfig(nodes=6, top_k=3, beam=2, depth=2),
        SSDTreeConfig(nodes=24, top_k=2, beam=4, budget="cost"),
        SSDTreeConfig(nodes=24, top_k=2, beam=4, lookahead=5),
    ],
    ids=["to-row-end", "depth-2", "cost-budget", "lookahead"],
)
@pytest.mark.parametrize("grid", [False, True], ids=["horizontal", "grid"])
def test_greedy_ssd_tree_equals_greedy_ar_on_digits(tiny_backbone, batch, config, grid):
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9][:batch]))
    baseline = generate_ar(tiny_backbone, condition, sampling)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=2, grid=grid)
    tree = generate_ssd_tree(tiny_backbone, heads, condition, sampling, config=config)
    assert torch.equal(tree.tokens, baseline.tokens)
    assert tree.forward_passes <= baseline.forward_passes


def test_a_top_1_tree_is_the_chain_and_the_tree_keeps_the_most_confident_nodes():
    """top_k 1: a chain of `depth` nodes. Wider: the kept nodes are the pool's best by joint confidence, parents
    first, each node's tokens its parent's top-k."""
    vocabulary, batch = 5, 2
    table = torch.randn(vocabulary, vocabulary, generator=torch.Generator().manual_seed(0)) * 3

    def expand(nodes, pool_parents, states, tokens, depth):  # the draft's scores depend on the parent token only
        return states, table[tokens]

    root = torch.tensor([1, 3])
    chain = grow_tree(root, torch.zeros(batch, 4), expand, TreeShape(nodes=10, depth=4, top_k=1, beam=1), GREEDY)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    for node in range(1, 5):
        assert torch.equal(chain.tokens[:, node], table[chain.tokens[:, node - 1]].argmax(-1))
    tree = grow_tree(root, torch.zeros(batch, 4), expand, TreeShape(nodes=7, depth=3, top_k=3, beam=2), GREEDY)
    assert len(tree.depths) == 7 and tree.parents[0] == -1
    assert all(0 <= parent < node for node, parent in enumerate(tree.parents.tolist()) if node)
    log_q = table.log_softmax(-1)
    scores = torch.zeros(batch, 7)
    for node in range(1, 7):
        parent = int(tree.parents[node])
        assert torch.equal(tree.tokens[:, node], table[tree.tokens[:, parent]].topk(3).indices[:, tree.ranks[node]])
        scores[:, node] = scores[:, parent] + log_q[tree.tokens[:, parent], tree.tokens[:, node]]
    # Every depth-1 candidate is in the pool; the kept ones are at least as good as any dropped one of depth 1.
    kept = {tree.ranks[n] for n in range(7) if tree.depths[n] == 1}
    first = log_q[root].topk(3).values.mean(0)
    dropped = [r for r in range(3) if r not in kept]
    assert all(first[r] <= scores[:, 1:].mean(0).min() + 1e-6 for r in dropped)


@pytest.mark.parametrize("grid", [True, False], ids=["grid", "horizontal"])
def test_lookahead_drafts_each_paths_next_row_from_the_row_as_that_path_has_it(tiny_backbone, grid):
    """Past the row's end a node's draft state comes from its own path's row (exact up to the root, the path's
    drafted states and tokens after it): every state the tree's draft step predicts is checked against a
    per-path reference that runs the heads' modules one position at a time. A path reading another path's row,
    or another image's, fails."""
    backbone, cols = tiny_backbone, tiny_backbone.geometry.cols
    sampling = SamplingConfig(cfg_scale=3.0)
    heads = random_ssd_heads(backbone.hidden_size, seed=3, grid=grid)
    state, _ = backbone.prefill(Condition(class_ids=torch.tensor([2, 5])), True)
    config = SSDTreeConfig(nodes=128, top_k=2, beam=8, lookahead=cols)
    drafter = SSDTreeDrafter(backbone, heads, state, sampling, config)
    numbers = torch.Generator().manual_seed(0)
    total = backbone.geometry.rows * cols
    tokens = torch.randint(backbone.codebook_size, (2, total), generator=numbers)
    predicting = torch.randn(4, total, backbone.hidden_size, generator=numbers)  # [cond; uncond] rows
    frontier = cols + 1  # row 1's second position: the next row's drafts read the path's row from column 2 on
    last = 2 * cols - 1 - frontier  # the depth of the row's last column
    embed = drafter.drafter.embed
    expanded = {}  # pool node -> (its parent, its tokens, the state its expansion predicted)

    def recording(nodes, pool_parents, states, node_tokens, depth):
        predicted, scores = expand(nodes, pool_parents, states, node_tokens, depth)
        for i, node in enumerate(nodes):
            expanded[node] = (pool_parents[node], node_tokens[:, i], predicted[:, i])
        return predicted, scores

    def reference_state(path_tokens: list[torch.Tensor]) -> torch.Tensor:
        """The draft state predicting the position after the path (root excluded), one position at a time."""
        row_states = [predicting[:, c] for c in range(cols, frontier + 1)]  # row 1 as the path has it
        row_tokens = [tokens[:, c] for c in range(cols, frontier + 1)]
        left, left_token = predicting[:, frontier], tokens[:, frontier]
        for step, token in enumerate([*path_tokens, None]):
            after = frontier + step + 1
            if after == 2 * cols:  # the next row's first position: the vertical head from the path's row
                left = heads.vertical(torch.stack(row_states, 1), embed(torch.stack(row_tokens, 1)))[:, 0]
            elif after < 2 * cols:  # along the root's row: the row above is final
                above, above_token = predicting[:, after - cols], tokens[:, after - cols]
                left = _draft_along(heads, grid, above, above_token, left, left_token, embed)
            else:  # along the next row: the row above is the path's
                above, above_token = row_states[after - 2 * cols], row_tokens[after - 2 * cols]
                left = _draft_along(heads, grid, above, above_token, left, left_token, embed)
            if token is None:
                return left
            left_token = token
            if after < 2 * cols:
                row_states.append(left)
                row_tokens.append(left_token)

    with torch.inference_mode():
        expand = drafter.expander(frontier, tokens, predicting)
        grow_tree(tokens[:, frontier], predicting[:, frontier], recording, drafter.shape(frontier), sampling)
        last_column_nodes = set()
        for node, (_, _, predicted) in expanded.items():
            path = []
            while node != 0:
                path.insert(0, node)
                node = expanded[node][0]
            if len(path) > last:
                last_column_nodes.add(path[last - 1])
            reference = reference_state([expanded[n][1] for n in path])
            torch.testing.assert_close(predicted, reference, rtol=1e-4, atol=1e-4, msg=f"path {path}")
    assert len(last_column_nodes) >= 2, "the test needs next-row nodes under more than one path"


def _draft_along(heads, grid, above, above_token, left, left_token, embed):
    if grid:
        return heads.grid(above, embed(above_token), left, embed(left_token))
    return heads.horizontal(left, embed(left_token))


def test_skipping_candidates_that_cannot_make_the_tree_keeps_the_tree_and_saves_levels(monkeypatch):
    """grow_tree expands no candidate at or below the pool's (nodes - 1)-th best score: with deterministic (top-k)
    candidates the trees are those of expanding every level's `beam` best (the reference: the bar disabled), and
    deep trees stop early."""
    import decode.draft_tree as draft_tree

    vocabulary, batch = 6, 3
    numbers = torch.Generator().manual_seed(1)
    tables = [torch.randn(vocabulary, vocabulary, generator=numbers) * scale for scale in (1.0, 3.0, 6.0)]
    expansions = {"pruned": 0, "reference": 0}
    for table in tables:
        for shape in (
            TreeShape(nodes=12, depth=20, top_k=2, beam=4),
            TreeShape(nodes=40, depth=30, top_k=3, beam=8),
            TreeShape(nodes=7, depth=5, top_k=3, beam=2),
        ):
            trees = {}
            for kind in ("pruned", "reference"):

                def expand(nodes, pool_parents, states, tokens, depth, kind=kind, table=table):
                    expansions[kind] += 1
                    return states, table[tokens]

                with monkeypatch.context() as patch:
                    if kind == "reference":
                        patch.setattr(draft_tree, "_kth_largest", lambda scores, k: float("-inf"))
                    root = torch.arange(batch) % vocabulary
                    trees[kind] = grow_tree(root, torch.zeros(batch, 1, 1), expand, shape, GREEDY)
            assert torch.equal(trees["pruned"].tokens, trees["reference"].tokens)
            assert torch.equal(trees["pruned"].parents, trees["reference"].parents)
            assert trees["pruned"].ranks == trees["reference"].ranks
    assert expansions["pruned"] < 0.8 * expansions["reference"], expansions


@pytest.mark.parametrize("draws", ["top_k", "sampled"])
def test_a_tree_level_reads_the_device_once_and_a_walk_once_per_depth(monkeypatch, draws):
    """On a GPU every host read (`.tolist()`, `.item()`, `int(t)`, `bool(t)`) waits for the device: growing a tree
    reads its frontier once per level, walking it reads once per depth plus the tree's shape and the counts."""
    vocabulary, batch = 8, 2
    table = torch.randn(vocabulary, vocabulary, generator=torch.Generator().manual_seed(3)) * 2
    shape = TreeShape(nodes=40, depth=12, top_k=3, beam=6, draws=draws)
    sampling = SamplingConfig(temperature=1.0)
    levels = []

    def expand(nodes, pool_parents, states, tokens, depth):
        levels.append(depth)
        return states, table[tokens]

    reads = [0]
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    generator = torch.Generator().manual_seed(0)
    tree = grow_tree(torch.arange(batch), torch.zeros(batch, 1, 1), expand, shape, sampling, generator)
    assert len(levels) >= 4, levels
    assert reads[0] <= len(levels) + 1, (reads[0], len(levels))  # a read per level and the kept nodes' list
    reads[0] = 0
    target = torch.softmax(torch.randn(batch, len(tree.depths), vocabulary, generator=generator), -1)
    walk_tree(tree, target, generator)
    assert reads[0] <= max(tree.depths) + 1 + 3, (reads[0], max(tree.depths))


# ---- sampled: the backbone's distribution ----------------------------------------------------


@pytest.fixture(scope="module")
def backbone3():
    return enumerable_backbone(grid_size=3, levels=2)


def _sample_tree(backbone, sampling, config):
    heads = random_ssd_heads(16, seed=1, grid=True)
    condition = Condition(class_ids=torch.full((20_000,), CLASS_ID))
    return generate_ssd_tree(backbone, heads, condition, sampling, torch.Generator().manual_seed(0), config)


@pytest.mark.parametrize(
    "config",
    [
        SSDTreeConfig(nodes=6, top_k=2, beam=2),
        SSDTreeConfig(nodes=4, top_k=1, beam=1),
        SSDTreeConfig(nodes=8, top_k=2, beam=2, lookahead=2),
    ],
    ids=["siblings", "chain", "lookahead"],
)
def test_sampled_ssd_tree_has_the_backbone_distribution(backbone3, config):
    sampling = SamplingConfig(cfg_scale=2.0)
    result = _sample_tree(backbone3, sampling, config)
    counts = result.extras  # both siblings are accepted at times
    assert counts["accepted_rank_0"] > 0 and (config.top_k == 1 or counts["accepted_rank_1"] > 0), counts
    assert_sampled_from(result.tokens.flatten(1).tolist(), image_distribution(backbone3, CLASS_ID, sampling))


def test_the_tree_distribution_test_catches_siblings_without_the_residual_update(backbone3, monkeypatch):
    import decode.draft_tree as draft_tree
    from decode.rules import accept_drafts, probability_of

    def without_residual(p, sibling_tokens, sibling_q, uniform, valid=None):  # every sibling against p itself
        width = sibling_tokens.shape[-1]
        accepted = torch.full(sibling_tokens.shape[:-1], width, dtype=torch.long)
        for i in range(width):
            token = sibling_tokens[..., i]
            passes = accept_drafts(
                probability_of(p, token), probability_of(sibling_q[..., i, :], token), uniform[..., i]
            )
            undecided = (accepted == width) & (valid[..., i] if valid is not None else True)
            accepted = torch.where(undecided & passes, i, accepted)
        return accepted, p

    monkeypatch.setattr(draft_tree, "accept_among_siblings", without_residual)
    sampling = SamplingConfig(cfg_scale=2.0)
    result = _sample_tree(backbone3, sampling, SSDTreeConfig(nodes=6, top_k=2, beam=2))
    pvalue = fit_pvalue(result.tokens.flatten(1).tolist(), image_distribution(backbone3, CLASS_ID, sampling))
    assert pvalue < 1e-6, f"siblings tested against p without the residual update went unnoticed (p = {pvalue:.2e})"


def test_a_calibrated_tree_never_keeps_a_draw_outside_the_drafts_support():
    """Top-k sampling leaves q = 0 on most tokens; a candidate there would be tested with q(x) = 0 (always
    accepted where the target has mass), so the tree must not keep it, whatever the acceptance model says."""
    from decode.draft_tree import AcceptanceModel

    vocabulary = 6
    scores = torch.full((1, 1, vocabulary), float("-inf"))
    scores[..., :2] = torch.tensor([1.0, 0.5])

    def expand(nodes, pool_parents, states, tokens, depth):
        return states, scores.expand(1, states.shape[1], -1)

    sampling = SamplingConfig(top_k=2)
    tree = grow_tree(
        torch.tensor([0]),
        torch.zeros(1, 4),
        expand,
        TreeShape(nodes=20, depth=3, top_k=4, beam=4, draws="sampled"),
        sampling,
        torch.Generator().manual_seed(0),
        AcceptanceModel(ranks=4),
    )
    assert bool((tree.tokens[:, 1:] < 2).all()), tree.tokens
    assert len(tree.depths) > 4  # the two supported tokens at every level are kept


def _first_token_pvalue(trials: int = 200_000) -> float:
    """Chi-square p-value of the first token after a root whose three children are draws without replacement from
    a q that disagrees with the target p (one level, a batch of `trials` images), walked by `walk_tree`."""
    from scipy.stats import chisquare

    from decode.draft_tree import walk_tree

    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])
    generator = torch.Generator().manual_seed(0)

    def expand(nodes, pool_parents, states, tokens, depth):
        return states, q.log().expand(trials, states.shape[1], -1)

    shape = TreeShape(nodes=4, depth=1, top_k=3, beam=1, draws="sampled")
    root = torch.zeros(trials, dtype=torch.long)
    tree = grow_tree(root, torch.zeros(trials, 1, 1), expand, shape, SamplingConfig(), generator)
    walk = walk_tree(tree, p.expand(trials, len(tree.depths), -1).clone(), generator)
    accepted_child = tree.tokens.gather(1, walk.path[:, 1:2].clamp(min=0))[:, 0]
    first = torch.where(walk.length > 1, accepted_child, walk.next_token)
    counts = torch.bincount(first, minlength=len(p)).double()
    return chisquare(counts.numpy(), (p.double() / p.double().sum() * counts.sum()).numpy()).pvalue


def test_sampled_siblings_are_tested_against_q_without_their_earlier_siblings(monkeypatch):
    """A draw without replacement comes from q with the earlier siblings taken out; testing it against q itself
    (the planted bug) biases the tree's tokens, and the test has the power to see it."""
    import decode.draft_tree as draft_tree

    assert _first_token_pvalue() > 1e-3

    def full_q(tree, children, sibling_tokens, vocabulary):
        q = tree.proposals[:, children[:, 0].clamp(min=0)]
        return q[:, :, None].expand(-1, -1, children.shape[1], -1)

    monkeypatch.setattr(draft_tree, "_sibling_proposals", full_q)
    assert _first_token_pvalue() < 1e-6


# ---- batch 1: the tree's shape follows the image's own draws ----------------------------------


def _two_token_walks(
    trials: int, calibrated: bool, seed: int = 0, min_score: float = float("-inf")
) -> tuple[list[list[int]], dict[tuple, float]]:
    """The first two tokens after a fixed root from `trials` batch-1 trees (nodes 3, depth 2, two sampled draws
    per node: which nodes are kept depends on the draws), drafted from a table q(next | token) and walked
    against another, p; and their true distribution p(a | root) p(b | a)."""
    from decode.draft_tree import AcceptanceModel, walk_tree

    vocabulary, root = 4, 0
    tables = torch.Generator().manual_seed(5)
    draft_logits = torch.randn(vocabulary, vocabulary, generator=tables) * 1.5
    target = (torch.randn(vocabulary, vocabulary, generator=tables)).softmax(-1)
    truth = {(a, b): float(target[root, a] * target[a, b]) for a in range(vocabulary) for b in range(vocabulary)}

    def expand(nodes, pool_parents, states, tokens, depth):
        return states, draft_logits[tokens]

    shape = TreeShape(nodes=3, depth=2, top_k=2, beam=2, draws="sampled")
    generator = torch.Generator().manual_seed(seed)
    model = AcceptanceModel(ranks=2) if calibrated else None  # learns from the walks, as in a generation
    pairs = []
    for _ in range(trials):
        tree = grow_tree(
            torch.tensor([root]), torch.zeros(1, 1, 1), expand, shape, SamplingConfig(), generator, model, min_score
        )
        walk = walk_tree(tree, target[tree.tokens], generator)
        if model is not None:
            model.update(walk)
        tokens = [int(tree.tokens[0, node]) for node in walk.path[0, 1:].tolist() if node >= 0]
        tokens.append(int(walk.next_token[0]))
        if len(tokens) < 2:  # the whole tree was rejected: the second token comes from the target itself
            tokens.append(int(torch.multinomial(target[tokens[0]], 1, generator=generator)))
        pairs.append(tokens[:2])
    return pairs, truth


@pytest.mark.parametrize(
    "calibrated, min_score",
    [(False, float("-inf")), (True, float("-inf")), (True, -1.2)],
    ids=["draft-confidence", "calibrated", "calibrated-threshold"],
)
def test_a_batch_1_sampled_tree_keeps_the_targets_distribution(calibrated, min_score):
    """At batch 1 the kept nodes are chosen from this image's own draws; a draw must not be kept for its own
    value (it would no longer be distributed as the proposal it is tested with). A cost budget's threshold
    (min_score) drops the nodes below it, still blind to their values."""
    pairs, truth = _two_token_walks(4000, calibrated, min_score=min_score)
    assert_sampled_from(pairs, truth)


def test_the_batch_1_tree_test_catches_draws_kept_by_their_own_probability(monkeypatch):
    """The bias earlier versions had: a sampled draw scored by q of its own token."""
    import decode.draft_tree as draft_tree

    candidates = draft_tree._candidates

    def own_value_confidence(scores, k, sampling, sampled, generator):
        tokens, log_confidence, feature, q = candidates(scores, k, sampling, sampled, generator)
        own = q.gather(-1, tokens)
        return tokens, own.log(), (own / (1 - (own.cumsum(-1) - own)).clamp(min=1e-12)).clamp(max=1.0), q

    monkeypatch.setattr(draft_tree, "_candidates", own_value_confidence)
    pairs, truth = _two_token_walks(4000, calibrated=False)
    pvalue = fit_pvalue(pairs, truth)
    assert pvalue < 1e-6, f"draws kept by their own probability went unnoticed (p = {pvalue:.2e})"


def test_sampled_and_point_candidate_trees_are_reported_as_lossless():
    from decode.eagle2 import METHOD as EAGLE2
    from decode.eagle2 import Eagle2DecodeConfig
    from decode.ssd_tree import METHOD as SSD_TREE

    assert SSD_TREE.lossless(SSDTreeConfig()) and SSD_TREE.lossless(SSDTreeConfig(draws="top_k"))
    assert EAGLE2.lossless(Eagle2DecodeConfig()) and EAGLE2.lossless(Eagle2DecodeConfig(draws="sampled"))


def test_a_threshold_keeps_exactly_the_candidates_that_clear_it():
    """grow_tree's min_score (the cost budget's): the tree is the root and the pool's candidates scoring at
    least the threshold, ancestor-closed, never more than `nodes`."""
    vocabulary = 6
    table = torch.randn(vocabulary, vocabulary, generator=torch.Generator().manual_seed(1)) * 2

    def expand(nodes, pool_parents, states, tokens, depth):
        return states, table[tokens]

    shape, root = TreeShape(nodes=40, depth=4, top_k=3, beam=3), torch.tensor([2])
    full = grow_tree(root, torch.zeros(1, 1, 1), expand, shape, GREEDY)
    log_q = table.log_softmax(-1)
    path_scores = [0.0]
    for node in range(1, len(full.depths)):  # top-k at batch 1: the path's summed log-probability
        parent = int(full.parents[node])
        path_scores.append(path_scores[parent] + float(log_q[full.tokens[0, parent], full.tokens[0, node]]))
    threshold = sorted(path_scores)[len(path_scores) // 2]
    pruned = grow_tree(root, torch.zeros(1, 1, 1), expand, shape, GREEDY, min_score=threshold)
    kept = {
        tuple(full.tokens[0, n].tolist() for n in _path(full, node))
        for node in range(len(full.depths))
        if path_scores[node] >= threshold
    }
    got = {tuple(pruned.tokens[0, n].tolist() for n in _path(pruned, node)) for node in range(len(pruned.depths))}
    assert 1 < len(got) < len(full.depths) and got == kept


def _path(tree, node: int) -> list[int]:
    """The nodes from the root to `node`."""
    path = [node]
    while int(tree.parents[path[-1]]) >= 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def test_the_node_budget_threshold_is_the_marginal_cost_of_a_node_at_the_measured_rate():
    """C(n) = a + b n measured: after rounds averaging n nodes, E tokens and D seconds beyond their pass, a node
    must be reached with probability b E / (C(n) + D) to pay for its place (decode/tree_budget.py)."""
    import math

    from decode.tree_budget import NodeBudget

    budget = NodeBudget.__new__(NodeBudget)
    budget.counts = [1, 8, 16, 32, 64]
    budget.seconds = [0.004 + 0.0003 * n for n in budget.counts]
    budget.passes, budget.tokens, budget.nodes, budget.overhead = 0, 0.0, 0.0, 0.0
    assert budget.min_log_score() == float("-inf")  # the first pass: the whole tree
    budget.observe(40, 6, 0.004 + 0.0003 * 40 + 0.003)  # rounds 3 and 1 ms longer than their passes: D = 2 ms
    budget.observe(20, 2, 0.004 + 0.0003 * 20 + 0.001)
    expected = 0.0003 * 4 / (0.004 + 0.0003 * 30 + 0.002)
    assert math.isclose(math.exp(budget.min_log_score()), expected, rel_tol=1e-9)
