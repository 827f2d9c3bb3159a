"""The comparison a decode run prints and saves: one row per method, beside the baseline's quality band."""

from __future__ import annotations

QUALITY_NAMES = {"classifier_accuracy": "accuracy", "frechet_distance": "Fréchet", "fid": "FID", "clip_score": "CLIP"}
# The values a metric can take: a tolerance is shown clipped to them (an accuracy above 1 is no bound).
QUALITY_RANGES = {"classifier_accuracy": (0.0, 1.0), "frechet_distance": (0.0, float("inf"))}


def mean_quality(per_seed: list[dict | None]) -> dict | None:
    """The mean of every quality metric over a method's seeds (None when quality was not measured)."""
    if not per_seed or per_seed[0] is None:
        return None
    return {metric: sum(seed[metric] for seed in per_seed) / len(per_seed) for metric in per_seed[0]}


def band_of(figures: dict) -> dict | None:
    """{metric: [lowest, highest]} over a method's seeds: the seed-to-seed band of its quality."""
    per_seed = figures.get("quality_per_seed") or ([figures["quality"]] if figures.get("quality") else [])
    if not per_seed:
        return None
    return {metric: [min(s[metric] for s in per_seed), max(s[metric] for s in per_seed)] for metric in per_seed[0]}


def summary_table(report: dict) -> str:
    """A markdown table of every method's passes, tokens per pass, time, speedup and quality, and the band line."""
    methods = report["methods"]
    metrics = [m for m in QUALITY_NAMES if all(m in (f.get("quality") or {}) for f in methods.values())]
    seeds = report.get("seeds", [report.get("seed")])
    header = [
        "method",
        "lossless",
        "passes/image",
        "tokens/pass",
        "s/image (batches p10-p90)",
        "speedup (batches p10-p90)",
    ] + [QUALITY_NAMES[m] for m in metrics]
    lines = [
        f"batch {report['batch_size']}, {report['num_images']} images x {len(seeds)} seed(s) {seeds}, "
        f"CFG {report['sampling']['cfg_scale']}, {report['device']}, methods interleaved batch by batch",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for name, f in methods.items():
        time_spread, speed_spread = f["seconds_per_image_spread"], f["speedup_vs_ar_spread"]
        tokens_per_pass = (
            report["backbone"]["geometry"]["rows"]
            * report["backbone"]["geometry"]["cols"]
            / f["forward_passes_per_image"]
        )
        cells = [
            name,
            "yes" if f.get("lossless") else "no",
            f"{f['forward_passes_per_image']:.1f}",
            f"{tokens_per_pass:.1f}",
            f"{f['seconds_per_image']:.3f} ({time_spread['p10']:.3f}-{time_spread['p90']:.3f})",
            f"{f['speedup_vs_ar']:.2f}x ({speed_spread['p10']:.2f}-{speed_spread['p90']:.2f})",
        ]
        band = band_of(f) or {}
        for metric in metrics:
            low, high = band[metric]
            cells.append(f"{f['quality'][metric]:.3f}" + (f" ({low:.3f}-{high:.3f})" if len(seeds) > 1 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    baseline = report.get("baseline_band")
    if baseline and metrics:
        described = ", ".join(f"{QUALITY_NAMES[m]} {baseline[m][0]:.3f}-{baseline[m][1]:.3f}" for m in metrics)
        lines += ["", f"baseline band (ar over seeds {seeds}): {described}"]
    tolerance = report.get("baseline_tolerance")
    if tolerance and metrics and "ar" in methods:
        lines.append(tolerance_line(methods, tolerance, metrics, report["num_images"] * len(seeds)))
    windows = [
        f"{name} {f['counts']['window_sum'] / f['counts']['window_passes']:.1f}"
        for name, f in methods.items()
        if (f.get("counts") or {}).get("window_passes")
    ]
    if windows:  # the pass lengths a cost-aware method chose (decode/ssd_ragged.py)
        lines.append(f"mean open positions verified per image and pass: {', '.join(windows)}")
    by_step = [f"{name} {rates}" for name, f in methods.items() if (rates := draft_step_acceptance(f.get("counts")))]
    if by_step:  # CSpD on MAR: how acceptance falls along a round's drafted steps (decode/cspd_mar.py)
        lines.append(f"token acceptance at draft steps 1, 2, ... of a round: {'; '.join(by_step)}")
    return "\n".join(lines)


def draft_step_acceptance(counts: dict | None) -> str:
    """ "0.41, 0.38, ..." from the accepted_/drafted_at_draft_step_k counts of a method's figures ("" without)."""
    counts, rates, step = counts or {}, [], 1
    while counts.get(f"drafted_at_draft_step_{step}"):
        rates.append(f"{counts[f'accepted_at_draft_step_{step}'] / counts[f'drafted_at_draft_step_{step}']:.3f}")
        step += 1
    return ", ".join(rates)


def outside_tolerance(methods: dict, tolerance: dict) -> dict[str, list[str]]:
    """{method: [metrics whose mean is further from ar's than the baseline's sampling tolerance]}."""
    reference = methods["ar"]["quality"]
    outside = {}
    for name, figures in methods.items():
        off = [m for m in tolerance if abs(figures["quality"][m] - reference[m]) > tolerance[m]]
        if off and name != "ar":
            outside[name] = off
    return outside


def tolerance_line(methods: dict, tolerance: dict, metrics: list[str], images: int) -> str:
    """The sampling tolerance around ar's mean quality, and the methods outside it."""
    reference = methods["ar"]["quality"]
    bounds = {m: QUALITY_RANGES.get(m, (-float("inf"), float("inf"))) for m in metrics}
    ranges = ", ".join(
        f"{QUALITY_NAMES[m]} {max(bounds[m][0], reference[m] - tolerance[m]):.3f}-"
        f"{min(bounds[m][1], reference[m] + tolerance[m]):.3f}"
        for m in metrics
    )
    outside = outside_tolerance(methods, tolerance)
    verdict = (
        "outside it: " + "; ".join(f"{n} ({', '.join(QUALITY_NAMES[m] for m in ms)})" for n, ms in outside.items())
        if outside
        else "every method inside it"
    )
    return (
        f"baseline tolerance ({images} images, sampling error): {ranges} holds a method with ar's distribution "
        f"19 times in 20; {verdict}"
    )
