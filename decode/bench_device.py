"""`python -m decode.bench_device`: what a row pass costs at real model sizes, and the digits comparison, on one device.

    python -m decode.bench_device                 # CUDA when present: published sizes in bfloat16, <= 8 minutes
    python -m decode.bench_device --sizes tiny    # the same steps at test sizes (CPU, seconds)

Steps, each recorded in DIR/bench_device.json and DIR/bench_device.md (written
atomically at the end of every step, so a run cut short keeps what it measured):

1. the digits comparison: `python -m decode`'s run (decode/cli.py) of AR, SSD
   lossless and approximate and MuLo-SD on the embedded backbone on this device,
   at each batch, the baseline on its preallocated KV cache; methods whose
   exports are missing are listed with the command that makes them;
2. each method's pass schedule on the digits (decode/pass_schedule.py);
3. for each real backbone at its published size with random weights
   (backbones/published_sizes.py), the seconds of one pass against the tokens
   fed, at batch 1 and 16 with CFG twins, and the SSD drafter's seconds per row
   and per grid step at its hidden size (decode/pass_cost.py);
4. for each real backbone, the speedup its measured costs allow for the
   digits' pass schedule, labelled a projection, with its formula.

A step that would start after the time budget is recorded as skipped, with
the reason; an error in one backbone (e.g. out of memory) is recorded and the
next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import hydra
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from backbones.base import Condition
from backbones.published_sizes import published_backbones
from common.atomic_io import atomic_write_text
from common.paths import PROJECT_ROOT, register_config_resolvers
from decode.cli import run_decode, sampling_from_config
from decode.pass_cost import drafting_costs, pass_costs
from decode.pass_schedule import projected_speedup, record_schedule
from decode.registry import check_methods, load_artefacts
from heads.export import training_advice

COUNTS = [1, 8, 24, 48, 90, 180]
DIGITS_METHODS = ["ar", "ssd_exact", "ssd_autocorrect", "mulo", "mulo_exact"]
PROMPT_TOKENS = 64  # a prompt of typical length with its chat template and image header


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m decode.bench_device", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", choices=["published", "tiny"], default=None, help="default: published on CUDA")
    parser.add_argument("--models", default="janus_pro_7b,lumina_mgpt_7b,emu3_gen")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)), help="tokens fed per timed pass")
    parser.add_argument("--batches", default="1,16", help="images per pass (CFG twins double the rows)")
    parser.add_argument("--cfg-scale", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--methods", default=",".join(DIGITS_METHODS))
    parser.add_argument("--digits-images", type=int, default=32, help="images per method and batch size")
    parser.add_argument("--schedule-images", type=int, default=8)
    parser.add_argument(
        "--override", action="append", default=[], help="a Hydra override for the digits comparison (repeatable)"
    )
    parser.add_argument("--budget-minutes", type=float, default=8.0)
    parser.add_argument("--out", default=str(PROJECT_ROOT / "outputs" / "bench_device"))
    arguments = parser.parse_args(argv)
    arguments.sizes = arguments.sizes or ("published" if arguments.device.startswith("cuda") else "tiny")
    arguments.counts = [int(n) for n in arguments.counts.split(",")]
    arguments.batches = [int(b) for b in arguments.batches.split(",")]
    arguments.models = [m for m in arguments.models.split(",") if m]
    arguments.methods = [m for m in arguments.methods.split(",") if m]
    if arguments.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch (use --device cpu --sizes tiny)")
    return arguments


class Budget:
    """Wall-clock since the start against the budget: a step that would start after it is skipped, and says so."""

    def __init__(self, minutes: float):
        self.began, self.seconds = time.perf_counter(), 60 * minutes

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def spent(self) -> str | None:
        if self.elapsed < self.seconds:
            return None
        return f"skipped: the time budget of {self.seconds / 60:g} min was spent ({self.elapsed:.0f} s elapsed)"


def main(argv: list[str] | None = None) -> dict:
    """Run every step within the budget; write and return the report."""
    arguments = _arguments(argv)
    device = torch.device(arguments.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(arguments.out)
    budget = Budget(arguments.budget_minutes)
    report = {
        "environment": _environment(device, dtype, arguments),
        "digits": {},
        "schedules": {},
        "backbones": {},
        "projections": {},
    }

    def save() -> None:
        report["environment"]["elapsed_seconds"] = budget.elapsed
        atomic_write_text(out / "bench_device.json", json.dumps(report, indent=2) + "\n")
        atomic_write_text(out / "bench_device.md", markdown_report(report) + "\n")

    report["digits"], report["schedules"] = _digits(arguments, device, out, budget)
    save()
    for name in arguments.models:
        report["backbones"][name] = _real_backbone(name, arguments, device, dtype, budget)
        save()
    report["projections"] = _projections(report)
    save()
    print(markdown_report(report))
    print(f"[bench_device] wrote {out / 'bench_device.json'} and {out / 'bench_device.md'}")
    return report


def _environment(device: torch.device, dtype: torch.dtype, arguments: argparse.Namespace) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."),
        "sizes": arguments.sizes,
        "cfg_scale": arguments.cfg_scale,
        "counts": arguments.counts,
        "batches": arguments.batches,
        "budget_minutes": arguments.budget_minutes,
    }


# ---- steps 1 and 2: the digits comparison and its pass schedules ------------------------------------------------


def _digits(arguments, device: torch.device, out: Path, budget: Budget) -> tuple[dict, dict]:
    cfg = _digits_config(arguments, device, out / "digits", arguments.methods)
    available, missing = _available_methods(cfg)
    results: dict = {"missing": missing}
    for name, why in missing.items():
        print(f"[bench_device] {name}: {why}")
    schedules: dict = {}
    for batch in arguments.batches:
        skipped = budget.spent()
        if skipped:
            results[f"batch_{batch}"] = skipped
            continue
        run_cfg = _digits_config(arguments, device, out / f"digits_batch{batch}", available, batch)
        decoded = run_decode(run_cfg)
        results[f"batch_{batch}"] = {
            name: {
                key: figures.get(key)
                for key in ("forward_passes_per_image", "seconds_per_image", "speedup_vs_ar", "nfe_reduction_vs_ar")
            }
            | {"quality": figures.get("quality"), "lossless": figures.get("lossless")}
            for name, figures in decoded["methods"].items()
        }
        methods = [m for m in check_methods(run_cfg.decode) if m.name != "ar"]
        backbone = hydra.utils.instantiate(run_cfg.backbone)
        load_artefacts(methods, backbone)
        sampling = sampling_from_config(run_cfg)
        classes = torch.arange(arguments.schedule_images * batch) % 10
        conditions = [Condition(class_ids=chunk.to(device)) for chunk in classes.split(batch)]
        schedules[f"batch_{batch}"] = {
            m.name: record_schedule(m, backbone, conditions[: max(1, arguments.schedule_images // batch)], sampling)
            for m in methods
        }
    return results, schedules


def _digits_config(arguments, device: torch.device, out: Path, methods: list[str], batch: int = 1):
    register_config_resolvers()
    overrides = [
        f"backbone.device={device}",
        f"decode.methods=[{','.join(methods)}]",
        f"decode.num_images={arguments.digits_images}",
        f"decode.batch_size={batch}",
        f"decode.cfg_scale={arguments.cfg_scale}",
        f"decode.out={out}",
        *arguments.override,
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def _available_methods(cfg) -> tuple[list[str], dict]:
    """The chosen presets whose export exists, and for the others why not and the command that makes it."""
    available, missing = [], {}
    for method in check_methods(cfg.decode):
        export = method.artefact_path
        if export is not None and not (Path(export) / "heads.json").is_file():
            setting = f"decode.presets.{method.name}.{method.spec.artefact}"
            advice = training_advice(Path(export), method.spec.artefact_kind, setting=setting)
            missing[method.name] = f"no export at {export}: {advice}"
            continue
        available.append(method.name)
    return available, missing


# ---- step 3: pass and drafting costs at published sizes ---------------------------------------------------------


def _real_backbone(name: str, arguments, device: torch.device, dtype: torch.dtype, budget: Budget) -> dict:
    skipped = budget.spent()
    if skipped:
        return {"skipped": skipped}
    entry = published_backbones()[name]
    result: dict = {}
    backbone = None
    try:
        began = time.perf_counter()
        backbone = entry.backbone(arguments.sizes, device, dtype)
        geometry = backbone.geometry
        result.update(
            rows=geometry.rows,
            cols=geometry.cols,
            end_of_line=geometry.end_of_line,
            hidden_size=backbone.hidden_size,
            parameters=sum(p.numel() for p in backbone.parameters()),
            build_seconds=time.perf_counter() - began,
            passes={},
            drafting={},
        )
        print(f"[bench_device] {name}: {result['parameters'] / 1e9:.2f}B parameters, {geometry.rows}x{geometry.cols}")
        for batch in arguments.batches:
            condition = entry.condition(backbone, batch, PROMPT_TOKENS)
            result["passes"][f"batch_{batch}"] = pass_costs(
                backbone, condition, arguments.cfg_scale, arguments.counts, repeats=arguments.repeats
            )
            result["drafting"][f"batch_{batch}"] = drafting_costs(backbone, condition, arguments.cfg_scale, dtype)
            if device.type == "cuda":
                result.setdefault("peak_memory_gib", {})[f"batch_{batch}"] = torch.cuda.max_memory_allocated() / 2**30
    except (RuntimeError, ValueError) as error:  # out of memory, a shape the adapter refuses: record, go on
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        print(f"[bench_device] {name}: {result['error']}")
    finally:
        del backbone
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return result


# ---- step 4: projections ----------------------------------------------------------------------------------------


def _projections(report: dict) -> dict:
    projections = {}
    for name, measured in report["backbones"].items():
        if "passes" not in measured:
            continue
        for batch_key, cost in measured["passes"].items():
            for method, schedule in report["schedules"].get(batch_key, {}).items():
                if schedule["generator"] != "decode.ssd":  # drafting is measured for SSD's heads only
                    continue
                drafting = measured["drafting"].get(batch_key)
                figures = projected_speedup(schedule, cost, drafting, measured["rows"], measured["cols"])
                projections.setdefault(name, {}).setdefault(batch_key, {})[method] = figures
    return projections


def markdown_report(report: dict) -> str:
    """The report's figures as markdown tables: digits comparison, pass costs, drafting, projections."""
    env = report["environment"]
    lines = [
        f"# Device benchmark: {env['device']} ({env['device_type']}, {env['dtype']}, {env['sizes']} sizes)",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, CFG {env['cfg_scale']}, "
        f"{env.get('elapsed_seconds', 0):.0f} s of a {env['budget_minutes']:g} min budget.",
    ]
    for section in (_digits_section, _passes_section, _drafting_section, _projection_section):
        lines += ["", *section(report)]
    return "\n".join(lines)


