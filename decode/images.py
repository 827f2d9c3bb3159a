"""Writing generated images as PNG grids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.atomic_io import atomic_path


def save_image_grid(
    images: torch.Tensor, path: str | Path, columns: int = 10, scale: int = 4, padding: int = 1
) -> None:
    """Save images (N, C, H, W) in [0, 1] as one PNG grid, `columns` wide, each pixel `scale`x enlarged."""
    n, channels, height, width = images.shape
    rows = -(-n // columns)
    canvas = torch.ones(channels, rows * (height + padding) + padding, columns * (width + padding) + padding) * 0.5
    for index in range(n):
        top = padding + (index // columns) * (height + padding)
        left = padding + (index % columns) * (width + padding)
        canvas[:, top : top + height, left : left + width] = images[index].float().cpu()
    array = (canvas.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    picture = Image.fromarray(array[..., 0] if channels == 1 else array)
    picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    with atomic_path(path) as tmp:
        picture.save(tmp, format="PNG")


def save_tokens(tokens: torch.Tensor, path: str | Path) -> None:
    """Save generated tokens (N, rows, cols) as an int .npy file."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            np.save(handle, tokens.cpu().numpy().astype(np.int64))
