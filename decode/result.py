"""What every generator returns: the tokens and the cost of getting them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationResult:
    """A generated batch and its cost in backbone forward passes (the machine-independent cost)."""

    tokens: torch.Tensor  # (B, rows, cols) codebook ids; continuous backbones: (B, rows, cols, token_dim)
    forward_passes: int  # backbone forwards for the whole batch, prefill included
    drafted_tokens: int = 0  # speculative methods: tokens proposed by the drafter
    accepted_tokens: int = 0  # speculative methods: drafted tokens kept
    hidden: torch.Tensor | None = None  # (cache rows, N, hidden) pre-norm states, when asked for
    extras: dict = field(default_factory=dict)  # a method's own counts (e.g. CSpD's residual fallbacks)
