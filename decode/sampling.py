"""Turning next-token scores into distributions and tokens: temperature, top-k, top-p, greedy.

Every generator (baseline and speculative) goes through `token_distribution`, so
a speculative method verifies against exactly the distribution the baseline
samples from. Greedy decoding is the one-hot distribution on the argmax, which
makes the speculative acceptance rules reduce to "accept iff the argmax agrees".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn from the backbone's (guided) scores."""

    cfg_scale: float = 1.0  # classifier-free guidance; 1.0 means conditional only (no uncond twin)
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # nucleus mass; 1.0 keeps every token
    greedy: bool = False  # argmax instead of sampling (temperature/top-k/top-p are then irrelevant)

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=true for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")

    @property
    def guided(self) -> bool:
        """Whether the unconditional twin is run at all (scale 1 needs no twin)."""
        return self.cfg_scale != 1.0


def token_distribution(scores: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Scores (..., V) -> the probabilities (..., V) a token is drawn from."""
    scores = scores.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
    if sampling.temperature != 1.0:  # skip a no-op division: this runs once per drafted token
        scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per distribution: probs (..., V) -> tokens (...)."""
    uniform = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)
    return sample_with(probs, uniform)


def sample_with(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs (..., V) and uniforms in [0, 1) (...) -> tokens (...).

    The token is the first whose cumulative mass exceeds ``uniform * total``, so a
    zero-probability token is never drawn and the mass need not be normalised.
    Drawing the uniforms up front lets a sequential drafter sample a whole chain
    with one call to the generator, and this is a few element-wise kernels where
    torch.multinomial is one slow call per draw on CPU.
    """
    cumulative = probs.float().cumsum(-1)  # half-precision sums would bias the draw
    threshold = uniform[..., None] * cumulative[..., -1:]
    return (cumulative <= threshold).sum(-1).clamp(max=probs.shape[-1] - 1)


def sample_tokens(
    scores: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Scores (..., V) -> tokens (...), by the sampling settings."""
    if sampling.greedy:
        return scores.argmax(-1)
    return sample_from(token_distribution(scores, sampling), generator)


_MASK32 = 0xFFFFFFFF
_MURMUR_1, _MURMUR_2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values (products wrap, the mask keeps
    their low 32 bits)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MURMUR_1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _MURMUR_2) & _MASK32
    return x ^ (x >> 16)


def _mix32_uint32(x: np.ndarray) -> np.ndarray:
    """`_mix32` on uint32 arrays, whose products wrap by themselves."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_MURMUR_1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(_MURMUR_2)
    return x ^ (x >> np.uint32(16))


def keyed_uniforms(seeds: torch.Tensor, *keys: torch.Tensor | int) -> torch.Tensor:
    """Uniforms in [0, 1) that depend on (seed, keys) only: int64 tensors broadcast together -> float32.

    A generator whose images share a batch draws each image's uniforms by its own seed and the event's keys
    (grid position, attempt, kind), not from one stream in batch order: an image then draws the same numbers
    whichever images share its batch and in which order they finish (continuous batching). 24 bits of a
    hash chain (MurmurHash3's finaliser, combined as boost's hash_combine) of the values' low 32 bits.

    On the CPU the chain runs in NumPy's uint32 arithmetic (a ragged generator calls this a few times per pass,
    and each of the torch path's ~100 small kernels costs more than its arithmetic); elsewhere in torch's int64
    with masks. Both give the same bits (tests/test_keyed_uniforms.py).
    """
    on_cpu = seeds.device.type == "cpu" and all(
        not isinstance(key, torch.Tensor) or key.device.type == "cpu" for key in keys
    )
    return _keyed_uniforms_uint32(seeds, keys) if on_cpu else _keyed_uniforms_int64(seeds, keys)


def _keyed_uniforms_int64(seeds: torch.Tensor, keys) -> torch.Tensor:
    """`keyed_uniforms`' chain in torch's int64 arithmetic, masked to 32 bits (any device)."""
    h = _mix32(seeds.long())
    for key in keys:
        key = torch.as_tensor(key, dtype=torch.long, device=h.device)
        h = _mix32(h ^ (_mix32(key) + _GOLDEN + (h << 6) + (h >> 2)))
    return (h >> 8).float() * (1.0 / (1 << 24))


def _keyed_uniforms_uint32(seeds: torch.Tensor, keys) -> torch.Tensor:
    """`keyed_uniforms`' chain on CPU tensors in uint32 arithmetic: casting int64 to uint32 keeps the low 32 bits,
    as the torch path's masks do, and sums and shifts wrap where that path masks them."""

    def low_bits(value) -> np.ndarray:
        array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value, dtype=np.int64)
        return array.astype(np.int64, copy=False).astype(np.uint32)

    with np.errstate(over="ignore"):  # 0-d arrays compute as NumPy scalars, which warn where they wrap
        h = _mix32_uint32(low_bits(seeds))
        for key in keys:
            h = _mix32_uint32(
                h ^ (_mix32_uint32(low_bits(key)) + np.uint32(_GOLDEN) + (h << np.uint32(6)) + (h >> np.uint32(2)))
            )
        uniforms = (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))
    return torch.from_numpy(np.asarray(uniforms))


def image_seeds(count: int, generator: torch.Generator | None) -> torch.Tensor:
    """One seed per image of a queue (for `keyed_uniforms`): a base drawn from `generator` plus the image's index
    in the queue's order.

    Distinct within a queue (below 2**32 images), so no two images share their draws: seeds drawn independently
    from 31 bits would collide in a 50,000-image queue with probability ~0.44, and such a pair would share every
    uniform (the same image where the prompt is the same). The hash chain spreads neighbouring seeds apart."""
    device = generator.device if generator is not None else None
    base = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device)
    return base + torch.arange(count, device=device)
