"""Self-distillation of an EAGLE-style draft head (heads/eagle.py) against a frozen backbone.

EAGLE's recipe (Li et al., 2024; SafeAILab/EAGLE ``train/main.py``): teacher
forcing over whole sequences, the input state at position i and the embedding
of token i predict the state at i + 1; uniform noise on the input features;
loss SmoothL1 on the predicted state (weight 1.0) plus the cross-entropy of the
target's distribution under the head's (weight 0.1, here the KL, which has the
same gradient). Teacher, CFG mixing, optimiser and export are every head's
(train/head_distillation.py). The image is one raster-order sequence: the state
that ends a row predicts the next row's first token, as the backbone's does.
"""

from __future__ import annotations

import torch

from backbones.base import Condition
from heads.eagle import EagleHead, EagleHeadConfig
from train.head_distillation import HeadDistillation


class EagleDistillation(HeadDistillation):
    """Trains an EAGLE head; the backbone is frozen, only head parameters reach the optimizer."""

    logged_predictions = {"next": "next"}

    def build_heads(self, head: dict) -> EagleHead:
        return EagleHead(
            EagleHeadConfig(
                hidden_size=self.backbone.hidden_size, max_positions=self.backbone.geometry.num_tokens, **head
            )
        )

    def predictions(
        self, hidden: torch.Tensor, tokens: torch.Tensor, noise: bool
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """[("next", predicted states at 1 .. N - 1, the teacher's)] over the raster sequence."""
        states = hidden.flatten(1, 2)  # (rows, N, H): states[:, i] predicts token i
        embedded = self.embedded_tokens(tokens, hidden.shape[1], hidden.shape[2]).flatten(1, 2)
        inputs = states[:, :-1]
        if noise and self.heads.config.input_noise > 0:
            scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()  # noise relative to the (pre-norm) state's size
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.heads.config.input_noise * scale
        return [("next", self.heads(inputs, embedded[:, :-1]), states[:, 1:])]

    def sample_generate(self, heads, group: Condition, sampling):
        from decode.eagle import generate_eagle

        return generate_eagle(self.backbone, heads, group, sampling)
