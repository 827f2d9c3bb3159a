"""Shared fixtures: tiny backbones and the real Hydra config, shrunk for tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from backbones.digits import random_digits_backbone
from backbones.digits_continuous import random_continuous_digits_backbone
from common.paths import PROJECT_ROOT, register_config_resolvers

register_config_resolvers()
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist runs a worker per core (pyproject.toml's addopts):
    torch.set_num_threads(1)  # one thread each, or the workers' thread pools fight over the same cores
CONF_DIR = PROJECT_ROOT / "conf"
COMMITTED_BACKBONE = PROJECT_ROOT / "checkpoints" / "digits-backbone"

TINY_BACKBONE = dict(grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


# The presets `python -m decode +experiment=compare_digits` runs, in order (conf/experiment/compare_digits.yaml).
COMPARISON_METHODS = [
    "ar",
    "ssd_exact",
    "ssd_autocorrect",
    "ssd_tree",
    "ssd_ragged",
    "ssd_ragged_autocorrect",
    "mulo",
    "mulo_exact",
    "mulo_ragged",
    "sjd",
    "sjd_ragged",
    "gsd",
    "gsd_ragged",
    "zipar",
    "eagle",
    "eagle_ragged",
    "eagle_ragged_auto",
    "eagle_depth3",
    "eagle2",
    "lantern",
    "lantern_ragged",
]


def compose_config(overrides: list[str], output_dir: Path) -> DictConfig:
    """The project's root config with overrides, as the CLIs would see it, writing under `output_dir`; the
    training's evaluation runs eager passes unless the overrides say otherwise (compiling costs about a minute per
    process; tests/test_compiled_passes.py covers compiled passes)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        if cfg.train.get("evaluate") and not any(o.startswith("train.evaluate.compile=") for o in overrides):
            cfg.train.evaluate.compile = False
    return cfg


@pytest.fixture
def tiny_backbone():
    """An untrained 8x8-grid digits backbone with 8 intensity levels (seeded)."""
    return random_digits_backbone(seed=0, **TINY_BACKBONE)


@pytest.fixture(scope="session")
def classifier_cache(tmp_path_factory) -> Path:
    """A checkpoints dir holding the digits classifier of the tiny grid (8x8, 8 levels), trained once per session."""
    from train.digits_classifier import train_and_save

    directory = tmp_path_factory.mktemp("checkpoints")
    train_and_save(
        directory / "digits-classifier", TINY_BACKBONE["grid_size"], TINY_BACKBONE["levels"], log=lambda _: None
    )
    return directory


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_ssd_heads(hidden_size: int, seed: int = 0, std: float = 0.5, grid: bool = False):
    """Untrained SSD heads with random (not zero) output layers: losslessness must not depend on head quality."""
    from heads.ssd import SSDHeadConfig, SSDHeads

    torch.manual_seed(seed)
    heads = SSDHeads(SSDHeadConfig(hidden_size=hidden_size, width=16, depth=1, grid=grid))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=std)
    return heads.eval()


def random_eagle_head(backbone, seed: int = 0, std: float = 0.3):
    """An untrained head with random weights: losslessness must not depend on the head's quality."""
    from heads.eagle import EagleHead, EagleHeadConfig

    torch.manual_seed(seed)
    heads = 2 if backbone.hidden_size % 2 == 0 else 1
    head = EagleHead(
        EagleHeadConfig(
            hidden_size=backbone.hidden_size,
            num_heads=heads,
            intermediate_size=2 * backbone.hidden_size,
            max_positions=backbone.geometry.num_tokens,
        )
    )
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=std)
    return head.eval()


def assert_greedy_lossless_methods_equal_greedy_ar(backbone, condition, cfg_scale: float) -> None:
    """The lossless contract every backbone must keep: greedy exact SSD, SJD and EAGLE, and ZipAR with a window
    of a whole row, return greedy AR's tokens."""
    from decode import SamplingConfig, SSDDecodeConfig, generate_ar, generate_ssd
    from decode.eagle import EagleDecodeConfig, generate_eagle
    from decode.sjd import SJDDecodeConfig, generate_sjd
    from decode.zipar import ZipARDecodeConfig, generate_zipar

    sampling = SamplingConfig(cfg_scale=cfg_scale, greedy=True)
    heads = random_ssd_heads(backbone.hidden_size, seed=1, std=0.3)
    baseline = generate_ar(backbone, condition, sampling)
    # Lookahead feeds across the row boundary, where end-of-line families insert their EOL token.
    for config in (SSDDecodeConfig(mode="exact"), SSDDecodeConfig(mode="exact", lookahead=True)):
        speculative = generate_ssd(backbone, heads, condition, sampling, config=config)
        assert torch.equal(speculative.tokens, baseline.tokens), config
    # Jacobi windows across rows (end-of-line tokens inside a window) and past the image's end.
    for config in (SJDDecodeConfig(), SJDDecodeConfig(window=3, init="repeat_left")):
        jacobi = generate_sjd(backbone, condition, sampling, torch.Generator().manual_seed(0), config)
        assert torch.equal(jacobi.tokens, baseline.tokens), config
    # EAGLE chains across rows (end-of-line tokens inside a chain) and past the image's end, from a random head.
    for depth in (3, 40):
        head = random_eagle_head(backbone)
        eagle = generate_eagle(backbone, head, condition, sampling, None, EagleDecodeConfig(depth))
        assert torch.equal(eagle.tokens, baseline.tokens), depth
    # ZipAR waiting for whole rows is the baseline: its position-addressed passes (and end-of-line stand-ins)
    # reproduce the appended ones.
    zipar = generate_zipar(backbone, condition, sampling, config=ZipARDecodeConfig(window=backbone.geometry.cols))
    assert torch.equal(zipar.tokens, baseline.tokens)
    assert zipar.forward_passes == backbone.geometry.num_tokens
    # A narrower window runs rows in parallel: fewer passes.
    parallel = generate_zipar(backbone, condition, sampling, config=ZipARDecodeConfig(window=1))
    assert parallel.forward_passes < backbone.geometry.num_tokens or backbone.geometry.rows == 1


TINY_CONTINUOUS = dict(
    image_size=8, patch_size=2, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
    head_width=32, head_depth=1, sampling_steps=4,
)  # fmt: skip


def tiny_continuous(seed: int = 0, head_std: float | None = 0.1):
    """A tiny random continuous digits backbone (4x4 tokens of 4 values); a random (not zero) diffusion output."""
    backbone = random_continuous_digits_backbone(seed=seed, **TINY_CONTINUOUS)
    if head_std is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in backbone.diffusion.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * head_std)
    return backbone
