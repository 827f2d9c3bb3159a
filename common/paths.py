"""Where the project lives on disk, for configs that must not depend on the working directory."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def register_config_resolvers() -> None:
    """Make `${project_root:}` available to Hydra/OmegaConf configs (idempotent)."""
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
