"""Tensor operations and host reads per backbone pass, one image each, the main job's SSD heads and
`+experiment=eagle_digits`'s head, batch 1, CFG 3.0, seed 0 (ragged SSD: 8 images over 4 slots).

A tensor operation is an ATen call (on a GPU about one kernel launch each, the pass's included); a host read is a
`.tolist()`, `.item()`, `int(t)`, `bool(t)` or `float(t)` of a tensor, which on a GPU waits for the device to catch
up. Machine-independent counts, not timings. Run from the repository root:

    python docs/runs/trees/2026-12-07_ops_per_pass/ops_per_pass.py > ops_per_pass.json
"""

import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backbones.digits import DigitsBackbone
from decode import (
    Condition,
    RaggedSSDConfig,
    SamplingConfig,
    SSDDecodeConfig,
    generate_ar,
    generate_ssd,
    generate_ssd_ragged,
)
from decode.eagle import EagleDecodeConfig, generate_eagle
from decode.eagle2 import Eagle2DecodeConfig, generate_eagle2
from decode.ssd_tree import SSDTreeConfig, generate_ssd_tree
from heads.export import load_heads

HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


class Counting(TorchDispatchMode):
    """Counts ATen calls and host reads inside the block."""

    def __init__(self):
        super().__init__()
        self.operations, self.reads, self._originals = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_READS:
            original = self._originals[name] = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.reads += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def main() -> None:
    backbone = DigitsBackbone.from_pretrained("checkpoints/digits-backbone")
    ssd = load_heads("checkpoints/ssd_digits", backbone)
    eagle = load_heads("checkpoints/eagle_digits", backbone)
    sampling = SamplingConfig(cfg_scale=3.0)
    one, queue = Condition(class_ids=torch.tensor([3])), Condition(class_ids=torch.arange(8) % 10)
    ssd_exact = SSDDecodeConfig(mode="exact", grid_steps=6, lookahead=True, lookahead_confidence=0.05)
    fewest = SSDTreeConfig(nodes=256, top_k=3, beam=32, lookahead=24)
    runs = {
        "ar": lambda g: generate_ar(backbone, one, sampling, g),
        "ssd_exact": lambda g: generate_ssd(backbone, ssd, one, sampling, g, config=ssd_exact),
        "ssd_tree": lambda g: generate_ssd_tree(backbone, ssd, one, sampling, g, SSDTreeConfig()),
        "ssd_tree_fewest_passes": lambda g: generate_ssd_tree(backbone, ssd, one, sampling, g, fewest),
        "eagle": lambda g: generate_eagle(backbone, eagle, one, sampling, g, EagleDecodeConfig()),
        "eagle2": lambda g: generate_eagle2(backbone, eagle, one, sampling, g, Eagle2DecodeConfig()),
        "ssd_ragged (4 slots, 8 images, window 8)": lambda g: generate_ssd_ragged(
            backbone, ssd, queue, sampling, g, config=RaggedSSDConfig(slots=4, window=8)
        ),
    }
    figures = {}
    for name, run in runs.items():
        with Counting() as counting:
            result = run(torch.Generator().manual_seed(0))
        passes = result.forward_passes
        figures[name] = {
            "passes": passes,
            "tensor_ops_per_pass": round(counting.operations / passes),
            "host_reads_per_pass": round(counting.reads / passes, 1),
        }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
