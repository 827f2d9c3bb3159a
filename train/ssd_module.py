"""Self-distillation of SSD latent heads against a frozen backbone.

Students: the horizontal, vertical (and grid) heads of heads/ssd.py; teacher,
loss and optimisation as every head's (train/head_distillation.py). The
horizontal head is unrolled over its own predictions (`head.horizontal_unroll`
steps, as EAGLE-3's training-time test does) so that it can draft a run along
a row; so is the grid head. Inputs get Gaussian feature noise.

Online targets work for any conditions of the corpus: class ids, or prompts of
different token lengths (run as groups of equal length and put back in batch
order, `data.corpus.grouped_teacher_forced_hidden`). ``head.width: null`` makes
the heads as wide as the backbone's hidden state (EAGLE-like heads for the real
backbones).
"""

from __future__ import annotations

import torch

from backbones.base import Condition
from heads.ssd import SSDHeadConfig, SSDHeads
from train.head_distillation import HeadDistillation


class SSDDistillation(HeadDistillation):
    """Trains SSD heads; the backbone is frozen, only head parameters reach the optimizer."""

    logged_predictions = {"vertical": "vertical", "horizontal_1": "horizontal", "grid_1": "grid"}

    def build_heads(self, head: dict) -> SSDHeads:
        if head.get("width") is None:  # null: as wide as the backbone's hidden state (EAGLE-like)
            head["width"] = self.backbone.hidden_size
        return SSDHeads(SSDHeadConfig(hidden_size=self.backbone.hidden_size, **head))

    def summary_acceptance(self, logs: dict) -> torch.Tensor:
        return (logs["acceptance_vertical"] + logs["acceptance_horizontal"]) / 2

    def predictions(
        self, hidden: torch.Tensor, tokens: torch.Tensor, noise: bool
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """[(name, predicted states, target states)] for the vertical head and each horizontal unroll step."""
        cols = hidden.shape[2]
        embedded = self.embedded_tokens(tokens, hidden.shape[1], cols)
        inputs = hidden
        if noise and self.heads.config.input_noise > 0:
            scale = hidden.pow(2).mean(-1, keepdim=True).sqrt()  # pre-norm states vary in size; noise follows
            inputs = hidden + torch.randn_like(hidden) * scale * self.heads.config.input_noise
        out = [("vertical", self.heads.vertical(inputs[:, :-1], embedded[:, :-1]), hidden[:, 1:])]
        predicted = inputs
        for step in range(1, min(self.heads.config.horizontal_unroll, cols - 1) + 1):
            # step k predicts column j + k from (its own step k - 1 prediction at j + k - 1, token j + k - 1)
            predicted = self.heads.horizontal(predicted[:, :, :-1], embedded[:, :, step - 1 : -1])
            out.append((f"horizontal_{step}", predicted, hidden[:, :, step:]))
        if self.heads.grid is not None:
            # Rows below the first, columns right of the first: step k feeds its own step k - 1 predictions as
            # the left state (step 1 the teacher's), the teacher's state above, and the true tokens.
            predicted = inputs[:, 1:]
            for step in range(1, min(self.heads.config.horizontal_unroll, cols - 1) + 1):
                predicted = self.heads.grid(
                    inputs[:, :-1, step:], embedded[:, :-1, step:], predicted[:, :, :-1], embedded[:, 1:, step - 1 : -1]
                )
                out.append((f"grid_{step}", predicted, hidden[:, 1:, step:]))
        return out

    def sample_generate(self, heads, group: Condition, sampling):
        from decode import generate_ssd

        return generate_ssd(self.backbone, heads, group, sampling)
