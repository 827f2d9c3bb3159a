"""The device benchmark runs end to end at tiny sizes on a CPU, so it is known to work before a GPU is lent."""

import json

import pytest
import torch

from backbones.published_sizes import published_backbones
from decode.bench_device import main
from decode.pass_cost import measured_context, pass_costs
from decode.pass_schedule import interpolated_cost, projected_speedup


@pytest.mark.slow
def test_the_benchmark_writes_costs_schedules_and_projections(tmp_path, classifier_cache):
    from conftest import TINY_BACKBONE
    from test_decode_cli import _export_tiny_heads

    from backbones.digits import random_digits_backbone

    heads = tmp_path / "heads"
    _export_tiny_heads(random_digits_backbone(seed=0, **TINY_BACKBONE), heads)
    out = tmp_path / "bench"
    report = main(
        [
            "--device=cpu",
            "--sizes=tiny",
            "--models=janus_pro_7b,emu3_gen",
            "--counts=1,8,24",
            "--batches=1,2",
            "--repeats=2",
            "--methods=ar,ssd_exact,mulo",
            "--digits-images=2",
            "--schedule-images=2",
            "--override=backbone=digits_tiny",
            f"--override=paths.checkpoints_dir={classifier_cache}",
            f"--override=decode.heads={heads}",
            f"--out={out}",
        ]
    )
    saved = json.loads((out / "bench_device.json").read_text())
    assert saved["environment"]["sizes"] == "tiny" and saved["environment"]["device_type"] == "cpu"
    # The digits comparison ran what has an export and names the command for what has none.
    assert set(saved["digits"]["batch_1"]) == {"ar", "ssd_exact"}
    assert "python -m train +experiment=mulo_digits" in saved["digits"]["missing"]["mulo"]
    assert saved["digits"]["batch_2"]["ar"]["forward_passes_per_image"] == 64
    # Each backbone: a cost for every count and batch, drafting per row and per step.
    for name in ("janus_pro_7b", "emu3_gen"):
        measured = saved["backbones"][name]
        assert "error" not in measured, measured.get("error")
        for batch in (1, 2):
            cost = measured["passes"][f"batch_{batch}"]
            assert cost["cache_rows"] == 2 * batch  # CFG twins
            assert set(cost["seconds_per_pass"]) == {"1", "8", "24"}
            assert all(s > 0 for s in cost["seconds_per_pass"].values())
            drafting = measured["drafting"][f"batch_{batch}"]
            assert drafting["seconds_per_drafted_row"] >= drafting["seconds_per_vertical_row"] > 0
        # The projection is made for SSD's schedule (the only method with measured drafting costs).
        assert set(saved["projections"][name]["batch_1"]) == {"ssd_exact"}
    schedule = saved["schedules"]["batch_1"]["ssd_exact"]
    assert 1 <= schedule["tokens_per_pass"] <= 64 and schedule["grid_steps_per_token"] > 0
    markdown = (out / "bench_device.md").read_text()
    assert "Projection (not a measurement)" in markdown and "| janus_pro_7b | 2 |" in markdown
    assert report["projections"] == saved["projections"]


def test_a_step_past_the_budget_is_recorded_as_skipped(tmp_path, classifier_cache):
    report = main(
        [
            "--device=cpu",
            "--models=janus_pro_7b",
            "--methods=ar",
            "--budget-minutes=0",
            "--override=backbone=digits_tiny",
            f"--override=paths.checkpoints_dir={classifier_cache}",
            f"--out={tmp_path}",
        ]
    )
    assert report["digits"]["batch_1"].startswith("skipped: the time budget")
    assert report["backbones"]["janus_pro_7b"]["skipped"].startswith("skipped: the time budget")


@pytest.mark.parametrize("name", sorted(published_backbones()))
def test_published_shapes_build_the_real_classes(name):
    """On the meta device (no memory): the published shapes, and a prompt each adapter accepts."""
    entry = published_backbones()[name]
    backbone = entry.backbone("published", "meta", torch.bfloat16)
    assert backbone.hidden_size == 4096
    assert {"janus_pro_7b": 24, "lumina_mgpt_7b": 48, "emu3_gen": 90}[name] == backbone.geometry.cols
    parameters = sum(p.numel() for p in backbone.parameters())
    assert 6.5e9 < parameters < 9e9, parameters
    ids = entry.condition(backbone, 2, 64).token_ids
    assert ids.shape == (2, 64) and torch.equal(backbone.prompt_token_ids(entry.condition(backbone, 2, 64)), ids)


def test_pass_costs_are_timed_at_the_same_context_for_every_count():
    entry = published_backbones()["janus_pro_7b"]
    backbone = entry.backbone("tiny", "cpu", torch.float32)
    condition = entry.condition(backbone, 1, 8)
    cost = pass_costs(backbone, condition, cfg_scale=3.0, counts=[1, 4, 1000], repeats=1, warmup=0)
    assert cost["skipped_counts"] == [1000]  # more than the image holds
    assert cost["context_tokens"] == 8 + measured_context(backbone, 4) == 8 + 128


def test_interpolation_and_projection_by_value():
    seconds = {"1": 1.0, "8": 1.0, "24": 2.0}
    assert interpolated_cost(seconds, 16) == pytest.approx(1.5)
    assert interpolated_cost(seconds, 40) == pytest.approx(3.0)  # extrapolated along the last segment
    schedule = {"cols": 24, "tokens_per_pass": 8.0, "fed_tokens_per_pass": 24.0, "grid_steps_per_token": 0.0}
    schedule["vertical_drafts_per_row"] = 0.0
    projected = projected_speedup(schedule, {"seconds_per_pass": seconds}, None, rows=24, cols=24)
    # 576 one-token passes of 1 s against 72 passes of 24 tokens at 2 s each.
    assert projected["projected_speedup"] == pytest.approx(576 / 144)
