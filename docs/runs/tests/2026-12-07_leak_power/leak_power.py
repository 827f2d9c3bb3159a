"""How reliably each ragged generator's planted leaks between images change an image's sampled tokens, at generator
seeds 0-5 (each test in tests/ uses one seed): a leak test whose detection depends on a lucky seed has little power.

    python docs/runs/tests/2026-12-07_leak_power/leak_power.py   # from the repository root
"""

import sys

import torch

sys.path.insert(0, "tests")
import test_cspd_ragged as cspd_tests  # noqa: E402
import test_eagle_ragged as eagle_tests  # noqa: E402
import test_mulo_ragged as mulo_tests  # noqa: E402
import test_sjd_ragged as sjd_tests  # noqa: E402
import test_ssd_ragged as ssd_tests  # noqa: E402
from conftest import TINY_BACKBONE, random_ssd_heads, tiny_continuous  # noqa: E402
from distribution_check import enumerable_backbone  # noqa: E402
from ragged_leaks import PLANTED_LEAKS  # noqa: E402
from test_decode_cspd import perturbed_drafter  # noqa: E402

from backbones.digits import random_digits_backbone  # noqa: E402
from decode.sampling import SamplingConfig  # noqa: E402


class Patches:
    """monkeypatch's setattr, undone by `undo`."""

    def __init__(self):
        self.saved = []

    def setattr(self, owner, name, value):
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()


def detections(name, leaks, run, same):
    """run(seed, slots) -> tokens; a leak is caught at a seed when the 4-slot tokens with it differ from alone."""
    for leak in leaks:
        caught = 0
        for seed in range(6):
            alone = run(seed, 1)
            patches = Patches()
            leak(patches)
            try:
                caught += not same(run(seed, 4), alone)
            finally:
                patches.undo()
        print(f"{name:5s} {leak.__name__:30s} caught at {caught}/6 seeds")


cfg3 = SamplingConfig(cfg_scale=3.0)
digits = random_digits_backbone(seed=0, **TINY_BACKBONE)
grid_heads = random_ssd_heads(digits.hidden_size, seed=0, std=0.3, grid=True)
for label, queue in (("ssd10", ssd_tests.QUEUE), ("ssd40", ssd_tests.LEAK_QUEUE)):
    detections(
        label,
        PLANTED_LEAKS,
        lambda seed, slots, queue=queue: (
            ssd_tests._ragged(digits, grid_heads, queue, cfg3, seed=seed, slots=slots, window=2).tokens
        ),
        torch.equal,
    )
sharp = enumerable_backbone(grid_size=8, levels=8, sharpen=2.0)
detections(
    "sjd",
    PLANTED_LEAKS,
    lambda seed, slots: (
        sjd_tests._sjd(sharp, sjd_tests.QUEUE, sjd_tests.SAMPLED, seed=seed, slots=slots, window=4).tokens
    ),
    torch.equal,
)
head = eagle_tests.random_eagle_head(sharp)
detections(
    "eagle",
    PLANTED_LEAKS,
    lambda seed, slots: (
        eagle_tests._ragged(sharp, head, eagle_tests.QUEUE, cfg3, seed=seed, slots=slots, depth=3).tokens
    ),
    torch.equal,
)
sharper = enumerable_backbone(grid_size=8, levels=8, sharpen=4.0)
drafter = mulo_tests.drafter_for(sharper)
detections(
    "mulo",
    PLANTED_LEAKS,
    lambda seed, slots: mulo_tests._mulo(sharper, drafter, seed=seed, slots=slots).tokens,
    torch.equal,
)
continuous = tiny_continuous()
continuous_drafter = perturbed_drafter(continuous, scale=1e-3)
detections(
    "cspd",
    [
        cspd_tests.feed_from_the_next_image,
        cspd_tests.keep_the_previous_prompt,
        cspd_tests.drain_into_other_images_rows,
        cspd_tests.noise_of_the_next_image,
    ],
    lambda seed, slots: cspd_tests._cspd(continuous, continuous_drafter, seed=seed, slots=slots, drain=0.9).tokens,
    lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-3),
)
