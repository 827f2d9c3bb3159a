"""SSD decoding: lossless exact mode, accept/reject accounting, autocorrect, distribution."""

import itertools

import pytest
import torch
from conftest import random_ssd_heads
from mock_backbone import MockBackbone, MockHeads

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode.ar import generate_ar
from decode.sampling import SamplingConfig, token_distribution
from decode.ssd import SSDDecodeConfig, generate_ssd

GREEDY = SamplingConfig(greedy=True)


# ---- mock backbone: every pass count is known ------------------------------------------------


def test_accept_all_costs_one_pass_per_row():
    backbone = MockBackbone(rows=4, cols=5)
    result = generate_ssd(backbone, MockHeads(7, 1, 1), Condition(class_ids=torch.zeros(2, dtype=torch.long)), GREEDY)
    assert torch.equal(result.tokens[0], backbone.target_tokens()) and torch.equal(result.tokens[1], result.tokens[0])
    assert result.forward_passes == 1 + 4  # prefill + one verification per row
    assert result.accepted_tokens == result.drafted_tokens == 2 * 4 * 4  # 4 drafted per row (first token is given)


def test_reject_all_falls_back_to_one_token_per_pass():
    backbone = MockBackbone(rows=4, cols=5)
    result = generate_ssd(backbone, MockHeads(7, 2, 2), Condition(class_ids=torch.zeros(1, dtype=torch.long)), GREEDY)
    assert torch.equal(result.tokens[0], backbone.target_tokens())
    assert result.accepted_tokens == 0
    # Each pass fixes one position; a row whose last token was corrected needs one more pass for the next
    # row's first state, except the last row: as many passes as plain AR, never more.
    assert result.forward_passes == 4 * 5


def test_partial_accept_horizontal_right_vertical_wrong():
    backbone = MockBackbone(rows=4, cols=5)
    config = SSDDecodeConfig(mode="exact", horizontal_steps=1)
    result = generate_ssd(
        backbone, MockHeads(7, 1, 2), Condition(class_ids=torch.zeros(1, dtype=torch.long)), GREEDY, config=config
    )
    assert torch.equal(result.tokens[0], backbone.target_tokens())
    # Row 0 is drafted horizontally (right): 1 pass, 4 accepted.
    # Rows 1-3: position 1 horizontal (right), 2-4 vertical (wrong). Pass 1 accepts 1, corrects 2 and re-drafts 3
    # horizontally; pass 2 accepts 3, corrects 4; pass 3 gives the next row's first state (not after the last row).
    assert result.forward_passes == 1 + 1 + 3 + 3 + 2
    assert result.accepted_tokens == 4 + 3 * 2
    assert result.drafted_tokens == 4 + 3 * (4 + 2)


def test_autocorrect_resamples_every_rejection_in_the_same_pass():
    backbone = MockBackbone(rows=4, cols=5)
    config = SSDDecodeConfig(mode="autocorrect", rounds=0, correction="residual")
    result = generate_ssd(
        backbone, MockHeads(7, 2, 2), Condition(class_ids=torch.zeros(3, dtype=torch.long)), GREEDY, config=config
    )
    # Context-free targets make the residual (= p) right everywhere: one pass per row, all tokens right.
    assert all(torch.equal(t, backbone.target_tokens()) for t in result.tokens)
    assert result.forward_passes == 1 + 4


def test_lookahead_verifies_the_next_row_in_the_pass_that_finishes_this_one():
    backbone = MockBackbone(rows=4, cols=5)
    config = SSDDecodeConfig(mode="exact", lookahead=True)
    result = generate_ssd(
        backbone, MockHeads(7, 1, 1), Condition(class_ids=torch.zeros(2, dtype=torch.long)), GREEDY, config=config
    )
    assert all(torch.equal(t, backbone.target_tokens()) for t in result.tokens)
    # Rows 0+1 in one pass, rows 2+3 in the next. A row verified early has its first token drafted too
    # (rows 1 and 3: 5 drafts); a row starting its own pass gets it from the backbone (rows 0 and 2: 4).
    assert result.forward_passes == 1 + 2
    assert result.accepted_tokens == result.drafted_tokens == 2 * (4 + 5 + 4 + 5)


