"""Long tests of the operational guarantees: DDP equivalence and resume after kill -9."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import PROJECT_ROOT

from heads.export import load_heads

TINY = [
    "+experiment=ssd_digits",
    "backbone=digits_tiny",
    "data=corpus_tiny",
    "head=ssd_tiny",
    "trainer=debug",
    "trainer.limit_val_batches=0",
    "train.evaluate=null",
    "data.shuffle_buffer=0",
]


def run_train(overrides, tmp_path, env_extra=None, timeout=900):
    env = {**os.environ, "PYTHONPATH": f"{PROJECT_ROOT / 'tests'}{os.pathsep}{PROJECT_ROOT}", **(env_extra or {})}
    done = subprocess.run(
        [sys.executable, "-m", "train", *TINY, f"paths.root_dir={tmp_path}", *overrides],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return done


def head_tensors(directory):
    return {k: v.clone() for k, v in load_heads(directory).state_dict().items()}


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_matches_one_process_with_the_same_global_batch(tmp_path):
    """2 ranks x 2 samples == 1 rank x 4 samples, step for step (no feature noise: it is drawn per rank)."""
    common = ["head.input_noise=0", "trainer.max_steps=3", "data.spec.num_images=40", "data.spec.shard_size=2"]
    single = run_train(
        common + ["data.batch_size=4", f"export.dir={tmp_path / 'one'}", f"hydra.run.dir={tmp_path / 'run_one'}"],
        tmp_path,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = run_train(
        common
        + [
            "data.batch_size=2",
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.precision=32-true",
            f"export.dir={tmp_path / 'two'}",
            f"hydra.run.dir={tmp_path / 'run_two'}",
            f"data.corpus_root={tmp_path / 'ddp_corpus'}",
        ],
        tmp_path,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # The two ranks generated the corpus between them (data-parallel), the same corpus one process makes.
    from data.corpus import corpus_dataset

    def corpus_tokens(root):
        (directory,) = [p.parent for p in root.glob("*/corpus.json")]
        return [s["tokens"] for s in corpus_dataset(directory, sorted(p.name for p in directory.glob("shard-*.tar")))]

    one_corpus, ddp_corpus = corpus_tokens(tmp_path / "corpora"), corpus_tokens(tmp_path / "ddp_corpus")
    assert len(one_corpus) == len(ddp_corpus) == 40
    assert all(torch.equal(a, b) for a, b in zip(one_corpus, ddp_corpus))
    one, two = head_tensors(tmp_path / "one"), head_tensors(tmp_path / "two")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in one.values())


@pytest.mark.slow
@pytest.mark.parametrize("num_images", [48, 16], ids=["within-one-pass", "past-several-passes"])
def test_resume_after_kill_reaches_the_weights_of_an_uninterrupted_run(tmp_path, num_images):
    """48 images: 5 training shards of 8, the 16 samples consumed at the checkpoint are inside one pass over
    them; 16 images: 1 training shard, so the resumed stream must skip two whole passes (this hung once)."""
    common = [
        "trainer.max_steps=6",
        "callbacks.checkpoint.every_n_train_steps=2",
        f"data.spec.num_images={num_images}",
        "data.spec.shard_size=8",
        "data.shuffle_buffer=8",
    ]
    straight = run_train(
        common + [f"export.dir={tmp_path / 'straight'}", f"hydra.run.dir={tmp_path / 'run_a'}"], tmp_path
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "run_b"
    killed = run_train(
        common
        + [
            f"export.dir={tmp_path / 'resumed'}",
            f"hydra.run.dir={run_dir}",
            "+callbacks.kill._target_=resume_helpers.KillAtStep",
            "+callbacks.kill.step=5",
        ],
        tmp_path,
    )
    assert killed.returncode == -9 and (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "resumed").exists()
    resumed = run_train(
        common + [f"export.dir={tmp_path / 'resumed'}", f"hydra.run.dir={run_dir}", "train.resume=true"],
        tmp_path,
        timeout=300,
    )  # a resume that never finds its place must fail, not hang
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = head_tensors(tmp_path / "straight"), head_tensors(tmp_path / "resumed")
    for name in a:
        assert torch.equal(a[name], b[name]), name
