"""The backbone recipe runs, writes a loadable model, and the real CLI works end to end."""

import subprocess
import sys

import pytest
import torch
from conftest import PROJECT_ROOT, compose_config

from backbones.base import Condition
from backbones.digits import DigitsBackbone
from train.pipeline import run_training


def test_backbone_recipe_trains_a_few_steps_and_exports_a_loadable_model(tmp_path):
    cfg = compose_config(
        [
            "+experiment=backbone_digits",
            "data=digits_tiny",
            "trainer=debug",
            "trainer.max_steps=3",
            f"export.dir={tmp_path / 'export'}",
            "module.architecture.hidden_size=32",
            "module.architecture.num_heads=2",
            "module.architecture.intermediate_size=64",
        ],
        tmp_path,
    )
    metrics = run_training(cfg)
    assert torch.isfinite(torch.tensor(metrics["train/bits_per_token"]))
    backbone = DigitsBackbone.from_pretrained(tmp_path / "export")
    assert backbone.geometry.rows == 8 and backbone.codebook_size == 8
    state, hidden = backbone.prefill(Condition(class_ids=torch.tensor([3])), guided=True)
    assert hidden.shape == (2, 1, 32)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()  # what `train.resume=true` continues from


@pytest.mark.slow
def test_train_cli_runs_as_a_subprocess(tmp_path):
    export = tmp_path / "export"
    command = [
        sys.executable,
        "-m",
        "train",
        "+experiment=backbone_digits",
        "data=digits_tiny",
        "trainer=debug",
        "trainer.max_steps=2",
        f"export.dir={export}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "module.architecture.hidden_size=32",
        "module.architecture.num_heads=2",
    ]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported backbone_digits to {export}" in done.stdout
    assert (export / "model.safetensors").is_file() and (tmp_path / "run" / "config.yaml").is_file()
