"""What a generator module declares so that the method registry can run it.

A decoding method is one generator file in decode/ (its algorithm, a frozen
settings dataclass, and a module-level ``METHOD = MethodSpec(...)``) plus one
preset per operating point in conf/method/ (``generator: decode.<module>`` and
values for the settings). The registry (decode/registry.py) builds the settings
from a preset, loads the export the method needs, and calls `generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backbones.base import ARImageBackbone, Condition
from decode.result import GenerationResult
from decode.sampling import SamplingConfig

# generate(backbone, artefact, condition, sampling, generator, settings) -> GenerationResult
GenerateFn = Callable[[ARImageBackbone, Any, Condition, SamplingConfig, torch.Generator, Any], GenerationResult]


@dataclass(frozen=True)
class MethodSpec:
    """A generator module's entry in the registry."""

    generate: GenerateFn
    settings: type  # a frozen dataclass; every preset key except `generator` and `artefact` is one of its fields
    artefact: str | None = None  # the preset key naming the export it needs (e.g. `heads`); None: nothing to load
    artefact_kind: str | None = None  # that export's kind, checked on load (heads/export.py)
    lossless: Callable[[Any], bool] = lambda settings: True  # whether these settings sample the backbone's distribution
    # The tokens the generator speaks: discrete (ARImageBackbone), continuous (ContinuousARBackbone), masked
    # (continuous tokens in a random order: MARBackbone), or any.
    token_kind: str = "discrete"
    # load_artefact(path, backbone, device=..., kind=...) -> the artefact; None: a safetensors export (heads/export.py)
    load_artefact: Callable[..., Any] | None = None
    # True: `generate` takes a queue of any length and decodes `settings.slots` images at once, a finished
    # image's slot going to the next of the queue (continuous batching; its settings have a `slots` field)
    continuous: bool = False
