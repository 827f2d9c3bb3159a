"""MuLo-SD's training-free upsampler: tokens between the drafter's grid and the backbone's.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026) drafts at
1/r of the backbone's resolution; a drafted low-resolution row becomes r
backbone rows through a resampler that needs no training, so it belongs to the
decoder, not to the drafter (heads/mulo.py). Two ways (the drafter's config
``resample``):

- ``pixels``: tokens -> pixels -> resize by r -> re-tokenise; needs a VQ decoder
  and a grid-agnostic encoder (the digits codec; the default there).
- ``latents``: encoder-free: tokens -> codebook latents -> resize by r ->
  nearest codebook entry (Euclidean, in the space ``codebook_latents()``
  returns); downsampling area-averages the latents of each r x r cell, then
  takes the nearest entry. Approximation: the VQ decoder is not linear in its
  latents, so the mean latent of a cell is not the latent of the cell's mean
  pixel colour, and bilinear upsampling blends codes the decoder never saw side
  by side; nearest upsampling just repeats each token r x r times.

Training uses the downsampler too (the drafter learns the backbone's samples
taken to its grid), through `downsample_to_drafter`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from backbones.base import ARImageBackbone


def resampling_latents(backbone: ARImageBackbone) -> torch.Tensor:
    """(codebook_size, D) float latents the ``latents`` resampler works in.

    The backbone's VQ codebook; when the backbone cannot provide it (LlamaGen
    without ``vq_path``, Tar without ``codebook``), its input embeddings of the
    image tokens stand in, with a warning: a learned proxy, not the VQ geometry.
    """
    try:
        return backbone.codebook_latents().float()
    except NotImplementedError as error:
        warnings.warn(
            f"{backbone.name}: no codebook latents ({error}); the MuLo latent resampler falls back to the "
            "backbone's input embeddings of the image tokens. Provide the codebook for the real geometry.",
            stacklevel=2,
        )
        ids = torch.arange(backbone.codebook_size, device=backbone._device())
        with torch.no_grad():
            return backbone.embed_image_tokens(ids).float()


def nearest_codebook_entry(grid: torch.Tensor, codebook: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Latent grids (B, D, H, W) -> (B, H, W) ids of the nearest codebook entry (Euclidean), in row chunks."""
    batch, dim, height, width = grid.shape
    flat = grid.permute(0, 2, 3, 1).reshape(-1, dim).to(codebook)  # (B*H*W, D)
    ids = torch.cat([torch.cdist(part, codebook).argmin(-1) for part in flat.split(chunk)])
    return ids.view(batch, height, width)


# The interpolations U_r takes (torch.nn.functional.interpolate's modes for images that accept align_corners, and
# nearest, which repeats each token).
UPSAMPLE_MODES = ("nearest", "bilinear", "bicubic")


def upsample_latents(tokens: torch.Tensor, codebook: torch.Tensor, scale: int, mode: str = "nearest") -> torch.Tensor:
    """Low-res ids (B, h, w) -> (B, h*r, w*r) through codebook latents; nearest mode repeats each id r x r times."""
    if mode == "nearest":
        return tokens.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    grid = codebook[tokens].permute(0, 3, 1, 2)  # (B, D, h, w)
    upsampled = F.interpolate(grid, scale_factor=scale, mode=mode, align_corners=False)
    return nearest_codebook_entry(upsampled, codebook)


def downsample_latents(tokens: torch.Tensor, codebook: torch.Tensor, scale: int) -> torch.Tensor:
    """High-res ids (B, H, W) -> (B, H/r, W/r): area-average each r x r cell's latents, take the nearest entry."""
    grid = codebook[tokens].permute(0, 3, 1, 2)  # (B, D, H, W)
    return nearest_codebook_entry(F.avg_pool2d(grid, scale), codebook)


def downsample_to_drafter(
    tokens: torch.Tensor,
    backbone: ARImageBackbone,
    drafter: ARImageBackbone,
    scale: int,
    resample: str = "pixels",
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backbone tokens (B, rows, cols) -> drafter tokens (B, rows/r, cols/r) (area average).

    ``pixels`` goes through the backbone's decoder and the drafter's encoder;
    ``latents`` through the shared codebook (`latents`, else `resampling_latents(backbone)`).
    """
    if resample == "latents":
        return downsample_latents(tokens, resampling_latents(backbone) if latents is None else latents, scale)
    pixels = backbone.tokens_to_pixels(tokens)  # (B, C, H, W)
    return drafter.pixels_to_tokens(F.avg_pool2d(pixels, scale))


def upsample_to_backbone(
    tokens: torch.Tensor,
    drafter: ARImageBackbone,
    backbone: ARImageBackbone,
    scale: int,
    mode: str = "nearest",
    resample: str = "pixels",
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The training-free upsampler U_r: drafter tokens (B, h, w) -> backbone tokens (B, h*r, w*r).

    ``pixels``: decode, interpolate by r (`mode`), re-encode; ``latents``: see `upsample_latents`.
    """
    if resample == "latents":
        if mode == "nearest":
            return upsample_latents(tokens, None, scale)  # no codebook needed to repeat ids
        return upsample_latents(tokens, resampling_latents(backbone) if latents is None else latents, scale, mode)
    pixels = drafter.tokens_to_pixels(tokens)
    upsampled = F.interpolate(
        pixels, scale_factor=scale, mode=mode, **({} if mode == "nearest" else {"align_corners": False})
    )
    return backbone.pixels_to_tokens(upsampled.clamp(0, 1))


def upsample_block(
    low_row: torch.Tensor,
    committed_above: torch.Tensor,
    drafter: ARImageBackbone,
    backbone: ARImageBackbone,
    scale: int,
    mode: str = "nearest",
    resample: str = "pixels",
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """A drafted low-res row (B, w) -> its r backbone rows (B, r, w * r).

    Interpolating modes upsample it under the committed low-res rows above
    (`committed_above`, (B, j, w); the last two are read, as bicubic does), so the
    top rows blend into the image above; below, the row's edge is replicated.
    """
    context = 0 if mode == "nearest" else 2
    strip = torch.cat([committed_above[:, max(0, committed_above.shape[1] - context) :], low_row[:, None]], dim=1)
    return upsample_to_backbone(strip, drafter, backbone, scale, mode, resample, latents)[:, -scale:]


def _repeat_cells(low_row: torch.Tensor, scale: int) -> torch.Tensor:
    """One low-res row (B, w, ...) -> the r backbone rows it covers, flattened: (B, r * w * r, ...)."""
    wide = low_row.repeat_interleave(scale, dim=1)  # (B, w * r, ...)
    return wide[:, None].expand(-1, scale, *wide.shape[1:]).flatten(1, 2)


def block_proposals(
    low_tokens: torch.Tensor, low_q: torch.Tensor, block_tokens: torch.Tensor, scale: int
) -> torch.Tensor:
    """The proposal distribution q (B, r * cols, V) of each draft of a block.

    A backbone position whose draft is the token of the low-res cell it lies in
    (every position under nearest upsampling, where the codebooks agree) takes the
    drafter's distribution at that cell, `low_q` (B, cols / r, V); a position
    the upsampler changed is a point proposal (one-hot on its draft).
    low_tokens (B, cols / r), block_tokens (B, r * cols).
    """
    source = _repeat_cells(low_tokens[..., None], scale)[..., 0]  # (B, r * cols)
    cell_q = _repeat_cells(low_q, scale)  # (B, r * cols, V)
    point = F.one_hot(block_tokens, low_q.shape[-1]).to(low_q.dtype)
    return torch.where((source == block_tokens)[..., None], cell_q, point)
