"""Ragged SSD with continuous batching (decode/ssd_ragged.py) is lossless, keeps images apart, and gives an
image the same tokens whatever images share its batch.

Greedy: equal to greedy AR with images that finish at different times (random heads: every image has its own
rejections) and slots refilled from the queue, on the digits backbone and every adapter. Sampled: chi-square
against the enumerated 3x3 grid with 2,000 slots over a 40,000-image queue; the same planted bias the SSD test
catches is caught here. A planted leak between images (a pass fed at another image's frontier, a refilled slot
that keeps the previous image's prompt) changes the sampled tokens an image gets alone.
"""

import pytest
import torch
from conftest import TINY_BACKBONE, random_ssd_heads
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution
from ragged_leaks import PLANTED_LEAKS, record_ragged_batch_sizes
from tiny_adapters import ADAPTERS, queue_of_four

from backbones.base import ARImageBackbone, Condition
from backbones.digits import random_digits_backbone
from decode.ar import generate_ar
from decode.sampling import SamplingConfig
from decode.ssd_ragged import RaggedSSDConfig, generate_ssd_ragged

QUEUE = Condition(class_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))


def _ragged(backbone, heads, condition, sampling, seed=0, **settings):
    return generate_ssd_ragged(
        backbone, heads, condition, sampling, torch.Generator().manual_seed(seed), RaggedSSDConfig(**settings)
    )


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize(
    "slots,window,grid", [(1, 0, True), (4, 0, True), (4, 3, False), (10, 0, False), (16, 2, True)]
)
def test_greedy_ragged_ssd_equals_greedy_ar(tiny_backbone, slots, window, grid, cfg_scale):
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=grid)
    result = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=slots, window=window)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)
    assert 0 < result.accepted_tokens < result.drafted_tokens  # drafts pass and fail: the rules run


@pytest.mark.parametrize(
    "slots,window,grid,confidence",
    [(1, 0, True, 0.0), (4, 0, False, 0.0), (4, 3, True, 0.0), (10, 4, False, 0.01), (16, 2, True, 0.05)],
)
def test_greedy_ragged_ssd_with_lookahead_equals_greedy_ar(tiny_backbone, slots, window, grid, confidence):
    """Lookahead: a pass that reaches a row's end also tests the next row's drafts, which were drafted before
    the row was final; a correction in the row (its last column too) must leave them unused."""
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=grid)
    settings = dict(slots=slots, window=window, lookahead=True, lookahead_confidence=confidence)
    result = _ragged(tiny_backbone, heads, QUEUE, sampling, **settings)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)
    assert result.extras["lookahead"] > 0  # passes did go on into the next row


def test_lookahead_that_tests_stale_drafts_is_caught(tiny_backbone, monkeypatch):
    """Planted: after a pass whose row ends in a correction, the next row's drafts it fed (drafted before the
    correction, their states computed after the rejected token) are tested anyway. Greedy output leaves AR's."""
    monkeypatch.setattr("decode.ssd_ragged._fed_ahead", lambda going, ready: going)
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=True)
    result = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=1, window=0, lookahead=True)
    assert not torch.equal(result.tokens, generate_ar(tiny_backbone, QUEUE, sampling).tokens)


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("lookahead", [False, True], ids=["row-by-row", "lookahead"])
@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_greedy_ragged_ssd_equals_greedy_ar_on_every_adapter(family, lookahead):
    make_backbone, make_condition, cfg_scale = ADAPTERS[family]
    backbone = make_backbone()
    queue = queue_of_four(make_condition())
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    heads = random_ssd_heads(backbone.hidden_size, seed=0, std=0.3, grid=True)
    result = _ragged(backbone, heads, queue, sampling, slots=2, lookahead=lookahead)  # 4 images over 2 slots
    assert torch.equal(result.tokens, generate_ar(backbone, queue, sampling).tokens)


