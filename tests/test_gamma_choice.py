"""The cost-aware draft length of CSpD (decode/gamma_choice.py) weighs acceptance against what a round costs."""

import pytest

from decode.gamma_choice import GammaChooser


def _chooser_after(rounds: list[tuple[int, float]], rate: float, max_gamma: int = 8) -> GammaChooser:
    """A chooser that has seen rounds of (drafts, seconds), each keeping `rate` of 100 drafts reached."""
    chooser = GammaChooser(max_gamma)
    for drafts, seconds in rounds:
        chooser.lengths.append(drafts)
        chooser.seconds.append(seconds)
        chooser.reached += 100
        chooser.kept += 100 * rate
    return chooser


def test_the_first_rounds_draft_one_then_two_so_that_the_cost_line_has_two_lengths():
    chooser = GammaChooser(max_gamma=8)
    assert chooser.choose() == 1
    chooser.start_round()
    chooser.end_round(1, reached=1, kept=0)
    assert chooser.choose() == 2
    assert GammaChooser(max_gamma=1).choose() == 1


def test_the_cost_line_is_fitted_to_the_rounds_seconds():
    chooser = _chooser_after([(1, 3.0), (2, 5.0), (4, 9.0)], rate=0.5)
    base, slope = chooser.cost_line()
    assert base == pytest.approx(1.0) and slope == pytest.approx(2.0)


def test_long_rounds_where_drafts_pass_and_cost_little_one_draft_where_they_fail_or_cost_much():
    cheap_drafts = [(1, 1.1), (2, 1.2)]  # a round costs 1 + 0.1 per draft
    assert _chooser_after(cheap_drafts, rate=0.95).choose() == 8
    assert _chooser_after(cheap_drafts, rate=0.02).choose() == 1
    dear_drafts = [(1, 2.0), (2, 3.0)]  # every draft costs what the rest of the round does
    assert _chooser_after(dear_drafts, rate=0.6).choose() == 1
    middle = _chooser_after([(1, 1.25), (2, 1.5)], rate=0.8).choose()
    assert 1 < middle < 8


def test_a_bad_max_gamma_is_refused():
    with pytest.raises(ValueError, match="max_gamma >= 1"):
        GammaChooser(max_gamma=0)
