"""Lossless MuLo-SD (`mulo_exact`) with ragged frontiers and continuous batching: every image drafts its blocks and
verifies them from its own frontier, in shared passes, and an image that is done hands its slot to the next of the
queue.

decode/mulo.py verifies a block for the whole batch: all images work on the same block, an image that has its block
re-feeds it until the others have theirs, so at batch 16 a block costs what its slowest image needs (450 passes per
image against 276 alone, docs/results.md). Here, per round:

1. each image whose frontier reached a new block drafts it: the drafter's cache gets the image's last committed
   low-resolution row (one ragged drafter pass), then the drafter samples the block's low-res row token by token
   (ragged steps on a scratch copy of the drafting images' cache rows only: a drafter step costs what a backbone
   step does, and images reach new blocks at different rounds), and the upsampler turns it into ``r`` backbone rows
   (decode/mulo_resampling.py; interpolating modes read the image's own committed low-res rows above);
2. one ragged backbone pass (`ARImageBackbone.step_ragged`) feeds each image from its last final token over its
   next ``window`` open positions, or to its block's end (point proposals: drafts and drafts kept from earlier
   rounds); the window only changes which positions a pass verifies, so exactness and batch independence hold
   for any window;
3. each image's open positions are tested left to right as `mulo_exact` tests them: a point proposal x passes
   with probability p(x); at the first rejection the token is drawn from p without x (`rules.point_residual`) and
   the rest of the block is tested again next round, against a pass that sees the correction;
4. a finished block is downsampled into the image's committed low-res rows (what its drafter continues from); a
   finished image leaves its slot to the next condition of the queue (the backbone's prompt through
   `decode.conditions.PromptQueue`, the drafter's by its own prefill), and once the queue is empty finished slots
   leave both batches (decode/drain.py).

Exactness, image by image: each token is judged against the backbone's distribution given the image's own final
tokens before it (the ragged pass gives each image the states `step` would give it alone), with a uniform no
decision has read (keyed by the image's seed, the position and how many times it was tested), and a rejected point
proposal is replaced by a draw from p without it: the prefix acceptance of decode/mulo.py, so greedy output is
greedy AR's and sampled output has the backbone's distribution.

Randomness: every draw of an image (its drafter's tokens, its tests, its residuals) is keyed by its seed and the
event (`decode.sampling.keyed_uniforms`), so an image gets the same tokens whatever images share its batch, how many
slots there are and when it enters (bit-identical where the backbone's batched pass is; a batch's shape can round a
float32 sum otherwise, which flips a token only at a near-tie). This is not decode/mulo.py's stream: the same seed
gives other images than the batched `mulo_exact`, from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backbones.base import ARImageBackbone, Condition
from backbones.kv_cache import copy_rows
from decode.conditions import PromptQueue, condition_rows, refill_slots
from decode.drain import drain_finished
from decode.method import MethodSpec
from decode.mulo import MuLoDecodeConfig
from decode.mulo_resampling import downsample_to_drafter, resampling_latents, upsample_block
from decode.result import GenerationResult
from decode.rules import first_true, point_residual, probability_of
from decode.sampling import SamplingConfig, image_seeds, keyed_uniforms, sample_with, token_distribution
from heads.mulo import MuLoDrafter

_DRAFT, _TEST, _RESIDUAL = 0, 1, 2  # what a keyed uniform is for


@dataclass(frozen=True)
class RaggedMuLoConfig:
    """`mulo_exact`'s settings (decode/mulo.py) and how many images are decoded at once."""

    upsample_mode: str = "nearest"  # interpolation of the upsampler (in pixel or latent space, per the drafter)
    drafter_cfg_scale: float = 1.0  # the drafter's own guidance (1.0: none; it is distilled from guided samples)
    # positions verified per image and pass, from its frontier (0: to its block's end). A pass costs compute per
    # token fed (a CPU, large batches), and past the first rejection a pass's verdicts are thrown away.
    window: int = 0
    slots: int = 0  # images decoded at once (continuous batching over the queue); 0: all the conditions
    # once the queue is empty, drop finished images' slots when at most this share still decodes (decode/drain.py;
    # 0: never)
    drain: float = 0.75

    def __post_init__(self):
        MuLoDecodeConfig(mode="exact", upsample_mode=self.upsample_mode, drafter_cfg_scale=self.drafter_cfg_scale)
        if self.slots < 0 or self.window < 0:
            raise ValueError(
                f"ragged MuLo needs slots >= 0 (0: all the conditions) and window >= 0 (0: to the block's end), got "
                f"{self.slots} and {self.window}"
            )
        if not 0 <= self.drain < 1:
            raise ValueError(f"ragged MuLo drain must be in [0, 1) (0: never drain), got {self.drain}")


