"""Building blocks of the taming-transformers / latent-diffusion convolutional autoencoders.

LlamaGen's VQ-16 tokenizer (backbones/llamagen.py) and MAR's KL-16 VAE
(backbones/mar_vae.py) are both descendants of the taming-transformers
autoencoder: the same residual, attention and resampling blocks, arranged under
different parameter names. The blocks here carry the names both checkpoints use
(``norm1``, ``conv1``, ``nin_shortcut``, ``q``, ``k``, ``v``, ``proj_out``,
``conv``), so each model only arranges them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swish(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) (the autoencoders' nonlinearity)."""
    return x * torch.sigmoid(x)


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm over 32 groups, eps 1e-6 (every norm of these autoencoders)."""
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


def run_level(x: torch.Tensor, blocks: nn.ModuleList, attention: nn.ModuleList) -> torch.Tensor:
    """One resolution level: its residual blocks in turn, each followed by its attention block where the level
    has them (every level of these autoencoders runs so; the resampling after it is the caller's)."""
    for i, block in enumerate(blocks):
        x = block(x)
        if len(attention):
            x = attention[i](x)
    return x


class ResBlock(nn.Module):
    """norm -> swish -> conv, twice, plus a 1x1 shortcut where the channel count changes (no timestep input)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = group_norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels of a feature map, 1x1 convolutions as projections."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.norm(x)
        q, k, v = (f(h).flatten(2).transpose(1, 2) for f in (self.q, self.k, self.v))  # (b, hw, c)
        out = torch.softmax(q @ k.transpose(1, 2) * c**-0.5, dim=-1) @ v
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, height, width))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    """A stride-2 3x3 convolution; the padding is asymmetric (right and bottom only), as the originals pad."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))