@pytest.mark.parametrize("lookahead", [False, True], ids=["row-by-row", "lookahead"])
@pytest.mark.parametrize("grid", [True, False], ids=["grid-heads", "horizontal-heads"])
def test_an_image_gets_the_same_tokens_whatever_its_batch_and_window(tiny_backbone, grid, lookahead):
    """Sampled, same seed: one slot to the row's end, five slots (refilled in another order) with a window of 1,
    all ten at once with a window of 2 and with cost-aware windows give every image the same tokens, bit for
    bit (drafts change only after corrections, each test's uniform is keyed by its image and draft; the digits
    backbone's batched float32 passes agree to far below the gaps between a uniform and its threshold). With
    lookahead the next row's drafts are made from the row as it stood at its last correction, with fixed keys,
    so whether and when a pass looked ahead (window, confidence gate) changes no token either."""
    sampling = SamplingConfig(cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=grid)
    alone = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=1, window=0, lookahead=lookahead)
    runs = [(5, 1, 0.0), (10, 2, 0.0), (10, "auto", 0.0)] + ([(4, 0, 0.3), (1, 5, 0.05)] if lookahead else [])
    for slots, window, confidence in runs:
        settings = dict(slots=slots, window=window, lookahead=lookahead, lookahead_confidence=confidence)
        batched = _ragged(tiny_backbone, heads, QUEUE, sampling, **settings)
        assert torch.equal(batched.tokens, alone.tokens), (slots, window, confidence)


@pytest.mark.parametrize("window", [2, "auto"])
def test_a_draining_batch_computes_no_finished_image_and_changes_no_token(tiny_backbone, window, monkeypatch):
    """Ten images over ten slots, no queue: as images finish, the passes shrink to the ones still decoding
    (never below them), with the same tokens and passes as a batch that keeps every slot to the end."""
    sampling = SamplingConfig(cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=True)
    kept = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=10, window=window, drain=0)
    batch_sizes = record_ragged_batch_sizes(monkeypatch)
    drained = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=10, window=window)
    assert torch.equal(drained.tokens, kept.tokens)
    if window != "auto":  # (auto windows follow the measured costs, which draining changes)
        assert drained.forward_passes == kept.forward_passes
    assert drained.extras["drains"] >= 2 and kept.extras["drains"] == 0
    assert batch_sizes[-1] < 10 and batch_sizes == sorted(batch_sizes, reverse=True)


# 40 images: a leak that moves an image's states a little (fed a few positions off, from its own cache) flips a
# sampled token only where a uniform lies near its threshold, in about a quarter of the tiny backbone's images.
LEAK_QUEUE = Condition(class_ids=torch.arange(40) % 10)


@pytest.fixture(scope="module")
def tokens_alone():
    """The tiny backbone, random heads and the leak queue's sampled tokens, each image decoded alone (one slot)."""
    backbone = random_digits_backbone(seed=0, **TINY_BACKBONE)
    heads = random_ssd_heads(backbone.hidden_size, seed=0, std=0.3, grid=True)
    sampling = SamplingConfig(cfg_scale=3.0)
    return backbone, heads, _ragged(backbone, heads, LEAK_QUEUE, sampling, slots=1, window=2).tokens


def test_images_of_a_batch_of_four_get_the_tokens_they_get_alone(tokens_alone):
    backbone, heads, alone = tokens_alone
    together = _ragged(backbone, heads, LEAK_QUEUE, SamplingConfig(cfg_scale=3.0), slots=4, window=2).tokens
    assert torch.equal(together, alone)


@pytest.mark.parametrize("leak", PLANTED_LEAKS)
def test_a_planted_leak_between_images_is_caught(tokens_alone, leak, monkeypatch):
    """Sampled tokens are sensitive to any change of an image's target (a uniform meets another threshold):
    with the leak, images in a batch of four no longer get the tokens they get alone."""
    backbone, heads, alone = tokens_alone
    leak(monkeypatch)
    leaky = _ragged(backbone, heads, LEAK_QUEUE, SamplingConfig(cfg_scale=3.0), slots=4, window=2).tokens
    assert not torch.equal(leaky, alone), "the planted leak went unnoticed"


CLASS_ID = 4


