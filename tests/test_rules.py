"""The acceptance rules of decode/rules.py, each checked by value on hand-made distributions."""

import pytest
import torch
from mock_backbone import MockBackbone, MockHeads

from backbones.base import Condition
from decode.rules import (
    accept_among_siblings,
    accept_drafts,
    autocorrect_distributions,
    count_islands,
    first_true,
    island_redraw_distributions,
    islands,
    latent_neighbours,
    point_proposals,
    point_residual,
    pooled_neighbour_mass,
    probability_of,
    relaxed_accept,
    residual_distribution,
)
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig, generate_ssd

# ---- exact speculative sampling ------------------------------------------------------------------


def test_drafts_pass_with_probability_min_one_p_over_q():
    p_x = torch.tensor([0.2, 0.2, 0.5, 0.0])
    q_x = torch.tensor([0.4, 0.4, 0.25, 0.0])
    u = torch.tensor([0.49, 0.51, 0.99, 0.5])
    # p/q = 0.5, 0.5, 2 (always), and q(x) = 0 with p(x) = 0 is never accepted (no division by zero)
    assert accept_drafts(p_x, q_x, u).tolist() == [True, False, True, False]


def test_first_true_finds_each_rows_first_rejection():
    mask = torch.tensor([[False, True, True], [False, False, False], [True, False, True]])
    assert first_true(mask, none=3).tolist() == [1, 3, 0]


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)  # nothing left: fall back to p


