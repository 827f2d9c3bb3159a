"""MuLo-SD: relaxed acceptance, islands, the upsampler, lossless exact mode, drafter export, the experiment."""

import pytest
import torch
from conftest import compose_config

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode import SamplingConfig, generate_ar
from decode.mulo import MuLoDecodeConfig, generate_mulo
from decode.mulo_resampling import block_proposals, downsample_to_drafter, upsample_block, upsample_to_backbone
from heads.export import HeadsMismatchError, export_heads, load_heads
from heads.mulo import MuLoDrafter, MuLoDrafterConfig

GRID12 = dict(grid_size=12, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture
def backbone12():
    return random_digits_backbone(seed=0, **GRID12)


def random_drafter(scale=3, seed=1):
    torch.manual_seed(seed)
    return MuLoDrafter(
        MuLoDrafterConfig(
            backbone_rows=12,
            backbone_cols=12,
            levels=8,
            scale=scale,
            hidden_size=16,
            num_layers=1,
            num_heads=1,
            intermediate_size=32,
        )
    ).eval()


# ---- proposals ----------------------------------------------------------------------------------


def test_block_proposals_take_the_drafters_cell_distribution_where_the_upsampler_kept_the_token():
    low_tokens = torch.tensor([[1, 2]])  # one low-res row of 2 cells, r = 2 -> a block of 2 rows x 4 columns
    low_q = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    block = torch.tensor([[1, 1, 2, 0, 1, 2, 2, 2]])  # positions 3 and 5 were changed by the upsampler
    q = block_proposals(low_tokens, low_q, block, scale=2)
    assert q.shape == (1, 8, 3)
    for position, cell in [(0, 0), (1, 0), (2, 1), (4, 0), (6, 1), (7, 1)]:
        assert torch.equal(q[0, position], low_q[0, cell])
    assert q[0, 3].tolist() == [1.0, 0.0, 0.0] and q[0, 5].tolist() == [0.0, 0.0, 1.0]  # point proposals


# ---- the upsampler -----------------------------------------------------------------------------


def test_upsampler_round_trip_on_piecewise_constant_images(backbone12):
    drafter = random_drafter(scale=3).model
    low = torch.randint(0, 8, (5, 4, 4))
    high = upsample_to_backbone(low, drafter, backbone12, scale=3)
    assert high.shape == (5, 12, 12)
    assert torch.equal(high[:, ::3, ::3], low) and torch.equal(high[:, 2::3, 1::3], low)  # constant 3x3 cells
    assert torch.equal(downsample_to_drafter(high, backbone12, drafter, 3), low)


def test_interpolating_upsampler_blends_a_block_into_the_committed_rows_above(backbone12):
    drafter = random_drafter(scale=3).model
    low_row = torch.zeros(2, 4, dtype=torch.long)  # black
    above = torch.full((2, 2, 4), 7)  # white (8 levels)
    nearest = upsample_block(low_row, above, drafter, backbone12, 3, "nearest")
    assert nearest.shape == (2, 3, 12) and (nearest == 0).all()  # nearest repeats the row, whatever is above
    blended = upsample_block(low_row, above, drafter, backbone12, 3, "bilinear")
    assert blended.shape == (2, 3, 12)
    assert (blended[:, 0] > 0).all() and (blended[:, -1] == 0).all()  # top row blends upwards, bottom row is the row's
    alone = upsample_block(low_row, above[:, :0], drafter, backbone12, 3, "bicubic")  # the first row has nothing above
    assert (alone == 0).all()


# ---- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_exact_mulo_equals_greedy_ar_with_a_random_drafter(backbone12, cfg_scale):
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    condition = Condition(class_ids=torch.tensor([0, 3, 7]))
    baseline = generate_ar(backbone12, condition, sampling)
    result = generate_mulo(backbone12, random_drafter(), condition, sampling, config=MuLoDecodeConfig(mode="exact"))
    assert torch.equal(result.tokens, baseline.tokens)


def test_relaxed_mode_costs_one_pass_per_drafted_block(backbone12):
    result = generate_mulo(
        backbone12,
        random_drafter(),
        Condition(class_ids=torch.tensor([1, 2])),
        SamplingConfig(cfg_scale=2.0),
        torch.Generator().manual_seed(0),
        MuLoDecodeConfig(),
    )
    assert result.forward_passes == 1 + 12 // 3
    assert result.tokens.shape == (2, 12, 12)


def test_relaxed_rounds_re_verify_blocks_with_resampled_islands(backbone12):
    condition, sampling = Condition(class_ids=torch.tensor([1, 2])), SamplingConfig(cfg_scale=2.0)
    passes = []
    for rounds in (0, 1, 3):
        result = generate_mulo(
            backbone12,
            random_drafter(),
            condition,
            sampling,
            torch.Generator().manual_seed(0),
            MuLoDecodeConfig(rounds=rounds),
        )
        assert result.forward_passes <= 1 + (12 // 3) * (rounds + 1)
        passes.append(result.forward_passes)
    assert passes[0] < passes[1] <= passes[2]  # a random drafter is rejected: the extra rounds are used
    # A block whose drafts all pass is not re-verified: pooling every other entry up to delta = 1 accepts all.
    everything = generate_mulo(
        backbone12,
        random_drafter(),
        condition,
        sampling,
        torch.Generator().manual_seed(0),
        MuLoDecodeConfig(rounds=3, k=backbone12.codebook_size - 1, delta=1.0),
    )
    assert everything.forward_passes == 1 + 12 // 3


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_rounds_settle_open_tokens_in_raster_order_so_greedy_mulo_can_be_greedy_ar(backbone12, cfg_scale):
    # One island over the whole block (radius >= block width), delta = 0 and a round per token: every token
    # is re-tested until everything before it is final, so the image must be greedy AR's, token for token.
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    condition = Condition(class_ids=torch.tensor([0, 5, 9]))
    baseline = generate_ar(backbone12, condition, sampling)
    config = MuLoDecodeConfig(delta=0.0, radius=12, rounds=3 * 12)
    result = generate_mulo(backbone12, random_drafter(), condition, sampling, config=config)
    assert torch.equal(result.tokens, baseline.tokens)
    # The random drafter's blocks were rejected, so rounds ran; each round fixes at least one token.
    assert 1 + 12 // 3 < result.forward_passes <= 1 + 12 * 12 + 12 // 3


# ---- export --------------------------------------------------------------------------------------


def test_drafter_export_round_trip_and_refusal(backbone12, tmp_path):
    drafter = random_drafter()
    export_heads(drafter, tmp_path, backbone12.identity())
    loaded = load_heads(tmp_path, backbone12, kind="mulo")
    assert loaded.config == drafter.config
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="'ssd' heads are needed"):
        load_heads(tmp_path, backbone12, kind="ssd")
    with pytest.raises(HeadsMismatchError, match="geometry"):
        load_heads(tmp_path, random_digits_backbone(**{**GRID12, "grid_size": 24}))


@pytest.mark.slow
def test_mulo_experiment_trains_exports_and_decodes(tmp_path, classifier_cache):
    from train.pipeline import run_training

    overrides = [
        "+experiment=mulo_digits",
        "backbone=digits_tiny",
        "data=corpus_tiny",
        "head=mulo_tiny",
        "trainer=debug",
        "trainer.max_steps=3",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        f"export.dir={tmp_path / 'drafter'}",
        f"paths.root_dir={tmp_path}",
        f"paths.checkpoints_dir={classifier_cache}",
        "train.evaluate.num_images=4",
    ]
    run_training(compose_config(overrides, tmp_path / "run"))
    assert load_heads(tmp_path / "drafter", kind="mulo").config.scale == 2
    import json

    report = json.loads((tmp_path / "run" / "evaluation" / "metrics.json").read_text())
    assert set(report["methods"]) == {"ar", "mulo", "mulo_exact"}
    assert report["methods"]["mulo"]["forward_passes_per_image"] == 1 + 8 // 2
