"""SJD and GSD: greedy SJD is greedy AR, sampled SJD has the backbone's distribution, GSD pools the test."""

import pytest
import torch
from distribution_check import assert_sampled_from, enumerable_backbone, image_distribution

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode.ar import generate_ar
from decode.gsd import GSDDecodeConfig, generate_gsd
from decode.rules import grouped_accept, token_group
from decode.sampling import SamplingConfig
from decode.sjd import SJDDecodeConfig, generate_sjd

CLASS_ID = 2


@pytest.mark.parametrize("window", [16, 3])
@pytest.mark.parametrize("init", ["random", "repeat_left"])
def test_greedy_sjd_is_greedy_ar_token_for_token(window, init):
    backbone = random_digits_backbone(
        seed=0, grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9]))  # images progress at their own pace
    sampling = SamplingConfig(cfg_scale=3.0, greedy=True)
    expected = generate_ar(backbone, condition, sampling).tokens
    result = generate_sjd(
        backbone, condition, sampling, torch.Generator().manual_seed(0), SJDDecodeConfig(window, init)
    )
    assert torch.equal(result.tokens, expected)
    assert result.forward_passes <= backbone.geometry.num_tokens
    assert 0 < result.accepted_tokens <= result.drafted_tokens


@pytest.mark.parametrize("init", ["random", "repeat_left"])
def test_sampled_sjd_has_the_backbone_distribution(init):
    """40,000 3x3 images in one batch: a window of 3 leaves room for rejections, Jacobi updates and new drafts,
    and the images' different progress makes most of them re-feed committed tokens before their drafts."""
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone, CLASS_ID, sampling)
    result = generate_sjd(
        backbone,
        Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling,
        torch.Generator().manual_seed(0),
        SJDDecodeConfig(window=3, init=init),
    )
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95  # drafts pass and fail: the rules run
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def test_gsd_with_a_group_of_one_is_sjd():
    backbone = enumerable_backbone(grid_size=3, levels=3)
    condition = Condition(class_ids=torch.full((64,), CLASS_ID))
    sampling = SamplingConfig(cfg_scale=2.0)
    sjd = generate_sjd(backbone, condition, sampling, torch.Generator().manual_seed(5), SJDDecodeConfig(window=4))
    gsd = generate_gsd(
        backbone, condition, sampling, torch.Generator().manual_seed(5), GSDDecodeConfig(window=4, rank_radius=0)
    )
    assert torch.equal(sjd.tokens, gsd.tokens) and sjd.forward_passes == gsd.forward_passes


def test_gsd_with_wide_groups_accepts_more_than_sjd():
    backbone = enumerable_backbone(grid_size=3, levels=3)
    condition = Condition(class_ids=torch.full((2_000,), CLASS_ID))
    sampling = SamplingConfig(cfg_scale=2.0)
    sjd = generate_sjd(backbone, condition, sampling, torch.Generator().manual_seed(5), SJDDecodeConfig(window=4))
    wide = GSDDecodeConfig(window=4, rank_radius=3, probability_gap=1.0, max_distance=1e9)
    gsd = generate_gsd(backbone, condition, sampling, torch.Generator().manual_seed(5), wide)
    assert gsd.accepted_tokens / gsd.drafted_tokens > sjd.accepted_tokens / sjd.drafted_tokens + 0.05


def test_token_group_by_value():
    p = torch.tensor([0.05, 0.29, 0.20, 0.40, 0.06])  # ascending order of p: 0, 4, 2, 1, 3
    embeddings = torch.tensor([[0.0], [0.0], [0.1], [0.0], [5.0]])
    members, in_group = token_group(p, torch.tensor(2), embeddings, rank_radius=1, probability_gap=0.15, max_distance=1)
    # Ranks [-1, 1) around token 2 (rank 2): tokens 4 (rank 1) and 2; token 4 is too far in embedding space.
    assert members.tolist() == [4, 2] and in_group.tolist() == [False, True]
    members, in_group = token_group(p, torch.tensor(1), embeddings, rank_radius=2, probability_gap=0.15, max_distance=1)
    assert members.tolist() == [4, 2, 1, 3] and in_group.tolist() == [False, True, True, True]
    # Pooled test: sum_G p = 0.89 against sum_G q = 1.
    q = torch.tensor([0.0, 0.5, 0.25, 0.25, 0.0])
    assert grouped_accept(p, q, members, in_group, torch.tensor(0.88)).item()
    assert not grouped_accept(p, q, members, in_group, torch.tensor(0.90)).item()
    # At the vocabulary's ends the candidates are cut, not wrapped around.
    members, in_group = token_group(p, torch.tensor(0), embeddings, rank_radius=2, probability_gap=1.0, max_distance=1)
    assert in_group.tolist() == [False, False, True, False]  # ranks -2, -1 cut; token 4 too far


def test_a_window_without_drafts_is_refused():
    with pytest.raises(ValueError, match="window must be >= 2"):
        SJDDecodeConfig(window=1)


def test_peers_run_as_presets_beside_the_baseline(tmp_path, classifier_cache):
    """SJD, GSD and ZipAR through the registry and the benchmark, as a user runs them."""
    import json

    from conftest import compose_config

    from decode.cli import run_decode

    out = tmp_path / "out"
    cfg = compose_config(
        [
            "backbone=digits_tiny",
            "decode.methods=[ar,sjd,gsd,zipar]",
            "decode.num_images=4",
            "decode.batch_size=2",
            "decode.presets.sjd.init=repeat_left",
            f"decode.out={out}",
            f"paths.checkpoints_dir={classifier_cache}",
        ],
        tmp_path,
    )
    run_decode(cfg)
    methods = json.loads((out / "metrics.json").read_text())["methods"]
    assert methods["sjd"]["lossless"] and not methods["gsd"]["lossless"]
    assert methods["sjd"]["settings"] == {"window": 16, "init": "repeat_left"}
    assert methods["gsd"]["settings"]["rank_radius"] == 7
    assert methods["sjd"]["forward_passes_per_image"] <= methods["ar"]["forward_passes_per_image"]
    assert methods["zipar"]["forward_passes_per_image"] == 2 * 8 + 6 * 8  # the default window is a whole row here
    assert not methods["zipar"]["lossless"]