# ---- the real (tiny) digits backbone ---------------------------------------------------------


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("horizontal_steps", [0, 1, 3])
@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("grid", [False, True], ids=["vertical-drafts", "grid-drafts"])
def test_greedy_exact_ssd_equals_greedy_ar_with_random_ssd_heads(
    tiny_backbone, cfg_scale, horizontal_steps, window, grid
):
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9]))
    baseline = generate_ar(tiny_backbone, condition, sampling)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=horizontal_steps, grid=grid)
    speculative = generate_ssd(
        tiny_backbone,
        heads,
        condition,
        sampling,
        config=SSDDecodeConfig(mode="exact", horizontal_steps=horizontal_steps, window=window),
    )
    assert torch.equal(speculative.tokens, baseline.tokens)
    assert speculative.forward_passes <= baseline.forward_passes


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("confidence", [0.0, 0.5])
@pytest.mark.parametrize("grid", [False, True], ids=["vertical-drafts", "grid-drafts"])
def test_lookahead_stays_lossless(tiny_backbone, cfg_scale, confidence, grid):
    """Verifying the next row's drafts early changes the passes, never the greedy output."""
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9]))
    baseline = generate_ar(tiny_backbone, condition, sampling)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=5, grid=grid)
    for config in (
        SSDDecodeConfig(mode="exact", grid_steps=2, lookahead=True, lookahead_confidence=confidence),
        SSDDecodeConfig(mode="autocorrect", rounds=8, lookahead=True, lookahead_confidence=confidence),
    ):
        assert torch.equal(
            generate_ssd(tiny_backbone, heads, condition, sampling, config=config).tokens, baseline.tokens
        )


def test_lookahead_needs_whole_row_passes():
    with pytest.raises(ValueError, match="lookahead needs window 0"):
        SSDDecodeConfig(lookahead=True, window=4)
    with pytest.raises(ValueError, match="lookahead needs window 0"):
        SSDDecodeConfig(mode="autocorrect", correction="target", lookahead=True)


@pytest.mark.parametrize("correction", ["prefix", "target", "residual"])
def test_autocorrect_with_enough_rounds_is_greedy_ar(tiny_backbone, correction):
    sampling = SamplingConfig(greedy=True, cfg_scale=2.0)
    condition = Condition(class_ids=torch.tensor([1, 5]))
    baseline = generate_ar(tiny_backbone, condition, sampling)
    result = generate_ssd(
        tiny_backbone,
        random_ssd_heads(tiny_backbone.hidden_size),
        condition,
        sampling,
        config=SSDDecodeConfig(mode="autocorrect", rounds=8, correction=correction),
    )
    assert torch.equal(result.tokens, baseline.tokens)


@pytest.mark.parametrize("correction", ["prefix", "target", "residual"])
def test_autocorrect_costs_at_most_rounds_plus_one_passes_per_row(tiny_backbone, correction):
    condition = Condition(class_ids=torch.tensor([2, 4, 6]))
    for rounds in (0, 1, 2):
        for window in (0, 3) if correction == "prefix" else (0,):
            result = generate_ssd(
                tiny_backbone,
                random_ssd_heads(tiny_backbone.hidden_size),
                condition,
                SamplingConfig(cfg_scale=2.0),
                torch.Generator().manual_seed(0),
                SSDDecodeConfig(mode="autocorrect", rounds=rounds, correction=correction, window=window),
            )
            assert result.forward_passes <= 1 + 8 * (rounds + 1)


@pytest.mark.parametrize("grid_steps", [1, 3])
def test_short_grid_redrafts_stay_lossless(tiny_backbone, grid_steps):
    """Re-drafting only a few positions after each correction changes the drafts, never the output."""
    sampling = SamplingConfig(greedy=True, cfg_scale=2.0)
    condition = Condition(class_ids=torch.tensor([0, 6]))
    baseline = generate_ar(tiny_backbone, condition, sampling)
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=2, grid=True)
    for config in (
        SSDDecodeConfig(mode="exact", grid_steps=grid_steps),
        SSDDecodeConfig(mode="autocorrect", rounds=8, grid_steps=grid_steps),
    ):
        assert torch.equal(
            generate_ssd(tiny_backbone, heads, condition, sampling, config=config).tokens, baseline.tokens
        )


def test_grid_head_prepared_row_equals_the_whole_mlp():
    """Decoding prepares the row above once and adds the left inputs per step: the same prediction
    as the grid head's MLP applied to all four inputs at once, at every column."""
    grid = random_ssd_heads(16, seed=4, grid=True).grid
    inputs = torch.randn(4, 3, 5, 16)  # above, above embedding, left, left embedding: (batch, columns, hidden)
    whole = inputs[2] + grid.mlp(torch.cat([norm(x) for norm, x in zip(grid.norms, inputs)], dim=-1))
    prepared = grid.prepare_above(inputs[0], inputs[1])  # (batch, columns, width)
    for column in range(5):
        torch.testing.assert_close(
            grid.from_above(prepared[:, column], inputs[2][:, column], inputs[3][:, column]), whole[:, column]
        )
    torch.testing.assert_close(grid(*inputs), whole)
    # The left token's share looked up from a per-codebook table (what decoding does per drafted token).
    codebook = torch.randn(7, 16)
    table, ids = grid.prepare_left_tokens(codebook), torch.tensor([3, 0, 6])
    torch.testing.assert_close(
        grid.from_prepared(prepared[:, 2], inputs[2][:, 2], table[ids]),
        inputs[2][:, 2]
        + grid.mlp(
            torch.cat(
                [
                    grid.norms[0](inputs[0][:, 2]),
                    grid.norms[1](inputs[1][:, 2]),
                    grid.norms[2](inputs[2][:, 2]),
                    grid.norms[3](codebook[ids]),
                ],
                dim=-1,
            )
        ),
    )


