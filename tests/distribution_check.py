"""Goodness of fit of sampled images against a tiny backbone's enumerated image distribution.

A lossless speculative method must sample images with exactly the probability
the backbone's own AR sampling gives them. On a grid small enough to enumerate
(2x2 or 3x3 tokens, 2-3 levels) that probability is known for every image, so
a chi-square test on the sampled images has the power to catch a biased rule
(correlated drafts, a residual without its clamp) that per-token checks miss.
"""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare

from backbones.digits import random_digits_backbone
from decode.sampling import SamplingConfig, token_distribution


def enumerable_backbone(grid_size: int = 3, levels: int = 2, seed: int = 3, sharpen: float = 1.0):
    """A random digits backbone small enough to enumerate (levels ** grid_size ** 2 images)."""
    backbone = random_digits_backbone(
        seed=seed, grid_size=grid_size, levels=levels, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32
    )
    if sharpen != 1.0:
        with torch.no_grad():
            for parameter in backbone.parameters():
                parameter.mul_(sharpen)
    return backbone


def image_distribution(backbone, class_id: int, sampling: SamplingConfig) -> dict[tuple, float]:
    """P(image) under the backbone's AR sampling, for every image of its grid (by enumeration)."""
    n, v = backbone.geometry.num_tokens, backbone.codebook_size
    images = torch.tensor(list(itertools.product(range(v), repeat=n)))  # (v^n, n)
    class_ids = torch.full((len(images),), class_id)
    with torch.no_grad():
        logits = backbone(images, class_ids)
        if sampling.guided:
            uncond = backbone(images, torch.full_like(class_ids, backbone.config.null_class))
            logits = uncond + sampling.cfg_scale * (logits - uncond)
    probs = token_distribution(logits, sampling).gather(-1, images[..., None])[..., 0].prod(-1)
    return {tuple(image.tolist()): float(p) for image, p in zip(images, probs)}


def marginal(truth: dict[tuple, float], positions: list[int]) -> dict[tuple, float]:
    """The enumerated distribution of the tokens at `positions` (grid indices) alone."""
    out: dict[tuple, float] = {}
    for image, p in truth.items():
        key = tuple(image[i] for i in positions)
        out[key] = out.get(key, 0.0) + p
    return out


def fit_pvalue(images: list[list[int]], truth: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Chi-square p-value of sampled images against their enumerated probabilities.

    Every image whose expected count is at least `min_expected` is a bin of its
    own; all rarer images share one pooled bin, so every sample is counted and a
    method that leaks mass onto rare images is caught (no leak allowance).
    """
    draws = len(images)
    observed: dict[tuple, int] = {}
    for image in images:
        observed[tuple(image)] = observed.get(tuple(image), 0) + 1
    unknown = set(observed) - set(truth)
    if unknown:
        raise AssertionError(f"sampled images outside the grid's support: {sorted(unknown)[:3]}")
    common = [image for image, p in truth.items() if p * draws >= min_expected]
    rare = [image for image, p in truth.items() if p * draws < min_expected]
    expected = [truth[image] * draws for image in common]
    counts = [observed.get(image, 0) for image in common]
    rare_expected = sum(truth[image] for image in rare) * draws
    if rare_expected >= min_expected:
        expected.append(rare_expected)
        counts.append(sum(observed.get(image, 0) for image in rare))
    else:  # too little mass to be a bin of its own: it joins the smallest common bin
        smallest = min(range(len(expected)), key=expected.__getitem__)
        expected[smallest] += rare_expected
        counts[smallest] += sum(observed.get(image, 0) for image in rare)
    expected_t = torch.tensor(expected, dtype=torch.float64)
    expected_t *= draws / expected_t.sum()  # the enumerated mass sums to 1 up to rounding
    return float(chisquare(torch.tensor(counts, dtype=torch.float64).numpy(), expected_t.numpy()).pvalue)


def assert_sampled_from(images: list[list[int]], truth: dict[tuple, float], threshold: float = 1e-3) -> None:
    """Fail when the sampled images do not fit the enumerated distribution (p-value below `threshold`)."""
    pvalue = fit_pvalue(images, truth)
    assert pvalue > threshold, f"samples do not have the backbone's distribution (chi-square p = {pvalue:.2e})"
