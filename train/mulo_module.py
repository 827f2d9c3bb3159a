"""Self-distillation of the MuLo-SD low-resolution drafter against a frozen backbone.

The frozen backbone's own generations (the SSD corpus machinery) are taken to
pixels, downsampled by r and re-tokenised at the drafter's resolution; the
drafter learns them with next-token cross-entropy and class dropout (so it has
an unconditional twin for CFG, like the backbone).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from backbones.base import ARImageBackbone
from heads.export import export_heads
from heads.mulo import MuLoDrafter, MuLoDrafterConfig, downsample_to_drafter
from train.schedules import warmup_cosine


class MuLoDistillation(pl.LightningModule):
    """Trains the drafter on the backbone's downsampled generations; the backbone stays frozen."""

    def __init__(self, backbone: ARImageBackbone, drafter: dict, optimizer: Callable[..., torch.optim.Optimizer],
                 class_dropout: float = 0.1, warmup_steps: int = 50, cfg_scale: float = 3.0):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        self.save_hyperparameters(ignore=["backbone", "optimizer"])
        self.backbone = backbone.eval().requires_grad_(False)
        geometry = backbone.geometry
        self.drafter = MuLoDrafter(MuLoDrafterConfig(backbone_rows=geometry.rows, backbone_cols=geometry.cols,
                                                     levels=backbone.codebook_size, **drafter))
        self.optimizer_factory, self.class_dropout, self.warmup_steps = optimizer, class_dropout, warmup_steps
        self.cfg_scale = cfg_scale  # only for the sample grids: the drafter is trained for every scale
        self.strict_loading = False  # checkpoints carry the drafter only

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()
        return self

    def bits_per_token(self, batch: dict, drop_classes: bool) -> torch.Tensor:
        geometry, small = self.backbone.geometry, self.drafter.model
        with torch.no_grad():
            low = downsample_to_drafter(batch["tokens"].view(-1, geometry.rows, geometry.cols), self.backbone, small,
                                        self.drafter.config.scale).flatten(1)  # (B, n_low)
        class_ids = batch["class_id"]
        if drop_classes:  # class dropout teaches the null class used by CFG
            dropped = torch.rand(class_ids.shape, device=class_ids.device) < self.class_dropout
            class_ids = torch.where(dropped, torch.full_like(class_ids, small.config.null_class), class_ids)
        logits = small(low, class_ids)
        return F.cross_entropy(logits.flatten(0, 1), low.flatten()) / math.log(2)

    def training_step(self, batch, batch_idx):
        bits = self.bits_per_token(batch, drop_classes=True)
        if not torch.isfinite(bits):
            raise FloatingPointError(f"loss is {bits.item()} at step {self.global_step} (batch {batch_idx})")
        self.log("train/bits_per_token", bits, prog_bar=True, batch_size=batch["tokens"].shape[0])
        return bits * math.log(2)

    def validation_step(self, batch, batch_idx):
        self.log("val/bits_per_token", self.bits_per_token(batch, drop_classes=False), prog_bar=True,
                 batch_size=batch["tokens"].shape[0])

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Greedy relaxed MuLo-SD with the drafter as it is now (for SampleGrid): images and passes per image."""
        from decode import Condition, SamplingConfig
        from decode.mulo import generate_mulo

        was_training = self.drafter.training
        self.drafter.eval()
        condition = Condition(class_ids=torch.arange(num_images, device=self.device) % 10)
        result = generate_mulo(self.backbone, self.drafter, condition, SamplingConfig(cfg_scale=self.cfg_scale, greedy=True))
        self.drafter.train(was_training)
        return self.backbone.tokens_to_pixels(result.tokens), {"forward_passes_per_image": float(result.forward_passes)}

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.drafter.parameters())
        scheduler = warmup_cosine(optimizer, self.warmup_steps, int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}

    def export(self, directory: str | Path) -> Path:
        """heads.safetensors + heads.json (kind "mulo", the drafter's shape and r), checked against the backbone."""
        return export_heads(self.drafter, directory, self.backbone.identity(),
                            extra={"training": {"step": int(self.global_step)}})
