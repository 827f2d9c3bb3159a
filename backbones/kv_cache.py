"""A KV cache preallocated for the whole image: appending a token writes in place instead of copying the cache.

transformers' DynamicCache grows by concatenation: every pass copies the whole
cache of every layer. On a CPU at batch 16 that copy was more than half of the
baseline's time per token (the digits backbone: 13.5 s of 25 s for one batch),
and it grows with the context, so an AR baseline on DynamicCache is slower than
it needs to be and flatters every method that makes fewer passes. Here each
layer's keys and values live in buffers sized once for the prompt and the
image; `update` writes the new positions and returns views of the filled part,
so attention sees exactly the tensors a DynamicCache would hold, and `crop`
(the speculative methods' rollback) only moves the length back.

ZipAR feeds tokens of several rows per pass at their own positions, not after
the cache's end: inside `writing_at(cache, slots)` a layer writes at those
slots and attention reads every slot (a mask says which each query sees).
Slots never written hold zero keys and values, as ZipAR's static cache does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` positions; otherwise a DynamicLayer."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.write_slots: torch.Tensor | None = None  # set by `writing_at`
        self.attend: int | None = None  # set by `writing_at`: the slots attention reads (None: all)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, key_dim = key_states.shape
        # Zeros, not garbage: a position-addressed pass (ZipAR) attends to slots not written yet.
        self._key_buffer = key_states.new_zeros(batch, heads, self.capacity, key_dim)
        self._value_buffer = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self._expose(0)
        self.is_initialized = True

    def _expose(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[..., :length, :]  # (B, heads, length, dim), views: no copy
        self.values = self._value_buffer[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.write_slots is not None:  # ZipAR, trees, ragged passes: write at the slots, attend over all of them
            if self.write_slots.dim() == 1:  # the same slots in every row
                self._key_buffer.index_copy_(-2, self.write_slots, key_states)
                self._value_buffer.index_copy_(-2, self.write_slots, value_states)
            else:  # (rows, T): each row at its own slots (`ARImageBackbone.step_ragged`)
                index = self.write_slots[:, None, :, None]
                self._key_buffer.scatter_(-2, index.expand_as(key_states), key_states)
                self._value_buffer.scatter_(-2, index.expand_as(value_states), value_states)
            if self.attend is not None:  # no query sees past this slot: attention reads no further
                return self._key_buffer[..., : self.attend, :], self._value_buffer[..., : self.attend, :]
            return self._key_buffer, self._value_buffer
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the preallocated KV cache holds {self.capacity} positions, {end} were fed")
        self._key_buffer[..., self.length : end, :] = key_states
        self._value_buffer[..., self.length : end, :] = value_states
        self._expose(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (negative, as DynamicLayer.crop takes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._expose(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        if self.is_initialized:
            self._expose(0)


def preallocated_cache(num_layers: int, capacity: int) -> Cache:
    """A transformers Cache of `num_layers` preallocated layers holding up to `capacity` positions each."""
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])


@contextmanager
def writing_at(cache, slots: torch.Tensor, attend: int | None = None) -> Iterator[None]:
    """Inside the block, the cache's preallocated layers (a transformers Cache, or LlamaGen's) write this
    pass's keys and values at `slots` (T,), or row by row at `slots` (rows, T), and return every slot (the
    first `attend` only, when given: the pass's mask is that wide); the length reported afterwards covers the
    furthest slot."""
    for layer in cache.layers:
        layer.write_slots, layer.attend = slots, attend
    try:
        yield
    finally:
        furthest = int(slots.max()) + 1
        for layer in cache.layers:
            layer.write_slots, layer.attend = None, None
            if layer.is_initialized:
                layer._expose(max(layer.length, furthest))


def reserve(cache, capacity: int) -> int:
    """Grow every layer's buffers to at least `capacity` slots (one copy; the filled part kept); the capacity now.

    A token tree (`ARImageBackbone.step_tree`) is written at scratch slots after the cache's end, which near
    the image's end lie past the capacity sized for the image itself.
    """
    for layer in cache.layers:
        if layer.is_initialized and layer.capacity < capacity:
            for name in ("_key_buffer", "_value_buffer"):
                old = getattr(layer, name)
                grown = old.new_zeros(*old.shape[:-2], capacity, old.shape[-1])
                grown[..., : old.shape[-2], :] = old
                setattr(layer, name, grown)
            layer._expose(layer.length)
        layer.capacity = max(layer.capacity, capacity)  # a layer not initialized yet allocates this much
    return max(layer.capacity for layer in cache.layers)


def ragged_slots(cache, first: torch.Tensor, width: int, capacity: int):
    """The layout of a ragged pass (`ARImageBackbone.step_ragged`, ragged EAGLE's head calls): row r writes
    `width` consecutive slots from ``first[r]`` (R,). Grows the buffers past `capacity` in steps of 64 slots
    (each growth copies the cache) so that a padded run near the end has room; returns the slots (R, width),
    how far attention reads (the furthest slot + 1) and the slots each query sees (R, width, attend): its
    row's slots up to its own."""
    reserve(cache, capacity + 64 * -(-width // 64))
    slots = first[:, None] + torch.arange(width, device=first.device)[None]
    attend = int(slots.max()) + 1
    visible = torch.arange(attend, device=first.device)[None, None, :] <= slots[:, :, None]
    return slots, attend, visible


def keep_rows(cache, rows: torch.Tensor) -> None:
    """Keep only the cache rows ``rows`` (k,), in this order (one copy of them): a batch drops its finished images
    (`ARImageBackbone.keep_images`, a ragged EAGLE head's own cache)."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for name in ("_key_buffer", "_value_buffer"):
            buffer = getattr(layer, name)
            setattr(layer, name, buffer.index_select(0, rows.to(buffer.device)))
        layer._expose(layer.length)


def copy_rows(cache, rows: torch.Tensor):
    """A new cache holding only the rows ``rows`` (k,) of `cache`, in this order (one copy of them; `cache` is left
    as it is): a scratch batch of some images, such as ragged MuLo-SD drafting the images that start a block."""
    copied = copy.copy(cache)
    copied.layers = []
    for layer in cache.layers:
        clone = copy.copy(layer)
        if layer.is_initialized:
            for name in ("_key_buffer", "_value_buffer"):
                buffer = getattr(layer, name)
                setattr(clone, name, buffer.index_select(0, rows.to(buffer.device)))
            clone._expose(layer.length)
        copied.layers.append(clone)
    return copied


def keep_slots(cache, sources: torch.Tensor, start: int) -> None:
    """Row by row, move the keys and values at slots ``sources[r]`` (R, k) to slots ``start .. start + k - 1``,
    and end the cache there: a token tree's accepted path becomes the cache's continuation."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for name in ("_key_buffer", "_value_buffer"):
            buffer = getattr(layer, name)  # (R, heads, capacity, dim)
            index = sources.to(buffer.device)[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[-1])
            buffer[..., start : start + sources.shape[1], :] = buffer.gather(2, index)
        layer._expose(start + sources.shape[1])
