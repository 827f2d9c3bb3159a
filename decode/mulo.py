"""MuLo-SD decoding: a low-resolution drafter proposes r rows at a time; relaxed, local verification.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026), with
LANTERN's relaxed acceptance (Jang et al., 2025). For each low-resolution row j:

1. The drafter (its own KV cache, the backbone's sampling settings, its own
   guidance scale ``drafter_cfg_scale``: 1, no guidance, by default, because it
   was distilled from the backbone's guided samples) generates the ``cols / r``
   tokens of low-res row j.
2. The training-free upsampler (heads/mulo.py, ``head.resample``: tokens ->
   pixels -> x r -> re-tokenise, or tokens -> codebook latents -> x r -> nearest
   entry) turns it into ``r`` backbone rows: a block of ``r * cols`` drafts.
   Interpolating modes (bilinear, bicubic) upsample the row under the two
   committed low-res rows above it (the downsampled accepted image), so the
   block's top rows blend into what is above; below, the row's edge is
   replicated (the next row is not drafted yet).
3. One backbone pass over the block (after any committed tokens the cache does
   not hold yet) gives the target distribution ``p`` at every block position.

   - ``relaxed`` (method ``mulo``): accept ``x`` with probability
     ``min(1, (p(x) + c_m) / q(x))``, where ``c_m`` pools the probability of the
     ``k`` codebook entries nearest to ``x`` in latent space, the largest prefix
     of them whose pooled mass stays ``<= delta`` (greedy: accept when
     ``p(x) + c_m >= max p``). With ``delta = 0`` it is standard acceptance.
     ``q`` (``proposal``): ``drafter`` (default) takes the drafter's
     distribution at the low-res cell a position lies in, where the upsampler
     kept that cell's token (every position under nearest upsampling), and
     treats a changed token as a point proposal (``q(x) = 1``); ``point``
     treats every draft as one. Under sampling, point proposals cap acceptance
     at ``sum p^2`` even for a perfect drafter; the drafter's ``q`` lifts it to
     ``1 - TV(p, q)``. A rejected draft is redrawn from the residual
     ``norm(max(0, p - q))``.
     Rejected positions grow by a neighbourhood of radius ``rho`` (Chebyshev,
     inside the block); the 8-connected islands are resampled from ``p`` of the
     same pass, all islands in parallel, and accepted tokens around them are
     kept. Approximation: an island token is drawn given the drafts to its
     left (some of them rejected), not given the final tokens as strict raster
     order would; the next pass re-feeds the changed tokens, so the cache and
     later positions see the final image. Every token up to a block's first
     redrawn one saw only final tokens, so it is final; redrawn tokens after it
     stay "open". With ``rounds = R`` the open tokens are re-tested (as point
     proposals, against ``p`` of a pass that sees the redrawn tokens) up to R
     more times, in raster order: the open tokens before the first rejected one
     become final, and that one is redrawn (from ``p`` without it) and final
     too; the later ones keep their draws for the next round (redrawing them
     all at once updates coupled neighbours together, which oscillates into
     stripes). Each round fixes at least one more token per image. A block costs at most
     ``R + 1`` passes and stops early once nothing is open. With an island
     covering the whole block and enough rounds this is exact: greedy
     ``delta = 0`` decoding then equals greedy AR.
   - ``exact`` (method ``mulo_exact``): every draft is a point proposal (a
     token copied into r x r positions is not an independent draw from ``q``,
     so ``q`` would break exactness); prefix acceptance, left to right, accept
     with probability ``p(x)``; at the first rejection draw from the residual
     (``p`` without ``x``, renormalised) and re-verify the rest of the block in
     the next pass. Lossless.

4. The committed block is downsampled and written back into the drafter's
   cache in place of its own draft of row j, so the drafter continues from the
   image the backbone actually accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    proposal: Literal["drafter", "point"] = "drafter"  # relaxed: q(x) of a draft (see the module docstring)
    # The drafter is distilled from the backbone's guided samples, so its conditional model already is the
    # guided distribution; guiding it again over-sharpens its drafts (measured: README). 1.0: no unconditional twin.
    drafter_cfg_scale: float = 1.0

    def __post_init__(self):
        if self.mode not in ("relaxed", "exact"):
            raise ValueError(f"MuLo mode must be 'relaxed' or 'exact', got {self.mode!r}")
        if self.proposal not in ("drafter", "point"):
            raise ValueError(f"MuLo proposal must be 'drafter' or 'point', got {self.proposal!r}")
        if self.drafter_cfg_scale < 0:
            raise ValueError(f"MuLo drafter_cfg_scale must be >= 0, got {self.drafter_cfg_scale}")
        if self.k < 0 or self.delta < 0 or self.radius < 0 or self.rounds < 0:
            raise ValueError(f"MuLo k, delta, radius and rounds must be >= 0, got {self.k}, {self.delta}, "
                             f"{self.radius}, {self.rounds}")


def relaxed_accept(p: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, delta: float, greedy: bool,
                   uniform: torch.Tensor, q_of_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Which drafts pass relaxed acceptance: p (..., V), tokens (...), uniform (...) -> bool (...).

    Accepts with probability ``min(1, (p(x) + c_m) / q(x))``; `q_of_tokens` (...)
    is q(x), None for point proposals (q(x) = 1).
    """
    mass = p.gather(-1, tokens[..., None])[..., 0] + pooled_neighbour_mass(p, tokens, neighbours, delta)
    if greedy:
        return mass >= p.amax(-1)
    if q_of_tokens is None:
        return uniform < mass
    return uniform * q_of_tokens < mass


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


