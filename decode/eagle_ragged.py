"""EAGLE with ragged frontiers and continuous batching: every image drafts and verifies its own chain from its
own frontier, in one shared head call per chain step and one shared backbone pass per round.

decode/eagle.py batches like SJD: a pass starts at the slowest image's last committed token and an image ahead
re-feeds its committed tokens, so at batch 16 every image pays for the slowest one's position. Here, per round:

1. the head catches up, per image, on the positions whose backbone states became final (their true states and
   tokens, from the image's own head-cache frontier: a ragged call over the head's cache rows);
2. it drafts a chain of ``depth`` tokens from each image's frontier (one ragged head call per step);
3. one ragged backbone pass (`ARImageBackbone.step_ragged`) feeds each image its last committed token and its
   chain; left to right, accept x with ``min(1, p(x) / q(x))``, at the first rejection draw from
   ``norm(max(0, p - q))``, and if every draft passes the pass's last state gives one more token;
4. an image that is done leaves its slot to the next condition of the queue.

Cost-aware depth (``depth: auto``): before each round the generator picks the chain depth ``d`` (1 ..
``max_depth``) that maximises the expected committed tokens per second: ``1 + sum_{k<=d} prod_{j<=k} a_j`` per
image, ``a_j`` the acceptance of the chain's j-th draft measured so far (drafts that the test reached; a prior of
0.7 with 8 pseudo-counts), over the round's cost: a ragged pass of ``d + 1`` tokens per image measured at start-up
at this batch size (`decode.pass_cost.ragged_pass_seconds`), ``d`` head steps and the rest of a round, both
measured as the generation runs. The depth only decides how many drafts are made and tested, from what happened
before the round, so the method stays exact; but an image's drafts then depend on the depths chosen (a draft of a
position made after a shorter chain is a new draw from other head states), so its tokens depend on its batch.
With a fixed depth they do not.

Exact for the reasons decode/eagle.py is: each image's tokens come from speculative sampling of its own drafts
against its own target states (the states `step` would give it alone). Uniforms are keyed per image and event
(`decode.sampling.keyed_uniforms`), so an image's tokens do not depend on the images beside it or on the
number of slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition
from backbones.hf_loading import positional_arguments
from backbones.kv_cache import ragged_slots, writing_at
from decode.conditions import PromptQueue, condition_rows, refill_slots
from decode.drain import drain_finished
from decode.method import MethodSpec
from decode.pass_cost import ragged_pass_seconds
from decode.result import GenerationResult
from decode.rules import judge_chains
from decode.sampling import SamplingConfig, image_seeds, keyed_uniforms, sample_with, token_distribution
from decode.sjd import AcceptRule, speculative_accept
from heads.eagle import EagleHead

_DRAFT, _TEST, _RESIDUAL, _TARGET = 0, 1, 2, 3  # what a keyed uniform is for


@dataclass(frozen=True)
class RaggedEagleConfig:
    """How long a chain each image drafts per round, and how many images are decoded at once."""

    depth: int | Literal["auto"] = 6  # drafts per image and pass (decode/eagle.py's default); auto: by cost
    slots: int = 0  # images decoded at once (continuous batching over the queue); 0: all the conditions
    max_depth: int = 8  # depth auto: the longest chain it may choose
    # once the queue is empty, drop finished images' slots when at most this share still decodes (decode/drain.py;
    # 0: never)
    drain: float = 0.75

    def __post_init__(self):
        depth_ok = self.depth == "auto" or (isinstance(self.depth, int) and self.depth >= 1)
        if not depth_ok or self.slots < 0 or self.max_depth < 1:
            raise ValueError(
                f"ragged EAGLE needs depth >= 1 or 'auto', slots >= 0 and max_depth >= 1, got {self.depth!r}, "
                f"{self.slots} and {self.max_depth}"
            )
        if not 0 <= self.drain < 1:
            raise ValueError(f"ragged EAGLE drain must be in [0, 1) (0: never drain), got {self.drain}")


def _head_step(head: EagleHead, cache, states, embeddings, starts: torch.Tensor, capacity: int) -> torch.Tensor:
    """A ragged call of the head: row r's inputs (states, embeddings) (rows, T, ...) at head-cache slots
    ``starts[r] ..`` (the grid positions they stand for), each seeing its row's slots up to its own."""
    slots, attend, visible = ragged_slots(cache, starts, states.shape[1], capacity)
    positional = positional_arguments(states.shape[0], slots, visible, slots.clamp(max=capacity - 1))
    with writing_at(cache, slots, attend):
        return head(states.to(head.fc.weight.dtype), embeddings.to(head.fc.weight.dtype), cache, **positional)