def _digits_section(report: dict) -> list[str]:
    lines = ["## Digits backbone: every method against the KV-cached baseline", ""]
    for name, why in report["digits"].get("missing", {}).items():
        lines.append(f"- `{name}` not run: {why}")
    for batch_key, methods in report["digits"].items():
        if batch_key == "missing":
            continue
        lines += ["", f"{batch_key.replace('_', ' ')}:", ""]
        if isinstance(methods, str):
            lines.append(methods)
            continue
        lines += ["| method | lossless | passes/image | s/image | speedup | accuracy |", "|---|---|---|---|---|---|"]
        for method, f in methods.items():
            accuracy = (f.get("quality") or {}).get("classifier_accuracy")
            lines.append(
                f"| {method} | {'yes' if f['lossless'] else 'no'} | {f['forward_passes_per_image']:.1f} | "
                f"{f['seconds_per_image']:.4f} | {f['speedup_vs_ar']:.2f}x | "
                f"{'-' if accuracy is None else f'{accuracy:.3f}'} |"
            )
    return lines


def _passes_section(report: dict) -> list[str]:
    counts = report["environment"]["counts"]
    lines = ["## One pass against the tokens fed (ms; in brackets: x the one-token pass)", ""]
    lines += ["| backbone | batch | context | " + " | ".join(map(str, counts)) + " |", "|---" * (3 + len(counts)) + "|"]
    for name, measured in report["backbones"].items():
        if "passes" not in measured:
            lines.append(f"| {name} | {measured.get('error') or measured.get('skipped')} |")
            continue
        for cost in measured["passes"].values():
            cells = [
                f"{1000 * cost['seconds_per_pass'][str(n)]:.2f} ({cost['relative_to_one_token'][str(n)]:.2f})"
                if str(n) in cost["seconds_per_pass"]
                else "-"
                for n in counts
            ]
            lines.append(f"| {name} | {cost['batch']} | {cost['context_tokens']} | " + " | ".join(cells) + " |")
    return lines


