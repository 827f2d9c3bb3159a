"""Where exact CSpD's time goes on the embedded MAR: pass costs by rows, diffusion-run costs, acceptance by token.

    python docs/runs/cspd_mar_digits/probe.py [--out probe.json]

Measures, with the machine to itself (medians of repeated calls, 2 CPU threads):
- the target's and the drafter's encoder-decoder pass at the rows a method feeds (MAR's twins of CFG: 2 per image;
  exact CSpD's verification: 2 x (gamma + 1) per image), at batch 1 and 16, each at the mid-generation known count;
- one diffusion run (25 reverse steps) for the tokens of a step (1 per image) and for a round's (gamma + 1 per image);
- exact CSpD's token acceptance on 16 images (batch 1, CFG 3, 144 steps) split by what the target's token is:
  background (every pixel of the patch below -0.9, i.e. < 5% intensity) or stroke; and the mean absolute difference
  of the drafter's and the target's final means against the final std.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from backbones.mar import load_mar_backbone
from decode.cspd_mar import CSpDMARConfig, _Run, generate_cspd_mar
from decode.pass_cost import median_seconds

ROOT = Path(__file__).resolve().parents[3]


def seconds(call) -> float:
    """Median of 7 timed calls after one untimed (decode.pass_cost.median_seconds, on the CPU)."""
    return median_seconds(call, torch.device("cpu"), 7, 1)


@torch.inference_mode()
def pass_costs(model, batch: int, rows_per_image: int) -> float:
    rows = batch * rows_per_image
    tokens = torch.randn(rows, model.seq_len, model.token_dim)
    known = torch.zeros(rows, model.seq_len, dtype=torch.bool)
    known[:, : model.seq_len // 2] = True
    classes = model.class_emb(torch.zeros(rows, dtype=torch.long))
    return seconds(lambda: model.conditions(tokens, known, classes))


@torch.inference_mode()
def diffusion_cost(model, tokens: int) -> float:
    z = torch.randn(2 * tokens, model.hidden_size)  # guided twins
    noise = torch.randn(tokens, model.diffusion.noise_steps, model.token_dim)
    return seconds(lambda: model.diffusion.sample(z, noise, 3.0, 1.0, guided=True))


@torch.inference_mode()
def acceptance_by_token(target, drafter, images: int = 16) -> dict:
    """Token acceptance of exact CSpD split by background/stroke, from the judge's own verdicts."""
    verdicts = {"background": [0, 0], "stroke": [0, 0]}
    gaps = []
    judge = _Run.judge

    def recording_judge(self, drafted, target_sample, settings, counts, verified=None):
        kept, replaced = judge(self, drafted, target_sample, settings, counts, verified)
        background = (target_sample.final_mean < -0.9).all(-1)
        judged = torch.ones_like(kept) if verified is None else ~verified[:, None].expand_as(kept)
        for name, where in (("background", background & judged), ("stroke", ~background & judged)):
            verdicts[name][0] += int((kept & where).sum())
            verdicts[name][1] += int(where.sum())
        gaps.append(((drafted.final_mean - target_sample.final_mean).abs() / target_sample.final_std)[judged].mean())
        return kept, replaced

    _Run.judge = recording_judge
    try:
        for seed in range(images):
            generate_cspd_mar(
                target, drafter, torch.tensor([seed % 10]), CSpDMARConfig(), target.num_iter, 3.0,
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
    finally:
        _Run.judge = judge
    out = {name: {"accepted": a, "judged": n, "rate": a / max(n, 1)} for name, (a, n) in verdicts.items()}
    out["mean |mu_q - mu_p| / std_p per value"] = float(torch.stack(gaps).mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("probe.json")))
    args = parser.parse_args()
    torch.set_num_threads(2)
    load = lambda name: load_mar_backbone(ROOT / "checkpoints" / name, num_iter=144, final_step_noise=True)  # noqa: E731
    target, drafter = load("mar-digits"), load("mar-digits-drafter")
    gamma = CSpDMARConfig().gamma
    figures = {"passes": {}, "diffusion": {}}
    for batch in (1, 16):
        for name, model in (("target", target), ("drafter", drafter)):
            for label, rows in (("guided step (2 rows per image)", 2), (f"verify {gamma}+1 prefixes", 2 * (gamma + 1))):
                if name == "drafter" and rows > 2:
                    continue
                figures["passes"][f"{name} batch {batch} {label}"] = pass_costs(model, batch, rows)
        for name, model in (("target", target), ("drafter", drafter)):
            figures["diffusion"][f"{name} batch {batch} one token per image"] = diffusion_cost(model, batch)
        figures["diffusion"][f"target batch {batch} {gamma + 1} tokens per image"] = diffusion_cost(
            target, batch * (gamma + 1)
        )
    figures["acceptance"] = acceptance_by_token(target, drafter)
    text = json.dumps(figures, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
