"""One verification pass: roll the cache back, feed what it lacks and the drafts, keep the target states.

Every speculative method verifies a *block* of drafted grid positions (an SSD
row, a MuLo-SD block of r rows, later a Jacobi window or an EAGLE chain) the
same way: crop the KV cache back to the first entry that is not final, feed the
committed tokens it lacks followed by the drafts, and read the states the pass
gives for the block's positions. ``states[:, i]`` is the state that predicts
block position ``i`` (the backbone's convention, backbones/base.py).
"""

from __future__ import annotations

import torch

from backbones.base import ARImageBackbone, DecodeState


def verification_pass(
    backbone: ARImageBackbone,
    state: DecodeState,
    tokens: torch.Tensor,
    start: int,
    block_start: int,
    drafts: torch.Tensor,
    feed_end: int,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed grid positions ``[start, feed_end)`` (plus `extra` tokens after them) through the cache.

    tokens (B, N): the image so far, read for the committed positions
    ``[start, block_start)``; drafts (B, L): the block's tokens from
    `block_start` on, fed up to `feed_end`. Returns the pass's states
    (rows, fed, H): ``out[:, j]`` predicts grid position ``start + j + 1``.
    """
    backbone.rollback(state, start)
    feed = [tokens[:, start:block_start], drafts[:, max(0, start - block_start) : feed_end - block_start]]
    if extra is not None:
        feed.append(extra)
    return backbone.step(state, torch.cat(feed, dim=1))


def write_block_states(
    block_states: torch.Tensor, out: torch.Tensor, start: int, block_start: int, feed_end: int
) -> tuple[int, int]:
    """Copy a pass's states into the block's (rows, L, H), in place; return the block positions they cover.

    A pass that fed ``[start, feed_end)`` gives the states of positions
    ``start + 1 .. feed_end`` (the last one predicts the position after the
    feed). Positions before the first of them keep their states from earlier
    passes (final: their context was). Returns ``(first, end)``: block
    positions ``first <= i < end`` now hold this pass's states.
    """
    first_fresh = max(block_start, start + 1)
    first = first_fresh - block_start
    end = min(block_states.shape[1], feed_end - block_start + 1)
    offset = first_fresh - start - 1
    block_states[:, first:end] = out[:, offset : offset + end - first]
    return first, end
