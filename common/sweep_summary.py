"""A Hydra callback that summarises a multirun sweep in one table, for training and decoding sweeps alike.

Each job of `python -m train -m ...` or `python -m decode -m ...` writes
`metrics.json` into its own folder. At the end of the sweep this writes
`sweep_summary.csv` into the sweep folder and prints the table: for training,
one row per job (its overrides and final metrics, best first by the configured
metric); for decoding, one row per job and method (passes, speedup against the
job's own baseline, quality), in job order.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from common.atomic_io import atomic_write_text


def summarise_sweep(sweep_dir: str | Path, metric: str, mode: str = "max") -> list[dict]:
    """Collect every job's overrides and figures under `sweep_dir`; write sweep_summary.csv; return its rows.

    Training jobs are ranked by `metric`; decoding jobs (a metrics.json with "methods") give one row per method.
    """
    sweep_dir = Path(sweep_dir)
    rows, decoding = [], False
    for metrics_path in sorted(sweep_dir.glob("*/metrics.json"), key=lambda path: _job_order(path.parent.name)):
        job = json.loads(metrics_path.read_text())
        common = {"job": metrics_path.parent.name, "overrides": " ".join(job.get("overrides", []))}
        if "methods" in job:
            decoding = True
            rows += [{**common, "method": name, **_decode_figures(figures)} for name, figures in job["methods"].items()]
        else:
            rows.append({**common, **job.get("metrics", {})})
    leading = ["job", "overrides", "method"] if decoding else ["job", "overrides", metric]
    if not decoding:
        missing = -math.inf if mode == "max" else math.inf
        rows.sort(key=lambda row: row.get(metric, missing), reverse=(mode == "max"))
    columns = leading + sorted({k for row in rows for k in row} - set(leading), key=_column_order)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(sweep_dir / "sweep_summary.csv", buffer.getvalue())
    return rows


def _job_order(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)


def _decode_figures(figures: dict) -> dict:
    """The columns of a decoding sweep: cost, speedup against the job's baseline, and quality."""
    row = {
        key: figures[key]
        for key in (
            "forward_passes_per_image",
            "seconds_per_image",
            "speedup_vs_ar",
            "nfe_reduction_vs_ar",
            "draft_acceptance_rate",
        )
        if key in figures
    }
    row.update({f"quality.{key}": value for key, value in (figures.get("quality") or {}).items()})
    return row


def _column_order(column: str):
    return (column.startswith("quality."), column)


class SweepSummary(Callback):
    """Write and print the sweep summary when a multirun ends."""

    def __init__(self, metric: str = "val/acceptance", mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"sweep summary mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        rows = summarise_sweep(config.hydra.sweep.dir, self.metric, self.mode)
        where = Path(config.hydra.sweep.dir) / "sweep_summary.csv"
        if rows and "method" in rows[0]:
            print(f"[sweep] {len(rows)} method runs; {where}")
            for row in rows:
                quality = "  ".join(f"{k.split('.', 1)[1]} {v:.3f}" for k, v in row.items() if k.startswith("quality."))
                print(
                    f"[sweep] job {row['job']:>3} {row['method']:>18}: {row['forward_passes_per_image']:7.1f} passes  "
                    f"speedup {row['speedup_vs_ar']:.2f}x  {quality}  {row['overrides']}"
                )
            return
        print(f"[sweep] {len(rows)} jobs ranked by {self.metric} ({self.mode}); {where}")
        for rank, row in enumerate(rows, 1):
            value = row.get(self.metric)
            shown = f"{value:.4f}" if isinstance(value, float) else "n/a"
            print(f"[sweep] {rank:>3}. {self.metric}={shown}  {row['overrides']}")
