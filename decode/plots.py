"""The speed-quality picture of a decode run: where each method lands against the baseline."""

from __future__ import annotations

import logging
from pathlib import Path

from common.atomic_io import atomic_path

log = logging.getLogger(__name__)


# Quality metrics a decode report may carry, how to label them, in the order they are drawn.
METRIC_LABELS = {
    "classifier_accuracy": "classifier accuracy (higher is better)",
    "frechet_distance": "Fréchet distance (lower is better)",
    "fid": "FID (lower is better)",
    "clip_score": "CLIP score (higher is better)",
}


def plot_speed_quality(report: dict, path: str | Path) -> bool:
    """Scatter speedup vs each quality metric the report holds, one point per method.

    False (and nothing written) without matplotlib or without any measured quality.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("[decode] no speed-quality plot: pip install matplotlib (or the project's [plots] extra)")
        return False
    methods = report["methods"]
    measured = [m for m in METRIC_LABELS if all(m in (f.get("quality") or {}) for f in methods.values())]
    if not measured:
        print("[decode] no speed-quality plot: no quality metric was measured for every method")
        return False
    figure, axes = plt.subplots(1, len(measured), figsize=(5.5 * len(measured), 4.2), squeeze=False)
    for axis, metric in zip(axes[0], measured):
        for name, figures in methods.items():
            x, y = figures["speedup_vs_ar"], figures["quality"][metric]
            marker = "s" if name.startswith("ar") else ("o" if name.startswith("ssd") else "^")
            axis.scatter(x, y, marker=marker, s=40)
            axis.annotate(
                f"{name}\n{figures['forward_passes_per_image']:.0f} passes",
                (x, y),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("wall-clock speedup vs KV-cached AR (log)")
        axis.set_ylabel(METRIC_LABELS[metric])
        axis.grid(alpha=0.3)
    title = f"batch {report['batch_size']}, {report['num_images']} images, CFG {report['sampling']['cfg_scale']}"
    return _save(plt, figure, f"{title}, {report['device']}", path)


def _save(plt, figure, title: str, path: str | Path) -> bool:
    """Title, lay out and write the figure atomically as a PNG; close it."""
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
    return True


def plot_throughput(reports: list[dict], path: str | Path) -> bool:
    """Images per second against batch size, one line per method, from decode reports at several batch sizes
    (each report's `metrics.json`); the baseline dashed. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[decode] no throughput plot: pip install matplotlib (or the project's [plots] extra)")
        return False
    reports = sorted(reports, key=lambda report: report["batch_size"])
    names = [name for name in reports[0]["methods"] if all(name in r["methods"] for r in reports)]
    figure, axis = plt.subplots(figsize=(6.0, 4.2))
    batches = [report["batch_size"] for report in reports]
    for name in names:
        rates = [1.0 / report["methods"][name]["seconds_per_image"] for report in reports]
        axis.plot(batches, rates, "--" if name == "ar" else "-", marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks(batches, [str(b) for b in batches])
    axis.set_xlabel("batch size (slots)")
    axis.set_ylabel("images per second")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    first = reports[0]
    counts = sorted({report["num_images"] for report in reports})  # runs at several batch sizes may differ
    images = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    seeds = len(first["seeds"])
    title = (
        f"{images} images x {seeds} seed{'s' if seeds > 1 else ''}, CFG {first['sampling']['cfg_scale']}, "
        f"{first['device']} ({first['torch_threads']} threads)"
    )
    return _save(plt, figure, title, path)
