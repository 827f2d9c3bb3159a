"""The acceptance rules of decode/rules.py, each checked by value on hand-made distributions."""

import pytest
import torch

from decode.rules import (
    accept_drafts,
    autocorrect_distributions,
    count_islands,
    first_true,
    island_redraw_distributions,
    islands,
    latent_neighbours,
    point_residual,
    pooled_neighbour_mass,
    relaxed_accept,
    residual_distribution,
)

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
