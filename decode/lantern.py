"""LANTERN (Jang et al., ICLR 2025): EAGLE's drafts verified with relaxed acceptance over latent-space neighbours.

Paper: "LANTERN: Accelerating Visual Autoregressive Models with Relaxed
Speculative Decoding"; code: github.com/jadohu/LANTERN. Image tokens whose
codebook latents are close look alike, and the target spreads its mass over
them, so exact speculative sampling rejects drafts that would look the same.

Steps: draft and verify exactly as EAGLE (decode/eagle.py, the same trained
head), except that a draft x is accepted with probability
``min(1, (p(x) + c_m) / q(x))``, where ``c_m`` is the target mass of x's `k`
nearest codebook neighbours (in latent distance), summed nearest first while it
stays <= `delta` (decode/rules.py's `relaxed_accept`). After a rejection the
token is drawn from ``norm(max(0, p - q))``. The paper's settings: k = 1000,
delta = 0.1 (the digits codebook has 16 entries: every other entry is a
neighbour, delta bounds what they contribute). Not lossless for delta > 0;
greedy decoding is not relaxed (it is EAGLE's). LANTERN++'s static tree and
its lambda cap are not implemented (EAGLE here drafts chains, see decode/eagle.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.eagle import EagleDecodeConfig, generate_eagle
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import latent_neighbours, probability_of, relaxed_accept
from decode.sampling import SamplingConfig
from heads.eagle import EagleHead


@dataclass(frozen=True)
class LanternDecodeConfig:
    """EAGLE's chain and the relaxed test's neighbourhood."""

    depth: int = 6  # drafts per pass, as EAGLE's
    k: int = 1000  # codebook neighbours pooled (the paper's)
    delta: float = 0.1  # their pooled target mass budget (the paper's; 0: EAGLE's exact test)

    def __post_init__(self):
        EagleDecodeConfig(self.depth)  # the same checks
        if self.k < 0 or not 0 <= self.delta <= 1:  # a probability budget: above 1 would accept anything
            raise ValueError(f"LANTERN k must be >= 0 and delta in [0, 1], got k={self.k}, delta={self.delta}")


def generate_lantern(
    backbone: ARImageBackbone,
    head: EagleHead,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: LanternDecodeConfig = LanternDecodeConfig(),
) -> GenerationResult:
    """LANTERN: EAGLE chains with the relaxed test over the `k` nearest codebook neighbours."""
    if sampling.greedy or config.k == 0 or config.delta == 0:
        return generate_eagle(backbone, head, condition, sampling, generator, EagleDecodeConfig(config.depth))
    neighbours = latent_neighbours(backbone.codebook_latents(), config.k)

    def accept(p, q, drafts, uniforms):
        return relaxed_accept(p, drafts, neighbours, config.delta, False, uniforms, probability_of(q, drafts))

    return generate_eagle(backbone, head, condition, sampling, generator, EagleDecodeConfig(config.depth), accept)


def _generate(backbone, heads, condition, sampling, generator, settings: LanternDecodeConfig) -> GenerationResult:
    return generate_lantern(backbone, heads, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=LanternDecodeConfig,
    artefact="heads",
    artefact_kind="eagle",
    lossless=lambda settings: settings.k == 0 or settings.delta == 0,
)
