"""The baseline of a masked random-order backbone (MAR, Harmon): its own sampler, one pass per step.

`ar` runs this on a backbone whose ``token_kind`` is "masked" (backbones/mar.py, backbones/harmon.py), at the
backbone's ``num_iter`` and ``cfg_schedule``, so that every method of a run generates the
same way and is measured against the same baseline.
"""

from __future__ import annotations

import torch

from backbones.base import Condition
from backbones.mar import MARBackbone, reveal_steps
from decode.continuous_ar import check_continuous_sampling
from decode.result import GenerationResult
from decode.sampling import SamplingConfig


def masked_inputs(backbone: MARBackbone, condition: Condition, sampling: SamplingConfig) -> torch.Tensor | list[str]:
    """What a masked backbone conditions on, its sampling checked (CFG and temperature only; every masked
    method's check): class ids for MAR, prompts for Harmon (``num_classes`` None)."""
    check_continuous_sampling(sampling)
    if backbone.num_classes is None:
        if condition.prompts is None:
            raise ValueError(f"{backbone.name} is text-to-image: give prompts, not class ids")
        return list(condition.prompts)
    if condition.class_ids is None:
        raise ValueError(f"{backbone.name} is class-conditional: give class ids, not prompts")
    return condition.class_ids


@torch.inference_mode()
def generate_masked(
    backbone: MARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """One image per class id (MAR) or prompt (Harmon) with the model's own sampler; a pass per step that reveals
    tokens (guided twins batched)."""
    inputs = masked_inputs(backbone, condition, sampling)
    grid = backbone.geometry
    tokens = backbone.sample(
        inputs,
        num_iter=backbone.num_iter,
        cfg_scale=sampling.cfg_scale,
        cfg_schedule=backbone.cfg_schedule,
        temperature=sampling.temperature,
        generator=generator,
    )
    passes = len(reveal_steps(backbone.seq_len, backbone.num_iter))
    return GenerationResult(tokens.view(-1, grid.rows, grid.cols, backbone.token_dim), forward_passes=passes)
