"""Training callbacks: periodic sample grids, so a run can be watched as pictures, not only as losses."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers import WandbLogger

from decode.images import save_image_grid


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
