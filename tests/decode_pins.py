"""Pinned behaviour of every decoding method: tokens and pass counts at fixed seeds.

Restructuring decode/ must not change what a method produces. Each case below is
one method setting; it runs greedy and sampled, at batch 1 and batch 4, on tiny
seeded backbones with seeded random drafters, and records a hash of the tokens
and the pass, draft and acceptance counts. tests/test_decode_pins.py compares a
fresh run with tests/data/decode_pins.json.

Continuous-token methods (CSpD) sample only, and their tokens are floats: they are
pinned by the counts (exact) and the tokens' sum and first values (to 1e-4, which
other CPUs' float rounding keeps).

Regenerate the file only when a change of behaviour is intended (and say so in
the commit): ``python tests/decode_pins.py --write``.
"""

from __future__ import annotations

import hashlib
import importlib
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
# Ragged lossless MuLo-SD (decode/mulo_ragged.py) with the same drafter
MULO_RAGGED_CASES = [
    ("mulo_ragged", {}),
    ("mulo_ragged_w4_bicubic_slots2", {"window": 4, "upsample_mode": "bicubic", "slots": 2}),
]
# The peers (conf/method/ presets' settings, and variants): (case, generator module, settings)
PEER_CASES = [
    ("sjd", "decode.sjd", {}),
    ("sjd_w3_repeat_left", "decode.sjd", {"window": 3, "init": "repeat_left"}),
    ("gsd", "decode.gsd", {}),
    ("gsd_r0", "decode.gsd", {"rank_radius": 0}),
    ("gsd_loose", "decode.gsd", {"probability_gap": 1.0, "max_distance": 1e9}),  # groups on the tiny backbone
    ("sjd_ragged", "decode.sjd_ragged", {}),
    ("sjd_ragged_w3_repeat_left_slots2", "decode.sjd_ragged", {"window": 3, "init": "repeat_left", "slots": 2}),
    ("gsd_ragged_loose_slots2", "decode.gsd_ragged", {"probability_gap": 1.0, "max_distance": 1e9, "slots": 2}),
    ("zipar_w2", "decode.zipar", {"window": 2}),
    ("zipar_w5", "decode.zipar", {"window": 5}),
    ("eagle", "decode.eagle", {}),
    ("eagle_depth3", "decode.eagle", {"depth": 3}),
    ("lantern", "decode.lantern", {}),
]
# Token trees (decode/ssd_tree.py with the grid heads; decode/eagle2.py with the EAGLE head)
TREE_CASES = [
    ("ssd_tree", "decode.ssd_tree", {"nodes": 32, "top_k": 2, "beam": 4}),
    ("ssd_tree_lookahead", "decode.ssd_tree", {"nodes": 32, "top_k": 3, "beam": 4, "lookahead": 5}),
    (
        "ssd_tree_topk_draft",
        "decode.ssd_tree",
        {"nodes": 12, "top_k": 3, "beam": 2, "draws": "top_k", "confidence": "draft"},
    ),
    ("eagle2", "decode.eagle2", {}),
    (
        "eagle2_sampled_calibrated",
        "decode.eagle2",
        {"nodes": 16, "depth": 4, "top_k": 3, "draws": "sampled", "confidence": "calibrated"},
    ),
]
# Ragged SSD (decode/ssd_ragged.py with the grid heads) at fixed windows, ragged EAGLE and LANTERN at fixed depths
# ("auto" reads the machine's clock)
RAGGED_CASES = [
    ("ssd_ragged", "decode.ssd_ragged", {"window": 0}),
    ("ssd_ragged_w2_slots2", "decode.ssd_ragged", {"window": 2, "slots": 2}),
    ("ssd_ragged_lookahead", "decode.ssd_ragged", {"window": 0, "lookahead": True}),
    ("ssd_ragged_lookahead_w4_slots2", "decode.ssd_ragged", {"window": 4, "slots": 2, "lookahead": True}),
    ("ssd_ragged_prefix_w3_slots2", "decode.ssd_ragged", {"window": 3, "slots": 2, "mode": "prefix", "rounds": 1}),
    ("eagle_ragged", "decode.eagle_ragged", {}),
    ("eagle_ragged_d3_slots2", "decode.eagle_ragged", {"depth": 3, "slots": 2}),
    ("lantern_ragged_slots2", "decode.lantern_ragged", {"slots": 2, "delta": 0.3}),
]
CSPD_CASES = [
    ("cspd", {}),
    ("cspd_relaxed", {"tau": 42.0, "reference_correction": True}),
    ("cspd_unaligned", {"trajectory_alignment": False}),
    ("cspd_g2_prefill15", {"gamma": 2, "prefill_fraction": 0.15}),
]
CSPD_RAGGED_CASES = [
    ("cspd_ragged", {}),
    ("cspd_ragged_g1_slots2", {"gamma": 1, "slots": 2}),
]
CSPD_MAR_CASES = [
    ("cspd_mar", {}),
    ("cspd_mar_reference", {"verification": "window", "tau": 42.0, "reference_correction": True}),
]
CONTINUOUS_RUNS = {"sampled_b1": 1, "sampled_b4": 4}
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


def _eagle_head(backbone):
    from heads.eagle import EagleHead, EagleHeadConfig

    torch.manual_seed(13)
    head = EagleHead(
        EagleHeadConfig(hidden_size=32, num_heads=2, intermediate_size=64, max_positions=backbone.geometry.num_tokens)
    )
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return head.eval()


