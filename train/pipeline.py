"""What `python -m train` does: build the objects a config names, fit, export, summarise."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from common.atomic_io import atomic_write_text

log = logging.getLogger(__name__)


def _instantiate_logged(name: str, node: DictConfig, **kwargs):
    log.info("instantiating %s <%s>", name, node.get("_target_"))
    # Plain dicts and lists, not DictConfig: hyperparameters end up in checkpoints, which are loaded with
    # torch.load(weights_only=True) on resume.
    return hydra.utils.instantiate(node, _convert_="all", **kwargs)


def needs_backbone(node: DictConfig) -> bool:
    """Whether a `_target_` takes the frozen backbone (built once, shared by data and module)."""
    target = hydra.utils.get_object(node._target_)
    return "backbone" in inspect.signature(target).parameters


def _resume_path(cfg: DictConfig) -> str | None:
    resume = cfg.train.resume
    if resume in (False, None):
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if last.is_file():  # starting over here would overwrite the interrupted run's checkpoint
            raise FileExistsError(
                f"{last} holds the checkpoint of an earlier run in this folder; continue it with "
                "train.resume=true, or start a new run in another folder (hydra.run.dir=<new folder>). "
                "Nothing was overwritten"
            )
        return None
    if resume is True:
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise FileNotFoundError(
                f"train.resume=true but there is no {last}; pass the run folder with "
                "hydra.run.dir=<folder of the interrupted run> or give train.resume=<path to a .ckpt>"
            )
        return str(last)
    if not Path(resume).is_file():
        raise FileNotFoundError(f"train.resume={resume} is not a checkpoint file")
    return str(resume)


def run_training(cfg: DictConfig) -> dict:
    """Seed, instantiate data, module, trainer (with logger and callbacks), fit, export; return metrics."""
    pl.seed_everything(cfg.seed, workers=True)
    Path(cfg.paths.output_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(cfg.paths.output_dir) / "config.yaml", resolve=True)

    shared = {}
    if needs_backbone(cfg.data) or needs_backbone(cfg.module):
        shared["backbone"] = _instantiate_logged("backbone", cfg.backbone)
    datamodule = _instantiate_logged("data", cfg.data, **(shared if needs_backbone(cfg.data) else {}))
    module = _instantiate_logged("module", cfg.module, **(shared if needs_backbone(cfg.module) else {}))
    callbacks = [_instantiate_logged(f"callback {k}", v) for k, v in (cfg.get("callbacks") or {}).items() if v]
    logger = _instantiate_logged("logger", cfg.logger) if cfg.get("logger") else False
    trainer: pl.Trainer = _instantiate_logged("trainer", cfg.trainer, callbacks=callbacks, logger=logger)

    trainer.fit(module, datamodule=datamodule, ckpt_path=_resume_path(cfg))

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            # Sweep jobs must not overwrite each other's export: each keeps its own in its job folder.
            with open_dict(cfg):
                cfg.export.dir = str(Path(cfg.paths.output_dir) / "export")
        atomic_write_text(
            Path(cfg.paths.output_dir) / "metrics.json",
            json.dumps({"overrides": overrides, "metrics": metrics}, indent=2) + "\n",
        )
        export_dir = module.export(cfg.export.dir)
        log.info("exported to %s", export_dir)
        print(f"[train] exported {cfg.experiment_name} to {export_dir}")
        for key, value in sorted(metrics.items()):
            print(f"[train] {key} = {value:.4f}")
        if cfg.train.get("evaluate"):
            evaluate_export(cfg, export_dir)
    return metrics


def evaluate_export(cfg: DictConfig, export_dir: Path) -> dict:
    """A short decode comparison of the fresh export against the KV-cached baseline (train.evaluate)."""
    from decode.cli import run_decode

    settings = cfg.train.evaluate
    eval_cfg = cfg.copy()
    with open_dict(eval_cfg):
        eval_cfg.decode.methods = list(settings.methods)
        eval_cfg.decode.num_images = settings.num_images
        eval_cfg.decode.batch_size = settings.batch_size
        eval_cfg.decode.seeds = settings.get("seeds", 1)
        eval_cfg.decode.compile = bool(settings.get("compile", False))
        eval_cfg.decode.heads = str(export_dir)
        eval_cfg.decode.out = str(Path(cfg.paths.output_dir) / "evaluation")
    print(
        f"[train] evaluating {export_dir}: {settings.num_images} images at batch {settings.batch_size}, "
        f"{eval_cfg.decode.seeds} seed(s) per method, against the KV-cached baseline"
    )
    return run_decode(eval_cfg)
