"""What every latent draft head's self-distillation shares: frozen teacher states, the loss, the optimiser, export.

Teacher: the frozen backbone's pre-norm hidden states on its own generations
(computed online under no_grad, or read from an offline corpus). Student: a
draft head predicting states (SSD's spatial heads, train/ssd_module.py; EAGLE's
sequential head, train/eagle_module.py). Loss per predicted state:

    SmoothL1(predicted, target) * hidden_loss_weight
    + KL(p_target || q_predicted) * kl_weight
    + TV(p_target, q_predicted) * tv_weight

where both distributions are the backbone's frozen final norm + head applied to
the states and mixed with CFG exactly as decoding mixes them (EAGLE/LANTERN
weights: 1.0 and 0.1, the KL having the cross-entropy's gradient; the total
variation 1 - sum_x min(p, q) is one minus the expected acceptance itself, which
DistillSpec (Zhou et al., 2023) uses as a distillation objective; off by default).

A subclass says which heads it builds (`build_heads`), what they predict
(`predictions`: named predicted and target states), which of those it logs as
acceptance, and how it decodes a sample grid (`sample_generate`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from backbones.base import ARImageBackbone, Condition, group_by_prompt_length
from data.corpus import batch_condition, grouped_teacher_forced_hidden
from heads.export import export_heads
from train.schedules import warmup_cosine_optimizers


class HeadDistillation(pl.LightningModule):
    """Trains draft heads; the backbone is frozen, only head parameters reach the optimizer."""

    # prediction name -> the acceptance it is logged as (acceptance_<offset>, top1_<offset>)
    logged_predictions: dict[str, str] = {}

    def __init__(
        self,
        backbone: ARImageBackbone,
        head: dict,
        optimizer: Callable[..., torch.optim.Optimizer],
        cfg_scale: float = 3.0,
        hidden_loss_weight: float = 1.0,
        kl_weight: float = 0.1,
        warmup_steps: int = 50,
        tv_weight: float = 0.0,
    ):
        super().__init__()
        if cfg_scale < 0 or hidden_loss_weight < 0 or kl_weight < 0 or tv_weight < 0:
            raise ValueError("module.cfg_scale, hidden_loss_weight, kl_weight and tv_weight must be >= 0")
        self.save_hyperparameters(ignore=["backbone", "optimizer"])
        self.backbone = backbone.eval().requires_grad_(False)
        self.heads = self.build_heads(dict(head))
        self.optimizer_factory = optimizer
        self.cfg_scale, self.guided = cfg_scale, cfg_scale != 1.0
        self.hidden_loss_weight, self.kl_weight, self.warmup_steps = hidden_loss_weight, kl_weight, warmup_steps
        self.tv_weight = tv_weight
        self.strict_loading = False  # checkpoints carry the heads only (see on_save_checkpoint)

    # ---- what a subclass defines ------------------------------------------------------------

    def build_heads(self, head: dict) -> nn.Module:
        """The heads to train, from the config's `head` settings and the backbone's sizes."""
        raise NotImplementedError

    def predictions(
        self, hidden: torch.Tensor, tokens: torch.Tensor, noise: bool
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """[(name, predicted states, target states)] for teacher states (twins * B, rows, cols, H)."""
        raise NotImplementedError

    def summary_acceptance(self, logs: dict) -> torch.Tensor:
        """The one acceptance figure checkpoints are selected by (val/acceptance)."""
        values = [logs[f"acceptance_{offset}"] for offset in dict.fromkeys(self.logged_predictions.values())]
        return sum(values) / len(values)

    def sample_generate(self, heads: nn.Module, group: Condition, sampling):
        """Decode a sample batch with `heads` (as they are now, in the backbone's dtype): a GenerationResult."""
        raise NotImplementedError

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no dropout, whatever Lightning toggles
        return self

    # ---- teacher ----------------------------------------------------------------------------

    def teacher_hidden(self, batch: dict) -> torch.Tensor:
        """Target states (twins * B, rows, cols, H), [cond; uncond] rows first, as `guide` expects."""
        tokens = batch["tokens"]
        rows, cols = self.backbone.geometry.rows, self.backbone.geometry.cols
        if "hidden" in batch:  # offline: recorded at generation, (B, twins, N, H) in fp16
            hidden = batch["hidden"].float().transpose(0, 1).flatten(0, 1)
            if (hidden.shape[0] == 2 * tokens.shape[0]) != self.guided:
                raise ValueError("the offline corpus was generated with a different CFG setting than module.cfg_scale")
        else:
            with torch.no_grad():  # prompts of different token lengths run as separate groups
                hidden = grouped_teacher_forced_hidden(self.backbone, batch_condition(batch), tokens, self.guided)
        return hidden.reshape(hidden.shape[0], rows, cols, -1)

    def distribution_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """States (twins * B, ..., H) -> log-probabilities (B, ..., V) as decoding mixes them."""
        logits = self.backbone.logits(hidden)
        return (self.backbone.guide(logits, self.cfg_scale) if self.guided else logits.float()).log_softmax(-1)

    def embedded_tokens(self, tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Image tokens (B, rows * cols) -> their input embeddings for every cache row (twins * B, rows, cols, H)."""
        embedded = self.backbone.embed_image_tokens(tokens.view(-1, rows, cols))  # (B, R, C, H)
        return torch.cat([embedded, embedded]) if self.guided else embedded  # the twins see the same tokens

    # ---- loss -------------------------------------------------------------------------------

    def losses(self, batch: dict, noise: bool) -> tuple[torch.Tensor, dict]:
        hidden = self.teacher_hidden(batch)
        total, logs = 0.0, {}
        for name, predicted, target in self.predictions(hidden, batch["tokens"], noise):
            hidden_loss = F.smooth_l1_loss(predicted, target)
            p_log, q_log = self.distribution_logits(target), self.distribution_logits(predicted)
            kl = F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1).mean()
            total = total + self.hidden_loss_weight * hidden_loss + self.kl_weight * kl
            logs[f"hidden_loss_{name}"], logs[f"kl_{name}"] = hidden_loss.detach(), kl.detach()
            logged = name in self.logged_predictions
            if not (logged or self.tv_weight):
                continue  # the distributions' overlap is only needed for the TV term and the logs
            p, q = p_log.exp(), q_log.exp()
            acceptance = torch.minimum(p, q).sum(-1).mean()  # expected sum_x min(p, q) = 1 - TV(p, q)
            if self.tv_weight:
                total = total + self.tv_weight * (1 - acceptance)
            if logged:
                offset = self.logged_predictions[name]
                logs[f"acceptance_{offset}"] = acceptance.detach()
                logs[f"top1_{offset}"] = (p.argmax(-1) == q.argmax(-1)).float().mean().detach()
        logs["acceptance"] = self.summary_acceptance(logs)
        return total, logs

    def training_step(self, batch, batch_idx):
        loss, logs = self.losses(batch, noise=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss.item()} at step {self.global_step} (batch {batch_idx}); "
                "lower optim.lr or check the corpus"
            )
        size = batch["tokens"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log_dict({f"train/{k}": v for k, v in logs.items() if k.startswith("acceptance")}, batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logs = self.losses(batch, noise=False)
        size = batch["tokens"].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=size)
        self.log("val/acceptance", logs.pop("acceptance"), prog_bar=True, batch_size=size)
        self.log_dict({f"val/{k}": v for k, v in logs.items()}, batch_size=size)

    # ---- samples ----------------------------------------------------------------------------

    @torch.no_grad()
    def sample_images(self, num_images: int) -> tuple[torch.Tensor, dict]:
        """Greedy decoding with the heads as they are now (for SampleGrid): images and passes per image."""
        from decode import SamplingConfig

        was_training = self.heads.training
        self.heads.eval()
        # As `python -m decode` will run them: in the backbone's dtype (heads/export.py casts them so at loading;
        # the sample grid runs outside the training step's autocast).
        dtype = next(self.backbone.parameters()).dtype
        heads = self.heads if next(self.heads.parameters()).dtype == dtype else copy.deepcopy(self.heads).to(dtype)
        condition = self._sample_condition(num_images)
        sampling = SamplingConfig(cfg_scale=self.cfg_scale, greedy=True)
        tokens, passes = None, 0.0
        for indices, group in group_by_prompt_length(self.backbone, condition):  # equal prompt lengths per batch
            if group.class_ids is not None:
                group = Condition(class_ids=group.class_ids.to(self.device))
            result = self.sample_generate(heads, group, sampling)
            if tokens is None:
                tokens = result.tokens.new_empty(num_images, *result.tokens.shape[1:])
            tokens[indices.to(tokens.device)] = result.tokens
            passes += float(result.forward_passes) * len(indices) / num_images
        self.heads.train(was_training)
        return self.backbone.tokens_to_pixels(tokens), {"forward_passes_per_image": passes}

    def _sample_condition(self, num_images: int) -> Condition:
        """The datamodule's sample conditions (prompts or class ids), else class ids 0..9."""
        trainer = self._trainer  # None outside a fit: `self.trainer` would raise
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if hasattr(datamodule, "sample_condition"):
            return datamodule.sample_condition(num_images)
        return Condition(class_ids=torch.arange(num_images) % 10)

    # ---- optimisation and export ------------------------------------------------------------

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.heads.parameters())

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The frozen backbone is loaded from its own weights; checkpoints hold what training changes.
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}
        # The feature noise draws from torch's RNG: a resumed run continues the same random stream.
        checkpoint["torch_rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "torch_rng_state" in checkpoint:
            torch.set_rng_state(checkpoint["torch_rng_state"])

    def export(self, directory: str | Path) -> Path:
        """heads.safetensors + heads.json, checked against this backbone when loaded."""
        return export_heads(
            self.heads,
            directory,
            self.backbone.identity(),
            extra={"training": {"cfg_scale": self.cfg_scale, "step": int(self.global_step)}},
        )