def _continuous_backbone(nudge: float = 0.0):
    """The tiny continuous digits backbone with a random diffusion output; `nudge` perturbs that output (a
    drafter close to the backbone, so that drafts are accepted part of the time)."""
    from backbones.digits_continuous import random_continuous_digits_backbone

    backbone = random_continuous_digits_backbone(
        seed=0, image_size=8, patch_size=2, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
        head_width=32, head_depth=1, sampling_steps=4,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in backbone.diffusion.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for parameter in backbone.diffusion.net.output.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * nudge)
    return backbone


def _row_heads():
    from heads.cspd import ContinuousRowHeads
    from heads.ssd import SSDHeadConfig

    torch.manual_seed(14)
    heads = ContinuousRowHeads(SSDHeadConfig(hidden_size=32, width=16, depth=1))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return heads.eval()


def _mar_pair():
    """A tiny random MAR target (float64) and a drafter: the target with its decoder blocks nudged."""
    from backbones.mar import random_mar_backbone

    target = random_mar_backbone(seed=0, final_step_noise=True, num_iter=8).double()
    drafter = random_mar_backbone(seed=0, final_step_noise=True, num_iter=8).double()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if name.startswith("decoder_blocks"):
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 1e-9)
    return target, drafter


def _record(result) -> dict:
    tokens = result.tokens.to(torch.int64).contiguous().numpy().tobytes()
    return {
        "tokens_sha1": hashlib.sha1(tokens).hexdigest()[:16],
        "forward_passes": result.forward_passes,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
    }


def _record_continuous(result) -> dict:
    tokens = result.tokens.double().flatten()
    return {
        "tokens_sum": round(float(tokens.sum()), 6),
        "tokens_first": [round(float(value), 6) for value in tokens[:8]],
        "forward_passes": result.forward_passes,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
    }


def compute_pins() -> dict:
    """{case: {run: record}} for every case and run (a few seconds on 2 cores)."""
    from decode.ar import generate_ar
    from decode.mulo import MuLoDecodeConfig, generate_mulo
    from decode.mulo_ragged import RaggedMuLoConfig, generate_mulo_ragged
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
    for name, settings in MULO_RAGGED_CASES:
        config = RaggedMuLoConfig(**settings)
        cases[name] = (
            lambda b, c, s, g, config=config: generate_mulo_ragged(b, drafter, c, s, g, config),
            mulo_backbone,
        )
    for name, module_name, settings in PEER_CASES:
        method = importlib.import_module(module_name).METHOD
        config = method.settings(**settings)
        artefact = _eagle_head(ssd_backbone) if method.artefact else None
        cases[name] = (
            lambda b, c, s, g, method=method, artefact=artefact, config=config: method.generate(
                b, artefact, c, s, g, config
            ),
            ssd_backbone,
        )
    for name, module_name, settings in TREE_CASES + RAGGED_CASES:
        method = importlib.import_module(module_name).METHOD
        config = method.settings(**settings)
        artefact = grid_heads if module_name in ("decode.ssd_tree", "decode.ssd_ragged") else _eagle_head(ssd_backbone)
        cases[name] = (
            lambda b, c, s, g, method=method, artefact=artefact, config=config: method.generate(
                b, artefact, c, s, g, config
            ),
            ssd_backbone,
        )
    pins = {}
    for name, (generate, backbone) in cases.items():
        pins[name] = {}
        for run, (greedy, batch) in RUNS.items():
            sampling = SamplingConfig(cfg_scale=3.0, greedy=greedy)
            generator = torch.Generator().manual_seed(5)
            result = generate(backbone, Condition(class_ids=CLASSES[:batch]), sampling, generator)
            pins[name][run] = _record(result)
    pins.update(_continuous_pins())
    return pins


def _continuous_pins() -> dict:
    from decode.cspd import CSpDConfig, generate_cspd
    from decode.cspd_mar import CSpDMARConfig, generate_cspd_mar
    from decode.cspd_ragged import RaggedCSpDConfig, generate_cspd_ragged
    from decode.cspd_rows import CSpDRowsConfig, generate_cspd_rows
    from decode.sampling import SamplingConfig

    backbone, drafter, heads = _continuous_backbone(), _continuous_backbone(nudge=0.002), _row_heads()
    target, mar_drafter = _mar_pair()
    cases = {}
    for name, settings in CSPD_CASES:
        config = CSpDConfig(**settings)
        cases[name] = lambda c, s, g, config=config: generate_cspd(backbone, drafter, c, s, g, config)
    for name, settings in CSPD_RAGGED_CASES:
        config = RaggedCSpDConfig(**settings)
        cases[name] = lambda c, s, g, config=config: generate_cspd_ragged(backbone, drafter, c, s, g, config)
    cases["cspd_rows"] = lambda c, s, g: generate_cspd_rows(backbone, heads, c, s, g, CSpDRowsConfig())
    for name, settings in CSPD_MAR_CASES:
        config = CSpDMARConfig(**settings)
        cases[name] = lambda c, s, g, config=config: generate_cspd_mar(
            target, mar_drafter, c.class_ids, config, num_iter=8, cfg_scale=3.0, generator=g
        )
    pins = {}
    for name, generate in cases.items():
        pins[name] = {}
        for run, batch in CONTINUOUS_RUNS.items():
            generator = torch.Generator().manual_seed(5)
            result = generate(Condition(class_ids=CLASSES[:batch]), SamplingConfig(cfg_scale=3.0), generator)
            pins[name][run] = _record_continuous(result)
    return pins


if __name__ == "__main__":
    pins = compute_pins()
    if "--write" in sys.argv:
        PINS_FILE.parent.mkdir(exist_ok=True)
        PINS_FILE.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        print(f"wrote {PINS_FILE}")
    else:
        print(json.dumps(pins, indent=1, sort_keys=True))