class _Chains:
    """The images being decoded, per slot (B slots, G = twins * B rows): its image and seed, its tokens so far, the
    backbone's true states of its committed positions, how many drafts each position had, its frontier and how far
    the head's cache holds true inputs. `drain.drain_finished` keeps the rows of every tensor here."""

    def __init__(self, slots: int, total: int, first: torch.Tensor, seeds: torch.Tensor):
        device = first.device
        self.image = torch.arange(slots, device=device)  # -1: empty
        self.seed = seeds[:slots].to(device)
        self.tokens = torch.zeros(slots, total, dtype=torch.long, device=device)
        self.true_states = first.new_zeros(first.shape[0], total + 1, first.shape[-1])  # [:, i] predicts token i
        self.attempts = torch.zeros(slots, total + 1, dtype=torch.long, device=device)  # drafts each position had
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)
        self.head_cached = torch.zeros(slots, dtype=torch.long, device=device)  # head entries from true inputs

    @property
    def active(self) -> torch.Tensor:
        return self.image >= 0

    @property
    def slots(self) -> int:
        return self.image.shape[0]

    @property
    def twins(self) -> int:
        """Cache rows per image: 2 under guidance (conditional and unconditional), else 1."""
        return self.true_states.shape[0] // self.slots


@torch.inference_mode()
def generate_eagle_ragged(
    backbone: ARImageBackbone,
    head: EagleHead,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedEagleConfig = RaggedEagleConfig(),
    accept: AcceptRule = speculative_accept,
) -> GenerationResult:
    """Generate one image per condition by ragged EAGLE chains over ``config.slots`` slots (module docstring).

    ``forward_passes`` counts every backbone pass (ragged passes and the prefills that start images). `accept`
    tests the drafts, ``accept(p, q, drafts, uniforms)`` as decode/eagle.py's (LANTERN's relaxed test:
    decode/lantern_ragged.py).
    """
    count = condition.batch_size
    slots = min(config.slots or count, count)
    total = backbone.geometry.num_tokens
    seeds = image_seeds(count, generator)
    state, first = backbone.prefill(condition_rows(condition, list(range(slots))), sampling.guided)
    device = first.device
    run = _Chains(slots, total, first, seeds)
    cache = head.new_cache()
    output = torch.zeros(count, total, dtype=torch.long, device=device)
    queue = PromptQueue(backbone, condition, range(slots, count), sampling.guided, ahead=slots)
    longest = config.max_depth if config.depth == "auto" else config.depth
    counts = {"passes": 1, "drafted": 0, "accepted": 0, "window_sum": 0, "window_passes": 0, "drains": 0}
    counts |= {f"{kind}_at_draft_step_{j + 1}": 0 for j in range(longest) for kind in ("drafted", "accepted")}
    chooser = _DepthChooser(backbone, state, slots, sampling.guided, longest) if config.depth == "auto" else None
    draft_scorer = backbone.draft_scorer(state, sampling.cfg_scale)

    _start(backbone, state, sampling, run, torch.arange(slots, device=device), first)
    while bool(run.active.any()):
        round_began = time.perf_counter()
        frontier = torch.where(run.active, run.committed, 1)  # an empty slot drafts at position 1 and is ignored
        predicted = _catch_up(backbone, head, cache, run, frontier)
        depth = min(chooser.choose() if chooser else config.depth, total - int(frontier.min()))
        chain_began = time.perf_counter()
        chain, q = _draft_chain(backbone, head, cache, sampling, draft_scorer, run, frontier, predicted, depth)
        chain_seconds = time.perf_counter() - chain_began
        reached_by_step, kept_by_step = _verify(backbone, state, sampling, accept, run, frontier, chain, q, counts)
        if chooser:
            chooser.observe(time.perf_counter() - round_began, chain_seconds, depth, reached_by_step, kept_by_step)
        # Images that are done: written out, their slots to the next of the queue.
        done = torch.nonzero(run.active & (run.committed >= total))[:, 0]
        if len(done):
            output[run.image[done]] = run.tokens[done]
            refill, images, fresh_first, prefilled = refill_slots(backbone, state, queue, done)
            counts["passes"] += int(prefilled)
            if len(refill):
                run.image[refill], run.seed[refill] = images, seeds[images.to(seeds.device)].to(device)
                _start(backbone, state, sampling, run, refill, fresh_first)
            run.image[done[len(refill) :]] = -1
            run.head_cached[done[len(refill) :]] = 0  # an empty slot catches up on position 0 only
            if config.drain and not len(queue):  # the queue is dry: finished slots leave the batch
                slots_before = run.slots
                kept = drain_finished(backbone, state, run.active, [run], config.drain, caches=(cache,))
                if kept is not None:
                    if chooser:
                        chooser.rescale(len(kept) / slots_before)
                    counts["drains"] += 1
    return GenerationResult(
        output.view(count, backbone.geometry.rows, backbone.geometry.cols),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        extras={k: v for k, v in counts.items() if k not in ("passes", "drafted", "accepted")},
    )


