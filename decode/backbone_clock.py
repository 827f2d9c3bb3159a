"""Where a method's time goes: seconds inside the backbone's forward passes, apart from the rest.

A speculative decoder's wall-clock is its backbone passes plus everything else
(drafting, verification, bookkeeping). The benchmark reports the first part
separately, because it bounds what any drafting optimisation can buy: a method
can never run faster than its passes, so ``AR seconds / backbone seconds`` is
the speedup it would reach if drafting and verification were free. On a CPU,
where a pass over a row costs a multiple of a one-token step, that bound is
what limits the speedup; on a GPU at small batch, the rest usually does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from backbones.base import ARImageBackbone


class BackboneClock:
    """Accumulates the time spent in `prefill` and `step` of one backbone.

    CPU: wall-clock around each call. CUDA: a pair of events around each call on
    the current stream, summed at `seconds` (one synchronisation at the end), so
    the clock does not stall the GPU between passes.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def time(self, call):
        """`call` wrapped so that every invocation adds to this clock."""

        def timed(*args, **kwargs):
            if self.cuda:
                began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                began.record()
                result = call(*args, **kwargs)
                ended.record()
                self._events.append((began, ended))
                return result
            began = time.perf_counter()
            result = call(*args, **kwargs)
            self._cpu_seconds += time.perf_counter() - began
            return result

        return timed

    @property
    def seconds(self) -> float:
        """Total seconds inside the timed calls so far."""
        if not self._events:
            return self._cpu_seconds
        torch.cuda.synchronize()
        return self._cpu_seconds + sum(began.elapsed_time(ended) for began, ended in self._events) / 1000


@contextmanager
def clock_backbone_passes(backbone: ARImageBackbone) -> Iterator[BackboneClock]:
    """Time every `prefill`, `step`, `step_at`, `step_tree` and `step_ragged` of `backbone` inside the block (the
    instance's methods, restored after);
    of a continuous-token backbone also its diffusion head's `sample_tokens`; of MAR its `conditions` passes
    and `sample_positions`.

    Only this backbone's passes are timed: a MuLo-SD drafter's own small model
    is drafting, not verification.
    """
    clock = BackboneClock(next(backbone.parameters()).device)
    # A continuous-token backbone's diffusion head is its own compute too (its drafter's is drafting).
    # MAR (masked, no cache): its encoder-decoder passes and its head's sampling.
    timed = tuple(
        name
        for name in (
            "prefill",
            "step",
            "step_at",
            "step_tree",
            "step_ragged",
            "sample_tokens",
            "conditions",
            "sample_positions",
        )
        if hasattr(backbone, name)
    )
    # An instance may already hold its own version of a method (compiled passes keep prefills eager that way,
    # backbones.base.prefills_stay_eager): that one is wrapped, and put back after.
    own = {name: vars(backbone)[name] for name in timed if name in vars(backbone)}
    for name in timed:
        setattr(backbone, name, clock.time(getattr(backbone, name)))
    try:
        yield clock
    finally:
        for name in timed:
            if name in own:
                setattr(backbone, name, own[name])
            else:
                delattr(backbone, name)  # the class's methods show through again
