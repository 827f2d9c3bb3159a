"""What the CSpD-on-MAR exactness tests measure, for tiny random MARs and the embedded one alike."""

from __future__ import annotations

import torch
from scipy.stats import kstest

from backbones.mar import MARBackbone, gather_positions, reveal_steps
from decode.cspd_mar import generate_cspd_mar


def draws(batch: int, model: MARBackbone, seed: int = 1, dtype: torch.dtype = torch.float64):
    """One random order per image and every position's trajectory noise, seeded."""
    generator = torch.Generator().manual_seed(seed)
    orders = torch.stack([torch.randperm(model.seq_len, generator=generator) for _ in range(batch)])
    shape = (batch, model.seq_len, model.diffusion.noise_steps, model.token_dim)
    return orders, torch.randn(shape, generator=generator, dtype=dtype)


@torch.no_grad()
def standardized_tokens(
    model, tokens, class_ids, orders, noise, num_iter, cfg, temperature=1.0, steps=None
) -> torch.Tensor:
    """(x - mean) / std of every token under `model`'s own final-step Gaussian given the tokens revealed before
    its step and its trajectory noise: exactly N(0, 1) and independent when `tokens` have the model's distribution
    (the chain rule, step by step: a step's tokens are independent given what came before). `steps` replaces the
    schedule's (`reveal_steps` of `num_iter` and `cfg`): the statistic of a sampler that reveals those."""
    seq, dim = model.seq_len, model.token_dim
    tokens = tokens.reshape(len(class_ids), seq, dim).to(noise.dtype)
    known = torch.zeros(len(class_ids), seq, dtype=torch.bool)
    guided = cfg != 1.0
    classes = model.class_embedding(class_ids, guided)
    out = []
    for step in reveal_steps(seq, num_iter, cfg) if steps is None else steps:
        positions = orders[:, step.start : step.end]
        z = model.conditions_at(tokens, known, classes, positions)
        gaussian = model.sample_positions(z, gather_positions(noise, positions), step.cfg_scale, temperature)
        out.append(((gather_positions(tokens, positions) - gaussian.final_mean) / gaussian.final_std).flatten())
        known = known.scatter(1, positions, True)
    return torch.cat(out)


def cspd_mar_statistic(target, drafter, settings, num_iter, cfg, class_ids, dtype=torch.float64):
    """CSpD on MAR's tokens for `class_ids` at fixed orders, noise and seed, and the KS p-value of their
    `standardized_tokens` against N(0, 1): (p-value, GenerationResult)."""
    orders, noise = draws(len(class_ids), target, seed=11, dtype=dtype)
    result = generate_cspd_mar(
        target, drafter, class_ids, settings, num_iter, cfg, orders=orders, noise=noise,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    u = standardized_tokens(target, result.tokens, class_ids, orders, noise, num_iter, cfg)
    return kstest(u.numpy(), "norm").pvalue, result
