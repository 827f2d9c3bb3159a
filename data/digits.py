"""The embedded data set: scikit-learn's bundled handwritten digits as token grids.

scikit-learn ships 1,797 8x8 digit images (intensity 0..16, 10 classes) inside the
package, so every machine has them without a download. We render each digit onto a
finer grid (default 24x24 = 576 tokens, the length of Janus-Pro's images) through a
random affine + elastic warp, so that the fine grid carries real variation rather
than interpolation only, and quantise the intensity to a small codebook. The
codebook's values are its latents, so "nearest codebook neighbours" (relaxed
acceptance) is meaningful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Digit size on the canvas when rendered without augmentation (the middle of DigitsAugment's range).
UNAUGMENTED_SCALE = 0.8
# Fixed split of the 1,797 digits: the permutation seed is part of the data set's identity.
_SPLIT_SEED = 0
_SPLIT_SIZES = {"test": 180, "val": 180}  # the rest (1,437) is "train"


def load_digit_images(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the real 8x8 digits of one split as (images (N, 8, 8) in [0, 1], labels (N,)).

    Splits are "train" (1,437), "val" (180) and "test" (180), fixed by a seeded
    permutation so that every run, model and metric sees the same partition.
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "val", "test"):
        raise ValueError(f"unknown digits split {split!r}: use 'train', 'val' or 'test'")
    digits = load_digits()
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(digits.target))
    n_test, n_val = _SPLIT_SIZES["test"], _SPLIT_SIZES["val"]
    index = {"test": order[:n_test], "val": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}[split]
    images = torch.from_numpy(digits.images[index] / 16.0).float()
    labels = torch.from_numpy(digits.target[index]).long()
    return images, labels


@dataclass(frozen=True)
class DigitsAugment:
    """Random warp applied when a digit is rendered onto the token grid."""

    max_rotation_deg: float = 12.0  # handwriting slant varies by about this much
    scale_range: tuple[float, float] = (0.72, 0.88)  # digit size on the canvas; < 1 leaves a margin
    max_shift: float = 0.12  # in normalised coordinates (2.0 = full width): ~1.4 px at 24x24
    elastic_strength: float = 0.05  # amplitude of the smooth displacement field; 0 disables
    elastic_grid: int = 4  # the displacement field is random on a coarse grid, then smoothed


def render_digits(
    images: torch.Tensor,
    grid_size: int,
    augment: DigitsAugment | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Resample 8x8 digits (N, 8, 8) onto a (N, grid, grid) canvas, optionally warped.

    One bicubic resampling from the source pixels (not upsample-then-warp), so the
    warp adds no second blur.
    """
    n = images.shape[0]
    # (N, 2, 3) affine maps output coordinates to source coordinates.
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0 / UNAUGMENTED_SCALE
    if augment is not None:

        def uniform(low, high):
            return torch.rand(n, generator=generator) * (high - low) + low

        angle = uniform(-augment.max_rotation_deg, augment.max_rotation_deg) * math.pi / 180
        scale = uniform(*augment.scale_range)
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
        theta[:, :, 2] = (torch.rand(n, 2, generator=generator) * 2 - 1) * augment.max_shift
    sampling_grid = F.affine_grid(theta, [n, 1, grid_size, grid_size], align_corners=False)  # (N, G, G, 2)
    if augment is not None and augment.elastic_strength > 0:
        coarse = torch.randn(n, 2, augment.elastic_grid, augment.elastic_grid, generator=generator)
        field = F.interpolate(coarse, size=(grid_size, grid_size), mode="bicubic", align_corners=True)
        sampling_grid = sampling_grid + augment.elastic_strength * field.permute(0, 2, 3, 1)
    rendered = F.grid_sample(
        images.unsqueeze(1), sampling_grid, mode="bicubic", padding_mode="zeros", align_corners=False
    )
    return rendered.squeeze(1).clamp(0, 1)
