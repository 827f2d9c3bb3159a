"""Lossless methods sample from the backbone's distribution: chi-square against enumerated tiny grids.

The grids are small enough to enumerate every image (3x3 tokens with 2 levels for
SSD, 2x2 with 3 levels for MuLo-SD) and the backbones are not sharpened, so no
token is near-certain and a biased rule shifts visible mass. The test's power is
checked in the fast tier by planting biases it must catch (a residual that
forgets the draft, a test that ignores q); the windowed, lookahead and MuLo-SD
variants are slow (the full run).
"""

import pytest
import torch
from conftest import random_ssd_heads
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution, marginal

from backbones.base import Condition
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig, generate_ssd

CLASS_ID = 4
SAMPLINGS = {"cfg": SamplingConfig(cfg_scale=2.0), "temperature": SamplingConfig(temperature=0.8)}


@pytest.fixture(scope="module")
def backbone3():
    return enumerable_backbone(grid_size=3, levels=2)


def _sample_ssd(backbone, sampling: SamplingConfig, grid: bool, config: SSDDecodeConfig):
    """40,000 images of one class in one batch, drafted by seeded random heads."""
    heads = random_ssd_heads(16, seed=1, grid=grid)
    condition = Condition(class_ids=torch.full((40_000,), CLASS_ID))
    return generate_ssd(backbone, heads, condition, sampling, torch.Generator().manual_seed(0), config)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize(
    "grid,config",
    [
        (False, SSDDecodeConfig(mode="exact", horizontal_steps=2)),
        (True, SSDDecodeConfig(mode="exact")),
        (True, SSDDecodeConfig(mode="exact", grid_steps=1)),
    ],
    ids=["horizontal-chains", "grid-redrafts", "grid-1-step"],
)
def test_sampled_exact_ssd_has_the_backbone_distribution(backbone3, sampling, grid, config):
    """40,000 images in one batch: every drafted chain, correction and re-draft at once."""
    truth = image_distribution(backbone3, CLASS_ID, sampling)
    result = _sample_ssd(backbone3, sampling, grid, config)
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95  # drafts pass and fail: the rules run
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


PLANTED_BIASES = {
    # after a rejection, the token is drawn from p instead of the residual norm(max(0, p - q))
    "residual_without_the_draft": ("decode.ssd.residual_distribution", lambda p, q: p),
    # the draft is accepted with probability p(x) (as if q were a point proposal), not min(1, p(x) / q(x))
    "test_ignores_q": ("decode.ssd.accept_drafts", lambda p_x, q_x, u: u < p_x),
}


@pytest.mark.parametrize("bias", PLANTED_BIASES)
def test_the_ssd_distribution_test_catches_a_planted_bias(backbone3, bias, monkeypatch):
    target, biased = PLANTED_BIASES[bias]
    monkeypatch.setattr(target, biased)
    sampling = SAMPLINGS["cfg"]
    result = _sample_ssd(backbone3, sampling, grid=True, config=SSDDecodeConfig(mode="exact"))
    pvalue = fit_pvalue(result.tokens.flatten(1).tolist(), image_distribution(backbone3, CLASS_ID, sampling))
    assert pvalue < 1e-6, f"the planted bias {bias} went unnoticed (p = {pvalue:.2e})"


@pytest.mark.slow
@pytest.mark.parametrize("grid", [False, True], ids=["horizontal-chains", "grid-redrafts"])
def test_sampled_windowed_ssd_has_the_backbone_distribution(grid):
    """A window of 1 verifies two of a row's three drafts per pass, so 4 columns are needed; 4x4 images are too
    many to fit whole, so each pair of adjacent rows (256 outcomes) is fitted against its enumerated marginal."""
    backbone = enumerable_backbone(grid_size=4, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone, CLASS_ID, sampling)
    result = generate_ssd(
        backbone,
        random_ssd_heads(16, seed=1, grid=grid),
        Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling,
        torch.Generator().manual_seed(0),
        SSDDecodeConfig(mode="exact", horizontal_steps=2, window=1),
    )
    images = result.tokens.flatten(1)
    for top in range(3):
        positions = list(range(4 * top, 4 * top + 8))
        pvalue = fit_pvalue(images[:, positions].tolist(), marginal(truth, positions))
        assert pvalue > 1e-3 / 3, f"rows {top}-{top + 1} do not have the backbone's distribution (p = {pvalue:.2e})"


@pytest.mark.slow
def test_sampled_lookahead_has_the_backbone_distribution(backbone3):
    """Single-image generations, so that a row passing whole hands the next row over verified (a batch
    needs every image's row to pass at once); 4,000 samples against the enumerated distribution."""
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone3, CLASS_ID, sampling)
    heads, generator = random_ssd_heads(16, seed=1, grid=True), torch.Generator().manual_seed(0)
    config = SSDDecodeConfig(mode="exact", lookahead=True)
    images, passes = [], []
    for _ in range(4000):
        result = generate_ssd(
            backbone3, heads, Condition(class_ids=torch.tensor([CLASS_ID])), sampling, generator, config
        )
        images.append(result.tokens.flatten().tolist())
        passes.append(result.forward_passes)
    assert min(passes) <= 3  # prefill + fewer passes than rows: the early verification was used
    assert max(passes) > 4  # and rejections happened
    assert_sampled_from(images, truth)


@pytest.mark.slow
def test_sampled_exact_mulo_has_the_backbone_distribution():
    """MuLo-SD's exact mode on a 4x4 grid with a 2x2 drafter (scale 2): two blocks of eight point proposals.
    Each block and the pair of rows across their border (256 outcomes each) is fitted against its marginal."""
    from decode.mulo import MuLoDecodeConfig, generate_mulo
    from heads.mulo import MuLoDrafter, MuLoDrafterConfig

    backbone = enumerable_backbone(grid_size=4, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone, CLASS_ID, sampling)
    torch.manual_seed(2)
    drafter = MuLoDrafter(
        MuLoDrafterConfig(
            backbone_rows=4,
            backbone_cols=4,
            levels=2,
            scale=2,
            hidden_size=16,
            num_layers=1,
            num_heads=1,
            intermediate_size=32,
        )
    ).eval()
    result = generate_mulo(
        backbone,
        drafter,
        Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling,
        torch.Generator().manual_seed(0),
        MuLoDecodeConfig(mode="exact"),
    )
    assert 0.1 < result.accepted_tokens / result.drafted_tokens < 0.9  # point proposals pass and fail
    images = result.tokens.flatten(1)
    for first_row in (0, 1, 2):
        positions = list(range(4 * first_row, 4 * first_row + 8))
        pvalue = fit_pvalue(images[:, positions].tolist(), marginal(truth, positions))
        assert pvalue > 1e-3 / 3, (
            f"rows {first_row}-{first_row + 1} do not have the backbone's distribution (p = {pvalue:.2e})"
        )
