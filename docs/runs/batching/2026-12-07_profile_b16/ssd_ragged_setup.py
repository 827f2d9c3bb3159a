"""The digits backbone, a preset's artefact (the main job's SSD heads for ssd_ragged) and its settings, built as
`python -m decode` builds them (Hydra's config, decode/registry.py), for the scripts beside this file and in
2026-12-07_own_keys."""

import dataclasses

import hydra
from hydra import compose, initialize_config_dir

from common.paths import PROJECT_ROOT, register_config_resolvers
from decode.cli import sampling_from_config
from decode.registry import check_methods, load_artefacts


def preset_setup(name: str):
    """(backbone, method, sampling): the preset `name` with its artefact loaded (`method.generate` runs it)."""
    register_config_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"decode.methods=[{name}]"])
    method = next(m for m in check_methods(cfg.decode) if m.name == name)
    backbone = hydra.utils.instantiate(cfg.backbone)
    load_artefacts([method], backbone)
    return backbone, method, sampling_from_config(cfg)


def ssd_ragged_setup(**settings):
    """(backbone, heads, sampling, RaggedSSDConfig): the preset with `settings` replaced (slots, window, ...)."""
    backbone, method, sampling = preset_setup("ssd_ragged")
    return backbone, method.artefact, sampling, dataclasses.replace(method.settings, **settings)
