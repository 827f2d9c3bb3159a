"""Pinned behaviour of every decoding method: tokens and pass counts at fixed seeds.

Restructuring decode/ must not change what a method produces. Each case below is
one method setting; it runs greedy and sampled, at batch 1 and batch 4, on tiny
seeded backbones with seeded random drafters, and records a hash of the tokens
and the pass, draft and acceptance counts. tests/test_decode_pins.py compares a
fresh run with tests/data/decode_pins.json.

Regenerate the file only when a change of behaviour is intended (and say so in
the commit): ``python tests/decode_pins.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones.base import Condition  # noqa: E402
from backbones.digits import random_digits_backbone  # noqa: E402

PINS_FILE = Path(__file__).parent / "data" / "decode_pins.json"

# (case name, method family, settings of its decode config)
SSD_CASES = [
    ("ssd_exact", {"mode": "exact"}),
    ("ssd_exact_h3", {"mode": "exact", "horizontal_steps": 3}),
    ("ssd_exact_w3", {"mode": "exact", "window": 3}),
    ("ssd_exact_la", {"mode": "exact", "lookahead": True}),
    ("ssd_exact_relaxed", {"mode": "exact", "relax_k": 3, "relax_delta": 0.3}),
    ("ssd_prefix_r0", {"mode": "autocorrect", "rounds": 0, "correction": "prefix"}),
    ("ssd_prefix_r2_w3", {"mode": "autocorrect", "rounds": 2, "correction": "prefix", "window": 3}),
    ("ssd_target_r1", {"mode": "autocorrect", "rounds": 1, "correction": "target"}),
    ("ssd_residual_r1", {"mode": "autocorrect", "rounds": 1, "correction": "residual"}),
]
GRID_CASES = [
    ("grid_exact", {"mode": "exact"}),
    ("grid_exact_g2", {"mode": "exact", "grid_steps": 2}),
    ("grid_exact_w3", {"mode": "exact", "window": 3}),
    ("grid_exact_la", {"mode": "exact", "lookahead": True}),
    ("grid_exact_g2_la50", {"mode": "exact", "grid_steps": 2, "lookahead": True, "lookahead_confidence": 0.5}),
    ("grid_prefix_r1_g2", {"mode": "autocorrect", "rounds": 1, "grid_steps": 2}),
    ("grid_prefix_r3_g3_la", {"mode": "autocorrect", "rounds": 3, "grid_steps": 3, "lookahead": True}),
    ("grid_residual_r1", {"mode": "autocorrect", "rounds": 1, "correction": "residual"}),
    ("grid_prefix_r2_relaxed", {"mode": "autocorrect", "rounds": 2, "relax_k": 3, "relax_delta": 0.4}),
]
MULO_CASES = [
    ("mulo_relaxed", {}),
    ("mulo_bicubic_k6_d09_r0", {"upsample_mode": "bicubic", "k": 6, "delta": 0.9, "radius": 0}),
    ("mulo_rounds2", {"rounds": 2}),
    ("mulo_point", {"proposal": "point", "upsample_mode": "bilinear"}),
    ("mulo_guided_drafter", {"drafter_cfg_scale": 2.0, "delta": 0.0}),
    ("mulo_exact", {"mode": "exact"}),
    ("mulo_exact_bicubic", {"mode": "exact", "upsample_mode": "bicubic"}),
]
RUNS = {  # run name -> (greedy, batch size)
    "greedy_b1": (True, 1),
    "sampled_b1": (False, 1),
    "greedy_b4": (True, 4),
    "sampled_b4": (False, 4),
}
CLASSES = torch.tensor([3, 0, 7, 9])


def _ssd_backbone():
    return random_digits_backbone(
        seed=0, grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )


def _mulo_backbone():
    return random_digits_backbone(
        seed=0, grid_size=12, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )


def _ssd_heads(grid: bool):
    from heads.ssd import SSDHeadConfig, SSDHeads

    torch.manual_seed(11)
    heads = SSDHeads(SSDHeadConfig(hidden_size=32, width=16, depth=1, grid=grid, grid_above_right=2 if grid else 0))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return heads.eval()


def _mulo_drafter():
    from heads.mulo import MuLoDrafter, MuLoDrafterConfig

    torch.manual_seed(12)
    drafter = MuLoDrafter(
        MuLoDrafterConfig(
            backbone_rows=12,
            backbone_cols=12,
            levels=8,
            scale=3,
            hidden_size=16,
            num_layers=1,
            num_heads=1,
            intermediate_size=32,
        )
    )
    for parameter in drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return drafter.eval()


def _record(result) -> dict:
    tokens = result.tokens.to(torch.int64).contiguous().numpy().tobytes()
    return {
        "tokens_sha1": hashlib.sha1(tokens).hexdigest()[:16],
        "forward_passes": result.forward_passes,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
    }


def compute_pins() -> dict:
    """{case: {run: record}} for every case and run (a few seconds on 2 cores)."""
    from decode.ar import generate_ar
    from decode.mulo import MuLoDecodeConfig, generate_mulo
    from decode.sampling import SamplingConfig
    from decode.ssd import SSDDecodeConfig, generate_ssd

    ssd_backbone, mulo_backbone = _ssd_backbone(), _mulo_backbone()
    heads, grid_heads, drafter = _ssd_heads(False), _ssd_heads(True), _mulo_drafter()
    cases = {"ar": (lambda b, c, s, g: generate_ar(ssd_backbone, c, s, g), ssd_backbone)}
    for name, settings in SSD_CASES:
        config = SSDDecodeConfig(**settings)
        cases[name] = (lambda b, c, s, g, config=config: generate_ssd(b, heads, c, s, g, config), ssd_backbone)
    for name, settings in GRID_CASES:
        config = SSDDecodeConfig(**settings)
        cases[name] = (lambda b, c, s, g, config=config: generate_ssd(b, grid_heads, c, s, g, config), ssd_backbone)
    for name, settings in MULO_CASES:
        config = MuLoDecodeConfig(**settings)
        cases[name] = (lambda b, c, s, g, config=config: generate_mulo(b, drafter, c, s, g, config), mulo_backbone)
    pins = {}
    for name, (generate, backbone) in cases.items():
        pins[name] = {}
        for run, (greedy, batch) in RUNS.items():
            sampling = SamplingConfig(cfg_scale=3.0, greedy=greedy)
            generator = torch.Generator().manual_seed(5)
            result = generate(backbone, Condition(class_ids=CLASSES[:batch]), sampling, generator)
            pins[name][run] = _record(result)
    return pins


if __name__ == "__main__":
    pins = compute_pins()
    if "--write" in sys.argv:
        PINS_FILE.parent.mkdir(exist_ok=True)
        PINS_FILE.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        print(f"wrote {PINS_FILE}")
    else:
        print(json.dumps(pins, indent=1, sort_keys=True))
