"""Lightning module that trains the embedded continuous digits backbone (recipe of checkpoints/digits-continuous)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch

from backbones.digits_continuous import ContinuousDigitsBackbone, ContinuousDigitsConfig
from train.schedules import warmup_cosine_optimizers


def tokens_and_classes(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, N, D), class ids (B,)) of a batch of the digits patches (a pair) or of a corpus (a dict)."""
    if isinstance(batch, dict):
        return batch["tokens"], batch["class_id"]
    return batch


def diffusion_training_loss(model: ContinuousDigitsBackbone, batch, class_dropout: float, repeats: int) -> torch.Tensor:
    """MAR's diffusion loss on every token of a (tokens (B, N, D), class ids (B,)) batch, with class dropout."""
    tokens, class_ids = tokens_and_classes(batch)
    # Class dropout teaches the null class, the unconditional twin of classifier-free guidance.
    dropped = torch.rand(class_ids.shape, device=class_ids.device) < class_dropout
    class_ids = torch.where(dropped, torch.full_like(class_ids, model.config.null_class), class_ids)
    return model(tokens, class_ids, repeats=repeats).mean()


def diffusion_validation_loss(model: ContinuousDigitsBackbone, batch, batch_idx: int) -> torch.Tensor:
    """The diffusion loss of a validation batch at steps and noise fixed by the batch's index (comparable curves)."""
    tokens, class_ids = tokens_and_classes(batch)
    generator = torch.Generator(device=tokens.device).manual_seed(batch_idx)
    z = model.condition(model.teacher_forced_hidden_states(tokens, class_ids)).flatten(0, 1)
    return model.diffusion.loss(z, tokens.flatten(0, 1), generator=generator).mean()


class ContinuousDigitsBackboneTraining(pl.LightningModule):
    """MAR's diffusion loss on every patch token, teacher-forced in raster order, with class dropout for CFG."""

    def __init__(
        self,
        architecture: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        class_dropout: float = 0.1,
        warmup_steps: int = 100,
        diffusion_repeats: int = 4,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        if diffusion_repeats < 1:
            raise ValueError(f"module.diffusion_repeats must be >= 1, got {diffusion_repeats}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.model = ContinuousDigitsBackbone(ContinuousDigitsConfig(**architecture))
        self.optimizer_factory = optimizer
        self.class_dropout = class_dropout
        self.warmup_steps = warmup_steps
        self.diffusion_repeats = diffusion_repeats  # MAR's diffusion_batch_mul: steps drawn per token per pass

    def training_step(self, batch, batch_idx):
        loss = diffusion_training_loss(self.model, batch, self.class_dropout, self.diffusion_repeats)
        self.log("train/diffusion_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/diffusion_loss", diffusion_validation_loss(self.model, batch, batch_idx), prog_bar=True)

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Samples of the model as it is now, at CFG 3 (for SampleGrid)."""
        from decode import Condition, SamplingConfig
        from decode.continuous_ar import generate_continuous_ar

        was_training = self.model.training
        self.model.eval()
        condition = Condition(class_ids=torch.arange(num_images, device=self.device) % 10)
        result = generate_continuous_ar(
            self.model, condition, SamplingConfig(cfg_scale=3.0), torch.Generator(device=self.device).manual_seed(0)
        )
        self.model.train(was_training)
        return self.model.tokens_to_pixels(result.tokens), {}

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.model.parameters())

    def export(self, directory: str | Path) -> Path:
        """Save the trained backbone (config.json + model.safetensors)."""
        return self.model.save_pretrained(directory)
