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
from data.corpus import group_by_prompt_length
from data.prompts import balanced_class_ids, load_prompts
from decode.ar import generate_ar
from decode.backbone_clock import clock_backbone_passes
from decode.images import save_image_grid, save_tokens
from decode.mulo import MuLoDecodeConfig, generate_mulo
from decode.plots import plot_speed_quality
from decode.quality import DigitsQuality
from decode.real_quality import RealQuality
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

    Names: ``ar`` (KV-cached baseline), ``ssd_exact``, ``ssd_autocorrect`` (rounds from
    ``decode.ssd.rounds``) and ``ssd_autocorrect_r<K>`` (K rounds), with optional suffixes
    ``_target|_residual|_prefix`` (autocorrect's correction), ``_w<W>`` (verification window), ``_g<G>``
    (grid head re-drafts G positions after each correction), ``_la[<C>]`` (lookahead into the next row,
    at confidence C/100) and
    ``_k<K>_d<delta>`` (LANTERN relaxation; not lossless); ``mulo``, ``mulo_exact`` and
    ``mulo_k<K>_d<delta>_r<rho>[_rounds<R>][_nearest|_bilinear|_bicubic][_point]`` (the upsampler's
    interpolation; ``_point``: drafts verified as point proposals). Any name + ``_seed<K>`` runs that
    method again with seed + K (``ar_seed1``, ``mulo_seed2``: seed-to-seed bands in one run).
    """
    names = list(dict.fromkeys(cfg.decode.methods))
    if "ar" not in names:
        log.info("adding the KV-cached baseline 'ar': every speedup is measured against it in the same run")
    names = ["ar"] + [name for name in names if name != "ar"]
    heads = drafter = None
    methods = {}
    for full_name in names:
        # Any method + _seed<K>: the same method sampled with seed + K (its own seed-to-seed band).
        name, seed_suffix = re.fullmatch(r"(.*?)(?:_seed(\d+))?", full_name).groups()
        seed_offset = int(seed_suffix) if seed_suffix else 0
        if name == "ar":
            methods[full_name] = Method(generate_ar, seed_offset)
        elif match := re.fullmatch(r"ssd_(exact|autocorrect(?:_r(\d+))?(?:_(target|residual|prefix))?)"
                                   r"(?:_w(\d+))?(?:_g(\d+))?(?:_la(\d*))?(?:_k(\d+)_d([\d.]+))?", name):
            heads = heads or load_heads(cfg.decode.heads, backbone, device=next(backbone.parameters()).device, kind="ssd")
            mode, rounds, correction, window, grid_steps, lookahead, relax_k, relax_delta = match.groups()
            ssd = SSDDecodeConfig(mode="exact" if mode == "exact" else "autocorrect",
                                  rounds=int(rounds) if rounds else cfg.decode.ssd.rounds,
                                  correction=correction or cfg.decode.ssd.correction,
                                  horizontal_steps=cfg.decode.ssd.horizontal_steps,
                                  window=int(window) if window else cfg.decode.ssd.window,
                                  grid_steps=int(grid_steps) if grid_steps else cfg.decode.ssd.grid_steps,
                                  lookahead=lookahead is not None or cfg.decode.ssd.lookahead,
                                  lookahead_confidence=(int(lookahead) / 100 if lookahead
                                                        else cfg.decode.ssd.lookahead_confidence),
                                  relax_k=int(relax_k) if relax_k else cfg.decode.ssd.relax_k,
                                  relax_delta=float(relax_delta) if relax_delta else cfg.decode.ssd.relax_delta)
            methods[full_name] = Method(partial(_generate_ssd_with, heads=heads, config=ssd), seed_offset)
        elif match := re.fullmatch(r"mulo(_exact)?(?:_k(\d+))?(?:_d([\d.]+))?(?:_r(\d+))?(?:_rounds(\d+))?(?:_(nearest|bilinear|bicubic))?(_point)?", name):
            drafter = drafter or load_heads(cfg.decode.mulo.drafter, backbone, device=next(backbone.parameters()).device,
                                            kind="mulo")
            exact, k, delta, radius, rounds, upsample_mode, point = match.groups()
            mulo = MuLoDecodeConfig(mode="exact" if exact else "relaxed",
                                    k=int(k) if k else cfg.decode.mulo.k,
                                    delta=float(delta) if delta else cfg.decode.mulo.delta,
                                    radius=int(radius) if radius else cfg.decode.mulo.radius,
                                    upsample_mode=upsample_mode or cfg.decode.mulo.upsample_mode,
                                    rounds=int(rounds) if rounds else cfg.decode.mulo.rounds,
                                    proposal="point" if point else cfg.decode.mulo.proposal,
                                    drafter_cfg_scale=cfg.decode.mulo.drafter_cfg_scale)
            methods[full_name] = Method(partial(_generate_mulo_with, drafter=drafter, config=mulo), seed_offset)
        else:
            raise ValueError(f"unknown decode method {full_name!r}; available: ar, ssd_exact, "
                             "ssd_autocorrect, ssd_autocorrect_r<K>[_target|_residual|_prefix], any ssd_ method + [_w<W>][_g<G>][_k<K>_d<delta>], mulo, mulo_exact, mulo_k<K>_d<delta>_r<rho>[_rounds<R>][_nearest|_bilinear|_bicubic][_point], each + [_seed<K>]")
    return methods


def _generate_ssd_with(backbone, condition, sampling, generator, heads, config):
    return generate_ssd(backbone, heads, condition, sampling, generator, config)


def _generate_mulo_with(backbone, condition, sampling, generator, drafter, config):
    return generate_mulo(backbone, drafter, condition, sampling, generator, config)


def sampling_from_config(cfg: DictConfig) -> SamplingConfig:
    d = cfg.decode
    return SamplingConfig(cfg_scale=d.cfg_scale, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, greedy=d.greedy)


@dataclass
class Conditions:
    """What a run generates, one entry per image: class ids (class-conditional) or prompts (text-to-image)."""

    class_ids: torch.Tensor | None = None  # (N,) long
    prompts: list[str] | None = None
    num_classes: int | None = None  # the classes the ids are balanced over

    def __len__(self) -> int:
        return len(self.class_ids) if self.class_ids is not None else len(self.prompts)

    def batches(self, batch_size: int, backbone: ARImageBackbone) -> list[tuple[torch.Tensor, Condition]]:
        """(image indices, Condition) per batch, every image once.

        Class ids are cut in order. Prompts are grouped by their tokenized length first
        (in order of first appearance), because the text-to-image adapters do not pad:
        every prompt of a batch must have the same length.
        """
        whole = Condition(class_ids=self.class_ids) if self.class_ids is not None else Condition(prompts=self.prompts)
        return group_by_prompt_length(backbone, whole, max_batch=batch_size)

    def subset(self, indices: torch.Tensor) -> Condition:
        """The Condition of the images `indices`."""
        if self.class_ids is not None:
            return Condition(class_ids=self.class_ids[indices])
        return Condition(prompts=[self.prompts[i] for i in indices.tolist()])


def is_digits(backbone: ARImageBackbone) -> bool:
    """The embedded digits backbone, scored by its own classifier."""
    from backbones.digits import DigitsBackbone

    return isinstance(backbone, DigitsBackbone)


def is_text_to_image(backbone: ARImageBackbone) -> bool:
    """Text-to-image adapters (Emu3, Janus-Pro, Lumina-mGPT, Tar) turn prompts into their own token ids."""
    return hasattr(backbone, "prompt_token_ids")


def build_conditions(cfg: DictConfig, backbone: ARImageBackbone) -> Conditions:
    """Balanced class ids for class-conditional backbones, prompts from `decode.prompts` for text-to-image ones.

    ``decode.num_classes`` null means the backbone's own class count (10 digits,
    1000 ImageNet classes for LlamaGen). Prompts repeat in order when there are
    fewer than ``decode.num_images``.
    """
    count = cfg.decode.num_images
    if is_text_to_image(backbone):
        prompts = load_prompts(cfg.decode.prompts, column=cfg.decode.prompt_column)
        if len(prompts) < count:
            log.info("%d prompts in %s for %d images: they repeat in order", len(prompts), cfg.decode.prompts, count)
        return Conditions(prompts=[prompts[i % len(prompts)] for i in range(count)])
    own = getattr(backbone, "num_classes", None) or getattr(getattr(backbone, "config", None), "num_classes", None)
    num_classes = cfg.decode.get("num_classes") or own
    if num_classes is None:
        raise ValueError(f"{backbone.name}: set decode.num_classes (the backbone does not say how many classes it has)")
    if own is not None and num_classes > own:
        raise ValueError(f"decode.num_classes={num_classes} but {backbone.name} has {own} classes; "
                         f"set decode.num_classes<={own} (or null for all of them)")
    return Conditions(class_ids=balanced_class_ids(count, num_classes), num_classes=num_classes)


def build_quality(cfg: DictConfig, backbone: ARImageBackbone, pixels_available: bool):
    """The scorer of this run and a note on what it measures (or why nothing is measured).

    Digits: the independent classifier (decode/quality.py). Real backbones: FID
    against ``decode.quality.reference_dir`` and/or CLIP score with ``decode.quality.clip``
    (decode/real_quality.py), built before any image is generated so that missing
    weights fail at once; with neither key set, quality is not measured.
    """
    if is_digits(backbone):
        scorer = DigitsQuality(backbone.geometry.rows, backbone.codebook_size,
                               Path(cfg.paths.checkpoints_dir) / "digits-classifier")
        return scorer, "digits classifier accuracy and Fréchet distance of its features (decode/quality.py)"
    settings = cfg.decode.get("quality") or {}
    reference_dir, clip = settings.get("reference_dir"), settings.get("clip")
    if clip is not None and not is_text_to_image(backbone):
        log.info("decode.quality.clip is set but %s is class-conditional: no CLIP score", backbone.name)
        clip = None
    if reference_dir is None and clip is None:
        return None, ("quality not measured: set decode.quality.reference_dir (FID) and, for text-to-image "
                      "backbones, decode.quality.clip (CLIP score); the figures are passes and speed only")
    if not pixels_available:
        raise ValueError(f"quality metrics were asked for (decode.quality) but {backbone.name} cannot decode tokens "
                         "to pixels (see the line above); give the backbone its image decoder or set "
                         "decode.quality.reference_dir=null decode.quality.clip=null")
    features = settings.get("fid_features", "inception")
    if isinstance(features, DictConfig):  # a `_target_` mapping: the user's own feature extractor
        features = hydra.utils.instantiate(features)
    scorer = RealQuality(reference_dir=reference_dir, fid_features=features, fid_weights=settings.get("fid_weights"),
                         clip=clip, max_reference_images=settings.get("max_reference_images"),
                         batch_size=settings.get("batch_size", 32), device=next(backbone.parameters()).device)
    return scorer, f"{' and '.join(scorer.measures)} (decode/real_quality.py)"


def pixels_work(backbone: ARImageBackbone) -> bool:
    """Whether `tokens_to_pixels` works for this backbone (one all-zero image is decoded to find out)."""
    probe = torch.zeros(1, backbone.geometry.rows, backbone.geometry.cols, dtype=torch.long,
                        device=next(backbone.parameters()).device)
    try:
        with torch.no_grad():
            backbone.tokens_to_pixels(probe)
    except NotImplementedError as error:
        print(f"[decode] no PNG grids and no image metrics, the backbone has no image decoder: {error}")
        return False
    return True


def run_method(generate: Generator, backbone: ARImageBackbone, conditions: Conditions, batch_size: int,
               sampling: SamplingConfig, seed: int, label: str) -> tuple[torch.Tensor, dict]:
    """Generate all images in batches; return tokens (N, rows, cols) in the order of `conditions` and cost figures."""
    device = next(backbone.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    batches = conditions.batches(batch_size, backbone)
    # One untimed batch of one image: first calls pay for allocations and lazy initialisation.
    generate(backbone, _to(conditions.subset(batches[0][0][:1]), device), sampling, generator)
    generator.manual_seed(seed)
    tokens = torch.zeros(len(conditions), backbone.geometry.rows, backbone.geometry.cols, dtype=torch.long)
    passes, drafted, accepted, seconds = 0, 0, 0, 0.0
    with clock_backbone_passes(backbone) as backbone_clock:
        for indices, condition in tqdm(batches, desc=f"decode {label}", unit="batch", leave=False, disable=None):
            condition = _to(condition, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            result = generate(backbone, condition, sampling, generator)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - began
            tokens[indices] = result.tokens.cpu()
            passes += result.forward_passes
            drafted += result.drafted_tokens
            accepted += result.accepted_tokens
    # NFE: the passes that made an image; one pass serves every image of its batch.
    passes_per_image = passes / len(batches)
    figures = {
        "forward_passes_per_image": passes_per_image,
        "seconds_per_image": seconds / len(conditions),
        "seconds_total": seconds,
        # Inside the backbone's passes (decode/backbone_clock.py); the rest is drafting and verification.
        "backbone_seconds_per_image": backbone_clock.seconds / len(conditions),
    }
    if drafted:
        figures["mean_accepted_per_pass"] = backbone.geometry.num_tokens / passes_per_image
        figures["draft_acceptance_rate"] = accepted / drafted
    return tokens, figures


def _to(condition: Condition, device: torch.device) -> Condition:
    return Condition(class_ids=condition.class_ids.to(device)) if condition.class_ids is not None else condition


def _quality_line(quality: dict | None) -> str:
    if quality is None:
        return "quality not measured"
    names = {"classifier_accuracy": "accuracy", "frechet_distance": "FD", "fid": "FID", "clip_score": "CLIP"}
    return "  ".join(f"{names.get(k, k)} {v:.3f}" for k, v in quality.items())


def run_decode(cfg: DictConfig) -> dict:
    """Decode with every requested method, score and compare them; write DIR/metrics.json and DIR/<method>.png.

    Conditions follow the backbone (class ids or prompts, see `build_conditions`);
    quality follows `build_quality`. Every scorer and every file it needs is set up
    before the first image is generated.
    """
    if cfg.decode.num_images < 1 or cfg.decode.batch_size < 1:
        raise ValueError(f"decode.num_images and decode.batch_size must be >= 1, got {cfg.decode.num_images}, {cfg.decode.batch_size}")
    out = Path(cfg.decode.out)
    out.mkdir(parents=True, exist_ok=True)
    backbone: ARImageBackbone = hydra.utils.instantiate(cfg.backbone)
    sampling = sampling_from_config(cfg)
    conditions = build_conditions(cfg, backbone)
    pixels_available = is_digits(backbone) or pixels_work(backbone)
    quality, quality_note = build_quality(cfg, backbone, pixels_available)
    print(f"[decode] quality: {quality_note}")
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
    if not is_digits(backbone):  # the digits report keeps its historical keys
        report["conditions"] = ({"kind": "prompts", "source": cfg.decode.prompts, "distinct": len(set(conditions.prompts))}
                                if conditions.prompts is not None else
                                {"kind": "class_ids", "num_classes": conditions.num_classes})
        report["quality_note"] = quality_note
    for name, method in methods.items():
        tokens, figures = run_method(method.generate, backbone, conditions, cfg.decode.batch_size, sampling,
                                     cfg.decode.seed + method.seed_offset, name)
        images = _decode_pixels(backbone, tokens) if pixels_available else None
        if isinstance(quality, DigitsQuality):
            figures["quality"] = quality(images, conditions.class_ids)
        else:
            figures["quality"] = quality(images, conditions.prompts) if quality is not None else None
        baseline = report["methods"].get("ar", figures)
        figures["speedup_vs_ar"] = baseline["seconds_per_image"] / figures["seconds_per_image"]
        figures["nfe_reduction_vs_ar"] = baseline["forward_passes_per_image"] / figures["forward_passes_per_image"]
        # The speedup this method's passes alone allow: what it would reach if drafting and verification were free.
        figures["speedup_bound_vs_ar"] = baseline["seconds_per_image"] / figures["backbone_seconds_per_image"]
        report["methods"][name] = figures
        if images is not None:
            save_image_grid(images[:100], out / f"{name}.png")
        if cfg.decode.save_tokens:
            save_tokens(tokens, out / f"tokens_{name}.npy")
        print(f"[decode] {name:>16}: {figures['forward_passes_per_image']:7.1f} passes/image  "
              f"{figures['seconds_per_image']:.3f} s/image ({figures['backbone_seconds_per_image']:.3f} in the backbone)  "
              f"speedup {figures['speedup_vs_ar']:.2f}x (passes alone allow {figures['speedup_bound_vs_ar']:.2f}x)  "
              f"{_quality_line(figures['quality'])}")
    atomic_write_text(out / "metrics.json", json.dumps(report, indent=2) + "\n")
    if len(methods) > 1:
        plot_speed_quality(report, out / "speed_quality.png")
    written = ", ".join(f"{n}.png" for n in methods) if pixels_available else "no PNGs"
    print(f"[decode] wrote {out / 'metrics.json'} and {written}")
    return report


def _decode_pixels(backbone: ARImageBackbone, tokens: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Tokens (N, rows, cols) -> images (N, C, H, W) on the CPU, decoded in batches (VQ decoders are large)."""
    device = next(backbone.parameters()).device
    with torch.no_grad():
        return torch.cat([backbone.tokens_to_pixels(tokens[start : start + batch_size].to(device)).float().cpu()
                          for start in range(0, len(tokens), batch_size)])
