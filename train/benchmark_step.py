"""Head-training overhead: step time of SSD distillation vs the frozen backbone's forward alone.

    python -m train.benchmark_step [--batch-size 16] [--repeats 5] [--out outputs/benchmark_step.json]

Measures, on the committed digits backbone (or `--backbone DIR`), median seconds of
(a) the teacher forward alone (hidden states of [cond; uncond] twins under no_grad),
(b) an online training step (a + head losses + backward + optimizer step), and
(c) an offline training step (states read from the batch, as from the corpus).
Prints them and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backbones.digits import DigitsBackbone
from common.atomic_io import atomic_write_text
from common.paths import PROJECT_ROOT
from data.corpus import batch_condition
from train.ssd_module import SSDDistillation


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default=str(PROJECT_ROOT / "checkpoints" / "digits-backbone"))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=str(PROJECT_ROOT / "outputs" / "benchmark_step.json"))
    args = parser.parse_args()

    backbone = DigitsBackbone.from_pretrained(args.backbone)
    module = SSDDistillation(backbone, head=dict(width=args.width), optimizer=torch.optim.AdamW, cfg_scale=3.0)
    optimizer = torch.optim.AdamW(module.heads.parameters(), lr=1e-4)
    n = backbone.geometry.num_tokens
    batch = {
        "tokens": torch.randint(0, backbone.codebook_size, (args.batch_size, n)),
        "class_id": torch.randint(0, 10, (args.batch_size,)),
    }
    condition = batch_condition(batch)
    recorded = backbone.teacher_forced_hidden(condition, batch["tokens"], guided=True)  # (2B, N, H)
    offline_batch = {**batch, "hidden": recorded.view(2, args.batch_size, n, -1).transpose(0, 1).half()}

    def train_step(step_batch):
        loss, _ = module.losses(step_batch, noise=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    figures = {
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "teacher_forward_seconds": _median_seconds(
            lambda: backbone.teacher_forced_hidden(condition, batch["tokens"], guided=True), args.repeats
        ),
        "online_step_seconds": _median_seconds(lambda: train_step(batch), args.repeats),
        "offline_step_seconds": _median_seconds(lambda: train_step(offline_batch), args.repeats),
    }
    figures["online_over_teacher"] = figures["online_step_seconds"] / figures["teacher_forward_seconds"]
    for key, value in figures.items():
        print(f"{key:>26}: {value:.3f}" if isinstance(value, float) else f"{key:>26}: {value}")
    atomic_write_text(Path(args.out), json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.out}")
    return figures


if __name__ == "__main__":
    main()
