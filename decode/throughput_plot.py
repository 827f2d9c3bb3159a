"""python -m decode.throughput_plot RUN_DIR ... --out PNG: images per second against batch size, from decode runs
of the same methods at several batch sizes (each RUN_DIR holds a metrics.json), and a markdown table of it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decode.plots import plot_throughput


def throughput_table(reports: list[dict]) -> str:
    """Per method and batch size: images/s, speedup against the baseline of the same run, passes per image."""
    reports = sorted(reports, key=lambda report: report["batch_size"])
    names = [name for name in reports[0]["methods"] if all(name in r["methods"] for r in reports)]
    header = "| method | " + " | ".join(f"batch {r['batch_size']}" for r in reports) + " |"
    lines = [header, "|---|" + "---|" * len(reports)]
    for name in names:
        cells = []
        for report in reports:
            figures = report["methods"][name]
            cells.append(
                f"{1 / figures['seconds_per_image']:.2f} img/s, {figures['speedup_vs_ar']:.2f}x, "
                f"{figures['forward_passes_per_image']:.1f} passes"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="decode output folders, each with a metrics.json")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    reports = []
    for run in args.runs:
        metrics = run / "metrics.json"
        if not metrics.exists():
            raise SystemExit(f"{metrics} does not exist: give folders written by python -m decode")
        reports.append(json.loads(metrics.read_text()))
    if len({tuple(sorted(r["methods"])) for r in reports}) > 1:
        print("[decode] the runs compare different methods; only those in every run are drawn")
    print(throughput_table(reports))
    if plot_throughput(reports, args.out):
        print(f"[decode] wrote {args.out}")


if __name__ == "__main__":
    main()