class _Slots:
    """Per slot: its image (-1: empty), seed, tokens (final before `frontier`, the current block's drafts after it),
    committed low-res rows, how often each position was tested, and the prefill's state predicting its first token
    (one per cache row)."""

    def __init__(self, backbone: ARImageBackbone, small: ARImageBackbone, slots: int, first: torch.Tensor):
        device, total = first.device, backbone.geometry.num_tokens
        self.image = torch.arange(slots, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, total, dtype=torch.long, device=device)
        self.low = torch.zeros(slots, small.geometry.rows, small.geometry.cols, dtype=torch.long, device=device)
        self.frontier = torch.zeros(slots, dtype=torch.long, device=device)
        self.attempts = torch.zeros(slots, total, dtype=torch.long, device=device)
        self.first = first[:, -1].clone()  # (cache rows, H)


@torch.inference_mode()
def generate_mulo_ragged(
    backbone: ARImageBackbone,
    drafter: MuLoDrafter,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedMuLoConfig = RaggedMuLoConfig(),
) -> GenerationResult:
    """Generate one image per condition by lossless MuLo-SD blocks over ``config.slots`` slots (module docstring).
    ``forward_passes`` counts the backbone's passes (ragged passes and prefills)."""
    small: ARImageBackbone = drafter.bind(backbone)
    scale, resample = drafter.config.scale, drafter.config.resample
    latents = resampling_latents(backbone) if resample == "latents" else None
    drafter_sampling = replace(sampling, cfg_scale=config.drafter_cfg_scale)
    count, total, cols = condition.batch_size, backbone.geometry.num_tokens, backbone.geometry.cols
    size, low_cols = scale * cols, small.geometry.cols  # a block: r backbone rows, one low-res row
    slots = min(config.slots or count, count)
    seeds = image_seeds(count, generator)
    state, first = backbone.prefill(condition_rows(condition, list(range(slots))), sampling.guided)
    small_state, small_first = small.prefill(condition_rows(condition, list(range(slots))), drafter_sampling.guided)
    small_first = small_first[:, -1].clone()  # (drafter cache rows, H): predicts each image's first low-res token
    device = first.device
    run = _Slots(backbone, small, slots, first)
    run.seed = seeds[:slots].to(device)
    output = torch.zeros(count, total, dtype=torch.long, device=device)
    queue = PromptQueue(backbone, condition, range(slots, count), sampling.guided, ahead=slots)
    counts = {"passes": 1, "drafted": 0, "accepted": 0, "drains": 0, "window_passes": 0}

    def draft_blocks(active: torch.Tensor) -> None:
        """Step 1 for the images whose frontier is at a block's start. Every round moves an active image's frontier
        by at least one position (a kept draft or a residual draw), so it is there once per block: its first
        round in the block."""
        block = run.frontier // size
        need = active & (run.frontier % size == 0)
        if not bool(need.any()):
            return
        hidden = small_first[:, None]  # (rows, 1, H): the state before an image's first low-res row
        if bool((need & (block > 0)).any()):  # the last committed low-res row goes into the drafter's cache
            previous = (block - 1).clamp(min=0)  # other images re-feed a committed row (the same entries)
            committed = run.low[torch.arange(len(block), device=device), previous]
            fed = small.step_ragged(small_state, committed, previous * low_cols)
            after_first = (block > 0).repeat(hidden.shape[0] // len(block))
            hidden = torch.where(after_first[:, None, None], fed[:, -1:], hidden)
        # The low-res rows are drafted on a scratch copy of the drafting images' cache rows: a drafter step costs
        # what a backbone step does, and the drafts it writes are never read again (a finished block's accepted
        # row replaces them above).
        images = torch.nonzero(need)[:, 0]
        rows = small_state.rows_of(images)
        scratch = replace(
            small_state,
            cache=copy_rows(small_state.cache, rows),
            batch_size=len(images),
            extras={key: value.index_select(0, rows.to(value.device)) for key, value in small_state.extras.items()},
        )
        hidden, start, seed = hidden[rows], block[images] * low_cols, run.seed[images]
        low_row = []
        for column in range(low_cols):
            q = token_distribution(small.scores(scratch, hidden, drafter_sampling.cfg_scale), drafter_sampling)
            low_row.append(sample_with(q[:, 0], keyed_uniforms(seed, start + column, _DRAFT)))
            if column + 1 < low_cols:
                hidden = small.step_ragged(scratch, low_row[-1][:, None], start + column)
        low_row = torch.stack(low_row, dim=1)  # (k, w)
        for index in block[images].unique().tolist():  # interpolating upsamplers read the low-res rows above
            group = torch.nonzero(block[images] == index)[:, 0]
            drafts = upsample_block(
                low_row[group],
                run.low[images[group], :index],
                small,
                backbone,
                scale,
                config.upsample_mode,
                resample,
                latents,
            )
            run.tokens[images[group], index * size : (index + 1) * size] = drafts.flatten(1)

    while bool((run.image >= 0).any()):
        active = run.image >= 0
        draft_blocks(active)
        frontier = torch.where(active, run.frontier, 0)
        block_end = (frontier // size + 1) * size
        verify_end = torch.minimum(block_end, frontier + config.window) if config.window else block_end
        start = (frontier - 1).clamp(min=0)  # from the last final token (the prefill's state before token 0)
        width = int((verify_end - start)[active].max())  # each image's open positions: frontier .. verify_end - 1
        columns = torch.arange(width, device=device)
        fed = (start[:, None] + columns).clamp(max=total - 1)
        out = backbone.step_ragged(state, run.tokens.gather(1, fed), start)  # out[:, j] predicts start + j + 1
        counts["passes"] += 1
        # states[:, k] predicts frontier + k: the prefill's state first where the frontier is 0.
        shift = (frontier > 0).long().repeat(out.shape[0] // len(frontier))
        extended = torch.cat([run.first[:, None], out], dim=1)
        index = (columns[None] + shift[:, None]).clamp(max=width)
        states = extended.gather(1, index[..., None].expand(-1, -1, out.shape[-1]))
        p = token_distribution(backbone.scores(state, states, sampling.cfg_scale), sampling)  # (B, W, V)
        positions = (frontier[:, None] + columns).clamp(max=total - 1)
        is_open = (frontier[:, None] + columns < verify_end[:, None]) & active[:, None]
        rows = torch.arange(len(frontier), device=device)[:, None].expand_as(positions)
        run.attempts[rows[is_open], positions[is_open]] += 1
        tested = run.attempts.gather(1, positions)
        drafts = run.tokens.gather(1, positions)
        uniform = keyed_uniforms(run.seed[:, None], positions, tested, _TEST)
        rejected_at = first_true(~(uniform < probability_of(p, drafts)) & is_open, none=width)  # point proposals
        opened = is_open.sum(1)
        cut = torch.minimum(rejected_at, opened)
        counts["drafted"] += int(opened.sum())  # every open position is tested: the report's window is drafted / passes
        counts["window_passes"] += int(active.sum())
        counts["accepted"] += int(cut.sum())
        rejected = active & (rejected_at < opened)
        if bool(rejected.any()):
            at = rejected_at[rejected]
            where = positions[rejected, at]
            residual = point_residual(p[rejected, at], drafts[rejected, at])
            run.tokens[rejected, where] = sample_with(
                residual, keyed_uniforms(run.seed[rejected], where, tested[rejected, at], _RESIDUAL)
            )
        run.frontier = torch.where(active, frontier + cut + rejected.long(), run.frontier)
        # Finished blocks go into the drafter's low-res image (it continues from what the backbone accepted).
        closed = torch.nonzero(active & (run.frontier == block_end))[:, 0]
        if len(closed):
            block = block_end[closed] // size - 1
            pieces = torch.stack(
                [run.tokens[b, i * size : (i + 1) * size] for b, i in zip(closed.tolist(), block.tolist())]
            )
            low = downsample_to_drafter(
                pieces.view(len(closed), scale, cols), backbone, small, scale, resample, latents
            )
            run.low[closed, block] = low[:, 0]
        finished = torch.nonzero(active & (run.frontier >= total))[:, 0]
        if len(finished):
            output[run.image[finished]] = run.tokens[finished]
            refill, images, fresh_first, prefilled = refill_slots(backbone, state, queue, finished)
            counts["passes"] += int(prefilled)
            if len(refill):
                small_fresh, small_fresh_first = small.prefill(
                    condition_rows(condition, images.tolist()), drafter_sampling.guided
                )
                small.replace_images(small_state, refill, small_fresh)
                small_first[small_state.rows_of(refill)] = small_fresh_first[:, -1]
                run.first[state.rows_of(refill)] = fresh_first[:, -1]
                run.image[refill], run.seed[refill] = images, seeds[images.to(seeds.device)].to(device)
                run.frontier[refill], run.attempts[refill] = 0, 0
            run.image[finished[len(refill) :]] = -1
            if config.drain and not len(queue):  # the queue is dry: finished slots leave both batches
                small_rows = small_state.rows_of(torch.nonzero(run.image >= 0)[:, 0])
                kept = drain_finished(backbone, state, run.image >= 0, [run], config.drain)
                if kept is not None:
                    small_first = small_first.index_select(0, small_rows)
                    small.keep_images(small_state, kept)
                    counts["drains"] += 1
    rows = backbone.geometry.rows
    return GenerationResult(
        output.view(count, rows, cols),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        extras={"drains": counts["drains"], "window_sum": counts["drafted"], "window_passes": counts["window_passes"]},
    )


def _generate(backbone, drafter, condition, sampling, generator, settings: RaggedMuLoConfig) -> GenerationResult:
    return generate_mulo_ragged(backbone, drafter, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=RaggedMuLoConfig,
    artefact="drafter",
    artefact_kind="mulo",
    lossless=lambda settings: True,
    continuous=True,
)
