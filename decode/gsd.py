"""Grouped speculative decoding (GSD; So et al., ICCV 2025): SJD with the test pooled over similar tokens.

Paper: "Grouped Speculative Decoding for Autoregressive Image Generation";
code: github.com/junhyukso/GSD (`scheduler/jacobi_iteration_lumina_mgpt.py`,
`SpeculativeSampler.__call__`; `test_GSD.py` for the settings).

Steps: SJD's iterations (decode/sjd.py), with one change in step 2: a draft x
is accepted with probability ``min(1, sum_G p_now / sum_G p_prev)`` over its
group G (decode/rules.py `token_group`): the tokens ranked within 7 of x by
p_now (``sort()[cur - 7 : cur + 7]``), whose p_now is within 0.15 of p_now(x)
and whose input embeddings (the backbone's, for image tokens) lie within
squared L2 distance 0.5 of x's. A rejected draft is corrected from
``norm(max(0, p_now - p_prev))`` over the whole vocabulary, as in SJD. The
reference script's settings: window 16, random initial drafts, image top-k
2000, CFG 3.0. Not lossless: accepting x for its group's mass samples x more
often than p_now(x).

The embedding distance threshold is in the backbone's own embedding scale
(Lumina-mGPT's in the reference); `max_distance` sets it for another backbone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.rules import grouped_accept, token_group
from decode.sampling import SamplingConfig
from decode.sjd import SJDDecodeConfig, generate_jacobi


@dataclass(frozen=True)
class GSDDecodeConfig:
    """SJD's window and initialisation, and the group of the pooled test."""

    window: int = 16
    init: Literal["random", "repeat_left"] = "random"
    rank_radius: int = 7  # candidates: ranks [-r, r) around the draft's in p_now (0: the draft alone, i.e. SJD)
    probability_gap: float = 0.15  # members' p_now within this of the draft's
    max_distance: float = 0.5  # members' input embeddings within this squared L2 distance of the draft's

    def __post_init__(self):
        SJDDecodeConfig(self.window, self.init)  # the same checks
        if self.rank_radius < 0 or self.probability_gap < 0 or self.max_distance < 0:
            raise ValueError("rank_radius, probability_gap and max_distance must be >= 0")


@torch.inference_mode()
def generate_gsd(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: GSDDecodeConfig = GSDDecodeConfig(),
) -> GenerationResult:
    """GSD: speculative Jacobi iterations with the grouped test."""
    accept = grouped_test(backbone, config.rank_radius, config.probability_gap, config.max_distance)
    return generate_jacobi(
        backbone, condition, sampling, generator, SJDDecodeConfig(config.window, config.init), accept
    )


def grouped_test(backbone: ARImageBackbone, rank_radius: int, probability_gap: float, max_distance: float):
    """GSD's acceptance rule ``accept(p, q, drafts, uniforms)`` over the groups of this backbone's image tokens
    (decode/rules.py `token_group`, `grouped_accept`); shared by decode/gsd_ragged.py."""
    embeddings = backbone.embed_image_tokens(torch.arange(backbone.codebook_size, device=backbone._device()))

    def accept(p, q, drafts, uniforms):
        members, in_group = token_group(p, drafts, embeddings, rank_radius, probability_gap, max_distance)
        return grouped_accept(p, q, members, in_group, uniforms)

    return accept


def _generate(backbone, _artefact, condition, sampling, generator, settings: GSDDecodeConfig) -> GenerationResult:
    return generate_gsd(backbone, condition, sampling, generator, settings)


METHOD = MethodSpec(generate=_generate, settings=GSDDecodeConfig, lossless=lambda settings: settings.rank_radius == 0)
