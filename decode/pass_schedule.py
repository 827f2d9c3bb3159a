"""A speculative method's pass schedule on one backbone, and what that schedule would buy on another.

`record_schedule` runs a method on a few conditions and counts what its time
is made of: backbone passes and the tokens each was fed, the SSD drafter's grid
steps and vertical row drafts. `projected_speedup` combines such a schedule
with pass and drafting costs measured on another backbone (decode/pass_cost.py):

    AR    = N * c(1)
    SSD   = (N / a) * c(f * cols / cols_d)  +  N * s * t_step  +  R * v * t_row
    speedup = AR / SSD

with N = R x cols the other backbone's tokens, c(n) its measured seconds per
pass of n tokens (linearly interpolated between measured n), and from the
schedule: a = tokens per pass, f = mean tokens fed per pass (scaled by the
ratio of row widths, since a pass verifies about a row), s = grid steps per
token, v = vertical drafts per row; t_step, t_row the drafting costs measured at
the other backbone's hidden size. It assumes the other backbone's heads accept
per position as the schedule's did: a projection, not a measurement.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from backbones.base import ARImageBackbone, Condition
from decode.sampling import SamplingConfig


@contextmanager
def _counting(backbone: ARImageBackbone, heads, counts: dict):
    """Count passes, fed tokens, grid steps and vertical drafts while the block runs (instance patches, undone)."""
    original_step = backbone.step

    def step(state, tokens):
        counts["passes"] += 1
        counts["fed_tokens"] += tokens.shape[1]
        return original_step(state, tokens)

    backbone.step = step
    grid = getattr(heads, "grid", None)
    vertical = getattr(heads, "vertical", None)
    if grid is not None:
        original_drafting_step = grid.drafting_step

        def drafting_step():
            inner = original_drafting_step()

            def counted(*args):
                counts["grid_steps"] += 1
                return inner(*args)

            return counted

        grid.drafting_step = drafting_step
    if vertical is not None:
        original_vertical = vertical.forward

        def vertical_forward(*args):
            counts["vertical_rows"] += 1
            return original_vertical(*args)

        vertical.forward = vertical_forward
    try:
        yield
    finally:
        del backbone.step
        if grid is not None:
            del grid.drafting_step
        if vertical is not None:
            del vertical.forward


def record_schedule(
    method, backbone: ARImageBackbone, conditions: list[Condition], sampling: SamplingConfig, seed: int = 0
) -> dict:
    """Per image and per pass figures of `method` (a decode.registry.Method with its export loaded) over
    `conditions` (one batch each; prefill passes are not counted)."""
    counts = {"passes": 0, "fed_tokens": 0, "grid_steps": 0, "vertical_rows": 0}
    device = next(backbone.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    images = 0
    with _counting(backbone, method.artefact, counts):
        for condition in conditions:
            method.generate(backbone, condition, sampling, generator)
            images += condition.batch_size
    batches = len(conditions)
    rows, tokens = backbone.geometry.rows, backbone.geometry.num_tokens
    passes_per_batch = counts["passes"] / batches
    return {
        "generator": method.generator,
        "images": images,
        "cols": backbone.geometry.cols,
        "passes_per_batch": passes_per_batch,
        "tokens_per_pass": tokens / passes_per_batch,
        "fed_tokens_per_pass": counts["fed_tokens"] / max(1, counts["passes"]),
        "grid_steps_per_token": counts["grid_steps"] / (batches * tokens),
        "vertical_drafts_per_row": counts["vertical_rows"] / (batches * rows),
    }


def interpolated_cost(seconds_per_pass: dict[str, float], tokens: float) -> float:
    """Seconds of a pass of `tokens` fed tokens, linear between measured counts (clamped to the measured range
    below, extrapolated along the last segment above)."""
    points = sorted((int(n), s) for n, s in seconds_per_pass.items())
    if tokens <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if tokens <= n1:
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
    (n0, s0), (n1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) * (tokens - n1) / (n1 - n0)


def projected_speedup(schedule: dict, pass_cost: dict, drafting: dict | None, rows: int, cols: int) -> dict:
    """The module docstring's formula for a backbone of `rows` x `cols` tokens; every term is returned."""
    seconds = pass_cost["seconds_per_pass"]
    tokens = rows * cols
    fed = schedule["fed_tokens_per_pass"] * cols / schedule["cols"]
    ar = tokens * interpolated_cost(seconds, 1)
    passes = tokens / schedule["tokens_per_pass"]
    verify = passes * interpolated_cost(seconds, fed)
    draft = 0.0
    if drafting is not None:
        draft = (
            tokens * schedule["grid_steps_per_token"] * drafting["seconds_per_grid_step"]
            + rows * schedule["vertical_drafts_per_row"] * drafting["seconds_per_vertical_row"]
        )
    return {
        "ar_seconds_per_image": ar,
        "passes_per_image": passes,
        "fed_tokens_per_pass": fed,
        "verification_seconds_per_image": verify,
        "drafting_seconds_per_image": draft,
        "projected_speedup": ar / (verify + draft),
        "projected_speedup_if_drafting_were_free": ar / verify,
    }