def _start(backbone: ARImageBackbone, state, sampling: SamplingConfig, run: _Chains, rows, first_states) -> None:
    """Slots `rows` start their images: the state after the prompt (`first_states`, their cache rows) gives
    each its first token, drawn from the backbone with the image's own keyed uniform."""
    run.true_states[state.rows_of(rows)] = 0
    run.true_states[state.rows_of(rows), 0] = first_states[:, 0]
    run.attempts[rows] = 0
    run.head_cached[rows] = 0
    p = token_distribution(backbone.scores(state, first_states, sampling.cfg_scale), sampling)[:, 0]
    zero = torch.zeros_like(rows)
    run.tokens[rows, 0] = sample_with(p, keyed_uniforms(run.seed[rows], zero, zero, _TARGET))
    run.committed[rows] = 1


def _catch_up(backbone: ARImageBackbone, head: EagleHead, cache, run: _Chains, frontier) -> torch.Tensor:
    """The head catches up on each image's positions [head_cached, frontier) with their true states and tokens
    (one ragged head call); returns its prediction of the state at each frontier (G, 1, H)."""
    total, twins = backbone.geometry.num_tokens, run.twins
    width = int((frontier - run.head_cached).max())
    positions = (run.head_cached[:, None] + torch.arange(width, device=frontier.device)).clamp(max=total - 1)
    twin_positions = positions.repeat(twins, 1)
    caught = _head_step(
        head,
        cache,
        run.true_states.gather(1, twin_positions[..., None].expand(-1, -1, run.true_states.shape[-1])),
        backbone.embed_image_tokens(run.tokens.gather(1, positions)).repeat(twins, 1, 1),
        run.head_cached.repeat(twins),
        total,
    )
    last = (frontier - 1 - run.head_cached).repeat(twins)
    run.head_cached = frontier.clone()
    return caught[torch.arange(caught.shape[0], device=frontier.device), last][:, None]  # predicts `frontier`


def _draft_chain(backbone, head, cache, sampling, draft_scorer, run: _Chains, frontier, predicted, depth: int):
    """Each image's chain of `depth` drafts from its own frontier (a ragged head call per step), each drawn with
    its image's keyed uniform for that position and attempt. Returns the drafts (B, depth) and their q."""
    total, twins, slots = backbone.geometry.num_tokens, run.twins, run.slots
    device = frontier.device
    chain = torch.zeros(slots, depth, dtype=torch.long, device=device)
    q = torch.zeros(slots, depth, backbone.codebook_size, device=device)
    rows = torch.arange(slots, device=device)
    for j in range(depth):
        position = (frontier + j).clamp(max=total)
        q[:, j] = token_distribution(draft_scorer(predicted), sampling)[:, 0]
        run.attempts[rows, position] += 1
        uniform = keyed_uniforms(run.seed, position, run.attempts[rows, position], _DRAFT)
        chain[:, j] = sample_with(q[:, j], uniform)
        if j < depth - 1:
            embedded = backbone.embed_image_tokens(chain[:, j : j + 1]).repeat(twins, 1, 1)
            predicted = _head_step(head, cache, predicted, embedded, (frontier + j).repeat(twins), total)
    return chain, q


