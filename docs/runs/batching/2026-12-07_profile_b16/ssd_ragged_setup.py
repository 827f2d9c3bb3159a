"""The digits backbone, the main job's SSD heads and the ssd_ragged preset's settings, built as `python -m decode`
builds them (Hydra's config, decode/registry.py), for the scripts beside this file."""

import dataclasses

import hydra
from hydra import compose, initialize_config_dir

from common.paths import PROJECT_ROOT, register_config_resolvers
from decode.cli import sampling_from_config
from decode.registry import check_methods, load_artefacts


def ssd_ragged_setup(**settings):
    """(backbone, heads, sampling, RaggedSSDConfig): the preset with `settings` replaced (slots, window, ...)."""
    register_config_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decode.methods=[ssd_ragged]"])
    method = next(m for m in check_methods(cfg.decode) if m.name == "ssd_ragged")
    backbone = hydra.utils.instantiate(cfg.backbone)
    load_artefacts([method], backbone)
    return backbone, method.artefact, sampling_from_config(cfg), dataclasses.replace(method.settings, **settings)
