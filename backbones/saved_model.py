"""The embedded backbones' folder format: config.json (the architecture dataclass) + model.safetensors (weights)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from common.atomic_io import atomic_save_safetensors, atomic_write_text

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_model(model: nn.Module, config, directory: str | Path) -> Path:
    """Write `config` (a dataclass) as config.json and the model's state as model.safetensors, each atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, directory / WEIGHTS_FILE
    )
    atomic_write_text(directory / CONFIG_FILE, json.dumps(asdict(config), indent=2) + "\n")
    return directory


def load_model(model_class, config_class, directory: str | Path, device, what: str, advice: str) -> nn.Module:
    """Build `model_class(config_class(**config.json))` from a saved folder, frozen and in eval mode.

    A missing file is a FileNotFoundError naming `what` the folder should hold and `advice` on getting one.
    """
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"no {what} at {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE}); {advice}")
    model = model_class(config_class(**json.loads(config_path.read_text())))
    model.load_state_dict(load_file(weights_path, device="cpu"))
    return model.to(device).eval().requires_grad_(False)