def _verify(backbone, state, sampling, accept: AcceptRule, run: _Chains, frontier, chain, q, counts):
    """One ragged pass feeds each image its last committed token and its chain; the chain is tested left to
    right, the residual (or the target after the last kept draft) gives the next token, and the accepted drafts,
    that token and the pass's states whose context is final are committed. Returns the drafts the test reached
    and kept per chain step (depth,)."""
    total, device, depth = backbone.geometry.num_tokens, frontier.device, chain.shape[1]
    twins, active, rows = run.twins, run.active, torch.arange(run.slots, device=device)
    feed = torch.cat([run.tokens.gather(1, (frontier - 1)[:, None]), chain], dim=1)
    out = backbone.step_ragged(state, feed, frontier - 1)  # out[:, k] predicts frontier + k
    counts["passes"] += 1
    p = token_distribution(backbone.scores(state, out, sampling.cfg_scale), sampling)  # (B, depth + 1, V)
    offsets = torch.arange(depth, device=device)
    chain_positions = frontier[:, None] + offsets[None]
    inside = (chain_positions < total) & active[:, None]
    test_uniform = keyed_uniforms(
        run.seed[:, None], chain_positions, run.attempts.gather(1, chain_positions.clamp(max=total)), _TEST
    )
    kept, rejected, reached, correction = judge_chains(accept, p, q, chain, inside, test_uniform)
    reached_by_step, kept_by_step = reached.sum(0), (reached & (offsets[None] < kept[:, None])).sum(0)
    # The report's counts in one read of the device. The kept drafts are a prefix of the reached ones, so the
    # per-step counts sum to reached.sum() and kept.sum().
    drafted, accepted = torch.stack([reached_by_step, kept_by_step]).tolist()
    for j in range(depth):
        counts[f"drafted_at_draft_step_{j + 1}"] += drafted[j]
        counts[f"accepted_at_draft_step_{j + 1}"] += accepted[j]
    counts["drafted"] += sum(drafted)
    counts["accepted"] += sum(accepted)
    counts["window_sum"] += depth
    counts["window_passes"] += 1
    # The next token: the residual at a rejection, the target after the last accepted draft otherwise.
    next_position = frontier + kept
    has_next = active & (next_position < total)
    kind = torch.where(rejected, _RESIDUAL, _TARGET)
    clamped = next_position.clamp(max=total)
    next_token = sample_with(correction, keyed_uniforms(run.seed, clamped, run.attempts[rows, clamped], kind))
    # Commit the accepted drafts and the next token; keep the pass's states whose context is final.
    committed = torch.where(has_next, next_position + 1, torch.where(active, next_position, run.committed))
    write = (offsets[None] < kept[:, None]) & active[:, None]
    run.tokens[rows[:, None].expand_as(chain)[write], chain_positions[write]] = chain[write]
    run.tokens[rows[has_next], next_position[has_next]] = next_token[has_next]
    state_positions = frontier[:, None] + torch.arange(depth + 1, device=device)[None]  # out[:, k]'s
    final = (state_positions < committed[:, None]) & active[:, None]
    twin_final, twin_positions = final.repeat(twins, 1), state_positions.repeat(twins, 1)
    twin_rows = torch.arange(out.shape[0], device=device)[:, None].expand_as(twin_positions)
    run.true_states[twin_rows[twin_final], twin_positions[twin_final]] = out[twin_final]
    run.committed = committed
    return reached_by_step, kept_by_step


class _DepthChooser:
    """Cost-aware chain depth: the depth that maximises the expected committed tokens per second (module doc)."""

    def __init__(self, backbone: ARImageBackbone, state, batch: int, guided: bool, max_depth: int, prior=0.7):
        self.prior, self.prior_weight = prior, 8.0
        # A round feeds the last committed token and d drafts: a pass of d + 1 tokens per image.
        lengths = list(range(2, max_depth + 2))
        self.pass_seconds = torch.tensor(ragged_pass_seconds(backbone, state, batch, guided, lengths))
        self.reached = torch.zeros(max_depth, dtype=torch.float64)
        self.kept = torch.zeros(max_depth, dtype=torch.float64)
        self.step_seconds, self.other_seconds, self.rounds = 0.0, 0.0, 0

    def choose(self) -> int:
        """The depth (1 .. max_depth) of the best expected tokens per second, from what the rounds so far gave."""
        rate = (self.kept + self.prior * self.prior_weight) / (self.reached + self.prior_weight)
        expected = 1 + torch.cumprod(rate, 0).cumsum(0)  # tokens per image at depth 1, 2, ...
        depths = torch.arange(1, len(rate) + 1, dtype=torch.float64)
        seconds = self.pass_seconds.double() + depths * self.step_seconds + self.other_seconds
        return int(torch.argmax(expected / seconds)) + 1

    def rescale(self, fraction: float) -> None:
        """The batch has drained to `fraction` of its slots: passes, head steps and the rest of a round are taken
        to cost that share of what they cost before (a CPU pays per row; a memory-bound GPU pays less than that
        for fewer rows, so there this errs towards deeper chains)."""
        self.pass_seconds *= fraction
        self.step_seconds *= fraction
        self.other_seconds *= fraction

    def observe(self, round_seconds: float, chain_seconds: float, depth: int, reached, kept) -> None:
        """A round's figures: its drafts reached and kept by the test at each chain step, and its wall-clock beyond
        the pass (its chain per head step; the rest: catch-up, testing, committing)."""
        self.reached[:depth] += reached.double().cpu()
        self.kept[:depth] += kept.double().cpu()
        self.rounds += 1
        other = max(0.0, round_seconds - chain_seconds - float(self.pass_seconds[depth - 1]))
        self.step_seconds += (chain_seconds / depth - self.step_seconds) / self.rounds
        self.other_seconds += (other - self.other_seconds) / self.rounds


def _generate(backbone, head, condition, sampling, generator, settings: RaggedEagleConfig) -> GenerationResult:
    return generate_eagle_ragged(backbone, head, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate, settings=RaggedEagleConfig, artefact="heads", artefact_kind="eagle", continuous=True
)
