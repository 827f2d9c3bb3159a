"""The baseline at batch 16 (CFG 3), eager and compiled passes alternating batch by batch in one process, so that
host drift falls on both: seconds per image of 4 batches each (ar_eager_vs_compiled.json)."""

import json
import time

import torch

from backbones.base import Condition
from backbones.digits import load_digits_backbone
from decode import SamplingConfig, generate_ar

torch.set_grad_enabled(False)
backbone = load_digits_backbone("checkpoints/digits-backbone")
sampling = SamplingConfig(cfg_scale=3.0)
module = backbone.transformer


def seconds_per_image(seed: int) -> float:
    began = time.perf_counter()
    generate_ar(backbone, Condition(class_ids=torch.arange(16) % 10), sampling, torch.Generator().manual_seed(seed))
    return (time.perf_counter() - began) / 16


seconds_per_image(0)  # eager warm-up
backbone.compile_passes()
compiled_call = module._compiled_call_impl  # nn.Module.compile's compiled call; None runs the module eager
seconds_per_image(0)  # compiles the passes
seconds_per_image(1)
times = {"eager": [], "compiled": []}
for seed in range(4):
    for name, call in (("eager", None), ("compiled", compiled_call)):
        module._compiled_call_impl = call
        times[name].append(seconds_per_image(seed))
means = {f"mean_{name}": sum(values) / len(values) for name, values in times.items()}
print(json.dumps({**times, **means}, indent=2))
