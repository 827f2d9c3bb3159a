"""GSD with ragged frontiers and continuous batching: ragged SJD's windows, GSD's pooled test.

decode/gsd.py is decode/sjd.py's Jacobi iterations with a draft x accepted with probability
``min(1, sum_G p_now / sum_G p_prev)`` over its group G of similar tokens (decode/rules.py `token_group`; So et
al., ICCV 2025). This is the same test on decode/sjd_ragged.py's passes: every image runs its own window from its
own last committed token in one shared pass, and a finished image's slot goes to the next condition of the queue.
Uniforms are keyed per image and event, so an image's tokens do not depend on its batch. Not lossless for
rank_radius > 0; rank_radius 0 is ragged SJD's exact test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition
from decode.gsd import GSDDecodeConfig, grouped_test
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.sjd_ragged import RaggedSJDConfig, generate_jacobi_ragged


@dataclass(frozen=True)
class RaggedGSDConfig:
    """Ragged SJD's window, initialisation and slots; GSD's group (decode/gsd.py's defaults, the reference's)."""

    window: int = 16
    init: Literal["random", "repeat_left"] = "random"
    rank_radius: int = 7
    probability_gap: float = 0.15
    max_distance: float = 0.5
    slots: int = 0  # images decoded at once; 0: all the conditions
    drain: float = 0.75  # ragged SJD's: drop finished slots once the queue is dry (decode/drain.py; 0: never)

    def __post_init__(self):
        GSDDecodeConfig(self.window, self.init, self.rank_radius, self.probability_gap, self.max_distance)
        RaggedSJDConfig(self.window, self.init, self.slots, self.drain)  # the same checks


def generate_gsd_ragged(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedGSDConfig = RaggedGSDConfig(),
) -> GenerationResult:
    """Ragged Jacobi windows over ``config.slots`` slots with GSD's grouped test (module docstring)."""
    windows = RaggedSJDConfig(config.window, config.init, config.slots, config.drain)
    accept = grouped_test(backbone, config.rank_radius, config.probability_gap, config.max_distance)
    return generate_jacobi_ragged(backbone, condition, sampling, generator, windows, accept)


def _generate(backbone, _artefact, condition, sampling, generator, settings: RaggedGSDConfig) -> GenerationResult:
    return generate_gsd_ragged(backbone, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=RaggedGSDConfig,
    lossless=lambda settings: settings.rank_radius == 0,
    continuous=True,
)
