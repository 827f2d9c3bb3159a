"""Training callbacks: progress lines that a log file shows, and periodic sample grids (a run watched as pictures)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers import WandbLogger

from common.progress import ProgressLog
from decode.images import save_image_grid

log = logging.getLogger(__name__)


class ProgressLines(pl.Callback):
    """A log line every `every_n_steps` optimizer steps (or `every_seconds`): step, loss, acceptance, time left.

    Lightning's progress bar redraws itself on a terminal and shows nothing in a
    log file; these lines go through `logging` (the terminal and the run's log
    alike). Each validation adds a line with its loss and acceptance.
    """

    def __init__(self, every_n_steps: int = 25, every_seconds: float = 60.0):
        if every_n_steps < 1 or every_seconds <= 0:
            raise ValueError(
                f"callbacks.progress every_n_steps must be >= 1 and every_seconds > 0, got {every_n_steps}, "
                f"{every_seconds}"
            )
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.progress: ProgressLog | None = None
        self.first_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
        # Resumed runs start part-way: the rate and time left count the steps this process makes.
        self.first_step = trainer.global_step
        self.progress = ProgressLog(
            f"train (steps {self.first_step + 1}-{total})" if self.first_step else "train",
            max(total - self.first_step, 1),
            "step",
            log,
            self.every_seconds,
            self.every_n_steps,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self.progress is None or not trainer.is_global_zero:
            return
        step = trainer.global_step
        metrics = trainer.callback_metrics
        figures = [f"{name.split('/')[1]} {float(metrics[name]):.4f}" for name in _headline(metrics, "train/")]
        self.progress.update(step - self.first_step, ", ".join(figures))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        figures = [f"{name} {float(metrics[name]):.4f}" for name in _headline(metrics, "val/")]
        if figures:
            log.info("validation at step %d: %s", trainer.global_step, ", ".join(figures))


def _headline(metrics: dict, prefix: str) -> list[str]:
    """The metrics of `prefix` a progress line shows: its losses (every module's name for its objective, e.g.
    train/loss, train/diffusion_loss) and acceptance."""
    return [name for name in metrics if name.startswith(prefix) and ("loss" in name or name.endswith("/acceptance"))]


class SampleGrid(pl.Callback):
    """Every `every_n_steps` optimizer steps, decode `num_images` with the model being trained and log the grid.

    The module provides ``sample_images(num_images) -> (images (N, C, H, W), figures dict)``
    (SSD heads and MuLo drafters decode speculatively, so the figures include the
    backbone passes per image). The grid goes to ``<run>/samples/step_XXXXXX.png``
    and, under wandb, to the run's media; the figures go to every logger.
    """

    def __init__(self, every_n_steps: int = 200, num_images: int = 10):
        if every_n_steps < 1 or num_images < 1:
            raise ValueError(
                f"callbacks.samples every_n_steps and num_images must be >= 1, got {every_n_steps}, {num_images}"
            )
        self.every_n_steps, self.num_images = every_n_steps, num_images

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not hasattr(pl_module, "sample_images") or not trainer.is_global_zero:
            return
        images, figures = pl_module.sample_images(self.num_images)
        path = Path(trainer.default_root_dir) / "samples" / f"step_{step:06d}.png"
        save_image_grid(images, path)
        for logger in trainer.loggers:
            logger.log_metrics({f"samples/{k}": v for k, v in figures.items()}, step=step)
            if isinstance(logger, WandbLogger):
                logger.log_image("samples", [str(path)], step=step)
