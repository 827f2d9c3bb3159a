"""The benchmark: every method on the same batches, interleaved, so that machine load falls on all alike.

Timing each method in a block of its own lets a change of load between blocks
move every ratio (the same commit measured one method at 1.5x on a quiet machine
and at 9.7x when another process ran during the baseline's block). Here the
methods take turns batch by batch (AR, method 1, method 2, AR, ..., the order
rotating from batch to batch), each with its own random generator, so a method
produces exactly the tokens it would produce alone. Per method the benchmark
keeps every batch's seconds: the report gives the mean and, beside it, the
spread across batches of its seconds per image and of its paired speedup (the
baseline's seconds on the same batch over the method's).

Several seeds (``seeds``) repeat the whole comparison with seed, seed + 1, ...:
the seed-to-seed band of every method's quality, from one run.

Continuous batching (``queue_batches`` > 1): a turn is that many consecutive
batches. A method that batches continuously (``MethodSpec.continuous``) gets
the turn's images as one queue over ``batch_size`` slots; every other method
runs the turn batch by batch. Each turn is one entry of every method's
per-batch figures, so the paired speedups still compare the same images.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from backbones.base import ARImageBackbone, Condition
from common.progress import ProgressLog
from decode.backbone_clock import clock_backbone_passes
from decode.conditions import Conditions
from decode.registry import Method
from decode.sampling import SamplingConfig

log = logging.getLogger(__name__)


@dataclass
class SeedRun:
    """One method at one seed: its generator and what it has produced and measured so far."""

    seed: int
    generator: torch.Generator
    tokens: torch.Tensor  # (N, rows, cols) (continuous: (N, rows, cols, token_dim)), in the order of the conditions
    passes: int = 0  # backbone passes of all its batches (one pass serves a whole batch)
    drafted: int = 0
    accepted: int = 0
    batch_seconds: list[float] = field(default_factory=list)
    batch_backbone_seconds: list[float] = field(default_factory=list)
    batch_images: list[int] = field(default_factory=list)
    batch_count: list[int] = field(default_factory=list)  # batches of `batch_size` each entry covers
    counts: dict = field(default_factory=dict)  # a method's own counts, summed over batches (GenerationResult.extras)


def run_interleaved(
    methods: list[Method],
    backbone: ARImageBackbone,
    conditions: Conditions,
    batch_size: int,
    sampling: SamplingConfig,
    seeds: list[int],
    progress_seconds: float = 10.0,
    queue_batches: int = 1,
) -> dict[str, list[SeedRun]]:
    """Generate every image with every method at every seed, taking turns batch by batch (turn by turn of
    `queue_batches` batches); {name: [SeedRun per seed]}."""
    device = next(backbone.parameters()).device
    batches = conditions.batches(batch_size, backbone)
    if queue_batches > 1 and conditions.class_ids is None:
        raise ValueError(
            "decode.queue_batches > 1 needs class-conditional images: prompts are batched by their token length, "
            "and a queue mixing lengths cannot share one cache; set decode.queue_batches=1"
        )
    groups = [batches[g : g + queue_batches] for g in range(0, len(batches), queue_batches)]
    # One untimed one-image batch per method: first calls pay for allocations and lazy initialisation.
    warm_up = _to(conditions.subset(batches[0][0][:1]), device)
    for method in methods:
        # A continuous method warms up on a full batch of slots: it measures its pass costs at that batch then.
        first = _to(batches[0][1], device) if method.spec.continuous else warm_up
        log.info("decode: warming up %s on %d image(s), untimed", method.name, first.batch_size)
        method.generate(backbone, first, sampling, torch.Generator(device=device).manual_seed(seeds[0]), batch_size)
    runs = {
        method.name: [
            SeedRun(
                seed,
                torch.Generator(device=device).manual_seed(seed),
                _token_buffer(backbone, len(conditions)),
            )
            for seed in seeds
        ]
        for method in methods
    }
    turns = [(k, g) for k in range(len(seeds)) for g in range(len(groups))]
    # A line every few seconds (terminal and log file alike): images done by every method, the running passes.
    progress = ProgressLog(
        f"decode {len(methods)} methods at batch {batch_size}",
        len(seeds) * len(conditions),
        "image",
        log,
        every_seconds=progress_seconds,
    )
    done = 0
    for turn, (k, g) in enumerate(turns):
        group = [(indices, _to(condition, device)) for indices, condition in groups[g]]
        images = sum(len(indices) for indices, _ in group)
        order = methods[turn % len(methods) :] + methods[: turn % len(methods)]  # rotating order
        for finished, method in enumerate(order, start=1):
            _timed_turn(method, runs[method.name][k], backbone, group, sampling, device, batch_size)
            # A line may come between a turn's methods (the images' share of the turn's work done so far): a turn
            # of a long continuous-batching queue takes minutes.
            done_so_far = done + images * finished / len(order)
            progress.update(done_so_far, f"seed {seeds[k]}; passes/image " + _running_passes(runs, k))
        done += images
    return runs


def _running_passes(runs: dict[str, list[SeedRun]], k: int) -> str:
    """'ar 576.0, ssd_exact 87.1': each method's passes per image so far at seed index k (one pass per batch)."""
    return ", ".join(f"{name} {r[k].passes / max(sum(r[k].batch_count), 1):.1f}" for name, r in runs.items())


