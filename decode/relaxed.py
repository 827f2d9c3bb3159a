"""LANTERN's relaxed acceptance: pool the target probability of a draft's nearest codebook neighbours.

Latent proximity-aware relaxation (Jang et al., LANTERN, ICLR 2025): image tokens
whose codebook latents are close look alike, so a draft ``x`` may count the
target probability of its ``k`` nearest neighbours ``n_1(x), n_2(x), ...`` as its
own, up to a budget ``delta``: ``c_m = sum_{j<=m} p(n_j(x))`` for the largest
``m`` with ``c_m <= delta``. MuLo-SD's local verification and SSD's
``decode.ssd.relax_delta`` both use it. With ``delta = 0`` it is standard
acceptance; with ``delta > 0`` the output distribution is no longer exactly the
backbone's.
"""

from __future__ import annotations

import torch


def latent_neighbours(latents: torch.Tensor, k: int) -> torch.Tensor:
    """(V, D) codebook latents -> (V, k) indices of each entry's k nearest other entries, nearest first."""
    distances = torch.cdist(latents.float(), latents.float())  # (V, V)
    distances.fill_diagonal_(float("inf"))
    k = min(k, latents.shape[0] - 1)
    return distances.topk(k, dim=-1, largest=False).indices


def pooled_neighbour_mass(p: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, delta: float) -> torch.Tensor:
    """LANTERN's c_m: the largest prefix sum of p over x's nearest neighbours that stays <= delta.

    p (..., V), tokens (...) -> (...).
    """
    if neighbours.shape[-1] == 0 or delta <= 0:
        return torch.zeros(tokens.shape, dtype=p.dtype, device=p.device)
    neighbour_mass = p.gather(-1, neighbours[tokens])  # (..., k), nearest first
    prefix = neighbour_mass.cumsum(-1)
    return torch.where(prefix <= delta, prefix, torch.zeros_like(prefix)).amax(-1)
