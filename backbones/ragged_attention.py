"""Attention of a ragged pass over each image's own keys, not up to the furthest image's.

A ragged pass (`ContinuousBatching._ragged_pass`: every image verifies its own window from its own frontier) writes
row r's tokens at cache slots that end at ``row_ends[r]``; its mask lets no query of row r see a slot at or past
that end. One batched attention call still reads every row's keys up to the furthest row's end: with continuous
batching an image that just entered its slot sits beside one near its end, and on a 2-core CPU at batch 16 that
made attention 41% of the ragged passes' time, 37% of it spent on keys no query sees
(docs/results.md, "Where `ssd_ragged`'s time goes at batch 16").

Inside `own_keys(row_ends, queries)` attention runs in groups of consecutive cache rows, each group over the keys
up to its furthest row's end: slices of the cache's buffers, views, no copy. The keys a group leaves out are masked
for every query of it, so each output is the same softmax over the same visible keys; only the kernels' order of
summation may differ (float rounding, at most a few units in the last place).

Groups are chosen once per pass (`row_groups`): a run of rows is split where one call more costs less than the
padded keys it saves, at a call's overhead measured on this project's CPU. On other devices (a GPU, where a call's
launch costs another share of a pass, not measured here) attention stays one call.

`ragged_sdpa` is transformers' SDPA attention with this grouping, registered as the attention implementation
"ragged_sdpa" (`use_own_keys_attention` switches a model to it); outside `own_keys` it is transformers' own "sdpa"
call. Families that write their own attention (LlamaGen) call `attention` instead of
`torch.nn.functional.scaled_dot_product_attention`.

Measured (docs/runs/batching/2026-12-07_own_keys): every ragged pass of an ssd_ragged queue, run both ways on the same
inputs, takes 4.5-5.9% less time at 16 slots (64 images), 4.6-5.7% at 64 slots (128 images) and the same at 4 (three
runs). About 6 calls per layer read 79% of the keys one call reads, where each row's own keys would be 63%: slots
are filled in queue order, so rows of like length are rarely neighbours.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# (rows, [(first row, end row, keys read)]) of the pass in progress, None outside a ragged pass.
_GROUPS: ContextVar[tuple[int, list[tuple[int, int, int]]] | None] = ContextVar("ragged_attention_groups", default=None)


def call_overhead_keys(queries: int) -> float:
    """One attention call's fixed cost, in rows x keys of attention work at `queries` queries per row.

    Measured with torch's CPU SDPA on this project's 2-core VM (3 heads of 64): a call costs ~30 us beyond its
    work, and a row's key ~(0.025 + 0.006 x queries) us; so an extra call pays when it saves ~970 row-keys at
    one query, ~380 at 9 and ~240 at 17.
    """
    return 30.0 / (0.025 + 0.006 * queries)


def row_groups(row_ends: list[int], queries: int) -> list[tuple[int, int, int]]:
    """Consecutive row ranges ``(first, end, keys)`` covering ``row_ends`` (the slot after each row's last one),
    each read up to ``keys`` = its furthest row's end. Greedy from the first row: the next row joins the open range
    unless the padded keys joining adds cost more than a call (`call_overhead_keys`)."""
    overhead = call_overhead_keys(queries)
    groups: list[tuple[int, int, int]] = []
    first, keys = 0, row_ends[0]
    for row in range(1, len(row_ends)):
        end = row_ends[row]
        joined = (row - first + 1) * max(keys, end)
        apart = (row - first) * keys + end + overhead
        if joined <= apart:
            keys = max(keys, end)
        else:
            groups.append((first, row, keys))
            first, keys = row, end
    groups.append((first, len(row_ends), keys))
    return groups


@contextmanager
def own_keys(row_ends: list[int], queries: int) -> Iterator[None]:
    """Inside the block, attention over a batch of ``len(row_ends)`` rows reads each row group's keys up to its own
    furthest end (`row_groups`). ``row_ends[r]``: no query of row r sees a key slot at or past it."""
    token = _GROUPS.set((len(row_ends), row_groups(row_ends, queries)))
    try:
        yield
    finally:
        _GROUPS.reset(token)


@contextmanager
def attending_own_keys(model: nn.Module, slots: torch.Tensor) -> Iterator[None]:
    """`own_keys` for a ragged call of `model` whose row r writes the cache slots ``slots[r]`` (rows, T), ascending;
    the first such call switches the model to "ragged_sdpa" (`use_own_keys_attention`). Off the CPU attention stays
    one call (the call overhead is measured on CPUs only), and no groups are chosen."""
    if slots.device.type != "cpu":
        yield
        return
    if not getattr(model, "_attends_own_keys", False):
        use_own_keys_attention(model)
        model._attends_own_keys = True
    with own_keys((slots[:, -1] + 1).tolist(), slots.shape[1]):
        yield


def _active_groups(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None
) -> list[tuple[int, int, int]] | None:
    """The pass's groups, when a ragged pass is in progress for this batch of rows (a mask row by row) and grouping
    reads fewer keys than one call would; None otherwise (a compiled graph never groups: its shapes stay fixed)."""
    if torch.compiler.is_compiling():
        return None
    active, rows = _GROUPS.get(), query.shape[0]
    if active is None or active[0] != rows or mask is None or mask.dim() != 4 or mask.shape[0] != rows:
        return None
    groups = active[1]
    if len(groups) == 1 and groups[0][2] >= key.shape[-2]:
        return None
    return groups


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`F.scaled_dot_product_attention(query, key, value, attn_mask=mask)` (rows, heads, T, dim), per row group
    over its own keys inside `own_keys`."""
    groups = _active_groups(query, key, mask)
    if groups is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    out = query.new_empty(query.shape)
    for first, end, keys in groups:
        rows = slice(first, end)
        out[rows] = F.scaled_dot_product_attention(
            query[rows], key[rows, ..., :keys, :], value[rows, ..., :keys, :], attn_mask=mask[rows, ..., :keys]
        )
    return out


def ragged_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention function, run per row group over its own keys inside `own_keys`."""
    groups = _active_groups(query, key, attention_mask)
    if groups is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, length, _ = query.shape
    out = query.new_empty(batch, length, heads, value.shape[-1])
    for first, end, keys in groups:
        rows = slice(first, end)
        out[rows], _ = sdpa_attention_forward(
            module,
            query[rows],
            key[rows, :, :keys],
            value[rows, :, :keys],
            attention_mask[rows, ..., :keys],
            **kwargs,
        )
    return out, None


AttentionInterface.register("ragged_sdpa", ragged_sdpa)
# The masks "sdpa" builds: a name with no mask function gets none, and a KV-cached multi-token step would then run
# SDPA's is_causal kernel, whose diagonal starts at the first key, not at the cache's end.
AttentionMaskInterface.register("ragged_sdpa", sdpa_mask)


def use_own_keys_attention(model: nn.Module) -> None:
    """Switch every transformers config inside `model` that attends with "sdpa" to "ragged_sdpa" (the same call
    outside ragged passes). Other implementations (flash attention, eager) are left as they are."""
    for submodule in model.modules():
        config = getattr(submodule, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = {"": "ragged_sdpa"}  # this config only: sub-configs are visited apart
