"""What one backbone pass costs against the number of tokens it is fed, and what SSD's drafting costs.

SSD's premise is that verifying a row costs about one token's pass: true where
decoding is memory-bound (a 7B model on a GPU at small batch), false on a CPU.
These functions measure it on whatever device the backbone is on, through the
adapter's own `step` and `scores` (so the cache, the end-of-line tokens and the
image head are the ones decoding uses):

- `pass_costs`: a context filled to a point of the image, then passes of n
  tokens (each followed by its rollback) timed at that context;
- `drafting_costs`: the SSD drafter's work per row (the vertical head over the
  row above, then the grid head along the row) and per grid step, with heads of
  the backbone's hidden size.

Times are medians over repeats after warm-up: CUDA events on a GPU, the wall
clock on a CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from backbones.base import ARImageBackbone, Condition
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig
from decode.ssd_drafting import SSDRowDrafter
from heads.ssd import SSDHeadConfig, SSDHeads


def median_seconds(call: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """The median duration of `call()` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    durations = []
    for _ in range(repeats):
        if device.type == "cuda":
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            call()
            ended.record()
            ended.synchronize()
            durations.append(began.elapsed_time(ended) / 1000)
        else:
            began = time.perf_counter()
            call()
            durations.append(time.perf_counter() - began)
    return statistics.median(durations)


def measured_context(backbone: ARImageBackbone, largest_feed: int) -> int:
    """Grid tokens already in the cache when passes are timed: the image's middle, or less where the largest
    feed would run past the image's end."""
    return max(0, min(backbone.geometry.num_tokens // 2, backbone.geometry.num_tokens - largest_feed))


@torch.inference_mode()
def pass_costs(
    backbone: ARImageBackbone,
    condition: Condition,
    cfg_scale: float,
    counts: list[int],
    repeats: int = 10,
    warmup: int = 3,
) -> dict:
    """Seconds of one verification pass (step n grid tokens + their guided scores) for each n in `counts`.

    The cache holds the prompt and `measured_context` grid tokens (a twin per image under CFG); each timed
    pass is rolled back, so every n is timed at the same context. Counts that do not fit in the image are
    left out and listed under ``skipped_counts``.
    """
    device = next(backbone.parameters()).device
    geometry = backbone.geometry
    fitting = [n for n in counts if n <= geometry.num_tokens]
    guided = cfg_scale != 1.0
    state, _ = backbone.prefill(condition, guided)
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, backbone.codebook_size, (condition.batch_size, geometry.num_tokens), generator=generator)
    tokens = tokens.to(device)
    context = measured_context(backbone, max(fitting))
    for start in range(0, context, geometry.cols):  # fill the context a row at a time, as decoding would
        backbone.step(state, tokens[:, start : min(context, start + geometry.cols)])

    def one_pass(n: int) -> None:
        hidden = backbone.step(state, tokens[:, context : context + n])
        backbone.scores(state, hidden, cfg_scale)
        backbone.rollback(state, context)

    seconds = {n: median_seconds(lambda n=n: one_pass(n), device, repeats, warmup) for n in fitting}
    return {
        "batch": condition.batch_size,
        "cache_rows": state.cache_rows,
        "context_tokens": state.prefix_length + geometry.flat_length(context),
        "seconds_per_pass": {str(n): s for n, s in seconds.items()},
        "relative_to_one_token": {str(n): s / seconds[fitting[0]] for n, s in seconds.items()},
        "skipped_counts": [n for n in counts if n not in fitting],
    }


def drafting_heads(backbone: ARImageBackbone, dtype: torch.dtype) -> SSDHeads:
    """Random SSD heads of the shape the real experiments train (width = hidden size, depth 2, one row-attention
    layer with 32 heads where the hidden size allows) with the digits default's grid head (two positions
    above-right), on the backbone's device."""
    hidden = backbone.hidden_size
    attention_heads = 32 if hidden % 32 == 0 else 4
    config = SSDHeadConfig(
        hidden_size=hidden,
        width=hidden,
        depth=2,
        row_attention_layers=1,
        row_attention_heads=attention_heads,
        grid=True,
        grid_above_right=2,
    )
    device = next(backbone.parameters()).device
    return SSDHeads(config).to(device=device, dtype=dtype).eval().requires_grad_(False)


@torch.inference_mode()
def drafting_costs(
    backbone: ARImageBackbone, condition: Condition, cfg_scale: float, dtype: torch.dtype, repeats: int = 5
) -> dict:
    """Seconds the SSD drafter spends on one row: the vertical draft alone, and the whole row as SSD drafts it
    (vertical draft, the first token from its state, the grid head along the row); per grid step is the
    difference over the row's cols - 1 steps."""
    device = next(backbone.parameters()).device
    heads = drafting_heads(backbone, dtype)
    sampling = SamplingConfig(cfg_scale=cfg_scale)
    state, first_state = backbone.prefill(condition, sampling.guided)
    cols = backbone.geometry.cols
    drafter = SSDRowDrafter(
        backbone, heads, state, sampling, torch.Generator(device=device).manual_seed(0), SSDDecodeConfig(), device
    )
    tokens_above = torch.randint(0, backbone.codebook_size, (condition.batch_size, cols), device=device)
    hidden_above = backbone.step(state, tokens_above)  # real states of a row (G, C, H)

    def vertical() -> None:
        drafter.vertical(hidden_above, tokens_above)

    def whole_row() -> None:
        prepared = drafter.prepare_above(hidden_above, tokens_above)
        drafter.draft_row(1, hidden_above[:, :1], hidden_above, tokens_above, prepared, keep_states=False)

    vertical_seconds = median_seconds(vertical, device, repeats, warmup=2)
    row_seconds = median_seconds(whole_row, device, repeats, warmup=2)
    return {
        "batch": condition.batch_size,
        "head_parameters": sum(p.numel() for p in heads.parameters()),
        "seconds_per_vertical_row": vertical_seconds,
        "seconds_per_drafted_row": row_seconds,
        "seconds_per_grid_step": max(0.0, row_seconds - vertical_seconds) / max(1, cols - 1),
    }


_MEASURED_RAGGED_SECONDS: dict[tuple, list[float]] = {}


def ragged_pass_seconds(backbone: ARImageBackbone, state, batch: int, guided: bool, lengths: list[int]) -> list[float]:
    """The seconds of a ragged pass (`ARImageBackbone.step_ragged`) of each of `lengths` tokens per image at this
    batch (median of 3 after a warm-up), fed mid-image into `state` and thrown away: a generator calls it at
    start-up, when the slots it writes lie past every image's final slots. Measured once per backbone, device,
    batch, guidance and lengths in a process (cost-aware ragged generators: decode/ssd_ragged.py,
    decode/eagle_ragged.py)."""
    device = next(backbone.parameters()).device
    key = (id(backbone), str(device), batch, guided, tuple(lengths))
    if key not in _MEASURED_RAGGED_SECONDS:
        middle = backbone.geometry.num_tokens // 2
        seconds = []
        for length in lengths:
            start = max(1, min(middle, backbone.geometry.num_tokens - length))
            tokens = torch.zeros(batch, length, dtype=torch.long, device=device)
            starts = torch.full((batch,), start, dtype=torch.long, device=device)
            call = lambda t=tokens, s=starts: backbone.step_ragged(state, t, s)  # noqa: E731
            seconds.append(median_seconds(call, device, 3, 1))
        _MEASURED_RAGGED_SECONDS[key] = seconds
    return _MEASURED_RAGGED_SECONDS[key]
