"""Lightning module that trains the embedded digits backbone (the recipe behind checkpoints/digits-backbone)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from backbones.digits import DigitsBackbone, DigitsBackboneConfig
from train.schedules import warmup_cosine_optimizers


class DigitsBackboneTraining(pl.LightningModule):
    """Next-token cross-entropy on digit grids, with class dropout for classifier-free guidance."""

    def __init__(
        self,
        architecture: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        class_dropout: float = 0.1,
        warmup_steps: int = 100,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.model = DigitsBackbone(DigitsBackboneConfig(**architecture))
        self.optimizer_factory = optimizer
        self.class_dropout = class_dropout
        self.warmup_steps = warmup_steps

    def _bits_per_token(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens, class_ids)  # (B, N, levels)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) / math.log(2)

    def training_step(self, batch, batch_idx):
        tokens, class_ids = batch
        # Class dropout teaches the null class, the unconditional twin used by CFG.
        dropped = torch.rand(class_ids.shape, device=class_ids.device) < self.class_dropout
        class_ids = torch.where(dropped, torch.full_like(class_ids, self.model.config.null_class), class_ids)
        bits = self._bits_per_token(tokens, class_ids)
        self.log("train/bits_per_token", bits, prog_bar=True)
        return bits * math.log(2)  # nats, the usual scale for the learning rate

    def validation_step(self, batch, batch_idx):
        tokens, class_ids = batch
        self.log("val/bits_per_token", self._bits_per_token(tokens, class_ids), prog_bar=True)
        null = torch.full_like(class_ids, self.model.config.null_class)
        self.log("val/bits_per_token_unconditional", self._bits_per_token(tokens, null))

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Samples of the backbone as it is now, at CFG 3 (for SampleGrid)."""
        from decode import Condition, SamplingConfig, generate_ar

        was_training = self.model.training
        self.model.eval()
        condition = Condition(class_ids=torch.arange(num_images, device=self.device) % 10)
        result = generate_ar(self.model, condition, SamplingConfig(cfg_scale=3.0), torch.Generator().manual_seed(0))
        self.model.train(was_training)
        return self.model.tokens_to_pixels(result.tokens), {}

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.model.parameters())

    def export(self, directory: str | Path) -> Path:
        """Save the trained backbone (config.json + model.safetensors)."""
        return self.model.save_pretrained(directory)
