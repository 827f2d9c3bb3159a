"""Baseline autoregressive decoding with a KV cache: the reference every speedup is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_tokens


@dataclass(frozen=True)
class ARDecodeConfig:
    """The baseline has no settings of its own: sampling comes from SamplingConfig."""


@torch.inference_mode()
def generate_ar(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    guided: bool | None = None,
    record_hidden: bool = False,
) -> GenerationResult:
    """Generate one image per condition, one token per backbone pass.

    Steps: prefill the condition (with its unconditional twin under CFG) into the
    cache; then for each of the ``rows * cols`` grid tokens, mix the guided
    scores, draw a token and feed it back through the cache. Batched: all rows of
    the batch advance together, so ``rows * cols`` passes make the whole batch.

    `guided` forces the [cond; uncond] batch on or off (default: on when
    ``sampling.cfg_scale != 1``). `record_hidden` also returns the pre-norm hidden
    states that predicted each token (cache rows, N, hidden): the distillation
    corpus's offline targets, at no extra backbone cost.
    """
    guided = sampling.guided if guided is None else guided
    geometry = backbone.geometry
    state, hidden = backbone.prefill(condition, guided)
    tokens = torch.empty(condition.batch_size, geometry.num_tokens, dtype=torch.long, device=hidden.device)
    recorded = hidden.new_empty(hidden.shape[0], geometry.num_tokens, hidden.shape[-1]) if record_hidden else None
    for position in range(geometry.num_tokens):
        if record_hidden:
            recorded[:, position] = hidden[:, -1]
        scores = backbone.scores(state, hidden[:, -1:], sampling.cfg_scale)  # (B, 1, V)
        next_token = sample_tokens(scores, sampling, generator)  # (B, 1)
        tokens[:, position] = next_token[:, 0]
        if position + 1 < geometry.num_tokens:  # the last token needs no pass of its own
            hidden = backbone.step(state, next_token)
    return GenerationResult(
        tokens.view(-1, geometry.rows, geometry.cols), forward_passes=geometry.num_tokens, hidden=recorded
    )


def _generate(backbone, _artefact, condition, sampling, generator, _settings: ARDecodeConfig) -> GenerationResult:
    kind = getattr(backbone, "token_kind", "discrete")
    if kind == "continuous":  # the same baseline for diffusion-head tokens
        from decode.continuous_ar import generate_continuous_ar

        return generate_continuous_ar(backbone, condition, sampling, generator)
    if kind == "masked":  # MAR: its own random-order sampler
        from decode.masked_baseline import generate_masked

        return generate_masked(backbone, condition, sampling, generator)
    return generate_ar(backbone, condition, sampling, generator)


METHOD = MethodSpec(generate=_generate, settings=ARDecodeConfig, token_kind="any")
