"""Lightning module that trains continuous row heads (heads/cspd.py `ContinuousRowHeads`) against a frozen backbone.

The backbone's states are computed teacher-forced on the digits (the data it was
trained on) or on its own samples (``data=corpus_continuous``), with class
dropout so the heads also see the unconditional twin's states that guidance
mixes in. The vertical head predicts, from each committed row's states and
tokens, the states of the row below; the loss is SSD's SmoothL1 on the predicted
state plus the backbone's own (frozen) diffusion loss of the true token below
given the predicted state: a draft is only as good as the tokens the backbone's
diffusion head samples from it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from backbones.continuous import ContinuousARBackbone
from heads.cspd import ContinuousRowHeads
from heads.export import export_heads
from heads.ssd import SSDHeadConfig
from train.continuous_backbone_module import tokens_and_classes
from train.schedules import warmup_cosine_optimizers


class ContinuousRowHeadTraining(pl.LightningModule):
    """SmoothL1 on the predicted states below + the frozen diffusion head's loss on the true tokens below."""

    def __init__(
        self,
        backbone: ContinuousARBackbone,
        head: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        diffusion_weight: float = 1.0,
        class_dropout: float = 0.3,
        warmup_steps: int = 100,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        if diffusion_weight < 0:
            raise ValueError(f"module.diffusion_weight must be >= 0, got {diffusion_weight}")
        self.save_hyperparameters(ignore=["backbone", "optimizer"])
        self.backbone = backbone.eval().requires_grad_(False)
        self.heads = ContinuousRowHeads(SSDHeadConfig(hidden_size=backbone.hidden_size, **head))
        self.optimizer_factory = optimizer
        self.diffusion_weight, self.class_dropout, self.warmup_steps = diffusion_weight, class_dropout, warmup_steps

    def _losses(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self.backbone.geometry.rows, self.backbone.geometry.cols
        with torch.no_grad():
            states = self.backbone.teacher_forced_hidden_states(tokens, class_ids)
        states = states.view(len(tokens), rows, cols, -1)
        grid = tokens.view(len(tokens), rows, cols, -1)
        above = states[:, :-1]
        if self.training and self.heads.config.input_noise:  # robust to states of drafted rows
            scale = above.pow(2).mean(-1, keepdim=True).sqrt()
            above = above + self.heads.config.input_noise * scale * torch.randn_like(above)
        predicted = self.heads(above, self.backbone.embed_tokens(grid[:, :-1]))
        latent = F.smooth_l1_loss(predicted, states[:, 1:])
        condition = self.backbone.condition(predicted).flatten(0, 2)
        diffusion = self.backbone.diffusion.loss(condition, grid[:, 1:].flatten(0, 2)).mean()
        return latent, diffusion

    def training_step(self, batch, batch_idx):
        tokens, class_ids = tokens_and_classes(batch)
        dropped = torch.rand(class_ids.shape, device=class_ids.device) < self.class_dropout
        class_ids = torch.where(dropped, torch.full_like(class_ids, self.backbone.num_classes), class_ids)
        latent, diffusion = self._losses(tokens, class_ids)
        self.log_dict({"train/latent_loss": latent, "train/diffusion_loss": diffusion}, prog_bar=True)
        return latent + self.diffusion_weight * diffusion

    def validation_step(self, batch, batch_idx):
        torch.manual_seed(batch_idx)  # the same diffusion steps and noise at every validation
        latent, diffusion = self._losses(*tokens_and_classes(batch))
        self.log_dict({"val/latent_loss": latent, "val/diffusion_loss": diffusion})

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Row-drafted CSpD samples with the heads as they are now, at CFG 3 (for SampleGrid)."""
        from decode import Condition, SamplingConfig
        from decode.cspd_rows import CSpDRowsConfig, generate_cspd_rows

        was_training = self.heads.training
        self.heads.eval()
        condition = Condition(class_ids=torch.arange(num_images, device=self.device) % 10)
        generator = torch.Generator(device=self.device).manual_seed(0)
        result = generate_cspd_rows(
            self.backbone, self.heads, condition, SamplingConfig(cfg_scale=3.0), generator, CSpDRowsConfig()
        )
        self.heads.train(was_training)
        figures = {
            "forward_passes_per_image": result.forward_passes,
            "acceptance": result.accepted_tokens / max(result.drafted_tokens, 1),
        }
        return self.backbone.tokens_to_pixels(result.tokens), figures

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.heads.parameters())

    def export(self, directory: str | Path) -> Path:
        """heads.safetensors + heads.json (kind cspd_rows), checked against this backbone when loaded."""
        return export_heads(self.heads, directory, self.backbone.identity(), extra={"step": int(self.global_step)})
