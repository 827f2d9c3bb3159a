"""Baseline decoding of a continuous-token backbone: one backbone pass and one diffusion sampling per token.

The reference every continuous speculative method (decode/cspd.py) is measured
against: KV-cached, batched, the trajectory noise of every token drawn up front
(`ContinuousARBackbone.draw_noise`), so that a method given the same noise can
be compared token for token.
"""

from __future__ import annotations

import torch

from backbones.base import Condition
from backbones.continuous import ContinuousARBackbone
from decode.result import GenerationResult
from decode.sampling import SamplingConfig


def check_continuous_sampling(sampling: SamplingConfig) -> None:
    """Continuous tokens are sampled by a diffusion head: CFG and temperature apply, token filters do not."""
    if sampling.greedy or sampling.top_k or sampling.top_p < 1.0:
        raise ValueError(
            "greedy, top_k and top_p filter a token distribution; a continuous-token backbone samples each token "
            "with its diffusion head (only decode.cfg_scale and decode.temperature apply): set decode.greedy=false "
            "decode.top_k=0 decode.top_p=1.0"
        )


@torch.inference_mode()
def generate_continuous_ar(
    backbone: ContinuousARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate one image per condition, token by token.

    Steps: prefill the condition (and its unconditional twin under CFG); for each
    of the ``rows * cols`` positions, sample the token with the diffusion head
    from the last hidden state (guidance mixes the twins' noise predictions) and
    feed it back through the cache. `noise` (B, N, noise_steps, token_dim) replays
    given trajectory noise; by default it is drawn from `generator` up front.
    """
    check_continuous_sampling(sampling)
    geometry = backbone.geometry
    batch = condition.batch_size
    state, hidden = backbone.prefill(condition, sampling.guided)
    if noise is None:
        noise = backbone.draw_noise(batch, geometry.num_tokens, generator, hidden.device)
    tokens = hidden.new_empty(batch, geometry.num_tokens, backbone.token_dim)
    for position in range(geometry.num_tokens):
        drawn = backbone.sample_tokens(
            state, hidden[:, -1:], noise[:, position : position + 1], sampling.cfg_scale, sampling.temperature
        )
        tokens[:, position] = drawn.tokens[:, 0]
        if position + 1 < geometry.num_tokens:
            hidden = backbone.step(state, drawn.tokens)
    return GenerationResult(tokens.view(batch, geometry.rows, geometry.cols, -1), forward_passes=geometry.num_tokens)
