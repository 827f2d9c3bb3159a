"""A Hydra callback that ranks the jobs of a multirun sweep by a validation metric.

Each job of `python -m train -m ...` writes `metrics.json` into its own folder;
at the end of the sweep this writes `sweep_summary.csv` into the sweep folder
(one row per job: its overrides and final metrics, best first) and prints the
table.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from data.atomic_io import atomic_write_text


def summarise_sweep(sweep_dir: str | Path, metric: str, mode: str = "max") -> list[dict]:
    """Collect every job's overrides and metrics under `sweep_dir`, ranked by `metric`; write sweep_summary.csv."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for metrics_path in sorted(sweep_dir.glob("*/metrics.json")):
        job = json.loads(metrics_path.read_text())
        rows.append({"job": metrics_path.parent.name, "overrides": " ".join(job.get("overrides", [])),
                     **job.get("metrics", {})})
    missing = -math.inf if mode == "max" else math.inf
    rows.sort(key=lambda row: row.get(metric, missing), reverse=(mode == "max"))
    columns = ["job", "overrides", metric] + sorted({k for row in rows for k in row} - {"job", "overrides", metric})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(sweep_dir / "sweep_summary.csv", buffer.getvalue())
    return rows


class SweepSummary(Callback):
    """Write and print the sweep summary when a multirun ends."""

    def __init__(self, metric: str = "val/acceptance", mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"sweep summary mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        rows = summarise_sweep(config.hydra.sweep.dir, self.metric, self.mode)
        print(f"[sweep] {len(rows)} jobs ranked by {self.metric} ({self.mode}); "
              f"{Path(config.hydra.sweep.dir) / 'sweep_summary.csv'}")
        for rank, row in enumerate(rows, 1):
            value = row.get(self.metric)
            shown = f"{value:.4f}" if isinstance(value, float) else "n/a"
            print(f"[sweep] {rank:>3}. {self.metric}={shown}  {row['overrides']}")
