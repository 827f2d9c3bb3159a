"""MAR's own sampler with its steps grouped as CSpD's reference verification groups them: one pass per group.

The reference verification of CSpD on MAR (decode/cspd_mar.py, ``verification="window"``) lets one target
pass over the tokens known before a round predict every token the round drafted, each judged on its own. With
the exact test (tau 1, no std-ratio factor) a judged token is then distributed as the target's conditional
given the tokens before the round only, independently of the round's other tokens: the target's own sampler
with the round's steps revealed together in one step. This generator is that sampler without a drafter: after
the pre-fill, the steps of each reference round (`reference_round`) become one step, guided at the round's
last step's scale (as the reference verifies), so it takes one pass per round.

It is what the reference's rounds cost when nothing is drafted, and the distribution its verification has at
tau 1 (tests/test_decode_cspd_mar.py tests that): the fair reference for any speedup the reference verification
reports, as the masked baseline with fewer steps is for MAR itself. Not the backbone's sampler (`lossless`
False): its quality is reported beside the band.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import Condition
from backbones.mar import MARBackbone, RevealStep, reveal_steps
from decode.cspd_mar import prefill_steps, reference_round
from decode.masked_baseline import masked_inputs
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig


@dataclass(frozen=True)
class MARGroupedConfig:
    """How the steps are grouped: CSpD-on-MAR's reference rounds of `gamma` steps after its pre-fill."""

    gamma: int = 4  # the reference demo's num_draft
    prefill_fraction: float = 0.05  # the demo's ratio: these first steps stay one by one

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError(f"mar_grouped gamma must be >= 1, got {self.gamma}")
        if not 0 <= self.prefill_fraction <= 1:
            raise ValueError(f"mar_grouped prefill_fraction must be in [0, 1], got {self.prefill_fraction}")


def grouped_steps(steps: list[RevealStep], gamma: int, prefill_fraction: float) -> list[RevealStep]:
    """`steps` (consecutive ranges of the order, each before the last) with every reference round merged into
    one step over the round's positions, guided at its last step's scale."""
    first = prefill_steps(prefill_fraction, len(steps))
    grouped, index = list(steps[:first]), first
    while index < len(steps):
        window = reference_round(steps, index, gamma)
        grouped.append(RevealStep(window[-1].start, window[0].end, window[-1].cfg_scale))
        index += len(window)
    return grouped


@torch.inference_mode()
def generate_mar_grouped(
    backbone: MARBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    settings: MARGroupedConfig,
    generator: torch.Generator | None = None,
    orders: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """One image per class id with the backbone's sampler, its steps grouped (`grouped_steps`); a pass per group."""
    inputs = masked_inputs(backbone, condition, sampling)
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"mar_grouped runs MAR's class-conditional sampler; {backbone.name} is text-to-image")
    schedule = reveal_steps(backbone.seq_len, backbone.num_iter, sampling.cfg_scale, backbone.cfg_schedule)
    steps = grouped_steps(schedule, settings.gamma, settings.prefill_fraction)
    tokens = backbone.sample(
        inputs,
        cfg_scale=sampling.cfg_scale,
        temperature=sampling.temperature,
        orders=orders,
        noise=noise,
        generator=generator,
        steps=steps,
    )
    grid = backbone.geometry
    return GenerationResult(tokens.view(-1, grid.rows, grid.cols, backbone.token_dim), forward_passes=len(steps))


def _generate(backbone, _artefact, condition: Condition, sampling: SamplingConfig, generator, settings):
    return generate_mar_grouped(backbone, condition, sampling, settings, generator)


METHOD = MethodSpec(generate=_generate, settings=MARGroupedConfig, lossless=lambda s: False, token_kind="masked")
