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
    """Trains SSD heads; the backbone is frozen, only head parameters reach the optimizer.

    ``rows_per_image = k`` trains each step on k random rows of every image (each
    with the row above it, which the vertical and grid heads read), not on all of
    them: neighbouring rows of one image teach nearly the same thing, so a step
    over more images' rows learns more per FLOP. Validation always uses whole
    images. ``None``, or k >= the rows below the first: every row.
    """

    logged_predictions = {"vertical": "vertical", "horizontal_1": "horizontal", "grid_1": "grid"}

    def __init__(self, backbone, head: dict, optimizer, rows_per_image: int | None = None, **settings):
        super().__init__(backbone, head, optimizer, **settings)
        if rows_per_image is not None and rows_per_image < 1:
            raise ValueError(f"module.rows_per_image must be null (every row) or >= 1, got {rows_per_image}")
        self.rows_per_image = rows_per_image

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
        if noise and self.rows_per_image is not None and self.rows_per_image < hidden.shape[1] - 1:
            hidden, embedded = self.sampled_row_pairs(hidden, embedded)
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
            # The share from above is the same at every unroll step (as decoding prepares it once per row):
            # computed once for whole rows, each step takes its columns.
            above = self.heads.grid.prepare_above(inputs[:, :-1], embedded[:, :-1])
            for step in range(1, min(self.heads.config.horizontal_unroll, cols - 1) + 1):
                predicted = self.heads.grid.from_above(
                    above[:, :, step:], predicted[:, :, :-1], embedded[:, 1:, step - 1 : -1]
                )
                out.append((f"grid_{step}", predicted, hidden[:, 1:, step:]))
        return out

    def sampled_row_pairs(self, hidden: torch.Tensor, embedded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(twins * B, R, C, H) x 2 -> (twins * B * k, 2, C, H) x 2: k random rows r >= 1 of each image with row r - 1.

        A pair is a two-row image: the vertical and grid heads predict its second
        row from its first, the horizontal head runs along both. An image's CFG
        twins (the conditional and unconditional halves of the batch) get the
        same rows, so that guidance mixes matching positions; the halves stay in
        order ([cond pairs; uncond pairs]), as `guide` expects.
        """
        twins = 2 if self.guided else 1
        images, rows = hidden.shape[0] // twins, hidden.shape[1]
        # k distinct rows per image from 1..R-1, drawn from torch's RNG (resumed runs continue its stream)
        picked = torch.rand(images, rows - 1, device=hidden.device).argsort(-1)[:, : self.rows_per_image] + 1
        picked = picked.repeat(twins, 1)  # (twins * B, k)
        pairs = torch.stack([picked - 1, picked], dim=-1)  # (twins * B, k, 2)

        def gather(states: torch.Tensor) -> torch.Tensor:
            index = pairs.flatten(1)[:, :, None, None].expand(-1, -1, *states.shape[2:])
            return states.gather(1, index).reshape(-1, 2, *states.shape[2:])

        return gather(hidden), gather(embedded)

    def sample_generate(self, heads, group: Condition, sampling):
        from decode import generate_ssd

        return generate_ssd(self.backbone, heads, group, sampling)
