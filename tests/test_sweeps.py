"""Hydra multirun sweeps end with a ranked summary."""

import csv
import json
import subprocess
import sys

import pytest
from conftest import COMPARISON_METHODS, PROJECT_ROOT


@pytest.mark.slow
def test_two_by_two_sweep_completes_with_a_four_row_summary(tmp_path):
    command = [
        sys.executable,
        "-m",
        "train",
        "-m",
        "+experiment=ssd_digits",
        "backbone=digits_tiny",
        "data=corpus_tiny",
        "head=ssd_tiny",
        "trainer=debug",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "train.evaluate=null",
        f"paths.root_dir={tmp_path}",
        "head.width=8,16",
        "module.optimizer.lr=0.001,0.002",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    values = [float(row["val/acceptance"]) for row in rows]
    assert values == sorted(values, reverse=True)
    assert {row["overrides"].count("head.width=") for row in rows} == {1}
    for job in range(4):  # each job kept its own export
        assert (tmp_path / "sweep" / str(job) / "export" / "heads.safetensors").is_file()
    assert "[sweep]   1. val/acceptance=" in done.stdout


def test_optuna_sweeper_config_composes():
    from conftest import CONF_DIR
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/sweeper=optuna_search"], return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert cfg.hydra.sweeper.direction == "maximize" and "head.width" in cfg.hydra.sweeper.params
    assert cfg.optimized_metric == "val/acceptance"


@pytest.mark.slow
def test_optuna_sweep_runs_two_trials(tmp_path):
    command = [
        sys.executable,
        "-m",
        "train",
        "-m",
        "hydra/sweeper=optuna_search",
        "hydra.sweeper.n_trials=2",
        "+experiment=ssd_digits",
        "backbone=digits_tiny",
        "data=corpus_tiny",
        "head=ssd_tiny",
        "trainer=debug",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "train.evaluate=null",
        f"paths.root_dir={tmp_path}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.sweeper.params={head.width: 'choice(8, 16)'}",
    ]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 2


@pytest.mark.slow
def test_a_decode_setting_swept_with_multirun_lands_in_one_summary_table(tmp_path, classifier_cache):
    import hydra
    from conftest import compose_config, random_ssd_heads

    from heads.export import export_heads

    backbone = hydra.utils.instantiate(compose_config(["backbone=digits_tiny"], tmp_path).backbone)
    export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())
    command = [
        sys.executable,
        "-m",
        "decode",
        "-m",
        "backbone=digits_tiny",
        "decode.methods=[ar,ssd_autocorrect]",
        "decode.presets.ssd_autocorrect.rounds=0,2",
        "decode.num_images=2",
        "decode.batch_size=2",
        f"decode.heads={tmp_path / 'heads'}",
        f"paths.checkpoints_dir={classifier_cache}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["method"]) for row in rows] == [
        ("0", "ar"),
        ("0", "ssd_autocorrect"),
        ("1", "ar"),
        ("1", "ssd_autocorrect"),
    ]
    assert "rounds=0" in rows[1]["overrides"] and "rounds=2" in rows[3]["overrides"]
    # rounds bound the passes: 8 rows of an 8x8 image, at most rounds + 1 passes each, plus the prefill
    assert float(rows[1]["forward_passes_per_image"]) == 1 + 8 < float(rows[3]["forward_passes_per_image"])
    assert "quality.classifier_accuracy" in rows[0]
    for job in (0, 1):  # each job wrote its own report
        assert (tmp_path / "sweep" / str(job) / "metrics.json").is_file()


@pytest.mark.slow
def test_the_comparison_is_one_command_with_a_job_per_batch_size(tmp_path, classifier_cache):
    """python -m decode +experiment=compare_digits, shrunk to the tiny backbone: every method, both batch sizes."""
    import hydra
    from conftest import compose_config, random_eagle_head
    from test_decode_cli import _export_tiny_drafter, _export_tiny_heads

    from heads.export import export_heads

    backbone = hydra.utils.instantiate(compose_config(["backbone=digits_tiny"], tmp_path).backbone)
    _export_tiny_heads(backbone, tmp_path / "heads")
    _export_tiny_drafter(backbone, tmp_path / "drafter")
    export_heads(random_eagle_head(backbone), tmp_path / "eagle", backbone.identity())
    command = [
        sys.executable,
        "-m",
        "decode",
        "+experiment=compare_digits",
        "backbone=digits_tiny",
        "decode.num_images=2",
        "decode.seeds=2",
        "hydra.sweeper.params={decode.batch_size: '1,2'}",
        f"decode.heads={tmp_path / 'heads'}",
        f"decode.drafter={tmp_path / 'drafter'}",
        f"decode.eagle_heads={tmp_path / 'eagle'}",
        f"paths.checkpoints_dir={classifier_cache}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "sweep" / "sweep_summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * len(COMPARISON_METHODS) == 2 * 21  # a row per job and method
    for job in ("0", "1"):
        metrics = json.loads((tmp_path / "sweep" / job / "metrics.json").read_text())
        assert set(metrics["methods"]) == set(COMPARISON_METHODS)
        assert metrics["seeds"] == [0, 1]