def _token_buffer(backbone, count: int) -> torch.Tensor:
    """Room for `count` images' tokens: (count, rows, cols) ids, or (count, rows, cols, token_dim) vectors."""
    geometry = backbone.geometry
    if getattr(backbone, "token_kind", "discrete") != "discrete":  # continuous or masked (MAR)
        return torch.zeros(count, geometry.rows, geometry.cols, backbone.token_dim)
    return torch.zeros(count, geometry.rows, geometry.cols, dtype=torch.long)


def _timed_turn(
    method: Method,
    run: SeedRun,
    backbone: ARImageBackbone,
    group: list[tuple[torch.Tensor, Condition]],
    sampling: SamplingConfig,
    device: torch.device,
    batch_size: int,
) -> None:
    """One turn of one method: the group's batches one by one, or as one queue over `batch_size` slots for a
    method that batches continuously; recorded as one entry."""
    if method.spec.continuous and len(group) > 1:
        indices = torch.cat([indices for indices, _ in group])
        condition = Condition(class_ids=torch.cat([condition.class_ids for _, condition in group]))
        parts = [(indices, condition)]
    else:
        parts = group
    entries = len(run.batch_seconds)
    for indices, condition in parts:
        _timed_batch(method, run, backbone, indices, condition, sampling, device, batch_size)
    # Fold the turn's batches into one entry (the baseline's entry of the same turn covers the same images).
    for name in ("batch_seconds", "batch_backbone_seconds", "batch_images"):
        values = getattr(run, name)
        values[entries:] = [sum(values[entries:])]
    run.batch_count[entries:] = [len(group)]


def _timed_batch(
    method: Method,
    run: SeedRun,
    backbone: ARImageBackbone,
    indices: torch.Tensor,
    condition: Condition,
    sampling: SamplingConfig,
    device: torch.device,
    batch_size: int,
) -> None:
    with clock_backbone_passes(backbone) as backbone_clock:
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        result = method.generate(backbone, condition, sampling, run.generator, slots=batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
    run.tokens[indices] = result.tokens.cpu().to(run.tokens.dtype)  # (continuous: float32 whatever the model runs in)
    run.passes += result.forward_passes
    run.drafted += result.drafted_tokens
    run.accepted += result.accepted_tokens
    run.batch_seconds.append(seconds)
    run.batch_backbone_seconds.append(backbone_clock.seconds)
    run.batch_images.append(len(indices))
    run.batch_count.append(1)
    for key, value in result.extras.items():
        run.counts[key] = run.counts.get(key, 0) + value


def cost_figures(runs: list[SeedRun], baseline: list[SeedRun], num_tokens: int) -> dict:
    """A method's cost over all its seeds, against the baseline's runs on the same batches.

    The keys metrics.json has always had (passes, seconds, speedups) keep their
    meaning: means over every image. The spreads are the 10th, 50th and 90th
    percentiles across batches.
    """
    batches = sum(sum(run.batch_count) for run in runs)  # batches of batch_size (a continuous queue: its share)
    images = sum(sum(run.batch_images) for run in runs)
    seconds = sum(sum(run.batch_seconds) for run in runs)
    backbone_seconds = sum(sum(run.batch_backbone_seconds) for run in runs)
    passes_per_image = sum(run.passes for run in runs) / batches  # NFE: one pass serves every image of its batch
    figures = {
        "forward_passes_per_image": passes_per_image,
        "seconds_per_image": seconds / images,
        "seconds_total": seconds,
        # Inside the backbone's passes (decode/backbone_clock.py); the rest is drafting and verification.
        "backbone_seconds_per_image": backbone_seconds / images,
        "seconds_per_image_spread": _percentiles(
            [s / n for run in runs for s, n in zip(run.batch_seconds, run.batch_images)]
        ),
        "speedup_vs_ar_spread": _percentiles(
            [a / s for run, base in zip(runs, baseline) for a, s in zip(base.batch_seconds, run.batch_seconds)]
        ),
    }
    drafted = sum(run.drafted for run in runs)
    if drafted:
        figures["mean_accepted_per_pass"] = num_tokens / passes_per_image
        figures["draft_acceptance_rate"] = sum(run.accepted for run in runs) / drafted
    baseline_seconds = sum(sum(run.batch_seconds) for run in baseline) / sum(sum(run.batch_images) for run in baseline)
    baseline_passes = sum(run.passes for run in baseline) / sum(sum(run.batch_count) for run in baseline)
    figures["speedup_vs_ar"] = baseline_seconds / figures["seconds_per_image"]
    figures["nfe_reduction_vs_ar"] = baseline_passes / passes_per_image
    # The speedup this method's passes alone allow: what it would reach if drafting and verification were free.
    figures["speedup_bound_vs_ar"] = baseline_seconds / figures["backbone_seconds_per_image"]
    counts: dict = {}
    for run in runs:
        for key, value in run.counts.items():
            counts[key] = counts.get(key, 0) + value
    if counts:
        figures["counts"] = counts
    return figures


def _percentiles(values: list[float]) -> dict:
    p10, p50, p90 = np.percentile(np.asarray(values, dtype=np.float64), [10, 50, 90])
    return {"p10": float(p10), "p50": float(p50), "p90": float(p90)}


def _to(condition: Condition, device: torch.device) -> Condition:
    return Condition(class_ids=condition.class_ids.to(device)) if condition.class_ids is not None else condition
