"""MuLo-SD decoding: a low-resolution drafter proposes r rows at a time; relaxed, local verification.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026), with
LANTERN's relaxed acceptance (Jang et al., 2025). For each low-resolution row j:

1. The drafter (its own KV cache, the backbone's sampling settings, its own
   guidance scale ``drafter_cfg_scale``: 1, no guidance, by default, because it
   was distilled from the backbone's guided samples) generates the ``cols / r``
   tokens of low-res row j.
2. The training-free upsampler (decode/mulo_resampling.py, the drafter's ``resample``: tokens ->
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

import torch

from backbones.base import ARImageBackbone, Condition, DecodeState
from decode.method import MethodSpec
from decode.mulo_resampling import (
    UPSAMPLE_MODES,
    block_proposals,
    downsample_to_drafter,
    resampling_latents,
    upsample_block,
)
from decode.passes import verification_pass, write_block_states
from decode.result import GenerationResult
from decode.rules import (
    accept_drafts,
    first_true,
    island_redraw_distributions,
    islands,
    latent_neighbours,
    point_residual,
    probability_of,
    relaxed_accept,
)
from decode.sampling import SamplingConfig, sample_from, token_distribution
from heads.mulo import MuLoDrafter


@dataclass(frozen=True)
class MuLoDecodeConfig:
    """How MuLo-SD verifies (see the module docstring)."""

    mode: Literal["relaxed", "exact"] = "relaxed"
    k: int = 4  # codebook neighbours pooled by relaxed acceptance
    delta: float = 0.2  # pooled probability budget; 0 = standard acceptance
    radius: int = 1  # rho: rejected tokens grow by this many cells before islands are resampled
    upsample_mode: str = "nearest"  # interpolation of the upsampler (in pixel or latent space, per the drafter)
    rounds: int = (
        0  # relaxed: re-verification passes per block after resampling its islands (a block costs <= rounds + 1)
    )
    proposal: Literal["drafter", "point"] = "drafter"  # relaxed: q(x) of a draft (see the module docstring)
    # The drafter is distilled from the backbone's guided samples, so its conditional model already is the
    # guided distribution; guiding it again over-sharpens its drafts (measured: README). 1.0: no unconditional twin.
    drafter_cfg_scale: float = 1.0

    def __post_init__(self):
        if self.mode not in ("relaxed", "exact"):
            raise ValueError(f"MuLo mode must be 'relaxed' or 'exact', got {self.mode!r}")
        if self.proposal not in ("drafter", "point"):
            raise ValueError(f"MuLo proposal must be 'drafter' or 'point', got {self.proposal!r}")
        if self.upsample_mode not in UPSAMPLE_MODES:
            raise ValueError(
                f"MuLo upsample_mode must be one of {', '.join(UPSAMPLE_MODES)}, got {self.upsample_mode!r}"
            )
        if self.drafter_cfg_scale < 0:
            raise ValueError(f"MuLo drafter_cfg_scale must be >= 0, got {self.drafter_cfg_scale}")
        if self.delta > 1:  # a probability budget: above 1 every draft passes
            raise ValueError(f"MuLo delta must be in [0, 1], got {self.delta}")
        if self.k < 0 or self.delta < 0 or self.radius < 0 or self.rounds < 0:
            raise ValueError(
                f"MuLo k, delta, radius and rounds must be >= 0, got {self.k}, {self.delta}, "
                f"{self.radius}, {self.rounds}"
            )


@dataclass
class _MuLoSetup:
    """What every block of one generation uses."""

    backbone: ARImageBackbone
    small: ARImageBackbone  # the drafter's low-resolution model
    state: DecodeState  # the backbone's cache
    small_state: DecodeState  # the drafter's cache
    sampling: SamplingConfig
    drafter_sampling: SamplingConfig  # the drafter's own guidance (MuLoDecodeConfig.drafter_cfg_scale)
    config: MuLoDecodeConfig
    generator: torch.Generator | None
    scale: int
    resample: str  # "pixels" or "latents" (decode/mulo_resampling.py)
    latents: torch.Tensor | None  # (V, D) the latent resampler's codebook
    neighbours: torch.Tensor | None  # (V, k) relaxed acceptance's codebook neighbours
    use_drafter_q: bool  # relaxed drafts are verified against the drafter's q (else as point proposals)


@dataclass
class MuLoProgress:
    """What one generation carries from block to block (B images)."""

    tokens: torch.Tensor  # (B, rows * cols) the image so far
    committed_low: torch.Tensor  # (B, rows / r, cols / r) the accepted image, downsampled
    first_state: torch.Tensor  # (G, 1, H) predicts the next block's first token
    small_hidden: torch.Tensor  # the drafter's state after the committed low-res rows
    cache_valid: int = 0  # grid positions whose cache entries are final for every image
    passes: int = 1  # backbone passes, the prefill included
    drafted: int = 0
    accepted: int = 0


@dataclass
class MuLoBlock:
    """The block of r backbone rows being verified."""

    index: int  # its low-res row
    start: int  # its first grid position
    tokens: torch.Tensor  # (B, r * cols) drafts, redrawn in place
    q: torch.Tensor | None  # (B, r * cols, V) each draft's proposal (None: point proposals)
    states: torch.Tensor  # (G, r * cols, H): states[:, i] predicts block position i
    committed: torch.Tensor  # (B,) exact mode: the final prefix per image
    open_tokens: torch.Tensor  # (B, r * cols) relaxed: redrawn from a stale context, re-tested by rounds
    passes: int = 0


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
    setup, run = _set_up(backbone, drafter, condition, sampling, generator, config)
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    for index in range(rows // setup.scale):
        block = _draft_block(setup, run, index)  # steps 1-2: a low-res row, upsampled to r rows
        verify = _verify_exact if config.mode == "exact" else _verify_relaxed
        while not verify(setup, run, block):  # step 3: one pass, its verdict, the redraws
            pass
        _commit_block(setup, run, block)  # step 4: the drafter continues from the accepted image
    return GenerationResult(
        run.tokens.view(-1, rows, cols),
        forward_passes=run.passes,
        drafted_tokens=run.drafted,
        accepted_tokens=run.accepted,
    )


def _set_up(backbone, drafter: MuLoDrafter, condition, sampling, generator, config) -> tuple[_MuLoSetup, MuLoProgress]:
    """Prefill both models and prepare what the blocks share."""
    small: ARImageBackbone = drafter.bind(backbone)
    resample = drafter.config.resample
    latents = resampling_latents(backbone) if resample == "latents" else None  # (V, D), once per call
    state, first_state = backbone.prefill(condition, sampling.guided)
    # The drafter samples with its own guidance scale (see MuLoDecodeConfig.drafter_cfg_scale).
    drafter_sampling = replace(sampling, cfg_scale=config.drafter_cfg_scale)
    small_state, small_hidden = small.prefill(condition, drafter_sampling.guided)
    # Only relaxed acceptance pools over codebook neighbours; exact mode needs no codebook.
    neighbours = latent_neighbours(backbone.codebook_latents(), config.k) if config.mode == "relaxed" else None
    # Exact mode keeps point proposals: a token copied r x r times is not an independent draw from q.
    use_drafter_q = config.mode == "relaxed" and config.proposal == "drafter" and not sampling.greedy
    setup = _MuLoSetup(
        backbone,
        small,
        state,
        small_state,
        sampling,
        drafter_sampling,
        config,
        generator,
        drafter.config.scale,
        resample,
        latents,
        neighbours,
        use_drafter_q,
    )
    rows, cols, batch, device = backbone.geometry.rows, backbone.geometry.cols, condition.batch_size, first_state.device
    run = MuLoProgress(
        tokens=torch.empty(batch, rows * cols, dtype=torch.long, device=device),
        committed_low=torch.empty(batch, rows // setup.scale, small.geometry.cols, dtype=torch.long, device=device),
        first_state=first_state,
        small_hidden=small_hidden,
    )
    return setup, run


def _draft_block(setup: _MuLoSetup, run: MuLoProgress, index: int) -> MuLoBlock:
    """Steps 1-2: the drafter's low-res row, token by token through its own cache, upsampled to r rows."""
    small, sampling = setup.small, setup.drafter_sampling
    low_tokens, low_q = [], []
    for column in range(small.geometry.cols):
        scores = small.scores(setup.small_state, run.small_hidden[:, -1:], sampling.cfg_scale)
        low_q.append(token_distribution(scores, sampling))  # (B, 1, V)
        low_tokens.append(sample_from(low_q[-1], setup.generator))  # (B, 1)
        if column + 1 < small.geometry.cols:
            run.small_hidden = small.step(setup.small_state, low_tokens[-1])
    low_row = torch.cat(low_tokens, dim=1)  # (B, cols / r)
    tokens = upsample_block(
        low_row,
        run.committed_low[:, :index],
        small,
        setup.backbone,
        setup.scale,
        setup.config.upsample_mode,
        setup.resample,
        setup.latents,
    ).flatten(1)  # (B, r * cols)
    q = block_proposals(low_row, torch.cat(low_q, dim=1), tokens, setup.scale) if setup.use_drafter_q else None
    batch, size = tokens.shape
    states = run.first_state.new_zeros(run.first_state.shape[0], size, run.first_state.shape[-1])
    states[:, 0] = run.first_state[:, 0]
    return MuLoBlock(
        index,
        index * size,
        tokens,
        q,
        states,
        torch.zeros(batch, dtype=torch.long, device=tokens.device),
        torch.zeros(batch, size, dtype=torch.bool, device=tokens.device),
    )


