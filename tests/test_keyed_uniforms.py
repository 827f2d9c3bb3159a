"""Keyed uniforms (decode/sampling.py) are the ragged generators' randomness: the CPU's uint32 path must give the
bits of the int64 torch path that other devices run (the pinned tokens of tests/data/decode_pins.json were drawn
with the torch path), and the values must depend on (seed, keys) alone and be uniform."""

import pytest
import torch

import decode.sampling as sampling
from decode.sampling import image_seeds, keyed_uniforms


@pytest.mark.parametrize("trial", range(20))
def test_cpu_path_gives_the_torch_paths_bits(trial):
    generator = torch.Generator().manual_seed(trial)
    rows, cols = (int(n) for n in torch.randint(1, 30, (2,), generator=generator))
    # Seeds as image_seeds draws them, and values past 32 bits and below zero (the low 32 bits count).
    seeds = torch.randint(-(2**40), 2**40, (rows, 1), generator=generator)
    seeds[0, 0] = 2**31 - 2
    positions = torch.randint(-(2**35), 2**35, (rows, cols), generator=generator)
    attempts = torch.randint(0, 9, (1, cols), generator=generator)
    with torch.inference_mode():  # the generators call it there
        fast = keyed_uniforms(seeds, positions, attempts, 3)
    assert fast.dtype == torch.float32 and fast.shape == (rows, cols)
    assert torch.equal(fast, sampling._keyed_uniforms_int64(seeds, (positions, attempts, 3)))


def test_scalars_and_broadcasting_keep_their_shapes():
    assert keyed_uniforms(torch.tensor(7), 1, 2).shape == ()
    assert torch.equal(keyed_uniforms(torch.tensor(7), 1, 2), sampling._keyed_uniforms_int64(torch.tensor(7), (1, 2)))
    assert keyed_uniforms(torch.tensor([1, 2, 3])[:, None], torch.arange(5)[None]).shape == (3, 5)


def test_uniforms_depend_on_seed_and_keys_only_and_are_uniform():
    seeds = torch.arange(4000)[:, None]
    first = keyed_uniforms(seeds, torch.arange(4)[None], 0)
    assert torch.equal(first[17:19], keyed_uniforms(seeds[17:19], torch.arange(4)[None], 0))  # not batch order
    assert not torch.equal(first, keyed_uniforms(seeds, torch.arange(4)[None], 1))  # another kind, other draws
    values = first.flatten()
    assert 0 <= float(values.min()) and float(values.max()) < 1
    # Kolmogorov-Smirnov against U(0, 1): 16,000 values, critical value at p = 0.001 is 1.95 / sqrt(n).
    ordered = values.sort().values.double()
    n = len(ordered)
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    statistic = float(torch.maximum(grid - ordered, ordered - (grid - 1 / n)).max())
    assert statistic < 1.95 / n**0.5


def test_image_seeds_are_distinct_within_a_queue_and_reproducible():
    """Two images of one queue never share their draws (independent 31-bit seeds collide in a 50,000-image queue
    with probability ~0.44); the same generator state gives the same seeds, image by image."""
    seeds = image_seeds(100_000, torch.Generator().manual_seed(0))
    assert len(torch.unique(seeds & 0xFFFFFFFF)) == 100_000  # keyed_uniforms reads the low 32 bits
    again = image_seeds(10, torch.Generator().manual_seed(0))
    assert torch.equal(again, seeds[:10])
    assert not torch.equal(again, image_seeds(10, torch.Generator().manual_seed(1)))
