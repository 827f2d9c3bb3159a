"""Hydra multirun sweeps end with a ranked summary."""

import csv
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT


@pytest.mark.slow
def test_two_by_two_sweep_completes_with_a_four_row_summary(tmp_path):
    command = [sys.executable, "-m", "train", "-m", "+experiment=ssd_digits", "backbone=digits_tiny", "data=corpus_tiny",
               "head=ssd_tiny", "trainer=debug", "trainer.max_steps=2", "trainer.val_check_interval=2",
               "trainer.limit_val_batches=1", "train.evaluate=null", f"paths.root_dir={tmp_path}",
               "head.width=8,16", "module.optimizer.lr=0.001,0.002", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
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
