"""Cost-aware draft lengths for CSpD (``gamma: auto``): each round drafts the number of tokens (raster CSpD) or
steps (CSpD on MAR) that maximises the expected committed tokens per second.

A round with ``g`` drafts costs ``g`` drafter steps and a verification that grows with ``g`` (on MAR, one row per
draft prefix), so its seconds are close to linear in ``g``: ``c0 + c1 g``, fitted by least squares to the rounds'
measured wall-clock (the first two rounds draft 1 and 2, so the fit has two lengths from the start; a CUDA
device is synchronised before each reading). A round advances the batch by its drafts kept before the first
rejection plus one (the residual or bonus token): ``sum_{k<=g} a^k`` in expectation, with ``a`` the share of
drafts the test reached that it kept so far (a prior of 0.5 with 4 pseudo-counts). The chosen ``g`` maximises
``sum_{k<=g} a^k / (c0 + c1 g)`` over ``1 .. max_gamma``.

Exact: ``g`` is fixed before the round from what earlier rounds gave, and a round is lossless for any ``g``
fixed before it; but the draws of a round depend on its length, so an image's tokens depend on the lengths
chosen (and so on the machine's timings), unlike a fixed ``gamma``'s.
"""

from __future__ import annotations

import time

import torch


class GammaChooser:
    """Draft lengths by expected tokens per second; `start_round` and `end_round` bracket each round."""

    def __init__(self, max_gamma: int, device: torch.device | None = None, prior: float = 0.5):
        if max_gamma < 1:
            raise ValueError(f"cost-aware gamma needs max_gamma >= 1, got {max_gamma}")
        self.max_gamma, self.device, self.prior, self.prior_weight = max_gamma, device, prior, 4.0
        self.reached, self.kept = 0.0, 0.0
        self.lengths: list[int] = []  # each ended round's drafts and seconds, for the cost fit
        self.seconds: list[float] = []
        self._began = 0.0

    def choose(self) -> int:
        """The next round's draft length (the first two rounds: 1, then 2 where allowed)."""
        if len(self.lengths) < 2:  # (rounds alternate choose, end_round: this is the round's index)
            return min(len(self.lengths) + 1, self.max_gamma)
        rate = (self.kept + self.prior * self.prior_weight) / (self.reached + self.prior_weight)
        gammas = torch.arange(1, self.max_gamma + 1, dtype=torch.float64)
        expected = (rate ** torch.arange(0, self.max_gamma + 1, dtype=torch.float64)).cumsum(0)[1:]
        base, slope = self.cost_line()
        return int(torch.argmax(expected / (base + slope * gammas).clamp(min=1e-9))) + 1

    def start_round(self) -> None:
        self._synchronize()
        self._began = time.perf_counter()

    def end_round(self, drafts: int, reached: int, kept: int) -> None:
        """A round of `drafts` drafts per image ended; the test reached `reached` drafts and kept `kept` of them
        (summed over the batch's images)."""
        self._synchronize()
        self.lengths.append(drafts)
        self.seconds.append(time.perf_counter() - self._began)
        self.reached += reached
        self.kept += kept

    def cost_line(self) -> tuple[float, float]:
        """(c0, c1) of a round's seconds ``c0 + c1 g``: least squares over the rounds so far (a slope of 0 while
        they have one length only; never negative)."""
        lengths = torch.tensor(self.lengths, dtype=torch.float64)
        seconds = torch.tensor(self.seconds, dtype=torch.float64)
        if len(lengths) == 0:
            return 1.0, 0.0
        spread = lengths - lengths.mean()
        slope = float((spread * (seconds - seconds.mean())).sum() / (spread**2).sum()) if spread.abs().sum() else 0.0
        slope = max(0.0, slope)
        return max(1e-9, float(seconds.mean()) - slope * float(lengths.mean())), slope

    def _synchronize(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