def _drafting_section(report: dict) -> list[str]:
    lines = ["## SSD drafting at the backbone's hidden size (ms)", ""]
    lines += ["| backbone | batch | vertical row | drafted row | grid step |", "|---|---|---|---|---|"]
    for name, measured in report["backbones"].items():
        for d in measured.get("drafting", {}).values():
            lines.append(
                f"| {name} | {d['batch']} | {1000 * d['seconds_per_vertical_row']:.2f} | "
                f"{1000 * d['seconds_per_drafted_row']:.2f} | {1000 * d['seconds_per_grid_step']:.3f} |"
            )
    return lines


def _projection_section(report: dict) -> list[str]:
    lines = [
        "## Projection (not a measurement): the digits pass schedule at each backbone's measured costs",
        "",
        "AR = N c(1); method = (N / a) c(f cols / 24) + N s t_step + R v t_row; speedup = AR / method "
        "(decode/pass_schedule.py: a tokens per pass, f tokens fed per pass, s grid steps per token and "
        "v vertical drafts per row on the digits; c, t_step, t_row measured above).",
        "",
        "| backbone | batch | method | passes/image | projected speedup | if drafting were free |",
        "|---|---|---|---|---|---|",
    ]
    for name, batches in report["projections"].items():
        for batch_key, methods in batches.items():
            for method, p in methods.items():
                lines.append(
                    f"| {name} | {batch_key.removeprefix('batch_')} | {method} | {p['passes_per_image']:.0f} | "
                    f"{p['projected_speedup']:.2f}x | {p['projected_speedup_if_drafting_were_free']:.2f}x |"
                )
    return lines


if __name__ == "__main__":
    main()
