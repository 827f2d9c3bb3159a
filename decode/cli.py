"""`python -m decode`: generate with each method, measure cost and quality, write metrics.json and PNGs.

This is the one place in decode/ that reads a Hydra config; the generators it
calls are plain functions over tensors. Every method runs on the same backbone,
conditions, batch size and sampling settings in one process, and the KV-cached
baseline `ar` always runs first, so every speedup is against it.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from backbones.base import ARImageBackbone, Condition
from data.atomic_io import atomic_write_text
from decode.ar import generate_ar
from decode.images import save_image_grid, save_tokens
from decode.mulo import MuLoDecodeConfig, generate_mulo
from decode.plots import plot_speed_quality
from decode.quality import DigitsQuality
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig, generate_ssd
from heads.export import load_heads

log = logging.getLogger(__name__)

Generator = Callable[[ARImageBackbone, Condition, SamplingConfig, torch.Generator], GenerationResult]


@dataclass
class Method:
    """A named way to generate: the generator function and the seed offset it samples with."""

    generate: Generator
    seed_offset: int = 0


def build_methods(cfg: DictConfig, backbone: ARImageBackbone) -> dict[str, Method]:
    """The generators this run compares, by name, the baseline first.

    Names: ``ar`` (KV-cached baseline), ``ar_seed<K>`` (the baseline again with seed + K,
    for its seed-to-seed band), ``ssd_exact``, ``ssd_autocorrect`` (rounds from
    ``decode.ssd.rounds``) and ``ssd_autocorrect_r<K>`` (K rounds).
    """
    names = list(dict.fromkeys(cfg.decode.methods))
    if "ar" not in names:
        log.info("adding the KV-cached baseline 'ar': every speedup is measured against it in the same run")
    names = ["ar"] + [name for name in names if name != "ar"]
    heads = drafter = None
    methods = {}
    for name in names:
        if name == "ar":
            methods[name] = Method(generate_ar)
        elif re.fullmatch(r"ar_seed\d+", name):
            methods[name] = Method(generate_ar, seed_offset=int(name.removeprefix("ar_seed")))
        elif match := re.fullmatch(r"ssd_exact|ssd_autocorrect(?:_r(\d+))?(?:_(target|residual|prefix))?", name):
            heads = heads or load_heads(cfg.decode.heads, backbone, device=next(backbone.parameters()).device, kind="ssd")
            rounds, correction = match.groups()
            ssd = SSDDecodeConfig(mode="exact" if name == "ssd_exact" else "autocorrect",
                                  rounds=int(rounds) if rounds else cfg.decode.ssd.rounds,
                                  correction=correction or cfg.decode.ssd.correction,
                                  horizontal_steps=cfg.decode.ssd.horizontal_steps)
            methods[name] = Method(partial(_generate_ssd_with, heads=heads, config=ssd))
        elif match := re.fullmatch(r"mulo(_exact)?(?:_k(\d+))?(?:_d([\d.]+))?(?:_r(\d+))?", name):
            drafter = drafter or load_heads(cfg.decode.mulo.drafter, backbone, device=next(backbone.parameters()).device,
                                            kind="mulo")
            exact, k, delta, radius = match.groups()
            mulo = MuLoDecodeConfig(mode="exact" if exact else "relaxed",
                                    k=int(k) if k else cfg.decode.mulo.k,
                                    delta=float(delta) if delta else cfg.decode.mulo.delta,
                                    radius=int(radius) if radius else cfg.decode.mulo.radius,
                                    upsample_mode=cfg.decode.mulo.upsample_mode)
            methods[name] = Method(partial(_generate_mulo_with, drafter=drafter, config=mulo))
        else:
            raise ValueError(f"unknown decode method {name!r}; available: ar, ar_seed<K>, ssd_exact, "
                             "ssd_autocorrect, ssd_autocorrect_r<K>[_target|_residual|_prefix], mulo, mulo_exact, mulo_k<K>_d<delta>_r<rho>")
    return methods


def _generate_ssd_with(backbone, condition, sampling, generator, heads, config):
    return generate_ssd(backbone, heads, condition, sampling, generator, config)


def _generate_mulo_with(backbone, condition, sampling, generator, drafter, config):
    return generate_mulo(backbone, drafter, condition, sampling, generator, config)


def sampling_from_config(cfg: DictConfig) -> SamplingConfig:
    d = cfg.decode
    return SamplingConfig(cfg_scale=d.cfg_scale, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, greedy=d.greedy)


def balanced_class_ids(num_images: int) -> torch.Tensor:
    """0, 1, ..., 9, 0, 1, ...: every class equally often."""
    return torch.arange(num_images) % 10


def run_method(generate: Generator, backbone: ARImageBackbone, class_ids: torch.Tensor, batch_size: int,
               sampling: SamplingConfig, seed: int, label: str) -> tuple[torch.Tensor, dict]:
    """Generate all images in batches; return tokens (N, rows, cols) and cost figures."""
    device = next(backbone.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    # One untimed batch of one image: first calls pay for allocations and lazy initialisation.
    generate(backbone, Condition(class_ids=class_ids[:1].to(device)), sampling, generator)
    generator.manual_seed(seed)
    tokens, passes, drafted, accepted, seconds = [], 0, 0, 0, 0.0
    batches = range(0, len(class_ids), batch_size)
    for start in tqdm(batches, desc=f"decode {label}", unit="batch", leave=False, disable=None):
        condition = Condition(class_ids=class_ids[start : start + batch_size].to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        result = generate(backbone, condition, sampling, generator)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - began
        tokens.append(result.tokens.cpu())
        passes += result.forward_passes
        drafted += result.drafted_tokens
        accepted += result.accepted_tokens
    # NFE: the passes that made an image; one pass serves every image of its batch.
    passes_per_image = passes / len(batches)
    figures = {
        "forward_passes_per_image": passes_per_image,
        "seconds_per_image": seconds / len(class_ids),
        "seconds_total": seconds,
    }
    if drafted:
        figures["mean_accepted_per_pass"] = backbone.geometry.num_tokens / passes_per_image
        figures["draft_acceptance_rate"] = accepted / drafted
    return torch.cat(tokens), figures


def run_decode(cfg: DictConfig) -> dict:
    """Decode with every requested method, score and compare them; write DIR/metrics.json and DIR/<method>.png."""
    if cfg.decode.num_images < 1 or cfg.decode.batch_size < 1:
        raise ValueError(f"decode.num_images and decode.batch_size must be >= 1, got {cfg.decode.num_images}, {cfg.decode.batch_size}")
    out = Path(cfg.decode.out)
    out.mkdir(parents=True, exist_ok=True)
    backbone: ARImageBackbone = hydra.utils.instantiate(cfg.backbone)
    sampling = sampling_from_config(cfg)
    class_ids = balanced_class_ids(cfg.decode.num_images)
    quality = DigitsQuality(backbone.geometry.rows, backbone.codebook_size, Path(cfg.paths.checkpoints_dir) / "digits-classifier")
    methods = build_methods(cfg, backbone)

    report = {
        "backbone": backbone.identity(),
        "sampling": vars(sampling) | {"guided": sampling.guided},
        "num_images": cfg.decode.num_images,
        "batch_size": cfg.decode.batch_size,
        "seed": cfg.decode.seed,
        "device": str(next(backbone.parameters()).device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "methods": {},
    }
    for name, method in methods.items():
        tokens, figures = run_method(method.generate, backbone, class_ids, cfg.decode.batch_size, sampling,
                                     cfg.decode.seed + method.seed_offset, name)
        images = backbone.tokens_to_pixels(tokens)
        figures["quality"] = quality(images, class_ids)
        baseline = report["methods"].get("ar", figures)
        figures["speedup_vs_ar"] = baseline["seconds_per_image"] / figures["seconds_per_image"]
        figures["nfe_reduction_vs_ar"] = baseline["forward_passes_per_image"] / figures["forward_passes_per_image"]
        report["methods"][name] = figures
        save_image_grid(images[:100], out / f"{name}.png")
        if cfg.decode.save_tokens:
            save_tokens(tokens, out / f"tokens_{name}.npy")
        print(f"[decode] {name:>16}: {figures['forward_passes_per_image']:7.1f} passes/image  "
              f"{figures['seconds_per_image']:.3f} s/image  speedup {figures['speedup_vs_ar']:.2f}x  "
              f"accuracy {figures['quality']['classifier_accuracy']:.3f}  FD {figures['quality']['frechet_distance']:.2f}")
    atomic_write_text(out / "metrics.json", json.dumps(report, indent=2) + "\n")
    if len(methods) > 1:
        plot_speed_quality(report, out / "speed_quality.png")
    print(f"[decode] wrote {out / 'metrics.json'} and {', '.join(f'{n}.png' for n in methods)}")
    return report

