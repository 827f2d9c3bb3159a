"""Shared fixtures: tiny backbones and the real Hydra config, shrunk for tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from backbones.digits import random_digits_backbone
from data.paths import PROJECT_ROOT, register_config_resolvers

register_config_resolvers()
CONF_DIR = PROJECT_ROOT / "conf"
COMMITTED_BACKBONE = PROJECT_ROOT / "checkpoints" / "digits-backbone"

TINY_BACKBONE = dict(grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def compose_config(overrides: list[str], output_dir: Path) -> DictConfig:
    """The project's root config with overrides, as the CLIs would see it, writing under `output_dir`."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


@pytest.fixture
def tiny_backbone():
    """An untrained 8x8-grid digits backbone with 8 intensity levels (seeded)."""
    return random_digits_backbone(seed=0, **TINY_BACKBONE)


@pytest.fixture(scope="session")
def classifier_cache(tmp_path_factory) -> Path:
    """A checkpoints dir shared by the tests, so the tiny-grid classifier is trained once per session."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
