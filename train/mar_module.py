"""Lightning module that trains a MAR (LTH14/mar's objective) from scratch: the embedded digits MAR and its drafter.

The model is `backbones.mar.MARBackbone`, the class real MAR weights load into, so what is trained here
generates and is speculated on through the same code as a released MAR (decode/masked_baseline.py,
decode/cspd_mar.py). The objective is LTH14/mar ``MAR.forward``:

- each image's class embedding, replaced by the learned ``fake_latent`` with probability `class_dropout`
  (the null condition of classifier-free guidance; MAR's ``label_drop_prob`` 0.1);
- one random order per image and one mask ratio per batch from a normal of mean 1 and std 0.25 truncated to
  [`mask_ratio_min`, 1] (MAR's ``mask_ratio_min`` 0.7): the first ``ceil(ratio * seq_len)`` positions of each
  order are masked;
- the encoder reads the buffer and the visible tokens, the decoder gives every position's condition z;
- the diffusion loss at the masked positions only, each drawn `diffusion_repeats` times (MAR's
  ``diffusion_batch_mul`` 4), averaged over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch

from backbones.mar import MARBackbone, MARConfig
from train.continuous_backbone_module import tokens_and_classes
from train.schedules import warmup_cosine_optimizers

MASK_RATIO_STD = 0.25  # LTH14/mar: stats.truncnorm((mask_ratio_min - 1.0) / 0.25, 0, loc=1.0, scale=0.25)


def initialise_like_mar(model: MARBackbone) -> MARBackbone:
    """LTH14/mar ``MAR.initialize_weights`` (run before its diffusion head exists, whose own init is kept): class
    embedding, fake latent, mask token and the position embeddings N(0, 0.02^2); linears Xavier-uniform with zero
    biases; LayerNorms weight 1, bias 0."""
    with torch.no_grad():
        for parameter in (model.class_emb.weight, model.fake_latent, model.mask_token):
            torch.nn.init.normal_(parameter, std=0.02)
        for parameter in (
            model.encoder_pos_embed_learned,
            model.decoder_pos_embed_learned,
            model.diffusion_pos_embed_learned,
        ):
            torch.nn.init.normal_(parameter, std=0.02)
        for name, module in model.named_modules():
            if name.startswith("diffusion"):
                continue
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                torch.nn.init.zeros_(module.bias)
            elif isinstance(module, torch.nn.LayerNorm):
                torch.nn.init.ones_(module.weight)
                torch.nn.init.zeros_(module.bias)
    return model


def mask_ratio(mask_ratio_min: float, generator: torch.Generator | None = None) -> float:
    """A draw of MAR's mask ratio: N(1, 0.25^2) truncated to [mask_ratio_min, 1], by the inverse CDF."""
    low = torch.special.ndtr(torch.tensor((mask_ratio_min - 1.0) / MASK_RATIO_STD, dtype=torch.float64))
    high = 0.5  # the normal's CDF at its mean, ratio 1
    u = low + (high - low) * torch.rand((), generator=generator, dtype=torch.float64)
    return float(1.0 + MASK_RATIO_STD * torch.special.ndtri(u))


def random_masks(batch: int, seq_len: int, masked: int, device, generator: torch.Generator | None = None):
    """(B, seq_len) bool, True at the first `masked` positions of one random order per row (MAR's random_masking)."""
    orders = torch.rand(batch, seq_len, generator=generator).argsort(dim=1).to(device)
    mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    return mask.scatter(1, orders[:, :masked], True)


def mar_loss(
    model: MARBackbone,
    tokens: torch.Tensor,
    class_ids: torch.Tensor,
    class_dropout: float,
    mask_ratio_min: float,
    repeats: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """MAR's training loss (module doc) of images (B, seq_len, token_dim) of classes (B,): a scalar.

    With `generator` every draw (class dropout, ratio, orders, diffusion steps and noise) comes from it.
    """
    batch, seq_len = tokens.shape[:2]
    embedding = model.class_emb(class_ids)
    dropped = torch.rand(batch, generator=generator).to(tokens.device) < class_dropout
    embedding = torch.where(dropped[:, None], model.fake_latent.to(embedding.dtype), embedding)
    masked_count = math.ceil(seq_len * mask_ratio(mask_ratio_min, generator))
    masked = random_masks(batch, seq_len, masked_count, tokens.device, generator)
    z = model.conditions(tokens, ~masked, embedding)  # (B, seq_len, dim)
    z, target = z[masked], tokens[masked]  # every row masks as many, so the mean is MAR's (loss*mask).sum()/mask.sum()
    return model.diffusion.loss(z.repeat(repeats, 1), target.repeat(repeats, 1), generator=generator).mean()


class MARTraining(pl.LightningModule):
    """MAR's masked-generation diffusion objective (module doc) on patch tokens, from random weights."""

    def __init__(
        self,
        architecture: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        class_dropout: float = 0.1,
        mask_ratio_min: float = 0.7,
        diffusion_repeats: int = 4,
        warmup_steps: int = 100,
        sample_num_iter: int = 64,
        sample_cfg_scale: float = 3.0,
    ):
        super().__init__()
        if not 0 <= class_dropout < 1:
            raise ValueError(f"module.class_dropout must be in [0, 1), got {class_dropout}")
        if not 0 < mask_ratio_min <= 1:
            raise ValueError(f"module.mask_ratio_min must be in (0, 1], got {mask_ratio_min}")
        if diffusion_repeats < 1:
            raise ValueError(f"module.diffusion_repeats must be >= 1, got {diffusion_repeats}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.model = initialise_like_mar(MARBackbone(MARConfig(**architecture), num_iter=sample_num_iter))
        self.optimizer_factory = optimizer
        self.class_dropout, self.mask_ratio_min = class_dropout, mask_ratio_min
        self.diffusion_repeats, self.warmup_steps = diffusion_repeats, warmup_steps
        self.sample_cfg_scale = sample_cfg_scale

    def training_step(self, batch, batch_idx):
        tokens, class_ids = tokens_and_classes(batch)
        loss = mar_loss(self.model, tokens, class_ids, self.class_dropout, self.mask_ratio_min, self.diffusion_repeats)
        self.log("train/diffusion_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        # Every draw fixed by the batch's index, so that the curve compares checkpoints, not draws.
        tokens, class_ids = tokens_and_classes(batch)
        generator = torch.Generator().manual_seed(batch_idx)
        loss = mar_loss(self.model, tokens, class_ids, 0.0, self.mask_ratio_min, 1, generator)
        self.log("val/diffusion_loss", loss, prog_bar=True)

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Samples of the model as it is now (MAR's sampler, CFG `sample_cfg_scale`), for SampleGrid."""
        was_training = self.model.training
        self.model.eval()
        class_ids = torch.arange(num_images, device=self.device) % self.model.num_classes
        tokens = self.model.sample(
            class_ids,
            num_iter=self.model.num_iter,
            cfg_scale=self.sample_cfg_scale,
            generator=torch.Generator().manual_seed(0),
        )
        self.model.train(was_training)
        grid = self.model.geometry
        return self.model.tokens_to_pixels(tokens.view(num_images, grid.rows, grid.cols, -1)), {}

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.model.parameters())

    def export(self, directory: str | Path) -> Path:
        """Save the trained MAR (config.json + model.safetensors under the official names)."""
        return self.model.save_pretrained(directory)
