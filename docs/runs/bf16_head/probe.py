"""bf16 backbones with the final norm and image head in bf16 (the model's own) or in float32 (`float32_head`).

    python docs/runs/bf16_head/probe.py lumina_mgpt_7b_16x16,janus_pro_7b_16x16,emu3_gen_16x16
    python docs/runs/bf16_head/probe.py janus,emu3,lumina,llamagen,tar

Prints, per model and head: (1) how much the guided scores of the same tokens differ between one-token steps
and one teacher-forced pass, and at how many positions their argmax differs; (2) where each lossless method's
greedy tokens first leave greedy AR's, with AR's top-two margin and the bf16 bound there
(tests/test_lossless_bf16.py). The figures of 2026-12-02 are 16x16.jsonl and tiny.jsonl beside this file.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import torch  # noqa: E402
from conftest import random_eagle_head, random_ssd_heads  # noqa: E402
from test_lossless_bf16 import CFG_SCALE, first_divergence, greedy_ar_with_margins, tiny_bf16  # noqa: E402

from decode import SamplingConfig, SSDDecodeConfig, generate_ssd  # noqa: E402
from decode.eagle import EagleDecodeConfig, generate_eagle  # noqa: E402
from decode.sjd import SJDDecodeConfig, generate_sjd  # noqa: E402
from decode.zipar import ZipARDecodeConfig, generate_zipar  # noqa: E402


def guided_scores(backbone, hidden):
    return backbone.guide(backbone.logits(hidden), CFG_SCALE)


def pass_length_dependence(backbone, condition, tokens) -> tuple[float, int]:
    """Max |score difference| and argmax disagreements: the same tokens stepped one by one vs in one pass."""
    state, first = backbone.prefill(condition, True)
    whole = guided_scores(backbone, torch.cat([first, backbone.step(state, tokens[:, :-1])], dim=1))
    state, hidden = backbone.prefill(condition, True)
    steps = [hidden] + [backbone.step(state, tokens[:, i : i + 1]) for i in range(tokens.shape[1] - 1)]
    stepped = guided_scores(backbone, torch.cat(steps, dim=1))
    return float((whole - stepped).abs().amax()), int((whole.argmax(-1) != stepped.argmax(-1)).sum())


def lossless_methods(backbone, condition, sampling) -> dict:
    ssd_heads = random_ssd_heads(backbone.hidden_size, seed=1, std=0.3).to(torch.bfloat16)
    eagle_head = random_eagle_head(backbone).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    return {
        "ssd_exact_lookahead": generate_ssd(
            backbone, ssd_heads, condition, sampling, config=SSDDecodeConfig(lookahead=True, grid_steps=6)
        ),
        "sjd": generate_sjd(backbone, condition, sampling, generator, SJDDecodeConfig()),
        "eagle": generate_eagle(backbone, eagle_head, condition, sampling, None, EagleDecodeConfig(6)),
        "zipar_rows": generate_zipar(
            backbone, condition, sampling, config=ZipARDecodeConfig(window=backbone.geometry.cols)
        ),
    }


def main(models: list[str]) -> None:
    for model in models:
        for float32_head in (False, True):
            backbone, condition = tiny_bf16(model)
            backbone.float32_head = float32_head
            reference, margins, bounds = greedy_ar_with_margins(backbone, condition, CFG_SCALE)
            difference, flips = pass_length_dependence(backbone, condition, reference)
            sampling = SamplingConfig(cfg_scale=CFG_SCALE, greedy=True)
            divergences = {
                name: [
                    None if p is None else (p, round(float(margins[i, p]), 5), round(float(bounds[i, p]), 5))
                    for i, p in enumerate(first_divergence(result.tokens, reference))
                ]
                for name, result in lossless_methods(backbone, condition, sampling).items()
            }
            figures = {
                "tokens": reference.shape[1],
                "steps_vs_one_pass_max_score_diff": difference,
                "argmax_flips": flips,
                "ar_positions_margin_below_bound": int((margins <= bounds).sum()),
                "first_divergence": divergences,
            }
            print(f"{model} float32_head={float32_head}", json.dumps(figures), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