def upsample_block(low_row: torch.Tensor, committed_above: torch.Tensor, drafter: ARImageBackbone,
                   backbone: ARImageBackbone, scale: int, mode: str = "nearest", resample: str = "pixels",
                   latents: torch.Tensor | None = None) -> torch.Tensor:
    """A drafted low-res row (B, w) -> its r backbone rows (B, r, w * r).

    Interpolating modes upsample it under the committed low-res rows above
    (`committed_above`, (B, j, w); the last two are read, as bicubic does), so the
    top rows blend into the image above; below, the row's edge is replicated.
    """
    context = 0 if mode == "nearest" else 2
    strip = torch.cat([committed_above[:, max(0, committed_above.shape[1] - context):], low_row[:, None]], dim=1)
    return upsample_to_backbone(strip, drafter, backbone, scale, mode, resample, latents)[:, -scale:]


def _without(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """p (..., V) with each rejected point draft `tokens` (...) removed: the residual of a point proposal.

    Unnormalised (`sample_from` does not need it); p itself where the draft held all the mass.
    """
    residual = p.scatter(-1, tokens[..., None], 0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def _first(mask: torch.Tensor, none: int) -> torch.Tensor:
    """The first True position of each row of `mask` (B, n), or `none` where a row has none."""
    return torch.where(mask.any(1), mask.float().argmax(1), none)


def _repeat_cells(low_row: torch.Tensor, scale: int) -> torch.Tensor:
    """One low-res row (B, w, ...) -> the r backbone rows it covers, flattened: (B, r * w * r, ...)."""
    wide = low_row.repeat_interleave(scale, dim=1)  # (B, w * r, ...)
    return wide[:, None].expand(-1, scale, *wide.shape[1:]).flatten(1, 2)


def block_proposals(low_tokens: torch.Tensor, low_q: torch.Tensor, block_tokens: torch.Tensor,
                    scale: int) -> torch.Tensor:
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
    # The drafter samples with its own guidance scale (see MuLoDecodeConfig.drafter_cfg_scale).
    drafter_sampling = replace(sampling, cfg_scale=config.drafter_cfg_scale)
    small_state, small_hidden = small.prefill(condition, drafter_sampling.guided)
    device = h_first.device
    # Only relaxed acceptance pools over codebook neighbours; exact mode needs no codebook.
    neighbours = latent_neighbours(backbone.codebook_latents(), config.k) if config.mode == "relaxed" else None
    # Exact mode keeps point proposals: a token copied r x r times is not an independent draw from q.
    use_drafter_q = config.mode == "relaxed" and config.proposal == "drafter" and not sampling.greedy
    tokens = torch.empty(batch, rows * cols, dtype=torch.long, device=device)
    committed_low = torch.empty(batch, rows // scale, small_cols, dtype=torch.long, device=device)  # downsampled
    position = torch.arange(scale * cols, device=device)[None]  # of each token in a block
    passes, drafted, accepted = 1, 0, 0
    cache_valid = 0  # grid tokens whose cache entries are final for every image

    for low_row in range(rows // scale):
        block_start = low_row * block
        # 1. The drafter's low-res row, token by token through its own cache.
        low_tokens, low_q = [], []
        for column in range(small_cols):
            scores = small.scores(small_state, small_hidden[:, -1:], drafter_sampling.cfg_scale)
            low_q.append(token_distribution(scores, drafter_sampling))  # (B, 1, V)
            low_tokens.append(sample_from(low_q[-1], generator))  # (B, 1)
            if column + 1 < small_cols:
                small_hidden = small.step(small_state, low_tokens[-1])
        low_row_tokens = torch.cat(low_tokens, dim=1)  # (B, small_cols)
        # 2. Upsample to r backbone rows.
        block_tokens = upsample_block(low_row_tokens, committed_low[:, :low_row], small, backbone, scale,
                                      config.upsample_mode, resample, latents).flatten(1)  # (B, r * cols)
        block_q = None  # point proposals
        if use_drafter_q:
            block_q = block_proposals(low_row_tokens, torch.cat(low_q, dim=1), block_tokens, scale)
        committed = torch.zeros(batch, dtype=torch.long, device=device)  # exact mode: final prefix per image
        block_states = h_first.new_zeros(h_first.shape[0], block, h_first.shape[-1])  # (G, r*cols, H) predicts each position
        block_states[:, 0] = h_first[:, 0]

        # 3. Verify.
        verify_passes = 0
        open_tokens = torch.zeros(batch, block, dtype=torch.bool, device=device)  # relaxed: redrawn from a stale context
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
                residual = _without(block_p[rejected_images, at], block_tokens[rejected_images, at])
                block_tokens[rejected_images, at] = sample_from(residual, generator)
                committed = torch.where(first_rejected < block, first_rejected + 1, block)
                if low_row == rows // scale - 1 and bool((committed >= block).all()):
                    break
            else:
                if verify_passes == 1:  # the drafts: relaxed test against q, rejections grown into islands
                    q_x = block_q.gather(-1, block_tokens[..., None])[..., 0] if block_q is not None else None
                    passed = relaxed_accept(block_p, block_tokens, neighbours, config.delta, sampling.greedy,
                                            uniform, q_x)
                    drafted += batch * block
                    accepted += int(passed.sum())
                    redrawn = islands(~passed.view(batch, scale, cols), config.radius).flatten(1)
                    redraw = block_p.clone()
                    if block_q is not None:  # a rejected draft is redrawn from the residual norm(max(0, p - q))
                        residual = (block_p - block_q).clamp(min=0)
                        usable = ~passed & (residual.sum(-1) > 0)
                        redraw[usable] = residual[usable]
                    candidates = redrawn
                else:  # a round: re-test the open tokens as point proposals against p that sees the redrawn ones
                    passed = relaxed_accept(block_p, block_tokens, neighbours, config.delta, sampling.greedy,
                                            uniform)
                    # Only the first rejected open token is redrawn: its p saw final tokens only. Redrawing the
                    # later ones too would update coupled neighbours at once, which oscillates into stripes.
                    rejected_open = open_tokens & ~passed
                    redrawn = rejected_open & (position == _first(rejected_open, block)[:, None])
                    redraw = _without(block_p, block_tokens)
                    candidates = open_tokens
                if redrawn.any():
                    block_tokens[redrawn] = sample_from(redraw[redrawn], generator)  # all islands at once
                    cache_valid = block_start + int(_first(redrawn, block).min())  # the next pass re-feeds from there
                else:
                    cache_valid = block_start + block
                # Up to the first redrawn token, every p saw final tokens only: those tokens are final; after it
                # open tokens keep their stale draws and stay open.
                open_tokens = candidates & (position > _first(redrawn, block)[:, None])
                if open_tokens.any() and verify_passes <= config.rounds:
                    continue  # re-verify the open tokens with the redrawn ones in context
                h_first = out[:, -1:]
                break

        tokens[:, block_start : block_start + block] = block_tokens
        # 4. The drafter continues from the accepted image, not from its own draft.
        accepted_low = downsample_to_drafter(block_tokens.view(batch, scale, cols), backbone, small, scale,
                                             resample, latents)
        committed_low[:, low_row] = accepted_low[:, 0]
        small.rollback(small_state, low_row * small_cols)
        if low_row + 1 < rows // scale:
            small_hidden = small.step(small_state, accepted_low.flatten(1))

    return GenerationResult(tokens.view(batch, rows, cols), forward_passes=passes, drafted_tokens=drafted,
                            accepted_tokens=accepted)
