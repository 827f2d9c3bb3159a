"""Long phases report progress as whole lines: readable in a terminal and in a log file (no redrawn bars)."""

import logging
import re
import subprocess
import sys

import pytest
import torch
from conftest import PROJECT_ROOT

from common.progress import ProgressLog


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_come_every_interval_with_the_time_left_at_the_rate_so_far(caplog):
    clock = FakeClock()
    progress = ProgressLog("decode", 10, "image", logging.getLogger("progress-test"), every_seconds=5, clock=clock)
    logged = []
    with caplog.at_level(logging.INFO, logger="progress-test"):
        for done in range(1, 11):
            clock.now += 2.0  # two seconds per image
            logged.append(progress.update(done, "seed 0"))
    # 2 s per image: a line at 6 s (3 images), 12 s (6), 18 s (9), and the last image always
    assert logged == [False, False, True, False, False, True, False, False, True, True]
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "decode: 3/10 images (seed 0), 2.00 s/image, ~14 s left"
    assert lines[-1] == "decode: 10/10 images (seed 0), 2.00 s/image, done in 20 s"


def test_every_n_steps_adds_lines_between_intervals(caplog):
    clock = FakeClock()
    progress = ProgressLog("train", 300, "step", logging.getLogger("progress-test"), 3600, every_n=100, clock=clock)
    with caplog.at_level(logging.INFO, logger="progress-test"):
        for step in range(1, 301):
            clock.now += 3.0
            progress.update(step)
    assert [r.getMessage() for r in caplog.records] == [
        "train: 100/300 steps, 3.00 s/step, ~10.0 min left",
        "train: 200/300 steps, 3.00 s/step, ~5.0 min left",
        "train: 300/300 steps, 3.00 s/step, done in 15.0 min",
    ]


@pytest.mark.parametrize("bad", [dict(total=0), dict(every_seconds=0), dict(every_n=0)])
def test_a_progress_that_could_never_report_is_refused(bad):
    settings = dict(what="x", total=3, unit="step", logger=logging.getLogger("x")) | bad
    with pytest.raises(ValueError, match="progress needs"):
        ProgressLog(**settings)


def test_train_with_stdout_to_a_file_shows_training_and_evaluation_progress(tmp_path, classifier_cache):
    """`python -m train > log` (no terminal): step lines, validation lines and the evaluation's image lines."""
    command = [
        sys.executable,
        "-m",
        "train",
        "+experiment=ssd_digits",
        "backbone=digits_tiny",
        "data=corpus_tiny",
        "head=ssd_tiny",
        "trainer=debug",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "callbacks.progress.every_n_steps=2",
        "callbacks.samples=null",
        "train.evaluate.num_images=4",
        "train.evaluate.seeds=1",
        "train.evaluate.compile=false",  # eager passes: compiling costs a minute per process
        f"export.dir={tmp_path / 'export'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"paths.root_dir={tmp_path}",
        f"paths.checkpoints_dir={classifier_cache}",
    ]
    with open(tmp_path / "stdout.log", "w") as stdout:
        done = subprocess.run(command, cwd=PROJECT_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = (tmp_path / "stdout.log").read_text()
    step_line = r"train: (\d)/4 steps \(loss [\d.]+, acceptance [\d.]+\), [\d.]+ s/step, (~\d+ s left|done)"
    steps = re.findall(step_line, printed)
    assert [s for s, _ in steps] == ["2", "4"], printed[-3000:]
    assert re.search(r"validation at step 2: val/loss [\d.]+, val/acceptance [\d.]+", printed)
    assert re.search(
        r"decode 3 methods at batch 1: 4/4 images \(seed 0; passes/image ar 64\.0, ssd_exact [\d.]+, "
        r"ssd_autocorrect [\d.]+\), [\d.]+ s/image, done in \d+ s",
        printed,
    ), printed[-3000:]
    # the same lines land in the run's log file
    assert "validation at step 2" in (tmp_path / "run" / "__main__.log").read_text()


def test_a_fraction_of_a_unit_counts_toward_the_rate_and_shows_rounded_down(caplog):
    clock = FakeClock()
    progress = ProgressLog("decode", 4, "image", logging.getLogger("progress-test"), every_seconds=1, clock=clock)
    with caplog.at_level(logging.INFO, logger="progress-test"):
        clock.now = 3.0
        progress.update(1.5)  # one method of two done with a turn of three images
    assert [r.getMessage() for r in caplog.records] == ["decode: 1/4 images, 2.00 s/image, ~5 s left"]


def test_the_decode_benchmark_reports_between_the_methods_of_a_turn(tiny_backbone, caplog):
    """A turn of a long continuous-batching queue takes minutes: a line may come after each method of a turn."""
    from decode.ar import METHOD as AR
    from decode.benchmark import run_interleaved
    from decode.conditions import Conditions
    from decode.registry import Method
    from decode.sampling import SamplingConfig
    from decode.sjd_ragged import METHOD as SJD_RAGGED
    from decode.sjd_ragged import RaggedSJDConfig

    methods = [Method("ar", "decode.ar", AR, AR.settings()), Method("sjd_ragged", "decode.sjd_ragged", SJD_RAGGED,
               RaggedSJDConfig(window=4))]  # fmt: skip
    conditions = Conditions(class_ids=torch.arange(4))
    with caplog.at_level(logging.INFO, logger="decode.benchmark"):
        run_interleaved(methods, tiny_backbone, conditions, 2, SamplingConfig(), [0], 1e-9, queue_batches=2)
    warm_ups = [r.getMessage() for r in caplog.records if "warming up" in r.getMessage()]
    expected = ("ar on 1 image(s)", "sjd_ragged on 2 image(s)")  # a continuous method: a full batch of slots
    assert warm_ups == [f"decode: warming up {name}, untimed" for name in expected]
    lines = [r.getMessage() for r in caplog.records if "decode 2 methods" in r.getMessage()]
    assert [line.split(":")[1].split()[0] for line in lines] == ["2/4", "4/4"]  # after ar, after sjd_ragged
