"""MuLo-SD decoding: a low-resolution drafter proposes r rows at a time; relaxed, local verification.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026), with
LANTERN's relaxed acceptance (Jang et al., 2025). For each low-resolution row j:

1. The drafter (its own KV cache, the same CFG and sampling settings) generates
   the ``cols / r`` tokens of low-res row j.
2. The training-free upsampler (heads/mulo.py, ``head.resample``: tokens ->
   pixels -> x r -> re-tokenise, or tokens -> codebook latents -> x r -> nearest
   entry) turns it into ``r`` backbone rows: a block of ``r * cols`` drafts.
3. One backbone pass over the block (after any committed tokens the cache does
   not hold yet) gives the target distribution ``p`` at every block position.
   The draft is a deterministic function of the drafter's sample, so it is
   verified as a point proposal (``q(x) = 1``), which keeps the exact rule
   lossless.

   - ``relaxed`` (method ``mulo``): accept ``x`` with probability
     ``min(1, p(x) + c_m)``, where ``c_m`` pools the probability of the ``k``
     codebook entries nearest to ``x`` in latent space, the largest prefix of
     them whose pooled mass stays ``<= delta`` (greedy: accept when
     ``p(x) + c_m >= max p``). With ``delta = 0`` it is standard acceptance.
     Rejected positions grow by a neighbourhood of radius ``rho`` (Chebyshev,
     inside the block); the 8-connected islands are resampled from ``p`` of the
     same pass, all islands in parallel, and accepted tokens around them are
     kept. Approximation: an island token is drawn given the drafts to its
     left (some of them rejected), not given the final tokens as strict raster
     order would; the next pass re-feeds the changed tokens, so the cache and
     later positions see the final image. With ``rounds = R`` the block is
     re-verified up to R more times (relaxed test of every position against
     the updated context, islands resampled again), so islands drawn from a
     stale context get re-checked: at most ``R + 1`` passes per block.
   - ``exact`` (method ``mulo_exact``): prefix acceptance, left to right, accept
     with probability ``p(x)``; at the first rejection draw from the residual
     (``p`` without ``x``, renormalised) and re-verify the rest of the block in
     the next pass. Lossless.

4. The committed block is downsampled and written back into the drafter's
   cache in place of its own draft of row j, so the drafter continues from the
   image the backbone actually accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage

from backbones.base import ARImageBackbone, Condition
from decode.relaxed import latent_neighbours, pooled_neighbour_mass
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_from, token_distribution
from heads.mulo import (
    MuLoDrafter,
    downsample_to_drafter,
    resampling_latents,
    upsample_to_backbone,
)


@dataclass(frozen=True)
class MuLoDecodeConfig:
    """How MuLo-SD verifies (see the module docstring)."""

    mode: Literal["relaxed", "exact"] = "relaxed"
    k: int = 4  # codebook neighbours pooled by relaxed acceptance
    delta: float = 0.2  # pooled probability budget; 0 = standard acceptance
    radius: int = 1  # rho: rejected tokens grow by this many cells before islands are resampled
    upsample_mode: str = "nearest"  # interpolation of the upsampler (in pixel or latent space, per the drafter)
    rounds: int = 0  # relaxed: re-verification passes per block after resampling its islands (a block costs <= rounds + 1)

    def __post_init__(self):
        if self.mode not in ("relaxed", "exact"):
            raise ValueError(f"MuLo mode must be 'relaxed' or 'exact', got {self.mode!r}")
        if self.k < 0 or self.delta < 0 or self.radius < 0 or self.rounds < 0:
            raise ValueError(f"MuLo k, delta, radius and rounds must be >= 0, got {self.k}, {self.delta}, "
                             f"{self.radius}, {self.rounds}")


def relaxed_accept(p: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, delta: float, greedy: bool,
                   uniform: torch.Tensor) -> torch.Tensor:
    """Which point drafts pass relaxed acceptance: p (..., V), tokens (...), uniform (...) -> bool (...)."""
    mass = p.gather(-1, tokens[..., None])[..., 0] + pooled_neighbour_mass(p, tokens, neighbours, delta)
    if greedy:
        return mass >= p.amax(-1)
    return uniform < mass  # probability min(1, p(x) + c_m) for a point proposal q(x) = 1


def islands(rejected: torch.Tensor, radius: int) -> torch.Tensor:
    """Grow rejected cells (B, H, W) by `radius` (Chebyshev): the mask of every island's cells.

    All islands are resampled in the same pass, so decoding needs the mask, not the labels.
    """
    grown = rejected.float()
    if radius > 0:
        grown = F.max_pool2d(grown[:, None], 2 * radius + 1, stride=1, padding=radius)[:, 0]
    return grown > 0


def count_islands(mask: torch.Tensor) -> list[int]:
    """The number of 8-connected islands in each image of a mask (B, H, W) (for reports and tests)."""
    return [int(ndimage.label(image, structure=np.ones((3, 3)))[1]) for image in mask.cpu().numpy()]


@torch.inference_mode()
def generate_mulo(
    backbone: ARImageBackbone,
    drafter: MuLoDrafter,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: MuLoDecodeConfig = MuLoDecodeConfig(),
) -> GenerationResult:
    """Generate one image per condition with MuLo-SD block drafting and verification (see the module docstring).

    The drafter is bound to `backbone` (refused when built for another one); it
    resamples between the grids the way its config says (``resample``).
    """
    rows, cols, scale = backbone.geometry.rows, backbone.geometry.cols, drafter.config.scale
    small: ARImageBackbone = drafter.bind(backbone)
    resample = drafter.config.resample
    latents = resampling_latents(backbone) if resample == "latents" else None  # (V, D), once per call
    small_cols = small.geometry.cols
    batch, block = condition.batch_size, scale * cols
    state, h_first = backbone.prefill(condition, sampling.guided)
    small_state, small_hidden = small.prefill(condition, sampling.guided)
    device = h_first.device
    # Only relaxed acceptance pools over codebook neighbours; exact mode needs no codebook.
    neighbours = latent_neighbours(backbone.codebook_latents(), config.k) if config.mode == "relaxed" else None
    tokens = torch.empty(batch, rows * cols, dtype=torch.long, device=device)
    passes, drafted, accepted = 1, 0, 0
    cache_valid = 0  # grid tokens whose cache entries are final for every image

    for low_row in range(rows // scale):
        block_start = low_row * block
        # 1. The drafter's low-res row, token by token through its own cache.
        low_tokens = []
        for column in range(small_cols):
            scores = small.scores(small_state, small_hidden[:, -1:], sampling.cfg_scale)
            low_tokens.append(sample_from(token_distribution(scores, sampling), generator))  # (B, 1)
            if column + 1 < small_cols:
                small_hidden = small.step(small_state, low_tokens[-1])
        low_row_tokens = torch.cat(low_tokens, dim=1)  # (B, small_cols)
        # 2. Upsample to r backbone rows.
        draft = upsample_to_backbone(low_row_tokens[:, None], small, backbone, scale, config.upsample_mode,
                                     resample, latents).flatten(1)
        block_tokens = draft.clone()  # (B, r * cols)
        committed = torch.zeros(batch, dtype=torch.long, device=device)  # exact mode: final prefix per image
        block_states = h_first.new_zeros(h_first.shape[0], block, h_first.shape[-1])  # (G, r*cols, H) predicts each position
        block_states[:, 0] = h_first[:, 0]

        # 3. Verify.
        verify_passes = 0
        while True:
            verify_passes += 1
            backbone.rollback(state, cache_valid)
            feed = torch.cat([tokens[:, cache_valid:block_start], block_tokens[:, max(0, cache_valid - block_start):]], dim=1)
            out = backbone.step(state, feed)  # out[:, j] predicts grid position cache_valid + j + 1
            passes += 1
            first_fresh = max(block_start, cache_valid + 1)  # states before it are final from earlier passes
            fresh = first_fresh - block_start
            block_states[:, fresh:] = out[:, first_fresh - cache_valid - 1 : first_fresh - cache_valid - 1 + block - fresh]
            block_p = token_distribution(backbone.scores(state, block_states, sampling.cfg_scale), sampling)  # (B, r*cols, V)
            uniform = torch.rand(batch, block, generator=generator, device=device)
            position = torch.arange(block, device=device)[None]

            if config.mode == "exact":
                px = block_p.gather(-1, block_tokens[..., None])[..., 0]
                passed = (uniform < px) | (position < committed[:, None])
                first_rejected = torch.where(passed.all(1), block, (~passed).float().argmax(1))
                open_images = committed < block
                drafted += int(((block - committed) * open_images).sum())
                accepted += int(((first_rejected - committed) * open_images).sum())
                cache_valid = block_start + int(first_rejected.min())
                rejected_images = torch.nonzero(first_rejected < block)[:, 0]
                if len(rejected_images) == 0:
                    h_first = out[:, -1:]
                    cache_valid = block_start + block
                    break
                at = first_rejected[rejected_images]
                target = block_p[rejected_images, at]
                residual = target.scatter(-1, block_tokens[rejected_images, at][:, None], 0.0)
                residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
                block_tokens[rejected_images, at] = sample_from(residual / residual.sum(-1, keepdim=True), generator)
                committed = torch.where(first_rejected < block, first_rejected + 1, block)
                if low_row == rows // scale - 1 and bool((committed >= block).all()):
                    break
            else:
                passed = relaxed_accept(block_p, block_tokens, neighbours, config.delta, sampling.greedy, uniform)
                if verify_passes == 1:  # later rounds re-test the same block, they draft nothing new
                    drafted += batch * block
                    accepted += int(passed.sum())
                grown = islands(~passed.view(batch, scale, cols), config.radius).flatten(1)
                if grown.any():
                    block_tokens[grown] = sample_from(block_p[grown], generator)  # all islands at once
                    first_changed = int(torch.where(grown.any(0))[0].min())
                    cache_valid = block_start + first_changed  # the next pass re-feeds from there
                    if verify_passes <= config.rounds:
                        continue  # re-verify the block with its resampled islands in context
                else:
                    cache_valid = block_start + block
                h_first = out[:, -1:]
                break

        tokens[:, block_start : block_start + block] = block_tokens
        # 4. The drafter continues from the accepted image, not from its own draft.
        accepted_low = downsample_to_drafter(block_tokens.view(batch, scale, cols), backbone, small, scale,
                                             resample, latents)
        small.rollback(small_state, low_row * small_cols)
        if low_row + 1 < rows // scale:
            small_hidden = small.step(small_state, accepted_low.flatten(1))

    return GenerationResult(tokens.view(batch, rows, cols), forward_passes=passes, drafted_tokens=drafted,
                            accepted_tokens=accepted)