def test_grid_head_reads_the_positions_right_of_the_one_above():
    """With grid_above_right = 2 the prepared row adds the states and tokens one and two columns right of the
    one above (the last column's repeat it), as the MLP on the explicit inputs would."""
    from heads.ssd import SSDHeadConfig, SSDHeads

    torch.manual_seed(0)
    grid = SSDHeads(SSDHeadConfig(hidden_size=16, width=8, depth=1, grid=True, grid_above_right=2)).grid
    for parameter in grid.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    above, above_embedding, left, left_embedding = torch.randn(4, 3, 5, 16)  # (batch, columns, hidden) each
    right = [torch.arange(shift, 5 + shift).clamp(max=4) for shift in (1, 2)]
    explicit = torch.cat(
        [grid.norms[0](above), grid.norms[1](above_embedding), grid.norms[2](left), grid.norms[3](left_embedding)]
        + [x for index in right for x in (grid.norms[0](above[:, index]), grid.norms[1](above_embedding[:, index]))],
        dim=-1,
    )
    torch.testing.assert_close(grid(above, above_embedding, left, left_embedding), left + grid.mlp(explicit))


def test_negative_grid_steps_are_refused():
    with pytest.raises(ValueError, match="grid_steps must be >= 0"):
        SSDDecodeConfig(grid_steps=-1)


def test_window_needs_exact_or_prefix():
    with pytest.raises(ValueError, match="window works with mode exact or correction prefix"):
        SSDDecodeConfig(mode="autocorrect", correction="residual", window=4)


def exact_image_distribution(backbone, class_id: int, sampling: SamplingConfig) -> dict:
    """P(image) of the AR model for every possible image of a tiny grid (by enumeration)."""
    n, v = backbone.geometry.num_tokens, backbone.codebook_size
    images = torch.tensor(list(itertools.product(range(v), repeat=n)))  # (v^n, n)
    class_ids = torch.full((len(images),), class_id)
    logits = backbone(images, class_ids)
    if sampling.guided:
        uncond = backbone(images, torch.full_like(class_ids, backbone.config.null_class))
        logits = uncond + sampling.cfg_scale * (logits - uncond)
    probs = token_distribution(logits, sampling).gather(-1, images[..., None])[..., 0].prod(-1)
    return {tuple(image.tolist()): float(p) for image, p in zip(images, probs)}


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(cfg_scale=2.0), SamplingConfig(temperature=0.8, top_k=2)],
    ids=["cfg", "temperature-topk"],
)
@pytest.mark.parametrize(
    "window,grid,grid_steps",
    [(0, False, 0), (1, False, 0), (0, True, 0), (0, True, 1)],
    ids=["whole-row", "window-1", "grid", "grid-1-step"],
)
def test_sampled_exact_ssd_has_the_backbone_distribution(sampling, window, grid, grid_steps):
    """Chi-square goodness of fit of 40,000 SSD samples against the enumerated AR distribution."""
    backbone = sharpened_tiny_backbone()
    truth = exact_image_distribution(backbone, class_id=4, sampling=sampling)
    draws = 40_000
    result = generate_ssd(
        backbone,
        random_ssd_heads(16, seed=1, grid=grid),
        Condition(class_ids=torch.full((draws,), 4)),
        sampling,
        torch.Generator().manual_seed(0),
        SSDDecodeConfig(mode="exact", window=window, grid_steps=grid_steps),
    )
    assert result.accepted_tokens < result.drafted_tokens  # the test exercises rejections and residuals
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def sharpened_tiny_backbone():
    """A 2x2-grid, 3-level random backbone whose image distribution can be enumerated and is far from uniform."""
    backbone = random_digits_backbone(
        seed=3, grid_size=2, levels=3, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32
    )
    with torch.no_grad():
        for parameter in backbone.parameters():
            parameter.mul_(3.0)
    return backbone


