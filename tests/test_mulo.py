"""MuLo-SD: relaxed acceptance, islands, the upsampler, lossless exact mode, drafter export, the experiment."""

import pytest
import torch
from conftest import compose_config

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode import SamplingConfig, generate_ar
from decode.mulo import (
    MuLoDecodeConfig,
    block_proposals,
    count_islands,
    generate_mulo,
    islands,
    latent_neighbours,
    pooled_neighbour_mass,
    relaxed_accept,
    upsample_block,
)
from heads.export import HeadsMismatchError, export_heads, load_heads
from heads.mulo import (
    MuLoDrafter,
    MuLoDrafterConfig,
    downsample_to_drafter,
    upsample_to_backbone,
)

GRID12 = dict(grid_size=12, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture
def backbone12():
    return random_digits_backbone(seed=0, **GRID12)


def random_drafter(scale=3, seed=1):
    torch.manual_seed(seed)
    return MuLoDrafter(MuLoDrafterConfig(backbone_rows=12, backbone_cols=12, levels=8, scale=scale, hidden_size=16,
                                         num_layers=1, num_heads=1, intermediate_size=32)).eval()


# ---- relaxed acceptance ------------------------------------------------------------------------

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
    assert relaxed_accept(p, x, neighbours, 0.0, greedy=False, uniform=u, q_of_tokens=q_x).tolist() == \
        [True, False, True, True]
    # delta = 0.5: x=0 pools p(1) -> min(1, 0.7 / 0.4) = 1
    assert relaxed_accept(p, x, neighbours, 0.5, greedy=False, uniform=u, q_of_tokens=q_x).all()
    # a drafter that proposes exactly p is always accepted, whatever the uniform
    u = torch.rand(4)
    assert relaxed_accept(p, x, neighbours, 0.0, False, u, q_of_tokens=p.gather(-1, x[:, None])[:, 0]).all()


def test_block_proposals_take_the_drafters_cell_distribution_where_the_upsampler_kept_the_token():
    low_tokens = torch.tensor([[1, 2]])  # one low-res row of 2 cells, r = 2 -> a block of 2 rows x 4 columns
    low_q = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    block = torch.tensor([[1, 1, 2, 0,
                           1, 2, 2, 2]])  # positions 3 and 5 were changed by the upsampler
    q = block_proposals(low_tokens, low_q, block, scale=2)
    assert q.shape == (1, 8, 3)
    for position, cell in [(0, 0), (1, 0), (2, 1), (4, 0), (6, 1), (7, 1)]:
        assert torch.equal(q[0, position], low_q[0, cell])
    assert q[0, 3].tolist() == [1.0, 0.0, 0.0] and q[0, 5].tolist() == [0.0, 0.0, 1.0]  # point proposals


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
    result = generate_mulo(backbone12, random_drafter(), Condition(class_ids=torch.tensor([1, 2])),
                           SamplingConfig(cfg_scale=2.0), torch.Generator().manual_seed(0), MuLoDecodeConfig())
    assert result.forward_passes == 1 + 12 // 3
    assert result.tokens.shape == (2, 12, 12)


def test_relaxed_rounds_re_verify_blocks_with_resampled_islands(backbone12):
    condition, sampling = Condition(class_ids=torch.tensor([1, 2])), SamplingConfig(cfg_scale=2.0)
    passes = []
    for rounds in (0, 1, 3):
        result = generate_mulo(backbone12, random_drafter(), condition, sampling, torch.Generator().manual_seed(0),
                               MuLoDecodeConfig(rounds=rounds))
        assert result.forward_passes <= 1 + (12 // 3) * (rounds + 1)
        passes.append(result.forward_passes)
    assert passes[0] < passes[1] <= passes[2]  # a random drafter is rejected: the extra rounds are used
    # A block whose drafts all pass is not re-verified: pooling every other entry up to delta = 1 accepts all.
    everything = generate_mulo(backbone12, random_drafter(), condition, sampling, torch.Generator().manual_seed(0),
                               MuLoDecodeConfig(rounds=3, k=backbone12.codebook_size - 1, delta=1.0))
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


def test_mulo_experiment_trains_exports_and_decodes(tmp_path, classifier_cache):
    from train.pipeline import run_training

    overrides = ["+experiment=mulo_digits", "backbone=digits_tiny", "data=corpus_tiny", "head=mulo_tiny",
                 "trainer=debug", "trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                 f"export.dir={tmp_path / 'drafter'}", f"paths.root_dir={tmp_path}",
                 f"paths.checkpoints_dir={classifier_cache}", "train.evaluate.num_images=4"]
    run_training(compose_config(overrides, tmp_path / "run"))
    assert load_heads(tmp_path / "drafter", kind="mulo").config.scale == 2
    import json

    report = json.loads((tmp_path / "run" / "evaluation" / "metrics.json").read_text())
    assert set(report["methods"]) == {"ar", "mulo", "mulo_exact"}
    assert report["methods"]["mulo"]["forward_passes_per_image"] == 1 + 8 // 2
