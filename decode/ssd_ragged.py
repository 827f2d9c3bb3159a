"""SSD with ragged frontiers and continuous batching: every image of a batch verifies its own row, from its own
position, in one shared pass, and an image that is done hands its slot to the next image of the queue.

decode/ssd.py keeps every image of a batch on the same row: a row costs 1 + the most rejections of any image,
so at batch 16 an image waits at each row for the slowest of 16 (173.8 passes per image against 87.7 alone).
Here each of the ``slots`` images has its own frontier:

1. Per pass, image ``b`` feeds grid positions ``[cached_b, end_b)``: the one committed token its cache lacks
   (a correction) and its open drafts up to ``end_b`` (its row's end, or a window). One ragged pass
   (`ARImageBackbone.step_ragged`) gives each image its own target states, exactly the states `step` would
   give it alone.
2. Each image's open drafts are tested left to right against its own target (speculative sampling: accept
   with ``min(1, p/q)``, at the first rejection draw from ``norm(max(0, p - q))``), and the positions after a
   correction are re-drafted by the heads from the exact state, as in decode/ssd.py.
3. An image whose row is final starts its next row at once (vertical head over the finished row; the grid or
   horizontal head along it from the first token, which is drawn from the backbone where the pass gave its
   state and drafted otherwise); an image whose last row is final leaves its slot to the next condition of the
   queue (`ARImageBackbone.replace_images` from the queue's prompts, prefilled up to `slots` at a time in one pass:
   `decode.conditions.PromptQueue`).

Exactness: each image's tokens are produced by the exact speculative-sampling rule applied to its own drafts
and its own target distributions; which positions a pass verifies (the window, the cost model) and when an
image's pass happens only decide how many tests are made, never what is accepted, so every image's output has
the backbone's distribution, and greedy output is greedy AR's. The target states come from the image's own cache
rows, whose slots before ``cached_b`` hold exactly its committed tokens (a slot is final only once its token
is; the mask of a ragged pass hides every later slot).

Randomness: each image's uniforms are keyed by its own seed and the event (grid position, how many drafts that
position has had, what the uniform is for; `decode.sampling.keyed_uniforms`), not drawn in batch order. Drafts
change only after a correction (a window that stops a pass early leaves the drafts after it as they are, and
the next pass tests them with the same uniforms), so an image gets the same tokens whatever images share its
batch, how many slots there are, when it enters and which windows the passes use (bit-identical where the
backbone's batched pass is: float32 results can depend on the batch's shape by rounding, which flips a token
only at a near-tie). The image seeds are a base drawn from the generator plus each condition's index in the queue
(`decode.sampling.image_seeds`: distinct within a queue).

Lookahead (``lookahead``, exact mode): decode/ssd.py's lookahead for ragged frontiers. A pass whose window
reaches an image's row end goes on into the next row's drafts (up to the window; window 0: to that row's end), so
a row that passes whole hands its pass to the next row instead of ending it; where the row passes whole, the next
row's drafts are tested with that pass's states at once (a second test of the same pass). The next row is
drafted before its row above is final, from that row as it stood at its last correction (exact states where they
were known then, the heads' predicted states elsewhere; its first token is a vertical draft, tested like the
others), with uniforms keyed by fixed attempt numbers. That row above and those keys depend on the image's
corrections only, never on the windows or on when a pass looked ahead, so an image keeps the same tokens
whatever its batch; lookahead drafts that a correction made stale (a correction anywhere in the row, its last
column too) are drafted again and never tested with the stale pass. Exact: the drafts of the final version are a
draw from q with uniforms no earlier decision read, and are tested with the exact rule against the image's own
target. ``lookahead_confidence`` looks ahead only where the product of the row's open drafts' q(x) clears it.

Cost-aware windows (``window: auto``): before each pass the generator picks how many open positions per image
the pass verifies, maximising the expected committed tokens per second: each image's expected tokens
``sum_{k<w} a^k`` from its acceptance rate ``a`` measured so far (a prior of 0.85 with 8 pseudo-counts), over
the pass's cost at that length, measured on this machine at start-up at this batch size, plus the drafting time
per pass measured as it runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

from backbones.base import ARImageBackbone, Condition
from decode.conditions import PromptQueue, condition_rows, refill_slots
from decode.drain import drain_finished
from decode.method import MethodSpec
from decode.pass_cost import ragged_pass_seconds
from decode.result import GenerationResult
from decode.rules import accept_drafts, first_true, probability_of, residual_distribution
from decode.sampling import SamplingConfig, image_seeds, keyed_uniforms, sample_with
from decode.ssd import SSDDecodeConfig
from decode.ssd_drafting import DraftedRow, SSDRowDrafter
from heads.ssd import SSDHeads

# What a keyed uniform is for (the last key of `keyed_uniforms`).
_DRAFT, _TEST, _RESIDUAL, _FIRST = 0, 1, 2, 3


@dataclass(frozen=True)
class RaggedSSDConfig:
    """How ragged SSD drafts, verifies and schedules."""

    # exact: lossless speculative sampling; prefix: the exact rule for a row's first rounds + 1 corrections, then
    # its re-drafted rest is kept unverified (decode/ssd.py's autocorrect with correction prefix: with whole-row
    # windows, rounds + 1 passes per row; corrections, not passes, so that windows never change the tokens)
    mode: Literal["exact", "prefix"] = "exact"
    rounds: int = 1
    grid_steps: int = 6  # grid heads: positions re-drafted along the row after each token the backbone gave
    horizontal_steps: int = 1  # without a grid head: positions re-drafted by the horizontal head (row 0: all)
    # open positions a pass verifies per image: 0 to the row's end, n at most n, "auto" chosen per pass by cost
    window: int | Literal["auto"] = 0
    slots: int = 0  # images decoded at once (continuous batching over the queue); 0: all the conditions
    # exact mode: a pass whose window reaches an image's row end goes on into the next row's drafts, drafted
    # before the row is final (see the module docstring); saves about one pass per row
    lookahead: bool = False
    # lookahead only where the product of the row's open drafts' own probabilities q(x) is at least this (0: always)
    lookahead_confidence: float = 0.0
    # once the queue is empty, drop finished images' slots from the batch when at most this share of the slots
    # still decodes (decode/drain.py; 0: never): later passes compute no finished image's rows
    drain: float = 0.75

    def __post_init__(self):
        if self.mode not in ("exact", "prefix"):
            raise ValueError(f"ragged SSD mode must be 'exact' or 'prefix', got {self.mode!r}")
        if self.window != "auto" and (not isinstance(self.window, int) or self.window < 0):
            raise ValueError(f"ragged SSD window must be an int >= 0 or 'auto', got {self.window!r}")
        if self.lookahead and self.mode != "exact":
            raise ValueError("ragged SSD lookahead needs mode exact (prefix mode keeps rows unverified)")
        if not 0 <= self.drain < 1:
            raise ValueError(f"ragged SSD drain must be in [0, 1) (0: never drain), got {self.drain}")
        if not 0 <= self.lookahead_confidence <= 1:
            raise ValueError(f"ragged SSD lookahead_confidence must be in [0, 1], got {self.lookahead_confidence}")
        if min(self.rounds, self.grid_steps, self.horizontal_steps, self.slots) < 0:
            raise ValueError(
                f"ragged SSD rounds, grid_steps, horizontal_steps and slots must be >= 0, got {self.rounds}, "
                f"{self.grid_steps}, {self.horizontal_steps}, {self.slots}"
            )

    def drafting(self) -> SSDDecodeConfig:
        """The drafter's settings (decode/ssd_drafting.py reads them from an SSDDecodeConfig). Its re-drafts do
        not stop at the window, so the drafts, and with them every token, do not depend on the window."""
        return SSDDecodeConfig(grid_steps=self.grid_steps, horizontal_steps=self.horizontal_steps)


class _Slots:
    """The images being decoded: per slot its image, row, frontier and drafts (B slots, G = twins * B rows)."""

    def __init__(self, backbone: ARImageBackbone, drafter: SSDRowDrafter, batch: int, device, dtype, lookahead, prefix):
        rows, cols, hidden = backbone.geometry.rows, backbone.geometry.cols, backbone.hidden_size
        cache_rows = drafter.twins * batch
        self.rows = rows
        self.image = torch.full((batch,), -1, dtype=torch.long, device=device)  # -1: empty
        self.seed = torch.zeros(batch, dtype=torch.long, device=device)
        self.row = torch.zeros(batch, dtype=torch.long, device=device)
        self.committed = torch.zeros(batch, dtype=torch.long, device=device)  # final positions of the row
        self.cached = torch.zeros(batch, dtype=torch.long, device=device)  # grid position: cache final before it
        self.grid = torch.zeros(batch, rows * cols, dtype=torch.long, device=device)  # committed, then drafts
        self.drafts = DraftedRow(
            torch.zeros(batch, cols, dtype=torch.long, device=device),
            torch.zeros(batch, cols, backbone.codebook_size, device=device),
        )
        self.attempts = torch.zeros(batch, cols, dtype=torch.long, device=device)  # drafts each position had
        self.states = torch.zeros(cache_rows, cols + 1, hidden, device=device, dtype=dtype)  # [:, cols]: next row
        self.state_known = torch.zeros(batch, cols + 1, dtype=torch.bool, device=device)
        self.above_states = torch.zeros(cache_rows, cols, hidden, device=device, dtype=dtype)
        self.above_tokens = torch.zeros(batch, cols, dtype=torch.long, device=device)
        self.above_prepared: torch.Tensor | None = None  # the grid head's share of each slot's row above
        # Corrections (rejections) in the current row: prefix mode's budget. Counting corrections, not passes,
        # keeps its tokens independent of the windows (a pass that a window ends corrects nothing).
        self.row_corrections = torch.zeros(batch, dtype=torch.long, device=device)
        self.tested = torch.zeros(batch, device=device)  # this image's tests and acceptances (cost model)
        self.accepted = torch.zeros(batch, device=device)
        self.lookahead = lookahead
        if lookahead or prefix:
            # The heads' predicted state behind each draft: the next row is drafted from them where the exact
            # state was not known at the row's last correction (lookahead), or where prefix mode keeps a row's
            # rest unverified.
            self.drafts.predicted = torch.zeros(cache_rows, cols, hidden, device=device, dtype=dtype)
            # Columns whose exact state the next row's drafts read: those known at the row's last correction (or
            # its start), so the next row's drafts depend on the image's corrections, never on the windows.
            self.epoch_known = torch.zeros(batch, cols, dtype=torch.bool, device=device)
            self.next = DraftedRow(
                torch.zeros(batch, cols, dtype=torch.long, device=device),
                torch.zeros(batch, cols, backbone.codebook_size, device=device),
                torch.zeros(cache_rows, cols, hidden, device=device, dtype=dtype),
            )
            self.next_attempts = torch.zeros(batch, cols, dtype=torch.long, device=device)
            self.next_ready = torch.zeros(batch, dtype=torch.bool, device=device)  # drafted since the last correction
            self.next_above_prepared: torch.Tensor | None = None

    @property
    def active(self) -> torch.Tensor:
        return self.image >= 0


@torch.inference_mode()
def generate_ssd_ragged(
    backbone: ARImageBackbone,
    heads: SSDHeads,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: RaggedSSDConfig = RaggedSSDConfig(),
) -> GenerationResult:
    """Generate one image per condition with ragged SSD over ``config.slots`` slots (see the module docstring).

    ``forward_passes`` counts every backbone pass (each ragged pass and each prefill that starts images); the
    passes per image of a batch-synchronous method correspond to ``forward_passes * slots / conditions``.
    """
    count = condition.batch_size
    slots = min(config.slots or count, count)
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    seeds = image_seeds(count, generator)
    state, first = backbone.prefill(condition_rows(condition, list(range(slots))), sampling.guided)
    device = first.device
    drafter = SSDRowDrafter(backbone, heads, state, sampling, generator, config.drafting(), device)
    run = _Slots(backbone, drafter, slots, device, first.dtype, config.lookahead, config.mode == "prefix")
    output = torch.zeros(count, rows * cols, dtype=torch.long, device=device)
    queue = PromptQueue(backbone, condition, range(slots, count), sampling.guided, ahead=slots)
    chooser = (
        _WindowChooser(backbone, state, slots, cols, sampling.guided, config.lookahead)
        if config.window == "auto"
        else None
    )
    counts = {
        "passes": 1,
        "drafted": 0,
        "accepted": 0,
        "window_sum": 0,
        "window_passes": 0,
        "lookahead": 0,
        "drains": 0,
    }
    _start_images(run, drafter, torch.arange(slots, device=device), torch.arange(slots, device=device), seeds, first)
    while bool(run.active.any()):
        began = time.perf_counter()
        may_look_ahead = _may_look_ahead(run, config)  # (B,): once per round, for the chooser and the pass
        window = chooser.choose(run, may_look_ahead) if chooser is not None else config.window
        out, lengths, starts, drafted_ahead = _ragged_pass(
            backbone, state, run, drafter, window, may_look_ahead, counts
        )
        counts["passes"] += 1
        counts["window_sum"] += window or cols
        counts["window_passes"] += 1
        deferred = _test_and_correct(run, drafter, out, lengths, starts, config, counts)
        done, moved = _finish_rows(run, drafter, output, rows, deferred)
        while len(moved):  # lookahead: the images whose pass went on into the row they have just started test it
            among = torch.zeros_like(run.active)
            among[moved] = True
            among &= starts + lengths > run.row * cols
            if not bool(among.any()):
                break
            deferred = _test_and_correct(run, drafter, out, lengths, starts, config, counts, among)
            more_done, moved = _finish_rows(run, drafter, output, rows, deferred, among)
            done = torch.cat([done, more_done])
        if len(done):
            refill, images, fresh_first, prefilled = refill_slots(backbone, state, queue, done)
            counts["passes"] += int(prefilled)
            if len(refill):
                _start_images(run, drafter, refill, images, seeds, fresh_first)
            run.image[done[len(refill) :]] = -1
            if config.drain and not len(queue):
                slots_before = run.image.shape[0]
                kept = drain_finished(backbone, state, run.active, [run], config.drain)
                if kept is not None:
                    counts["drains"] += 1
                    if chooser is not None:
                        chooser.rescale(len(kept) / slots_before)
        if chooser is not None:
            if device.type == "cuda":  # the round's kernels, not just their launches
                torch.cuda.synchronize(device)
            chooser.observe(time.perf_counter() - began, drafted_ahead)
    return GenerationResult(
        output.view(count, rows, cols),
        forward_passes=counts["passes"],
        drafted_tokens=counts["drafted"],
        accepted_tokens=counts["accepted"],
        extras={k: counts[k] for k in ("window_sum", "window_passes", "lookahead", "drains")},
    )


def _uniforms(run: _Slots, slots: torch.Tensor, columns: torch.Tensor, attempts: torch.Tensor, kind: int):
    """Keyed uniforms of slots (k,) at row columns (k, n) with these attempt numbers (k, n)."""
    positions = run.row[slots, None] * run.drafts.tokens.shape[1] + columns
    return keyed_uniforms(run.seed[slots, None], positions, attempts, kind)


def _start_images(run: _Slots, drafter: SSDRowDrafter, slots, images, seeds, first: torch.Tensor) -> None:
    """Slots (k,) begin images (k,): row 0, its first token from the backbone (states `first`, (2k or k, 1, H)),
    the rest of the row drafted by the horizontal head."""
    twin_slots = drafter.twin(slots)
    run.image[slots], run.seed[slots] = images, seeds[images.to(seeds.device)].to(run.seed.device)
    run.row[slots] = 0
    run.cached[slots] = 0
    run.row_corrections[slots] = 0
    run.tested[slots], run.accepted[slots] = 0.0, 0.0
    run.states[twin_slots] = 0
    run.state_known[slots] = False
    run.states[twin_slots, 0] = first[:, 0]
    run.state_known[slots, 0] = True
    run.attempts[slots] = 0
    run.drafts.q[slots] = 0
    _draw_first(run, drafter, slots, run.states[twin_slots, 0])
    _redraft(run, drafter, slots, torch.zeros_like(slots), first_row=True)
    run.grid[slots, : run.drafts.tokens.shape[1]] = run.drafts.tokens[slots]
    if run.lookahead:
        run.epoch_known[slots] = run.state_known[slots, : drafter.cols]
        run.next_ready[slots] = False


def _draw_first(run: _Slots, drafter: SSDRowDrafter, slots, first_state: torch.Tensor) -> None:
    """The row's first token from the backbone's state predicting it (rows of `slots`, H): final."""
    q = drafter.distribution(first_state[:, None])[:, 0]
    zero = torch.zeros_like(slots)[:, None]
    uniform = _uniforms(run, slots, zero, zero, _FIRST)[:, 0]
    run.drafts.q[slots, 0] = q
    run.drafts.tokens[slots, 0] = sample_with(q, uniform)
    if run.drafts.predicted is not None:
        run.drafts.predicted[drafter.twin(slots), 0] = first_state
    run.committed[slots] = 1


def _redraft(run: _Slots, drafter: SSDRowDrafter, slots, positions, first_row: bool, to_end: bool = False) -> None:
    """Re-draft each slot's row after `positions` (the backbone gave those tokens; their states are known),
    with uniforms keyed per image; each re-drafted position's attempt count goes up by one. Row 0
    (`first_row`) is drafted by the horizontal head to its end, later rows by the grid head where there is
    one (`grid_steps` positions, all of them with `to_end`; else `horizontal_steps` by the horizontal head)."""
    cols = drafter.cols

    def uniforms(steps: int) -> torch.Tensor:
        columns = (positions[:, None] + torch.arange(1, steps + 1, device=positions.device)).clamp(max=cols - 1)
        inside = positions[:, None] + torch.arange(1, steps + 1, device=positions.device) < cols
        attempts = run.attempts[slots[:, None], columns] + 1
        draws = _uniforms(run, slots, columns, attempts, _DRAFT)
        # Only the columns inside the row (clamped ones repeat the last column: a write there would race).
        run.attempts[slots[:, None].expand_as(columns)[inside], columns[inside]] = attempts[inside]
        return draws.T

    exact_state = run.states[drafter.twin(slots), positions.repeat(drafter.twins)]
    above_prepared = None if first_row or not drafter.has_grid else run.above_prepared
    # The drafter reads the row index only to tell row 0 (drafted horizontally to the end) from the others.
    drafter.redraft(
        run.drafts, 0 if first_row else 1, slots, positions, exact_state, above_prepared, to_end, uniforms=uniforms
    )


def _ragged_pass(
    backbone: ARImageBackbone, state, run: _Slots, drafter: SSDRowDrafter, window: int, may_look_ahead, counts
):
    """Feed every image from its first open cache slot to `window` open positions after its committed ones
    (0: its row's end); with lookahead, a run that reaches its row's end goes on into the next row's drafts (up
    to the window; 0: to that row's end) for the slots `may_look_ahead` (B,) allows. One ragged pass. Returns the
    states (rows, T, H), each image's run length, its first grid position and whether next rows were drafted."""
    cols = drafter.cols
    row_start = run.row * cols
    reach = run.committed + window if window else torch.full_like(run.committed, 2 * cols)
    end = row_start + torch.minimum(reach, torch.full_like(reach, cols))
    drafted_ahead = False
    if run.lookahead:
        ahead = may_look_ahead & (reach > cols)
        if bool(ahead.any()):
            unready = torch.nonzero(ahead & ~run.next_ready)[:, 0]
            if len(unready):
                _draft_next_rows(run, drafter, unready)
                drafted_ahead = True
            end = end + torch.where(ahead, (reach - cols).clamp(max=cols), 0)
            counts["lookahead"] += int(ahead.sum())
    lengths = torch.where(run.active, end - run.cached, 1)
    width = int(lengths.max())
    positions = (run.cached[:, None] + torch.arange(width, device=lengths.device)).clamp(max=run.grid.shape[1] - 1)
    tokens = run.grid.gather(1, positions)
    starts = torch.where(run.active, run.cached, 0)
    return backbone.step_ragged(state, tokens, starts), lengths, starts, drafted_ahead


def _may_look_ahead(run: _Slots, config) -> torch.Tensor:
    """(B,) bool: the slots a pass reaching their row's end would take into the next row (lookahead on, a row
    below, the confidence gate cleared)."""
    if not run.lookahead:
        return torch.zeros_like(run.active)
    eligible = run.active & (run.row < run.rows - 1)
    if config.lookahead_confidence > 0 and bool(eligible.any()):
        eligible &= _open_draft_log_probability(run, run.drafts.tokens.shape[1]) >= math.log(
            config.lookahead_confidence
        )
    return eligible


def _open_draft_log_probability(run: _Slots, cols: int) -> torch.Tensor:
    """Per slot, the log of the product of its row's open drafts' own probabilities q(x) (B,)."""
    draft_probability = run.drafts.q.gather(-1, run.drafts.tokens[..., None])[..., 0]  # (B, C)
    is_open = torch.arange(cols, device=run.committed.device)[None] >= run.committed[:, None]
    return torch.where(is_open, draft_probability.clamp(min=1e-30).log(), 0.0).sum(1)


def _draft_next_rows(run: _Slots, drafter: SSDRowDrafter, slots: torch.Tensor) -> None:
    """Lookahead: draft the row after each slot's row (k,) before that row is final, into `run.next` and the
    grid. The row above is the slot's row as it stood at its last correction: exact states where they were known
    then (`epoch_known`), the heads' predictions elsewhere. The vertical head drafts every column (uniforms keyed
    with attempt 1), the grid or horizontal head re-drafts from column 0 (attempt 2), as a row start would; these
    keys and this row above are the same whichever pass drafts them, so a slot's tokens do not depend on when
    (or whether) a pass looked ahead."""
    cols, twin = drafter.cols, drafter.twin(slots)
    known = run.epoch_known[slots].repeat(drafter.twins, 1)  # (G_k, C)
    above = torch.where(known[..., None], run.states[twin, :cols], run.drafts.predicted[twin])  # (G_k, C, H)
    tokens_above = run.drafts.tokens[slots]
    columns = torch.arange(cols, device=slots.device).expand(len(slots), -1)
    vertical = drafter.vertical(above, tokens_above, _uniforms(run, slots, columns + cols, columns * 0 + 1, _DRAFT))
    run.next.tokens[slots], run.next.q[slots] = vertical.tokens, vertical.q
    run.next.predicted[twin] = vertical.predicted
    run.next_attempts[slots] = 1
    prepared = drafter.prepare_above(above, tokens_above)
    if prepared is not None:
        if run.next_above_prepared is None:
            run.next_above_prepared = prepared.new_zeros(run.states.shape[0], *prepared.shape[1:])
        run.next_above_prepared[twin] = prepared

    def uniforms(steps: int) -> torch.Tensor:
        chain = torch.arange(1, steps + 1, device=slots.device).clamp(max=cols - 1).expand(len(slots), -1)
        run.next_attempts[slots[:, None], chain] = 2
        return _uniforms(run, slots, chain + cols, chain * 0 + 2, _DRAFT).T

    exact_state = run.next.predicted[twin, 0]  # the first column's state is a prediction here too
    next_prepared = None if prepared is None else run.next_above_prepared
    drafter.redraft(run.next, 1, slots, torch.zeros_like(slots), exact_state, next_prepared, uniforms=uniforms)
    next_columns = ((run.row[slots] + 1) * cols)[:, None] + columns
    run.grid[slots[:, None], next_columns] = run.next.tokens[slots]
    run.next_ready[slots] = True


def _test_and_correct(
    run: _Slots, drafter: SSDRowDrafter, out, lengths, starts, config: RaggedSSDConfig, counts, among=None
) -> torch.Tensor | None:
    """Store each image's new states, test its open drafts, draw its first rejection from the residual and
    re-draft the rest of its row from there; budget-spent rows (prefix mode) re-draft to the end and keep it.
    The other re-drafts of rows below the first are returned instead (slots; from their last committed
    position), to run in one call with the rows that start in this round (`_finish_rows`). `starts` (B,): the
    grid position each image's run began at; `among` (B,) bool: only these images (lookahead: the row a pass
    went on into)."""
    cols = drafter.cols
    batch = run.image.shape[0]
    active = run.active if among is None else run.active & among
    arange = torch.arange(cols + 1, device=out.device)
    # out[b, j] predicts grid position start_b + j + 1: row column c comes from j = row_start + c - 1 - start.
    j = run.row[:, None] * cols + arange[None] - 1 - starts[:, None]  # (B, C + 1)
    fresh = (j >= 0) & (j < lengths[:, None]) & active[:, None]
    twin_j = j.clamp(min=0, max=out.shape[1] - 1).repeat(drafter.twins, 1)
    gathered = out.gather(1, twin_j[..., None].expand(-1, -1, out.shape[-1]))
    twin_fresh = fresh.repeat(drafter.twins, 1)
    run.states = torch.where(twin_fresh[..., None], gathered, run.states)
    run.state_known |= fresh
    extent = (starts + lengths - run.row * cols).clamp(max=cols)  # columns < extent were verified
    columns = arange[None, :cols]
    is_open = (columns >= run.committed[:, None]) & (columns < extent[:, None]) & active[:, None]
    p = drafter.distribution(run.states[:, :cols])  # (B, C, V)
    drafts = run.drafts
    uniform = _uniforms(run, torch.arange(batch, device=out.device), columns.expand(batch, -1), run.attempts, _TEST)
    passed = accept_drafts(probability_of(p, drafts.tokens), probability_of(drafts.q, drafts.tokens), uniform)
    rejected_at = first_true(is_open & ~passed, cols)  # (B,)
    rejected = rejected_at < cols
    tested = (is_open & (columns <= rejected_at[:, None])).sum(1)
    counts["drafted"] += int(tested.sum())
    accepted = tested - rejected.long()
    counts["accepted"] += int(accepted.sum())
    run.tested += tested.float()
    run.accepted += accepted.float()
    opened = active & (extent > run.committed)
    # No rejection: every verified draft is final, and so are their cache slots.
    run.committed = torch.where(opened & ~rejected, extent, run.committed)
    run.cached = torch.where(opened & ~rejected, run.row * cols + extent, run.cached)
    run.row_corrections += rejected.long()
    fixed = torch.nonzero(rejected)[:, 0]
    if len(fixed) == 0:
        return None
    deferred = None
    position = rejected_at[fixed]
    residual = residual_distribution(p[fixed, position], drafts.q[fixed, position])
    residual_uniform = _uniforms(run, fixed, position[:, None], run.attempts[fixed, position][:, None], _RESIDUAL)
    drafts.tokens[fixed, position] = sample_with(residual, residual_uniform[:, 0])
    run.grid[fixed, run.row[fixed] * cols + position] = drafts.tokens[fixed, position]
    run.committed[fixed] = position + 1
    run.cached[fixed] = run.row[fixed] * cols + position  # the rejected draft's slot holds the wrong token
    run.state_known[fixed] &= arange[None] <= position[:, None]  # states right of the correction are stale
    if run.lookahead:  # the row changed: the next row is drafted again, from what is known now
        run.epoch_known[fixed] = run.state_known[fixed, :cols]
        run.next_ready[fixed] = False
    more = fixed[position < cols - 1]
    if len(more):
        first_row = run.row[more] == 0
        # prefix mode: a row's (rounds + 1)-th correction re-drafts its rest to the end now, to be kept unverified
        spent = run.row_corrections[more] > config.rounds if config.mode == "prefix" else torch.zeros_like(first_row)
        later = ~first_row & ~spent  # later rows join the re-drafts of the rows that start this round
        deferred, more, first_row, spent = more[later], more[~later], first_row[~later], spent[~later]
        # What is left: row 0 (its horizontal head drafts to the end) and rows whose budget this spent.
        for group, is_first in ((more[first_row], True), (more[~first_row & spent], False)):
            if len(group):
                _redraft(run, drafter, group, run.committed[group] - 1, first_row=is_first, to_end=not is_first)
        run.grid[more[:, None], (run.row[more] * cols)[:, None] + arange[None, :cols]] = drafts.tokens[more]
        _keep_unverified(run, drafter, more[spent])
    return deferred


def _keep_unverified(run: _Slots, drafter: SSDRowDrafter, corrected: torch.Tensor) -> None:
    """Prefix mode: the slots `corrected`, whose row's (rounds + 1)-th correction this was (before its last
    column), keep their rest, re-drafted to the end from the correction, unverified (with whole-row windows: at
    most rounds + 1 passes per row, decode/ssd.py's autocorrect with correction prefix). The kept positions'
    states, which the next row is drafted from, are the heads' predictions behind those drafts: they depend on
    the corrections only, never on how far earlier passes reached (a pass's states right of a rejection saw the
    rejected token)."""
    if not len(corrected):
        return
    cols = drafter.cols
    rest = torch.arange(cols, device=corrected.device)[None] >= run.committed[corrected][:, None]  # (k, C)
    twin_rows = drafter.twin(corrected)
    kept = rest.repeat(drafter.twins, 1)[..., None]
    run.states[twin_rows, :cols] = torch.where(kept, run.drafts.predicted[twin_rows], run.states[twin_rows, :cols])
    run.committed[corrected] = cols


def _finish_rows(run: _Slots, drafter: SSDRowDrafter, output, rows: int, deferred=None, among=None):
    """Images whose row is final write it out and start their next row. Returns the slots whose image is done
    and the slots that started a row whose drafts this pass may have fed already (lookahead). `deferred`: slots
    whose corrections in rows below the first still need their re-draft (one call with the rows that start here:
    on a CPU each head call costs its kernels' launches, whatever its batch). `among` (B,) bool: only these
    images (lookahead's second test of a pass)."""
    cols = drafter.cols
    active = run.active if among is None else run.active & among
    finished = torch.nonzero(active & (run.committed >= cols))[:, 0]
    arange = torch.arange(cols, device=finished.device)
    if len(finished) == 0:
        _redraft_and_write(run, drafter, deferred, None)
        return finished, finished
    grid_columns = (run.row[finished] * cols)[:, None] + arange[None]
    output[run.image[finished][:, None], grid_columns] = run.drafts.tokens[finished]
    last = run.row[finished] == rows - 1
    done, going = finished[last], finished[~last]
    if len(going) == 0:
        _redraft_and_write(run, drafter, deferred, None)
        return done, going
    # Lookahead: the slots whose pass fed the drafts they start with (drafted before the pass, and the row passed
    # whole in it) test them with this pass's states; the others draft them now and test them in the next pass.
    ahead = going[:0]
    if run.lookahead:
        ready = run.next_ready[going]
        ahead = _fed_ahead(going, ready)
        if not bool(ready.all()):
            _draft_next_rows(run, drafter, going[~ready])
    twin_going = drafter.twin(going)
    # The finished row becomes the row above: its states are exact (each position was tested with its state).
    run.above_states[twin_going] = run.states[twin_going, :cols]
    run.above_tokens[going] = run.drafts.tokens[going]
    next_known = run.state_known[going, cols]
    next_state = run.states[twin_going, cols]
    previous_cached = run.cached[going]
    run.row[going] += 1
    run.row_corrections[going] = 0
    run.attempts[going] = 0
    run.states[twin_going] = 0
    run.state_known[going] = False
    if drafter.has_grid:
        prepared = drafter.prepare_above(run.above_states[twin_going], run.above_tokens[going])
        if run.above_prepared is None:
            run.above_prepared = prepared.new_zeros(run.states.shape[0], *prepared.shape[1:])
        run.above_prepared[twin_going] = prepared
    if run.lookahead:  # the row drafted ahead, its first token a draft like the others
        run.drafts.tokens[going], run.drafts.q[going] = run.next.tokens[going], run.next.q[going]
        run.drafts.predicted[twin_going] = run.next.predicted[twin_going]
        run.attempts[going] = run.next_attempts[going]
        run.next_ready[going] = False
    else:  # the vertical head drafts the whole row (the first token too, where the backbone has not given its state)
        zero = torch.zeros(len(going), cols, dtype=torch.long, device=going.device)
        vertical = drafter.vertical(
            run.above_states[twin_going],
            run.above_tokens[going],
            _uniforms(run, going, arange.expand_as(zero), zero + 1, _DRAFT),
        )
        run.attempts[going] = 1
        run.drafts.tokens[going], run.drafts.q[going] = vertical.tokens, vertical.q
        if run.drafts.predicted is not None:  # prefix mode may keep a vertical draft unverified
            run.drafts.predicted[twin_going] = vertical.predicted
    run.committed[going] = 0
    # Where the pass did not give the state after the row's last token (a correction there, or prefix mode's
    # unverified rest), the cache lacks that row's tail: the next pass feeds it before the new drafts.
    run.cached[going] = torch.where(next_known, run.row[going] * cols, previous_cached)
    known = going[next_known]
    if len(known):
        twin_known = drafter.twin(known)
        run.states[twin_known, 0] = next_state[next_known.repeat(drafter.twins)]
        run.state_known[known, 0] = True
        if not run.lookahead:
            _draw_first(run, drafter, known, run.states[twin_known, 0])
    if run.lookahead:
        run.epoch_known[going] = run.state_known[going, :cols]
    run.grid[going[:, None], (run.row[going] * cols)[:, None] + arange[None]] = run.drafts.tokens[going]
    # Rows that start from a first token the backbone gave are re-drafted along from it (lookahead drafted ahead).
    starting = known if len(known) and not run.lookahead else None
    _redraft_and_write(run, drafter, deferred, starting)
    return done, ahead


def _fed_ahead(going: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
    """Of the slots starting a row, those whose drafts a pass may have fed: drafted before it and unchanged since
    (a correction anywhere in the row above, this pass's last column included, makes its lookahead stale)."""
    return going[ready]


def _redraft_and_write(run: _Slots, drafter: SSDRowDrafter, corrected, starting) -> None:
    """One re-draft call for rows below the first: `corrected` slots from their last committed position,
    `starting` slots from their row's first token; their rows written into the slots' grids."""
    slots, positions = [], []
    if corrected is not None and len(corrected):
        slots.append(corrected)
        positions.append(run.committed[corrected] - 1)
    if starting is not None and len(starting):
        slots.append(starting)
        positions.append(torch.zeros_like(starting))
    if not slots:
        return
    slots, positions = torch.cat(slots), torch.cat(positions)
    _redraft(run, drafter, slots, positions, first_row=False)
    cols = drafter.cols
    columns = (run.row[slots] * cols)[:, None] + torch.arange(cols, device=slots.device)[None]
    run.grid[slots[:, None], columns] = run.drafts.tokens[slots]


class _WindowChooser:
    """Cost-aware windows: the pass length that maximises the batch's expected committed tokens per second."""

    def __init__(
        self,
        backbone: ARImageBackbone,
        state,
        batch: int,
        cols: int,
        guided: bool,
        lookahead: bool = False,
        prior: float = 0.85,
    ):
        self.cols, self.prior, self.prior_weight, self.lookahead = cols, prior, 8.0, lookahead
        self.rows = backbone.geometry.rows
        self.lengths = sorted({1, 2, 3, 4, 6, 8, 12, 16, cols, cols + 1} | ({2 * cols + 1} if lookahead else set()))
        self.seconds = ragged_pass_seconds(backbone, state, batch, guided, self.lengths)
        # Every run length a pass can have (1 .. two rows and a token), its seconds interpolated once.
        self.seconds_by_length = torch.tensor(
            [0.0] + [self._pass_seconds(n) for n in range(1, 2 * cols + 2)], dtype=torch.float64
        )
        # Drafting and testing per round beyond its pass, measured as the generation runs (running means): rounds
        # that draft next rows ahead (lookahead) apart from the others, so that a window is charged for the
        # drafting it makes a round do.
        self.overhead = {False: 0.0, True: 0.0}
        self.overhead_count = {False: 0, True: 0}
        self.last_pass = 0.0

    def choose(self, run: _Slots, may_look_ahead: torch.Tensor | None = None) -> int:
        """All candidate windows at once: (W, B) expected tokens and run lengths, one argmax (the first best).
        `may_look_ahead` (B,) bool: slots whose window past their row's end goes on into the next row."""
        rate = (run.accepted + self.prior * self.prior_weight) / (run.tested + self.prior_weight)  # (B,)
        open_in_row = (self.cols - run.committed).clamp(min=1)
        ahead = may_look_ahead if self.lookahead and may_look_ahead is not None else torch.zeros_like(run.active)
        remaining = open_in_row + torch.where(ahead, self.cols, 0)
        lag = run.row * self.cols + run.committed - run.cached  # committed tokens the cache lacks (0 or 1)
        windows = torch.arange(1, int(remaining.max()) + 1, device=remaining.device)  # (W,)
        w = torch.minimum(remaining[None], windows[:, None]).double()  # (W, B)
        rate = rate.double()[None]
        expected = torch.where(run.active[None], (1 - rate**w) / (1 - rate).clamp(min=1e-6), 0.0).sum(1)  # (W,)
        length = torch.where(run.active[None], w.long() + lag[None], 1).amax(1).clamp(max=2 * self.cols + 1)
        # A window that takes an image whose next row is not drafted yet past its row's end costs that drafting.
        unready = ahead & ~run.next_ready if self.lookahead else ahead  # (B,)
        drafts_ahead = ((windows[:, None] > open_in_row[None]) & unready[None]).any(1).cpu()
        ahead_seconds = self.overhead[True] if self.overhead_count[True] else self.overhead[False]
        overhead = torch.where(drafts_ahead, ahead_seconds, self.overhead[False]).double()
        seconds = self.seconds_by_length[length.cpu()] + overhead
        best = int(torch.argmax(expected.cpu() / seconds))
        self.last_pass = float(self.seconds_by_length[int(length[best])])
        return int(windows[best])

    def observe(self, seconds: float, drafted_ahead: bool = False) -> None:
        """A round's wall-clock: what it took beyond its pass is drafting and testing, kept apart for rounds that
        drafted next rows ahead."""
        self.overhead_count[drafted_ahead] += 1
        mean = self.overhead[drafted_ahead]
        self.overhead[drafted_ahead] = (
            mean + (max(0.0, seconds - self.last_pass) - mean) / self.overhead_count[drafted_ahead]
        )

    def rescale(self, fraction: float) -> None:
        """The batch has drained to `fraction` of its slots: a pass and a round's drafting are taken to cost that
        share of what they cost before (rows of a pass are what a CPU pays for; a memory-bound GPU pays less
        than that for fewer rows, so there this errs towards longer windows)."""
        self.seconds_by_length *= fraction
        for key in self.overhead:
            self.overhead[key] *= fraction
        self.last_pass *= fraction

    def _pass_seconds(self, length: int) -> float:
        lengths, seconds = self.lengths, self.seconds
        if length <= lengths[0]:
            return seconds[0]
        for (a, sa), (b, sb) in zip(zip(lengths, seconds), zip(lengths[1:], seconds[1:])):
            if length <= b:
                return sa + (sb - sa) * (length - a) / (b - a)
        return seconds[-1] * length / lengths[-1]


def _generate(backbone, heads, condition, sampling, generator, settings: RaggedSSDConfig) -> GenerationResult:
    return generate_ssd_ragged(backbone, heads, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=RaggedSSDConfig,
    artefact="heads",
    artefact_kind="ssd",
    lossless=lambda settings: settings.mode == "exact",
    continuous=True,
)