@pytest.fixture(scope="module")
def backbone3():
    return enumerable_backbone(grid_size=3, levels=2)


def _sample(backbone, window: int, lookahead: bool = False):
    """40,000 images of one class over 2,000 slots: frontiers at every row and column, slots refilled."""
    heads = random_ssd_heads(16, seed=1, grid=True)
    condition = Condition(class_ids=torch.full((40_000,), CLASS_ID))
    return generate_ssd_ragged(
        backbone,
        heads,
        condition,
        SamplingConfig(cfg_scale=2.0),
        torch.Generator().manual_seed(0),
        RaggedSSDConfig(slots=2_000, window=window, grid_steps=0, lookahead=lookahead),
    )


@pytest.mark.slow  # the planted-bias checks below keep the test's power in the fast tier
@pytest.mark.parametrize("window,lookahead", [(0, False), (1, False), (0, True), (2, True)])
def test_sampled_ragged_ssd_has_the_backbone_distribution(backbone3, window, lookahead):
    truth = image_distribution(backbone3, CLASS_ID, SamplingConfig(cfg_scale=2.0))
    result = _sample(backbone3, window, lookahead)
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def _stale_lookahead(monkeypatch):
    """Lookahead's drafts tested even after a correction in the row above made them stale."""
    monkeypatch.setattr("decode.ssd_ragged._fed_ahead", lambda going, ready: going)


def _residual_without_the_draft(monkeypatch):
    """After a rejection the token is drawn from p instead of the residual norm(max(0, p - q))."""
    monkeypatch.setattr("decode.ssd_ragged.residual_distribution", lambda p, q: p)


@pytest.mark.parametrize(
    "bias,lookahead",
    [(_residual_without_the_draft, False), (_residual_without_the_draft, True), (_stale_lookahead, True)],
    ids=["residual", "residual-lookahead", "stale-lookahead"],
)
def test_the_ragged_distribution_test_catches_a_planted_bias(backbone3, monkeypatch, bias, lookahead):
    bias(monkeypatch)
    result = _sample(backbone3, window=0, lookahead=lookahead)
    truth = image_distribution(backbone3, CLASS_ID, SamplingConfig(cfg_scale=2.0))
    pvalue = fit_pvalue(result.tokens.flatten(1).tolist(), truth)
    assert pvalue < 1e-6, f"the planted bias went unnoticed (p = {pvalue:.2e})"


def test_ragged_ssd_refuses_bad_settings():
    with pytest.raises(ValueError, match="window"):
        RaggedSSDConfig(window=-1)
    with pytest.raises(ValueError, match="mode"):
        RaggedSSDConfig(mode="autocorrect")
    with pytest.raises(ValueError, match="lookahead needs mode exact"):
        RaggedSSDConfig(mode="prefix", lookahead=True)
    with pytest.raises(ValueError, match="lookahead_confidence"):
        RaggedSSDConfig(lookahead=True, lookahead_confidence=1.5)


def test_prefix_mode_spends_at_most_rounds_plus_one_passes_per_row_and_is_exact_with_enough(tiny_backbone):
    """mode prefix (ssd_autocorrect's rule): a row costs at most rounds + 1 passes per image, its unverified
    rest is kept (greedy tokens then leave AR's), and a budget no row exhausts gives greedy AR's tokens."""
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=True)
    ar = generate_ar(tiny_backbone, QUEUE, sampling).tokens
    rows = tiny_backbone.geometry.rows
    one_pass = _ragged(tiny_backbone, heads, QUEUE, sampling, mode="prefix", rounds=0, slots=1)
    assert one_pass.forward_passes <= len(QUEUE.class_ids) * (1 + rows)  # a prefill and a pass per row
    assert not torch.equal(one_pass.tokens, ar)
    generous = _ragged(tiny_backbone, heads, QUEUE, sampling, mode="prefix", rounds=100, slots=3)
    assert torch.equal(generous.tokens, ar)


