"""SSD latent heads: predict the backbone's hidden state at a spatial offset.

Spatially Speculative Decoding (Xiang et al., 2026) drafts image tokens with
light heads on the backbone's last-layer hidden state (before the final norm).
A head takes the hidden state ``H[i]`` that predicts grid token ``i`` and the
embedding of the token ``x_i`` drawn from it (the EAGLE convention), and predicts
the hidden state at an offset:

- horizontal: ``H[i + 1]``, the state that predicts the right neighbour;
- vertical: ``H[i + cols]``, the state that predicts the token directly below
  (for families with an end-of-line token the flat stride is ``cols + 1``; the
  backbone interface hides that, see backbones/base.py);
- grid (optional, ``head.grid``): ``H[i]`` from both the state above
  (``H[i - cols]``, ``x_{i - cols}``) and the state to the left (``H[i - 1]``,
  ``x_{i - 1}``). The vertical head drafts a row in parallel and cannot see the
  tokens drawn to its left; the grid head drafts along the row, each position
  from its drafted (or, after a correction, exact) left neighbour and the row
  above (with ``grid_above_right = k`` also the k positions right of the one
  above, which the backbone's state there has seen).

Draft logits are the backbone's own frozen final norm and image head applied to
the prediction, so a head predicts a continuous latent, not token ids (token-id
heads accept < 5% in the paper).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class SSDHeadConfig:
    """Shape of one SSD head pair; stored in the export's heads.json."""

    hidden_size: int  # the backbone's hidden size (input and output of each head)
    width: int = 512  # MLP width; ~0.2M parameters per head at the digits backbone's 192
    depth: int = 2  # hidden layers in the MLP
    input_noise: float = 0.1  # std of Gaussian noise on input hidden states in training (robust to drafted inputs)
    horizontal_unroll: int = 3  # training unrolls the horizontal head this many steps on its own predictions
    # Self-attention layers over the whole row above in the vertical head (0: a per-position MLP).
    # The row above is known entirely when a row is drafted, so its context (diagonal strokes) is free.
    row_attention_layers: int = 0
    row_attention_heads: int = 4
    grid: bool = False  # a third head drafting each position from the state above and the state to its left
    # The grid head also sees this many positions right of the one above (states and tokens): the backbone's
    # state there has seen them (diagonal strokes), and the row above is known before the row is drafted, so
    # they cost nothing per drafted token (they enter the once-per-row `prepare_above`).
    grid_above_right: int = 0

    def __post_init__(self):
        for key in ("hidden_size", "width", "depth", "horizontal_unroll", "row_attention_heads"):
            if getattr(self, key) < 1:
                raise ValueError(f"head.{key} must be >= 1, got {getattr(self, key)}")
        if self.grid_above_right < 0:
            raise ValueError(f"head.grid_above_right must be >= 0, got {self.grid_above_right}")
        if self.row_attention_layers < 0:
            raise ValueError(f"head.row_attention_layers must be >= 0, got {self.row_attention_layers}")
        if self.row_attention_layers and self.width % self.row_attention_heads:
            raise ValueError(
                f"head.width {self.width} must be divisible by head.row_attention_heads {self.row_attention_heads}"
            )
        if self.input_noise < 0:
            raise ValueError(f"head.input_noise must be >= 0, got {self.input_noise}")

    def to_dict(self) -> dict:
        return asdict(self)


def residual_mlp(in_features: int, config: SSDHeadConfig) -> nn.Sequential:
    """The heads' MLP: in_features -> width (depth SiLU layers) -> hidden size, output layer zero.

    The zero output layer makes a head whose forward adds the MLP to an input state
    start as "copy that state": a sensible draft before any training.
    """
    layers: list[nn.Module] = [nn.Linear(in_features, config.width), nn.SiLU()]
    for _ in range(config.depth - 1):
        layers += [nn.Linear(config.width, config.width), nn.SiLU()]
    layers.append(nn.Linear(config.width, config.hidden_size))
    mlp = nn.Sequential(*layers)
    nn.init.zeros_(mlp[-1].weight)
    nn.init.zeros_(mlp[-1].bias)
    return mlp


class SSDLatentPredictor(nn.Module):
    """One offset's head: (hidden (..., H), token embedding (..., H)) -> predicted hidden (..., H).

    The prediction is residual on the input hidden state (neighbouring states are
    alike), and the input is RMS-normalised because pre-norm states grow large.
    """

    def __init__(self, config: SSDHeadConfig):
        super().__init__()
        size = config.hidden_size
        self.hidden_norm = nn.RMSNorm(size)
        self.embed_norm = nn.RMSNorm(size)
        self.mlp = residual_mlp(2 * size, config)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        fused = torch.cat([self.hidden_norm(hidden), self.embed_norm(token_embedding)], dim=-1)  # (..., 2H)
        return hidden + self.mlp(fused)