def _pass(setup: _MuLoSetup, run: MuLoProgress, block: MuLoBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3's pass over the block (after the committed tokens the cache lacks): (states, p (B, L, V), uniforms)."""
    size = block.tokens.shape[1]
    block.passes += 1
    out = verification_pass(
        setup.backbone, setup.state, run.tokens, run.cache_valid, block.start, block.tokens, block.start + size
    )
    run.passes += 1
    write_block_states(block.states, out, run.cache_valid, block.start, block.start + size)
    p = token_distribution(setup.backbone.scores(setup.state, block.states, setup.sampling.cfg_scale), setup.sampling)
    uniform = torch.rand(block.tokens.shape, generator=setup.generator, device=p.device)
    return out, p, uniform


def _verify_exact(setup: _MuLoSetup, run: MuLoProgress, block: MuLoBlock) -> bool:
    """``mulo_exact``: prefix acceptance of point proposals, the first rejection from p without the draft.
    True when the block is done."""
    out, p, uniform = _pass(setup, run, block)
    size = block.tokens.shape[1]
    position = torch.arange(size, device=p.device)[None]
    p_of_draft = probability_of(p, block.tokens)
    passed = accept_drafts(p_of_draft, torch.ones_like(p_of_draft), uniform) | (position < block.committed[:, None])
    first_rejected = first_true(~passed, size)
    open_images = block.committed < size
    run.drafted += int(((size - block.committed) * open_images).sum())
    run.accepted += int(((first_rejected - block.committed) * open_images).sum())
    run.cache_valid = block.start + int(first_rejected.min())
    rejected_images = torch.nonzero(first_rejected < size)[:, 0]
    if len(rejected_images) == 0:
        run.first_state = out[:, -1:]
        run.cache_valid = block.start + size
        return True
    at = first_rejected[rejected_images]
    correction = point_residual(p[rejected_images, at], block.tokens[rejected_images, at])
    block.tokens[rejected_images, at] = sample_from(correction, setup.generator)
    block.committed = torch.where(first_rejected < size, first_rejected + 1, size)
    last_block = block.index == run.committed_low.shape[1] - 1
    return last_block and bool((block.committed >= size).all())  # no next block needs the state after it


def _verify_relaxed(setup: _MuLoSetup, run: MuLoProgress, block: MuLoBlock) -> bool:
    """``mulo``: relaxed acceptance, rejections grown into islands redrawn in parallel, then ``rounds`` passes
    that re-test the tokens redrawn from a stale context, in raster order. True when the block is done."""
    out, p, uniform = _pass(setup, run, block)
    config, size = setup.config, block.tokens.shape[1]
    position = torch.arange(size, device=p.device)[None]
    if block.passes == 1:  # the drafts: relaxed test against q, rejections grown into islands
        q_of_draft = probability_of(block.q, block.tokens) if block.q is not None else None
        passed = relaxed_accept(
            p, block.tokens, setup.neighbours, config.delta, setup.sampling.greedy, uniform, q_of_draft
        )
        run.drafted += block.tokens.numel()
        run.accepted += int(passed.sum())
        redrawn = islands(~passed.view(len(passed), setup.scale, -1), config.radius).flatten(1)
        redraw = island_redraw_distributions(p, block.q, passed, redrawn)
        candidates = redrawn
    else:  # a round: re-test the open tokens as point proposals against p that sees the redrawn ones
        passed = relaxed_accept(p, block.tokens, setup.neighbours, config.delta, setup.sampling.greedy, uniform)
        # Only the first rejected open token is redrawn: its p saw final tokens only. Redrawing the later
        # ones too would update coupled neighbours at once, which oscillates into stripes.
        rejected_open = block.open_tokens & ~passed
        redrawn = rejected_open & (position == first_true(rejected_open, size)[:, None])
        redraw = point_residual(p[redrawn], block.tokens[redrawn])
        candidates = block.open_tokens
    first_redrawn = first_true(redrawn, size)
    if redrawn.any():
        block.tokens[redrawn] = sample_from(redraw, setup.generator)  # all islands at once
        run.cache_valid = block.start + int(first_redrawn.min())  # the next pass re-feeds from there
    else:
        run.cache_valid = block.start + size
    # Up to the first redrawn token every p saw final tokens only: those tokens are final; after it open
    # tokens keep their stale draws and stay open.
    block.open_tokens = candidates & (position > first_redrawn[:, None])
    if block.open_tokens.any() and block.passes <= config.rounds:
        return False  # re-verify the open tokens with the redrawn ones in context
    run.first_state = out[:, -1:]
    return True


def _commit_block(setup: _MuLoSetup, run: MuLoProgress, block: MuLoBlock) -> None:
    """Step 4: write the block; the drafter's cache gets the accepted image downsampled instead of its draft."""
    size = block.tokens.shape[1]
    run.tokens[:, block.start : block.start + size] = block.tokens
    small, scale = setup.small, setup.scale
    accepted_low = downsample_to_drafter(
        block.tokens.view(len(block.tokens), scale, -1), setup.backbone, small, scale, setup.resample, setup.latents
    )
    run.committed_low[:, block.index] = accepted_low[:, 0]
    small.rollback(setup.small_state, block.index * small.geometry.cols)
    if block.index + 1 < run.committed_low.shape[1]:
        run.small_hidden = small.step(setup.small_state, accepted_low.flatten(1))


def _generate(backbone, drafter, condition, sampling, generator, settings: MuLoDecodeConfig) -> GenerationResult:
    return generate_mulo(backbone, drafter, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=MuLoDecodeConfig,
    artefact="drafter",
    artefact_kind="mulo",
    lossless=lambda settings: settings.mode == "exact",
)
