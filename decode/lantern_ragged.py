"""LANTERN with ragged frontiers and continuous batching: ragged EAGLE's rounds, LANTERN's relaxed test.

decode/lantern.py is decode/eagle.py's chains with LANTERN's acceptance (Jang et al., ICLR 2025): a draft x is
kept with probability ``min(1, (p(x) + c_m) / q(x))``, ``c_m`` the target mass of x's `k` nearest codebook
neighbours pooled nearest first up to `delta`; after a rejection the token comes from ``norm(max(0, p - q))``.
This is the same test on decode/eagle_ragged.py's rounds: every image drafts and verifies its own chain from its
own frontier in one shared pass, and a finished image's slot goes to the next condition of the queue. Uniforms
are keyed per image and event, so an image's tokens do not depend on its batch. Not lossless for delta > 0;
greedy decoding, k = 0 or delta = 0 is ragged EAGLE's exact test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.eagle_ragged import RaggedEagleConfig, generate_eagle_ragged
from decode.lantern import LanternDecodeConfig
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import latent_neighbours, probability_of, relaxed_accept
from decode.sampling import SamplingConfig
from heads.eagle import EagleHead


@dataclass(frozen=True)
class RaggedLanternConfig:
    """Ragged EAGLE's chain and slots, LANTERN's neighbourhood (the paper's k and delta)."""

    depth: int = 6
    k: int = 1000
    delta: float = 0.1
    slots: int = 0  # images decoded at once; 0: all the conditions
    drain: float = 0.75  # ragged EAGLE's: drop finished slots once the queue is dry (decode/drain.py; 0: never)

    def __post_init__(self):
        LanternDecodeConfig(self.depth, self.k, self.delta)  # the same checks
        RaggedEagleConfig(self.depth, self.slots, drain=self.drain)


def generate_lantern_ragged(
    backbone: ARImageBackbone,
    head: EagleHead,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedLanternConfig = RaggedLanternConfig(),
) -> GenerationResult:
    """Ragged EAGLE rounds over ``config.slots`` slots with LANTERN's relaxed test (module docstring)."""
    eagle = RaggedEagleConfig(config.depth, config.slots, drain=config.drain)
    if sampling.greedy or config.k == 0 or config.delta == 0:
        return generate_eagle_ragged(backbone, head, condition, sampling, generator, eagle)
    neighbours = latent_neighbours(backbone.codebook_latents(), config.k)

    def accept(p, q, drafts, uniforms):
        return relaxed_accept(p, drafts, neighbours, config.delta, False, uniforms, probability_of(q, drafts))

    return generate_eagle_ragged(backbone, head, condition, sampling, generator, eagle, accept)


def _generate(backbone, head, condition, sampling, generator, settings: RaggedLanternConfig) -> GenerationResult:
    return generate_lantern_ragged(backbone, head, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=RaggedLanternConfig,
    artefact="heads",
    artefact_kind="eagle",
    lossless=lambda settings: settings.k == 0 or settings.delta == 0,
    continuous=True,
)
