"""Lightning module that trains CSpD's drafter for a frozen continuous-token backbone (heads/cspd.py).

The drafter is a small continuous AR model of the backbone's family with its
own diffusion head, as in the CSpD paper, where MAR-B drafts for MAR-H: it is
trained with the backbone's own objective (MAR's diffusion loss on every
token, class dropout for CFG) on the data the backbone was trained on, sharing
the backbone's grid, token size and diffusion process (`CSpDDrafterConfig.for_backbone`).
The backbone stays frozen; it gives the drafter its geometry and its identity,
which the export records and `load_heads` checks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch

from backbones.continuous import ContinuousARBackbone
from heads.cspd import CSpDDrafter, CSpDDrafterConfig
from heads.export import export_heads
from train.continuous_backbone_module import diffusion_training_loss, diffusion_validation_loss
from train.schedules import warmup_cosine_optimizers


class CSpDDrafterTraining(pl.LightningModule):
    """The drafter's diffusion loss, teacher-forced in raster order, with class dropout for CFG."""

    def __init__(
        self,
        backbone: ContinuousARBackbone,
        drafter: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        class_dropout: float = 0.1,
        warmup_steps: int = 100,
        diffusion_repeats: int = 2,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        self.save_hyperparameters(ignore=["backbone", "optimizer"])
        self.backbone = backbone.eval().requires_grad_(False)
        self.drafter = CSpDDrafter(CSpDDrafterConfig.for_backbone(backbone, **drafter))
        self.drafter.bind(backbone)
        self.optimizer_factory = optimizer
        self.class_dropout, self.warmup_steps, self.diffusion_repeats = class_dropout, warmup_steps, diffusion_repeats

    def training_step(self, batch, batch_idx):
        loss = diffusion_training_loss(self.drafter.model, batch, self.class_dropout, self.diffusion_repeats)
        self.log("train/diffusion_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/diffusion_loss", diffusion_validation_loss(self.drafter.model, batch, batch_idx), prog_bar=True)

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """CSpD samples with the drafter as it is now, at CFG 3 (for SampleGrid), with its acceptance."""
        from decode import Condition, SamplingConfig
        from decode.cspd import METHOD, CSpDConfig

        was_training = self.drafter.training
        self.drafter.eval()
        condition = Condition(class_ids=torch.arange(num_images, device=self.device) % 10)
        generator = torch.Generator(device=self.device).manual_seed(0)
        # As `python -m decode` runs it (the drafter's own guidance from its config).
        sampling = SamplingConfig(cfg_scale=3.0)
        result = METHOD.generate(self.backbone, self.drafter, condition, sampling, generator, CSpDConfig())
        self.drafter.train(was_training)
        figures = {
            "forward_passes_per_image": result.forward_passes,
            "acceptance": result.accepted_tokens / max(result.drafted_tokens, 1),
        }
        return self.backbone.tokens_to_pixels(result.tokens), figures

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.drafter.parameters())

    def export(self, directory: str | Path) -> Path:
        """heads.safetensors + heads.json (kind cspd), checked against this backbone when loaded."""
        return export_heads(self.drafter, directory, self.backbone.identity(), extra={"step": int(self.global_step)})