class SSDGridPredictor(nn.Module):
    """Grid head: (above state, above token, left state, left token), each (..., H) -> predicted state (..., H).

    An MLP on the four RMS-normalised inputs, residual on the left state (the
    stronger single predictor), initialised to copy it. With
    ``grid_above_right = k`` it also reads the states and tokens of the k
    positions right of the one above (the inputs from above are then whole rows,
    (..., C, H): the last column's right neighbours repeat it).
    """

    def __init__(self, config: SSDHeadConfig):
        super().__init__()
        size = config.hidden_size
        self.above_right = config.grid_above_right
        self.norms = nn.ModuleList(nn.RMSNorm(size) for _ in range(4))
        # Input layout: [above, above token, left, left token, (above + s, its token) for s = 1..k].
        self.mlp = residual_mlp((4 + 2 * self.above_right) * size, config)
        # The MLP's Linear layers, for the per-token functional path (a plain tuple: not registered twice).
        self._linears = tuple(layer for layer in self.mlp if isinstance(layer, nn.Linear))

    def forward(
        self, above: torch.Tensor, above_embedding: torch.Tensor, left: torch.Tensor, left_embedding: torch.Tensor
    ) -> torch.Tensor:
        return self.from_above(self.prepare_above(above, above_embedding), left, left_embedding)

    def prepare_above(self, above: torch.Tensor, above_embedding: torch.Tensor) -> torch.Tensor:
        """The first layer's share of the inputs from above, (..., H) x 2 -> (..., width), bias included.

        Decoding drafts a row one position at a time but knows the whole row above
        beforehand: it prepares this once per row, and each step adds the left share.
        """
        first, size = self.mlp[0], self.norms[0].normalized_shape[0]
        normed = torch.cat([self.norms[0](above), self.norms[1](above_embedding)], dim=-1)
        prepared = nn.functional.linear(normed, first.weight[:, : 2 * size], first.bias)
        if self.above_right:
            cols = above.shape[-2]
            right = []
            for shift in range(1, self.above_right + 1):
                index = torch.arange(shift, cols + shift, device=above.device).clamp(max=cols - 1)
                right += [normed[..., index, :]]
            prepared = prepared + nn.functional.linear(torch.cat(right, dim=-1), first.weight[:, 4 * size :])
        return prepared

    def from_above(self, prepared: torch.Tensor, left: torch.Tensor, left_embedding: torch.Tensor) -> torch.Tensor:
        """The predicted state from `prepare_above`'s output (..., width) and the left inputs (..., H) x 2."""
        return self.from_prepared(prepared, left, self.prepare_left_tokens(left_embedding))

    def prepare_left_tokens(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        """The first layer's share of a left token's embedding, (..., H) -> (..., width).

        It depends on the token alone, so decoding computes it once for the whole
        codebook and looks it up per drafted token instead of embedding,
        normalising and projecting each one.
        """
        first, size = self.mlp[0], self.norms[0].normalized_shape[0]
        return nn.functional.linear(self.norms[3](token_embeddings), first.weight[:, 3 * size : 4 * size])

    def from_prepared(
        self, prepared_above: torch.Tensor, left: torch.Tensor, prepared_left_token: torch.Tensor
    ) -> torch.Tensor:
        """The predicted state from the prepared above share, the left state (..., H) and the prepared left token."""
        return self.drafting_step()(prepared_above, left, prepared_left_token)

    def drafting_step(self):
        """`from_prepared` as a function over contiguous copies of the weights it uses, for per-token loops.

        Decoding calls it once per drafted token, where each module call's and
        each strided weight slice's overhead costs as much as the kernel: the
        layers are applied functionally, the left-state slice of the first layer
        copied once. Make a new one after the weights change.
        """
        first, *hidden_layers, last = self._linears
        size = self.norms[0].normalized_shape[0]
        left_weight = first.weight[:, 2 * size : 3 * size].contiguous().t()  # (H, width)
        left_norm = self.norms[2]

        def step(prepared_above: torch.Tensor, left: torch.Tensor, prepared_left_token: torch.Tensor) -> torch.Tensor:
            flat_left = left.reshape(-1, size)
            normed = nn.functional.rms_norm(flat_left, (size,), left_norm.weight, left_norm.eps)
            shares = (prepared_above + prepared_left_token).reshape(len(flat_left), -1)
            hidden = torch.addmm(shares, normed, left_weight)
            for layer in hidden_layers:
                hidden = nn.functional.linear(nn.functional.silu(hidden), layer.weight, layer.bias)
            return (flat_left + nn.functional.linear(nn.functional.silu(hidden), last.weight, last.bias)).view_as(left)

        return step


class SSDRowAttentionPredictor(nn.Module):
    """Vertical head that sees the whole row above: (rows..., cols, H) x 2 -> predicted states below.

    Fused per-position features pass through bidirectional self-attention across
    the row (the row above is fully known when the row below is drafted), then an
    output projection residual on the input state.
    """

    def __init__(self, config: SSDHeadConfig):
        super().__init__()
        size, width = config.hidden_size, config.width
        self.hidden_norm = nn.RMSNorm(size)
        self.embed_norm = nn.RMSNorm(size)
        self.fuse = nn.Linear(2 * size, width)
        layer = nn.TransformerEncoderLayer(
            width,
            config.row_attention_heads,
            dim_feedforward=2 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.row_context = nn.TransformerEncoder(layer, config.row_attention_layers, enable_nested_tensor=False)
        self.out = nn.Linear(width, size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        fused = self.fuse(
            torch.cat([self.hidden_norm(hidden), self.embed_norm(token_embedding)], dim=-1)
        )  # (..., C, W)
        leading = fused.shape[:-2]
        context = self.row_context(fused.reshape(-1, *fused.shape[-2:])).reshape(*leading, *fused.shape[-2:])
        return hidden + self.out(context)


class SSDHeads(nn.Module):
    """The horizontal (+1) and vertical (+row) latent predictors, trained and exported together."""

    kind = "ssd"

    def __init__(self, config: SSDHeadConfig):
        super().__init__()
        self.config = config
        self.horizontal = SSDLatentPredictor(config)
        self.vertical = SSDRowAttentionPredictor(config) if config.row_attention_layers else SSDLatentPredictor(config)
        self.grid = SSDGridPredictor(config) if config.grid else None