def test_residual_is_exact_speculative_sampling_by_enumeration():
    """Accept x ~ q with min(1, p/q), else draw from the residual: the kept token is exactly p-distributed."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    accept = torch.minimum(torch.ones(4), p / q)
    kept = q * accept + (q * (1 - accept)).sum() * residual_distribution(p, q)
    torch.testing.assert_close(kept, p)


def test_point_residual_removes_the_rejected_token_and_renormalises():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(
        point_residual(p, torch.tensor([0, 1])), torch.tensor([[0.0, 0.6, 0.4], [0.0, 1.0, 0.0]])
    )


def test_autocorrect_uses_the_residual_at_the_first_rejection_and_p_after_it():
    p = torch.tensor([[[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]]])  # (B=1, C=3, V=2)
    q = torch.tensor([[[0.2, 0.8], [0.8, 0.2], [0.3, 0.7]]])
    resample = torch.tensor([[False, True, True]])
    first_rejected = torch.tensor([1])
    target = autocorrect_distributions(p, q, resample, first_rejected, everywhere_residual=False)
    torch.testing.assert_close(target, torch.tensor([[0.0, 1.0], [0.9, 0.1]]))  # residual at 1, p at 2
    paper = autocorrect_distributions(p, q, resample, first_rejected, everywhere_residual=True)
    torch.testing.assert_close(paper, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # the residual everywhere


# ---- relaxed acceptance (LANTERN) ----------------------------------------------------------------


def test_latent_neighbours_are_nearest_first():
    latents = torch.tensor([[0.0], [0.1], [0.3], [0.35], [1.0]])
    assert latent_neighbours(latents, 2).tolist() == [[1, 2], [0, 2], [3, 1], [2, 1], [3, 2]]


def test_pooled_mass_takes_the_longest_prefix_within_delta():
    neighbours = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 3, 0], [2, 1, 0]])
    p = torch.tensor([[0.4, 0.1, 0.15, 0.35]])
    x = torch.tensor([0])  # neighbours of 0: 1 (0.1), 2 (0.15), 3 (0.35): prefix sums 0.1, 0.25, 0.6
    assert pooled_neighbour_mass(p, x, neighbours, delta=0.3).item() == pytest.approx(0.25)
    assert pooled_neighbour_mass(p, x, neighbours, delta=0.2).item() == pytest.approx(0.1)
    assert pooled_neighbour_mass(p, x, neighbours, delta=0.05).item() == 0.0
    assert pooled_neighbour_mass(p, x, neighbours, delta=0.0).item() == 0.0


def test_relaxed_acceptance_follows_the_formula_and_reduces_to_standard_with_delta_zero():
    neighbours = torch.tensor([[1, 2], [0, 2], [1, 0]])
    p = torch.tensor([[0.2, 0.5, 0.3]] * 4)
    x = torch.tensor([0, 0, 2, 2])
    u = torch.tensor([0.15, 0.25, 0.25, 0.35])
    # delta = 0: accept with probability p(x): u < 0.2, u < 0.2, u < 0.3, u < 0.3
    assert relaxed_accept(p, x, neighbours, 0.0, greedy=False, uniform=u).tolist() == [True, False, True, False]
    # delta = 0.5: x=0 pools p(1)=0.5 -> 0.7; x=2 pools p(1)=0.5 -> 0.8
    assert relaxed_accept(p, x, neighbours, 0.5, greedy=False, uniform=u).tolist() == [True, True, True, True]
    # greedy: delta = 0 accepts only the argmax; with pooling, x=2 (0.3 + 0.5) beats max p = 0.5
    assert relaxed_accept(p, x, neighbours, 0.0, greedy=True, uniform=u).tolist() == [False] * 4
    assert relaxed_accept(p, torch.tensor([1, 2, 2, 2]), neighbours, 0.5, greedy=True, uniform=u).tolist() == [True] * 4


def test_relaxed_acceptance_divides_by_the_proposal_probability():
    neighbours = torch.tensor([[1, 2], [0, 2], [1, 0]])
    p = torch.tensor([[0.2, 0.5, 0.3]] * 4)
    x = torch.tensor([0, 0, 2, 2])
    q_x = torch.tensor([0.4, 0.4, 0.3, 0.3])
    u = torch.tensor([0.45, 0.55, 0.99, 0.0])
    # delta = 0: accept with probability min(1, p(x) / q(x)): 0.5, 0.5, 1, 1
    assert relaxed_accept(p, x, neighbours, 0.0, greedy=False, uniform=u, q_of_tokens=q_x).tolist() == [
        True,
        False,
        True,
        True,
    ]
    # delta = 0.5: x=0 pools p(1) -> min(1, 0.7 / 0.4) = 1
    assert relaxed_accept(p, x, neighbours, 0.5, greedy=False, uniform=u, q_of_tokens=q_x).all()
    # a drafter that proposes exactly p is always accepted, whatever the uniform
    u = torch.rand(4)
    assert relaxed_accept(p, x, neighbours, 0.0, False, u, q_of_tokens=p.gather(-1, x[:, None])[:, 0]).all()


def test_pooled_mass_sums_nearest_first_not_in_mass_order():
    """LANTERN's c_m by hand (jadohu/LANTERN ``evaluate_posterior``: cumsum of p over the draft's k nearest latents,
    nearest first, the last prefix <= delta): masses that are not ascending nearest-first, so sorting them, reading
    them farthest-first, skipping one that does not fit, or a budget off by a factor of 2 each give another c_m."""
    # 1-D latents: from token 0 the others lie at 1 (token 3), 2 (1), 3 (4), 4 (2) and 9 (5, beyond k = 4)
    latents = torch.tensor([[0.0], [2.0], [4.0], [1.0], [3.0], [9.0]])
    neighbours = latent_neighbours(latents, 4)
    assert neighbours[0].tolist() == [3, 1, 4, 2]
    p = torch.tensor([[10, 2, 6, 8, 1, 5]]) / 32  # nearest-first masses of token 0's neighbours: 8, 2, 1, 6 (/32)
    x = torch.tensor([0])
    # prefix sums nearest first: 8, 10, 11, 17; ascending (1, 2, 6, 8): 1, 3, 9, 17; descending: 8, 14, ...
    for budget, pooled in [
        (12, 11),  # ascending or reversed 9, descending 8, budget 24 17, budget 6 0, the next prefix 17
        (11, 11),  # a prefix exactly at the budget counts (<=, not <: 10)
        (9, 8),  # the sum ends at the first prefix over the budget (skipping 2 to add 1 would make 9)
    ]:
        assert pooled_neighbour_mass(p, x, neighbours, budget / 32).item() == pooled / 32, budget
    # the verdict at delta = 12/32: accept with probability min(1, (p(x) + c_m) / q(x)) = (10 + 11) / 24 = 0.875
    q_x = torch.tensor([0.75, 0.75])
    u = torch.tensor([0.86, 0.89])  # c_m 9/32 or 8/32 rejects both, 12/32 or more accepts both
    assert relaxed_accept(p.expand(2, -1), x.expand(2), neighbours, 12 / 32, False, u, q_x).tolist() == [True, False]


def test_ssd_relaxed_test_pools_within_its_own_budget():
    """SSD's relaxed test passes relax_delta to the rule as it is. On the mock backbone p puts ~1 on the target
    and ~2e-9 on each other token, and heads that add 2 draft a wrong token whose latent neighbours include the
    target (k = 6: all of them): every prefix sum that reaches the target is ~1, over a budget of 0.6 (nothing
    pooled but the ~1e-8 before it, every draft rejected) and within a budget twice that (every draft accepted)."""
    backbone = MockBackbone(rows=4, cols=5)
    result = generate_ssd(
        backbone, MockHeads(7, 2, 2), Condition(class_ids=torch.zeros(3, dtype=torch.long)), SamplingConfig(),
        torch.Generator().manual_seed(0), SSDDecodeConfig(mode="exact", relax_k=6, relax_delta=0.6),
    )  # fmt: skip
    assert result.accepted_tokens == 0 and result.drafted_tokens == 3 * 4 * 10  # 4 + 3 + 2 + 1 per row
    assert torch.equal(result.tokens, backbone.target_tokens().expand(3, -1, -1))


# ---- islands -----------------------------------------------------------------------------------


def test_islands_are_8_connected_and_grow_by_the_radius_within_borders():
    rejected = torch.zeros(1, 3, 8, dtype=torch.bool)
    rejected[0, 0, 0] = rejected[0, 1, 1] = True  # diagonal neighbours: one island under 8-connectivity
    rejected[0, 2, 6] = True
    grown = islands(rejected, radius=0)
    assert count_islands(grown) == [2] and torch.equal(grown, rejected)
    grown = islands(rejected, radius=1)
    assert count_islands(grown) == [2]
    assert grown[0, :, :3].all() and not grown[0, :, 3].any()  # clipped at the left border, 3 wide
    assert grown[0, 1:, 5:].all() and not grown[0, 0, 5:].any()  # the corner island stays inside the block
    far = torch.zeros(1, 3, 8, dtype=torch.bool)
    far[0, 1, 1] = far[0, 1, 5] = True
    assert count_islands(islands(far, radius=1)) == [2] and count_islands(islands(far, radius=2)) == [1]  # merges


def test_island_cells_are_redrawn_from_the_residual_where_rejected_and_from_p_where_pulled_in():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]])  # (B=1, L=3, V=3)
    q = torch.tensor([[[0.2, 0.6, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]])
    passed = torch.tensor([[False, True, True]])
    redrawn = torch.tensor([[True, True, False]])  # cell 1 passed but lies in cell 0's island
    redraw = island_redraw_distributions(p, q, passed, redrawn)
    torch.testing.assert_close(redraw, torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.1, 0.8]]))
    # point proposals (no q): every island cell from p
    torch.testing.assert_close(island_redraw_distributions(p, None, passed, redrawn), p[0, :2])


# ---- multi-candidate (token-tree) acceptance -----------------------------------------------------

# A target that is not peaked and a proposal that disagrees with it, so that siblings are often rejected and the
# residual after one rejection differs from p (what the planted bugs below get wrong).
TREE_P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
TREE_Q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])


def _draw_siblings(trials: int, siblings: int, how: str, generator: torch.Generator):
    """Siblings at one position and the proposal each was drawn from: (trials, K) tokens, (trials, K, V) q_i."""
    vocabulary = len(TREE_Q)
    q = TREE_Q.expand(trials, vocabulary)
    if how == "independent":  # x_i ~ q, each on its own
        tokens = torch.multinomial(q, siblings, replacement=True, generator=generator)
        return tokens, q[:, None].expand(trials, siblings, vocabulary)
    if how == "without_replacement":  # x_i ~ q without x_1..x_{i-1}, renormalised
        tokens = torch.multinomial(q, siblings, replacement=False, generator=generator)
        proposals, left = [], q.clone()
        for i in range(siblings):
            proposals.append(left / left.sum(-1, keepdim=True))
            left = left.scatter(-1, tokens[:, i : i + 1], 0.0)
        return tokens, torch.stack(proposals, 1)
    tokens = TREE_Q.topk(siblings).indices.expand(trials, siblings)  # "top_k": deterministic candidates
    return tokens, point_proposals(tokens, vocabulary)


def _tree_position_counts(how: str, siblings: int, share_uniform=False, skip_residual=False, trials=200_000):
    """Counts of the token a position of a token tree ends with: an accepted sibling, else the final target."""
    generator = torch.Generator().manual_seed(0)
    tokens, proposals = _draw_siblings(trials, siblings, how, generator)
    uniform = torch.rand(trials, siblings, generator=generator)
    if share_uniform:  # planted bug: one uniform for every sibling
        uniform = uniform[:, :1].expand(-1, siblings)
    if skip_residual:  # planted bug: every sibling tested against p itself
        accepted = torch.full((trials,), siblings)
        for i in range(siblings):
            passes = accept_drafts(TREE_P[tokens[:, i]], probability_of(proposals[:, i], tokens[:, i]), uniform[:, i])
            accepted = torch.where((accepted == siblings) & passes, i, accepted)
        left = TREE_P.expand(trials, -1)
    else:
        accepted, left = accept_among_siblings(TREE_P.expand(trials, -1), tokens, proposals, uniform)
    fallback = torch.multinomial(left, 1, generator=generator)[:, 0]
    chosen = tokens.gather(1, accepted.clamp(max=siblings - 1)[:, None])[:, 0]
    final = torch.where(accepted < siblings, chosen, fallback)
    return torch.bincount(final, minlength=len(TREE_P)).double()


def _p_value(counts):
    from scipy.stats import chisquare

    expected = TREE_P.double() / TREE_P.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("how", ["independent", "without_replacement", "top_k"])
def test_siblings_tested_in_turn_against_the_residual_keep_the_targets_distribution(how):
    assert _p_value(_tree_position_counts(how, siblings=3)) > 1e-3


@pytest.mark.parametrize("how", ["independent", "without_replacement", "top_k"])
def test_siblings_tested_against_the_same_target_without_the_residual_are_caught(how):
    assert _p_value(_tree_position_counts(how, siblings=3, skip_residual=True)) < 1e-6


@pytest.mark.parametrize("how", ["independent", "without_replacement"])
def test_two_siblings_sharing_one_uniform_are_caught(how):
    assert _p_value(_tree_position_counts(how, siblings=3, share_uniform=True)) < 1e-6


def test_sibling_acceptance_by_value():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    tokens = torch.tensor([[3, 1]])  # sibling 0 has no target mass: always rejected
    q = point_proposals(tokens, 4)
    # sibling 1 against p without token 3 (which held none): accepted iff u < 0.3
    for u, expected in ((0.29, 1), (0.31, 2)):
        accepted, left = accept_among_siblings(p, tokens, q, torch.tensor([[0.0, u]]))
        assert accepted.tolist() == [expected]
    # after both rejections the target is p without tokens 3 and 1, renormalised
    torch.testing.assert_close(left, torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]]))
