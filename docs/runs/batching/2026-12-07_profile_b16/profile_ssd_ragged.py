"""Where ssd_ragged's time goes at batch 16: cProfile of one 32-image queue over 16 slots (the main job's heads,
the ssd_ragged preset), after an untimed run of the same queue (pass costs measured, as a benchmark's warm-up does),
beside ar on the same queue; and the share of the ragged passes' token slots that is padding.

    python docs/runs/batching/2026-12-07_profile_b16/profile_ssd_ragged.py   # from the repository root, machine idle
"""

import cProfile
import pstats
import time

import torch
from ssd_ragged_setup import ssd_ragged_setup

import decode.ssd_ragged as ragged
from backbones.base import Condition
from decode.ar import generate_ar

torch.set_num_threads(2)
backbone, heads, sampling, config = ssd_ragged_setup(slots=16)
queue = Condition(class_ids=torch.arange(32) % 10)

ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(1), config)  # warm-up
began = time.perf_counter()
generate_ar(backbone, queue, sampling, torch.Generator().manual_seed(0))
ar_seconds = time.perf_counter() - began

padding = dict(width=0, used=0)
original_pass = ragged._ragged_pass


def counting_pass(backbone, state, run, *rest):
    out, lengths, starts, ahead = original_pass(backbone, state, run, *rest)
    padding["width"] += out.shape[1] * int(run.active.sum())
    padding["used"] += int(lengths[run.active].sum())
    return out, lengths, starts, ahead


ragged._ragged_pass = counting_pass
profile = cProfile.Profile()
began = time.perf_counter()
profile.enable()
result = ragged.generate_ssd_ragged(backbone, heads, queue, sampling, torch.Generator().manual_seed(0), config)
profile.disable()
seconds = time.perf_counter() - began
print(f"ar {ar_seconds:.2f} s, ssd_ragged {seconds:.2f} s under cProfile, {result.forward_passes} passes")
print(f"padding share of the ragged passes' token slots {1 - padding['used'] / padding['width']:.3f}")
pstats.Stats(profile).sort_stats("cumulative").print_stats("decode/|heads/|scaled_dot_product|step_ragged", 40)