def assert_sampled_from(images: list, truth: dict) -> None:
    """Chi-square goodness of fit of sampled images (lists of tokens) against enumerated probabilities."""
    from scipy.stats import chisquare

    draws = len(images)
    observed = {}
    for image in images:
        observed[tuple(image)] = observed.get(tuple(image), 0) + 1
    support = [image for image, p in truth.items() if p * draws >= 5]  # chi-square needs expected counts >= 5
    assert sum(observed.get(image, 0) for image in truth if image not in support) <= 0.01 * draws
    expected = torch.tensor([truth[image] for image in support], dtype=torch.float64) * draws
    counts = torch.tensor([observed.get(image, 0) for image in support], dtype=torch.float64)
    expected = expected * counts.sum() / expected.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.slow
def test_sampled_lookahead_has_the_backbone_distribution():
    """One image per generation, so that a row passing whole hands the next row over verified (in a batch that
    needs every image's row to pass at once); 3,000 samples against the enumerated AR distribution."""
    backbone = sharpened_tiny_backbone()
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = exact_image_distribution(backbone, class_id=4, sampling=sampling)
    heads, generator = random_ssd_heads(16, seed=1, grid=True), torch.Generator().manual_seed(0)
    config = SSDDecodeConfig(mode="exact", lookahead=True)
    images, passes = [], []
    for _ in range(3000):
        result = generate_ssd(backbone, heads, Condition(class_ids=torch.tensor([4])), sampling, generator, config)
        images.append(result.tokens.flatten().tolist())
        passes.append(result.forward_passes)
    assert min(passes) == 2  # prefill + one pass for both rows: some images used the early verification
    assert max(passes) > 2  # and some had rejections
    assert_sampled_from(images, truth)


def passes_per_row(backbone, run) -> dict[int, int]:
    """Backbone passes of `run()` counted by the row of the last grid token each pass feeds."""
    counts: dict[int, int] = {}
    original = backbone.step

    def counting_step(state, tokens):
        row = (state.num_image_tokens + tokens.shape[1] - 1) // backbone.geometry.cols
        counts[row] = counts.get(row, 0) + 1
        return original(state, tokens)

    backbone.step = counting_step
    try:
        run()
    finally:
        del backbone.step
    return counts


@pytest.mark.parametrize(
    "correction,window,grid", [("prefix", 0, False), ("prefix", 3, True), ("target", 0, False), ("residual", 0, True)]
)
def test_autocorrect_spends_at_most_rounds_plus_one_passes_on_every_row(tiny_backbone, correction, window, grid):
    """The budget holds row by row (a row may not borrow the passes another row left unused)."""
    heads = random_ssd_heads(tiny_backbone.hidden_size, seed=3, grid=grid)
    for rounds in (0, 1, 2):
        config = SSDDecodeConfig(mode="autocorrect", rounds=rounds, correction=correction, window=window)
        counts = passes_per_row(
            tiny_backbone,
            lambda config=config: generate_ssd(
                tiny_backbone,
                heads,
                Condition(class_ids=torch.tensor([2, 4, 6])),
                SamplingConfig(cfg_scale=2.0),
                torch.Generator().manual_seed(0),
                config,
            ),
        )
        assert max(counts.values()) <= rounds + 1, (rounds, counts)
        assert rounds == 0 or max(counts.values()) > 1  # random heads are rejected: the rounds are used


@pytest.mark.parametrize("mode", ["exact", "autocorrect"])
def test_relaxed_ssd_with_zero_budget_is_the_exact_rule(tiny_backbone, mode):
    """LANTERN's relaxation with delta = 0 pools nothing: the same tokens and counts as without it, same seed."""
    heads, condition = (
        random_ssd_heads(tiny_backbone.hidden_size, seed=4, grid=True),
        Condition(class_ids=torch.arange(4)),
    )
    results = [
        generate_ssd(
            tiny_backbone,
            heads,
            condition,
            SamplingConfig(cfg_scale=2.0),
            torch.Generator().manual_seed(0),
            SSDDecodeConfig(mode=mode, rounds=2, relax_k=k, relax_delta=0.0),
        )
        for k in (0, 4)
    ]
    assert torch.equal(results[0].tokens, results[1].tokens)
    assert results[0].accepted_tokens == results[1].accepted_tokens


def test_relaxed_ssd_accepts_more_drafts_as_the_budget_grows(tiny_backbone):
    heads, condition = (
        random_ssd_heads(tiny_backbone.hidden_size, seed=4, grid=True),
        Condition(class_ids=torch.arange(4)),
    )
    rates, passes = [], []
    for delta in (0.0, 0.2, 0.6):
        result = generate_ssd(
            tiny_backbone,
            heads,
            condition,
            SamplingConfig(cfg_scale=2.0),
            torch.Generator().manual_seed(0),
            SSDDecodeConfig(mode="exact", relax_k=4, relax_delta=delta),
        )
        rates.append(result.accepted_tokens / result.drafted_tokens)
        passes.append(result.forward_passes)
    assert rates[0] < rates[1] < rates[2]
    assert passes[0] > passes[2]
