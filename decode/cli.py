"""`python -m decode`: every chosen method against the KV-cached baseline, in one run; figures, table, PNGs.

The CLI layer of decode/ (it and decode/registry.py read Hydra configs; the
generators they call are plain functions over tensors). Steps: check every
setting and preset; build the backbone, the conditions and the quality scorer;
load the methods' exports; run the methods interleaved batch by batch
(decode/benchmark.py) at every seed; score each seed's images; write
DIR/metrics.json, DIR/summary.md, one PNG grid per method and the speed-quality
plot, and print the table.
"""

from __future__ import annotations

import json
import logging
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from backbones.base import ARImageBackbone
from common.atomic_io import atomic_write_text
from decode.benchmark import SeedRun, cost_figures, run_interleaved
from decode.conditions import build_conditions, is_text_to_image
from decode.images import save_image_grid, save_tokens
from decode.plots import plot_speed_quality
from decode.quality import DigitsQuality
from decode.real_quality import RealQuality
from decode.registry import BASELINE, check_methods, load_artefacts
from decode.report import band_of, mean_quality, summary_table
from decode.sampling import SamplingConfig
from decode.settings import settings_from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRunSettings:
    """The scalar settings of `decode.*`, checked before anything is built (decode/settings.py)."""

    num_images: int
    batch_size: int
    seed: int
    seeds: int
    greedy: bool
    cfg_scale: float
    temperature: float
    top_k: int
    top_p: float
    save_tokens: bool
    queue_batches: int = 1  # continuous batching: turns of this many batches (decode/benchmark.py)
    compile: bool = False  # torch.compile the backbone's passes for every method (ARImageBackbone.compile_passes)

    def __post_init__(self):
        for key in ("num_images", "batch_size", "seeds", "queue_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"decode.{key} must be >= 1, got {getattr(self, key)}")


def check_run_settings(cfg: DictConfig) -> DecodeRunSettings:
    keys = [name for name in DecodeRunSettings.__dataclass_fields__]
    return settings_from(DecodeRunSettings, {key: cfg.decode.get(key) for key in keys}, "decode")


def sampling_from_config(cfg: DictConfig) -> SamplingConfig:
    d = cfg.decode
    return SamplingConfig(
        cfg_scale=d.cfg_scale, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, greedy=d.greedy
    )


def is_digits(backbone: ARImageBackbone) -> bool:
    """An embedded digits backbone (discrete, continuous, or the MAR over the digits' pixel patches), scored by the
    digits classifier."""
    from backbones.digits import DigitsBackbone

    return isinstance(backbone, DigitsBackbone) or continuous_digits_size(backbone) is not None


def continuous_digits_size(backbone) -> int | None:
    """The image size of a backbone whose tokens are the digits' grey pixel patches (the continuous digits
    backbone, the embedded MAR: `MARConfig.pixel_patch_size`); None for any other."""
    from backbones.digits_continuous import ContinuousDigitsBackbone
    from backbones.mar import MARBackbone

    if isinstance(backbone, ContinuousDigitsBackbone):
        return backbone.config.image_size
    if isinstance(backbone, MARBackbone) and backbone.config.pixel_patch_size:
        return backbone.config.grid_size * backbone.config.pixel_patch_size
    return None


def digits_image_grid(backbone) -> tuple[int, int]:
    """(image size, intensity levels) of the classifier that scores this digits backbone.

    The continuous backbones' 24x24 images are scored by the 16-level classifier, their pixels rounded to those
    levels (`DigitsQuality` sees what a 16-level backbone would draw), so their figures compare with the discrete
    backbone's.
    """
    size = continuous_digits_size(backbone)
    if size is not None:
        return size, CONTINUOUS_SCORED_LEVELS
    return backbone.geometry.rows, backbone.codebook_size


CONTINUOUS_SCORED_LEVELS = 16


def build_quality(cfg: DictConfig, backbone: ARImageBackbone, pixels_available: bool):
    """The scorer of this run and a note on what it measures (or why nothing is measured).

    Digits: the independent classifier (decode/quality.py). Real backbones: FID
    against ``decode.quality.reference_dir`` and/or CLIP score with ``decode.quality.clip``
    (decode/real_quality.py), built before any image is generated so that missing
    weights fail at once; with neither key set, quality is not measured.
    """
    if is_digits(backbone):
        scorer = DigitsQuality(*digits_image_grid(backbone), Path(cfg.paths.checkpoints_dir) / "digits-classifier")
        return scorer, "digits classifier accuracy and Fréchet distance of its features (decode/quality.py)"
    settings = cfg.decode.get("quality") or {}
    reference_dir, clip = settings.get("reference_dir"), settings.get("clip")
    if clip is not None and not is_text_to_image(backbone):
        log.info("decode.quality.clip is set but %s is class-conditional: no CLIP score", backbone.name)
        clip = None
    if reference_dir is None and clip is None:
        return None, (
            "quality not measured: set decode.quality.reference_dir (FID) and, for text-to-image "
            "backbones, decode.quality.clip (CLIP score); the figures are passes and speed only"
        )
    if not pixels_available:
        raise ValueError(
            f"quality metrics were asked for (decode.quality) but {backbone.name} cannot decode tokens "
            "to pixels (see the line above); give the backbone its image decoder or set "
            "decode.quality.reference_dir=null decode.quality.clip=null"
        )
    features = settings.get("fid_features", "inception")
    if isinstance(features, DictConfig):  # a `_target_` mapping: the user's own feature extractor
        features = hydra.utils.instantiate(features)
    scorer = RealQuality(
        reference_dir=reference_dir,
        fid_features=features,
        fid_weights=settings.get("fid_weights"),
        clip=clip,
        max_reference_images=settings.get("max_reference_images"),
        batch_size=settings.get("batch_size", 32),
        device=next(backbone.parameters()).device,
    )
    return scorer, f"{' and '.join(scorer.measures)} (decode/real_quality.py)"


def pixels_work(backbone: ARImageBackbone) -> bool:
    """Whether `tokens_to_pixels` works for this backbone (one all-zero image is decoded to find out)."""
    grid, device = backbone.geometry, next(backbone.parameters()).device
    token_dim = getattr(backbone, "token_dim", None)  # continuous and masked backbones: one vector per token
    shape, dtype = (
        ((grid.rows, grid.cols, token_dim), torch.float32) if token_dim else ((grid.rows, grid.cols), torch.long)
    )
    probe = torch.zeros(1, *shape, dtype=dtype, device=device)
    try:
        with torch.no_grad():
            backbone.tokens_to_pixels(probe)
    except NotImplementedError as error:
        print(f"[decode] no PNG grids and no image metrics, the backbone has no image decoder: {error}")
        return False
    return True


def run_decode(cfg: DictConfig) -> dict:
    """Decode with every requested method, score and compare them; write DIR/metrics.json, summary.md and PNGs.

    Every setting, preset, scorer and file the run needs is checked before the first image is generated.
    """
    settings = check_run_settings(cfg)
    sampling = sampling_from_config(cfg)
    methods = check_methods(cfg.decode)
    out = _output_dir(cfg)
    backbone: ARImageBackbone = hydra.utils.instantiate(cfg.backbone)
    conditions = build_conditions(
        backbone, settings.num_images, cfg.decode.get("num_classes"), cfg.decode.prompts, cfg.decode.prompt_column
    )
    load_artefacts(methods, backbone)  # heads of another backbone stop the run before anything else is built
    compiled = settings.compile and compile_backbone(backbone)
    pixels_available = is_digits(backbone) or pixels_work(backbone)
    quality, quality_note = build_quality(cfg, backbone, pixels_available)
    print(f"[decode] quality: {quality_note}")
    seeds = [settings.seed + k for k in range(settings.seeds)]
    runs = run_interleaved(
        methods, backbone, conditions, settings.batch_size, sampling, seeds, queue_batches=settings.queue_batches
    )

    report = _report_header(cfg, backbone, sampling, settings, seeds, conditions, quality_note)
    report["compiled"] = compiled
    for method in methods:
        figures = cost_figures(runs[method.name], runs[BASELINE], backbone.geometry.num_tokens)
        per_seed = [_score(quality, backbone, run, conditions, pixels_available) for run in runs[method.name]]
        figures["quality"] = mean_quality(per_seed)
        if len(seeds) > 1:
            figures["quality_per_seed"] = per_seed
        report["methods"][method.name] = {**figures, **method.describe()}
        _save_outputs(out, method.name, runs[method.name], backbone, pixels_available, settings.save_tokens)
    report["baseline_band"] = band_of(report["methods"][BASELINE])
    if report["methods"][BASELINE]["quality"] is not None:
        report["baseline_tolerance"] = baseline_tolerance(quality, backbone, runs[BASELINE], conditions)
    table = summary_table(report)
    atomic_write_text(out / "metrics.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "summary.md", table + "\n")
    if len(methods) > 1:
        plot_speed_quality(report, out / "speed_quality.png")
    _remove_stale_outputs(out, methods, settings, pixels_available, plotted=len(methods) > 1)
    print(table)
    written = ", ".join(f"{m.name}.png" for m in methods) if pixels_available else "no PNGs"
    print(f"[decode] wrote {out / 'metrics.json'}, {out / 'summary.md'} and {written}")
    return report


def compile_backbone(backbone) -> bool:
    """`decode.compile`: compile the backbone's passes for every method of the run, the baseline's included; says
    so, or says why its passes stay eager (MAR and Harmon: not supported). True when compiled."""
    if not callable(getattr(backbone, "compile_passes", None)):
        name = type(backbone).__name__
        print(f"[decode] decode.compile: {name}'s passes cannot be compiled; every method runs eager")
        return False
    print(
        "[decode] compiling the backbone's passes (torch.compile, decode.compile=true): each method's untimed "
        "warm-up waits for the compiler, up to a minute per method on 2 CPU cores; if compiling fails, "
        "decode.compile=false (train.evaluate.compile=false after training) runs eager passes"
    )
    backbone.compile_passes()
    return True


def _output_dir(cfg: DictConfig) -> Path:
    """decode.out; in a multirun sweep each job's own folder, so that jobs do not overwrite each other."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.decode.out)


def _report_header(cfg, backbone, sampling, settings: DecodeRunSettings, seeds, conditions, quality_note) -> dict:
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    report = {
        "backbone": backbone.identity(),
        "sampling": vars(sampling) | {"guided": sampling.guided},
        "num_images": settings.num_images,
        "batch_size": settings.batch_size,
        "queue_batches": settings.queue_batches,
        "seed": settings.seed,
        "seeds": seeds,
        "interleaved": True,  # the methods took turns batch by batch (decode/benchmark.py)
        "device": str(next(backbone.parameters()).device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "overrides": overrides,
        "presets": {
            name: OmegaConf.to_container(preset, resolve=True)
            for name, preset in cfg.decode.presets.items()
            if name in cfg.decode.methods or name == BASELINE
        },
        "methods": {},
    }
    if not is_digits(backbone):  # the digits report keeps its historical keys
        report["conditions"] = (
            {"kind": "prompts", "source": cfg.decode.prompts, "distinct": len(set(conditions.prompts))}
            if conditions.prompts is not None
            else {"kind": "class_ids", "num_classes": conditions.num_classes}
        )
        report["quality_note"] = quality_note
    return report


def _scored_images(quality, backbone: ARImageBackbone, run: SeedRun) -> torch.Tensor:
    """A run's images as its scorer reads them (continuous digits: rounded to the classifier's levels)."""
    images = _decode_pixels(backbone, run.tokens)
    if isinstance(quality, DigitsQuality) and continuous_digits_size(backbone) is not None:
        levels = CONTINUOUS_SCORED_LEVELS - 1
        images = torch.round(images.clamp(0, 1) * levels) / levels
    return images


def _score(quality, backbone: ARImageBackbone, run: SeedRun, conditions, pixels_available: bool) -> dict | None:
    if quality is None or not pixels_available:
        return None
    images = _scored_images(quality, backbone, run)
    return quality(images, conditions.class_ids if isinstance(quality, DigitsQuality) else conditions.prompts)


def baseline_tolerance(quality, backbone: ARImageBackbone, runs: list[SeedRun], conditions) -> dict | None:
    """{metric: half-width}: how far from the baseline's mean quality a method with the baseline's distribution
    (a lossless one), run on as many images and seeds, lands 19 times in 20.

    The difference of two independent means of the same distribution has the standard error sqrt(2) times
    each one's; each one's is the per-seed sampling error (`standard_errors`) over sqrt(seeds). A min-max band
    of two seeds is not such a bound: a third draw of the same distribution falls inside it one time in three.
    None when the scorer has no sampling errors (FID and CLIP on real backbones).
    """
    if not hasattr(quality, "standard_errors"):
        return None
    errors = [quality.standard_errors(_scored_images(quality, backbone, run), conditions.class_ids) for run in runs]
    seeds = len(errors)
    return {
        metric: 1.96 * math.sqrt(2) * math.sqrt(sum(e[metric] ** 2 for e in errors) / seeds / seeds)
        for metric in errors[0]
    }


def _save_outputs(out: Path, name: str, runs: list[SeedRun], backbone, pixels_available: bool, save: bool) -> None:
    """The first seed's PNG grid; with decode.save_tokens every seed's tokens (tokens_<name>.npy for the first)."""
    if pixels_available:
        save_image_grid(_decode_pixels(backbone, runs[0].tokens[:100]), out / f"{name}.png")
    if save:
        for k, run in enumerate(runs):
            save_tokens(run.tokens, out / (f"tokens_{name}.npy" if k == 0 else f"tokens_{name}_seed{run.seed}.npy"))


def _remove_stale_outputs(out: Path, methods, settings: DecodeRunSettings, pixels_available: bool, plotted: bool):
    """Delete the PNGs and token files an earlier run left in `out` that this run's metrics.json does not
    describe, so that a folder never mixes two runs (other files are left alone)."""
    written = {"speed_quality.png"} if plotted else set()
    for method in methods:
        if pixels_available:
            written.add(f"{method.name}.png")
        if settings.save_tokens:
            written.add(f"tokens_{method.name}.npy")
            written.update(f"tokens_{method.name}_seed{settings.seed + k}.npy" for k in range(1, settings.seeds))
    for path in [*out.glob("*.png"), *out.glob("tokens_*.npy")]:
        if path.name not in written:
            log.info("removing %s: left by an earlier run into %s", path.name, out)
            path.unlink()


def _decode_pixels(backbone: ARImageBackbone, tokens: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Tokens (N, rows, cols) -> images (N, C, H, W) on the CPU, decoded in batches (VQ decoders are large)."""
    device = next(backbone.parameters()).device
    with torch.no_grad():
        return torch.cat(
            [
                backbone.tokens_to_pixels(tokens[start : start + batch_size].to(device)).float().cpu()
                for start in range(0, len(tokens), batch_size)
            ]
        )
