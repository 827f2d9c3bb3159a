"""Self-distillation of the MuLo-SD low-resolution drafter against a frozen backbone.

The frozen backbone's own generations (the SSD corpus machinery) are downsampled
by r to the drafter's grid (through pixels or codebook latents, ``head.resample``)
and the drafter learns them with next-token cross-entropy and condition dropout
(the class id becomes the null class, or the prompt vector the learned null
vector), so it has an unconditional twin for CFG, like the backbone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from backbones.base import ARImageBackbone, Condition, group_by_prompt_length
from data.corpus import batch_condition
from decode.mulo_resampling import downsample_to_drafter, resampling_latents
from heads.export import export_heads
from heads.mulo import MuLoDrafter, MuLoDrafterConfig
from train.schedules import warmup_cosine_optimizers


class MuLoDistillation(pl.LightningModule):
    """Trains the drafter on the backbone's downsampled generations; the backbone stays frozen.

    `drafter` is the head config (heads/mulo.py ``MuLoDrafterConfig`` fields but the
    ones read off the backbone; ``design: auto`` picks digits on the digits backbone).
    `class_dropout` is the condition dropout rate, for class ids and prompts alike.
    """

    def __init__(
        self,
        backbone: ARImageBackbone,
        drafter: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        class_dropout: float = 0.1,
        warmup_steps: int = 50,
        cfg_scale: float = 3.0,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        self.save_hyperparameters(ignore=["backbone", "optimizer"])
        self.backbone = backbone.eval().requires_grad_(False)
        self.drafter = MuLoDrafter(MuLoDrafterConfig.for_backbone(backbone, **drafter))
        self.drafter.bind(backbone)
        self.optimizer_factory, self.class_dropout, self.warmup_steps = optimizer, class_dropout, warmup_steps
        self.cfg_scale = cfg_scale  # only for the sample grids: the drafter is trained for every scale
        self.strict_loading = False  # checkpoints carry the drafter only
        self._latents: torch.Tensor | None = None  # the latent resampler's codebook, read once on the device
        self._sample_condition: Condition | None = None  # prompts for the sample grids (text-to-image backbones)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()
        return self

    def resampling_latents(self) -> torch.Tensor | None:
        """The codebook the ``latents`` resampler works in (None on the pixel path)."""
        if self.drafter.config.resample != "latents":
            return None
        if self._latents is None or self._latents.device != self.device:
            self._latents = resampling_latents(self.backbone).to(self.device)
        return self._latents

    def bits_per_token(self, batch: dict, drop_classes: bool) -> torch.Tensor:
        geometry, config = self.backbone.geometry, self.drafter.config
        small = self.drafter.bind(self.backbone)
        with torch.no_grad():
            low = downsample_to_drafter(
                batch["tokens"].view(-1, geometry.rows, geometry.cols),
                self.backbone,
                small,
                config.scale,
                config.resample,
                self.resampling_latents(),
            ).flatten(1)  # (B, n_low)
        condition = batch_condition(batch)
        dropped = None
        if drop_classes:  # condition dropout teaches the null condition used by CFG
            dropped = torch.rand(condition.batch_size, device=low.device) < self.class_dropout
        if config.design == "digits":
            class_ids = condition.class_ids
            if dropped is not None:
                class_ids = torch.where(dropped, torch.full_like(class_ids, small.config.null_class), class_ids)
            logits = small(low, class_ids)
        else:
            logits = small(low, small.condition_vectors(condition, drop=dropped))
        return F.cross_entropy(logits.flatten(0, 1).float(), low.flatten()) / math.log(2)

    def training_step(self, batch, batch_idx):
        if self._sample_condition is None and "class_id" not in batch:
            self._sample_condition = batch_condition(batch)
        bits = self.bits_per_token(batch, drop_classes=True)
        if not torch.isfinite(bits):
            raise FloatingPointError(f"loss is {bits.item()} at step {self.global_step} (batch {batch_idx})")
        self.log("train/bits_per_token", bits, prog_bar=True, batch_size=batch["tokens"].shape[0])
        return bits * math.log(2)

    def validation_step(self, batch, batch_idx):
        self.log(
            "val/bits_per_token",
            self.bits_per_token(batch, drop_classes=False),
            prog_bar=True,
            batch_size=batch["tokens"].shape[0],
        )

    def _sample_conditions(self, num_images: int) -> Condition:
        num_classes = getattr(self.backbone, "num_classes", None)
        if num_classes is not None:
            return Condition(class_ids=torch.arange(num_images, device=self.device) % min(10, num_classes))
        if self._sample_condition is None:
            raise RuntimeError("no prompts seen yet to sample with: sample grids start after the first training batch")
        seen = self._sample_condition
        if seen.prompts is not None:  # one batch must tokenize to one length: the first group of equal lengths
            return group_by_prompt_length(self.backbone, Condition(prompts=seen.prompts[:num_images]))[0][1]
        if seen.token_ids is not None:
            return Condition(token_ids=seen.token_ids[:num_images])
        return Condition(class_ids=seen.class_ids[:num_images])

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Greedy MuLo-SD with the drafter as it is now (for SampleGrid): images and passes per image.

        Relaxed mode where the backbone has codebook latents, else exact mode; a backbone
        without a pixel decoder shows its token ids as grey levels.
        """
        from decode import SamplingConfig
        from decode.mulo import MuLoDecodeConfig, generate_mulo

        was_training = self.drafter.training
        self.drafter.eval()
        try:
            self.backbone.codebook_latents()
            mode = "relaxed"
        except NotImplementedError:
            mode = "exact"
        result = generate_mulo(
            self.backbone,
            self.drafter,
            self._sample_conditions(num_images),
            SamplingConfig(cfg_scale=self.cfg_scale, greedy=True),
            config=MuLoDecodeConfig(mode=mode),
        )
        self.drafter.train(was_training)
        try:
            images = self.backbone.tokens_to_pixels(result.tokens)
        except NotImplementedError:
            images = (result.tokens.float() / max(self.backbone.codebook_size - 1, 1))[:, None]  # (B, 1, rows, cols)
        return images, {"forward_passes_per_image": float(result.forward_passes)}

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.drafter.parameters())

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}

    def export(self, directory: str | Path) -> Path:
        """heads.safetensors + heads.json (kind "mulo", the drafter's shape and r), checked against the backbone."""
        return export_heads(
            self.drafter, directory, self.backbone.identity(), extra={"training": {"step": int(self.global_step)}}
        )
