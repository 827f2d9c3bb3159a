"""Continuous batching's drain: once the queue is empty, the slots of finished images leave the batch.

A ragged generator refills a finished image's slot from the queue (`decode.conditions.refill_slots`); when the
queue has run dry, the slot stays empty, and every later pass would still compute its rows (a pad token each, in
every layer, and attention over its cache) until the batch's slowest image is done. With 64 images over 64 slots
that was a third of the rows a batch's passes computed (ragged SSD, window 8: 8,198 active of 12,224), and 11%
with a 64-image queue over 16 slots. `drain_finished` drops those slots from the backbone's state
(`ARImageBackbone.keep_images`) and from the generator's per-slot tensors, once enough of them are empty that
the copy pays for itself (a geometric schedule: at most log(slots) / log(1 / below) copies, each of the kept rows
only).

Which rows share a pass never changes what an image's tokens are (each image's uniforms are keyed by its own seed
and event; its attention sees its own rows only), so draining changes no token, up to the float rounding a
batch's shape can change (the ragged generators' docstrings state where that can flip a near-tie).
"""

from __future__ import annotations

import torch

from backbones.base import ARImageBackbone, DecodeState
from backbones.kv_cache import keep_rows


def select_slot_rows(holder, slots: torch.Tensor, rows: torch.Tensor, batch: int, cache_rows: int) -> None:
    """Keep, in place, only slots ``slots`` (k,) of every per-slot tensor that `holder`'s attributes hold (and those
    of the objects it holds, such as a row's drafts): a tensor of `batch` rows is indexed by slot, one of
    `cache_rows` rows (both twins under guidance) by `rows`. Every tensor must be one or the other."""
    for name, value in vars(holder).items():
        if isinstance(value, torch.Tensor):
            if value.dim() and value.shape[0] == cache_rows:
                setattr(holder, name, value.index_select(0, rows.to(value.device)))
            elif value.dim() and value.shape[0] == batch:
                setattr(holder, name, value.index_select(0, slots.to(value.device)))
            else:
                raise ValueError(
                    f"{type(holder).__name__}.{name} has shape {tuple(value.shape)}: a per-slot tensor has {batch} "
                    f"rows (one per slot) or {cache_rows} (cache rows)"
                )
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            select_slot_rows(value, slots, rows, batch, cache_rows)


def drain_finished(
    backbone: ARImageBackbone,
    state: DecodeState,
    active: torch.Tensor,
    holders: list,
    below: float,
    caches: tuple = (),
) -> torch.Tensor | None:
    """Drop the empty slots once at most `below` of them still hold an image (call it only when the queue is
    empty): the backbone's state, each of `holders` (the generator's per-slot objects, see `select_slot_rows`)
    and each of `caches` (KV caches of the slots' cache rows, such as a draft head's) keep the active slots, in
    order. Returns the kept slots' old indices (k,), or None where nothing was dropped (`below` 0 never drops;
    at least one slot is always kept)."""
    slots = active.shape[0]
    kept = torch.nonzero(active)[:, 0]
    if not len(kept) or len(kept) == slots or len(kept) > below * slots:
        return None
    rows, cache_rows = state.rows_of(kept), state.cache_rows
    for holder in holders:
        select_slot_rows(holder, kept, rows, slots, cache_rows)
    for cache in caches:
        keep_rows(cache, rows)
    backbone.keep_images(state, kept)
    return kept