def test_prefix_mode_spends_its_budget_on_corrections_so_its_tokens_do_not_depend_on_the_window(tiny_backbone):
    """mode prefix counts a row's corrections, not its passes: a window that ends a pass before the row's end
    (fixed, or chosen by the measured cost) corrects nothing and leaves the image's tokens as the whole-row
    passes give them, so the approximate preset keeps its images whatever the timings and the batch."""
    sampling = SamplingConfig(cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=True)
    whole_rows = _ragged(tiny_backbone, heads, QUEUE, sampling, mode="prefix", rounds=1, slots=4)
    for window, slots in ((2, 4), (3, 1), ("auto", 10)):
        windowed = _ragged(tiny_backbone, heads, QUEUE, sampling, mode="prefix", rounds=1, slots=slots, window=window)
        assert torch.equal(windowed.tokens, whole_rows.tokens), f"window {window}, {slots} slots"
        if slots == 4:  # the windows did stop passes short: more of them for the same images
            assert windowed.forward_passes > whole_rows.forward_passes


def test_the_window_chooser_charges_lookahead_drafting_to_the_windows_that_cause_it(tiny_backbone):
    """Flat pass costs and every draft passing: the chooser takes the longest window, past the row's end. Once
    rounds that draft the next row ahead have cost far more than the others, it stops at the row's end for an
    image whose next row is not drafted yet, and goes past it again where that row is drafted already."""
    from types import SimpleNamespace

    from decode.ssd_ragged import _WindowChooser

    cols = tiny_backbone.geometry.cols
    state, _ = tiny_backbone.prefill(Condition(class_ids=torch.tensor([1])), guided=True)
    chooser = _WindowChooser(tiny_backbone, state, 1, cols, guided=True, lookahead=True)
    chooser.seconds_by_length = torch.full_like(chooser.seconds_by_length, 1.0)  # every pass length costs 1 s
    one = torch.ones(1, dtype=torch.long)
    run = SimpleNamespace(
        accepted=torch.full((1,), 1000.0),
        tested=torch.full((1,), 1000.0),
        committed=one * 2,
        row=one,
        cached=one * (cols + 2),
        active=torch.ones(1, dtype=torch.bool),
        next_ready=torch.zeros(1, dtype=torch.bool),
    )
    may = torch.ones(1, dtype=torch.bool)
    assert chooser.choose(run, may) == 2 * cols - 2  # the rest of the row and the whole next row
    chooser.observe(1.0 + 0.1, drafted_ahead=False)
    chooser.observe(1.0 + 10.0, drafted_ahead=True)
    assert chooser.choose(run, may) == cols - 2  # drafting ahead costs 10 s: stop at the row's end
    run.next_ready[:] = True
    assert chooser.choose(run, may) == 2 * cols - 2  # drafted already: going on costs nothing extra
    assert chooser.choose(run, torch.zeros(1, dtype=torch.bool)) == cols - 2  # no lookahead for this image


def test_queued_prompts_are_prefilled_a_batch_at_a_time_into_prompt_sized_caches(tiny_backbone, monkeypatch):
    """Refills take their prompts from prefills of up to `slots` queued images at once, one pass each, into caches
    that hold the prompt alone; an image's tokens are the ones it gets when each refill round prefills its own."""
    sampling = SamplingConfig(cfg_scale=3.0)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=0, std=0.3, grid=True)
    alone = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=1, window=0)
    calls = []
    original = ARImageBackbone.prefill_prompts

    def counted(self, condition, guided):
        state, first = original(self, condition, guided)
        calls.append((condition.batch_size, state.cache.layers[0]._key_buffer.shape[-2], state.prefix_length))
        return state, first

    monkeypatch.setattr(ARImageBackbone, "prefill_prompts", counted)
    batched = _ragged(tiny_backbone, heads, QUEUE, sampling, slots=4, window=2)
    assert torch.equal(batched.tokens, alone.tokens)
    assert 2 <= len(calls) <= 3  # 6 queued images, 4 at a time (a third pass where a refill needs more than is left)
    assert all(size >= 2 for size, _, _ in calls)
    assert all(capacity == prefix for _, capacity, prefix in calls)  # no cache for the image in the queue
