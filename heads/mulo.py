"""MuLo-SD low-resolution drafter: a small AR model over the image at 1/r of the backbone's resolution.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026) drafts with a
cheap model that generates the image at a lower resolution; one drafted
low-resolution row, upsampled by r in pixel space and re-tokenised, proposes r
backbone rows at once.

For the embedded digits backbone the drafter is the same class-conditional
Llama design (backbones/digits.py) at grid ``rows / r``, self-distilled on the
backbone's own generations taken to pixels and downsampled by r. The drafter
implements the backbone interface, so the decoder drives it with the same
prefill/step/rollback calls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backbones.base import ARImageBackbone
from backbones.digits import DigitsBackbone, DigitsBackboneConfig


@dataclass
class MuLoDrafterConfig:
    """Shape of a low-resolution drafter; stored in the export's heads.json."""

    backbone_rows: int  # the backbone's grid (the drafter's is rows / scale)
    backbone_cols: int
    levels: int  # the drafter's codebook (the digits drafter shares the backbone's intensity levels)
    scale: int = 3  # r: one drafted low-res row becomes r backbone rows
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 2
    intermediate_size: int = 352

    def __post_init__(self):
        if self.scale < 1 or self.backbone_rows % self.scale or self.backbone_cols % self.scale:
            raise ValueError(f"head.scale must be >= 1 and divide the backbone grid {self.backbone_rows}x"
                             f"{self.backbone_cols}, got {self.scale}")
        if self.backbone_rows != self.backbone_cols:
            raise ValueError("the digits drafter needs a square grid")

    def to_dict(self) -> dict:
        return asdict(self)


class MuLoDrafter(nn.Module):
    """The trainable drafter (its `model` is an ARImageBackbone at low resolution)."""

    kind = "mulo"

    def __init__(self, config: MuLoDrafterConfig):
        super().__init__()
        self.config = config
        self.model = DigitsBackbone(DigitsBackboneConfig(
            grid_size=config.backbone_rows // config.scale, levels=config.levels, hidden_size=config.hidden_size,
            num_layers=config.num_layers, num_heads=config.num_heads, intermediate_size=config.intermediate_size,
            name="mulo-drafter"))


def downsample_to_drafter(tokens: torch.Tensor, backbone: ARImageBackbone, drafter: ARImageBackbone, scale: int) -> torch.Tensor:
    """Backbone tokens (B, rows, cols) -> drafter tokens (B, rows/r, cols/r) through pixel space (area average)."""
    pixels = backbone.tokens_to_pixels(tokens)  # (B, C, H, W)
    return drafter.pixels_to_tokens(F.avg_pool2d(pixels, scale))


def upsample_to_backbone(tokens: torch.Tensor, drafter: ARImageBackbone, backbone: ARImageBackbone, scale: int,
                         mode: str = "nearest") -> torch.Tensor:
    """The training-free upsampler U_r: drafter tokens (B, h, w) -> backbone tokens (B, h*r, w*r) via pixels."""
    pixels = drafter.tokens_to_pixels(tokens)
    upsampled = F.interpolate(pixels, scale_factor=scale, mode=mode,
                              **({} if mode == "nearest" else {"align_corners": False}))
    return backbone.pixels_to_tokens(upsampled.clamp(0, 1))
