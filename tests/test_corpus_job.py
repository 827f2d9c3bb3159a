"""Corpus generation as its own job: processes share the shards through claims on files, with no collective wait."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.paths import PROJECT_ROOT
from data.corpus import CorpusSpec, build_corpus, shard_name
from data.shard_locks import lock_path, try_claim

TESTS = Path(__file__).parent
TINY_ARCHITECTURE = [
    "backbone.grid_size=8",
    "backbone.levels=8",
    "backbone.hidden_size=32",
    "backbone.num_layers=2",
    "backbone.num_heads=2",
    "backbone.intermediate_size=64",
    "backbone.seed=0",
]


def slow_backbone(delay_s: float, log: Path) -> list[str]:
    """Overrides that make the backbone a tiny digits one whose every generation batch takes `delay_s`."""
    return [
        "backbone=digits_tiny",
        "backbone._target_=slow_generation.slow_digits_backbone",
        f"+backbone.delay_s={delay_s}",
        f"+backbone.log_path={log}",
        "~backbone.device",
        *TINY_ARCHITECTURE,
    ]


def launch(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(TESTS), **env}
    return subprocess.Popen(
        [sys.executable, *command], cwd=PROJECT_ROOT, env=environment, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def corpus_job(tmp_path: Path, generation_log: Path, delay_s: float) -> list[str]:
    return [
        "-m",
        "data",
        *slow_backbone(delay_s, generation_log),
        "data=corpus_tiny",
        "data.spec.num_images=32",  # 4 shards of 8, one generation batch each
        f"paths.root_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]


@pytest.mark.slow  # several processes building one corpus
@pytest.mark.parametrize("ranks", [[("0", "2"), ("1", "2")], [None, None]], ids=["two ranks", "two trainings"])
def test_processes_on_one_corpus_share_its_shards_and_generate_each_once(tmp_path, ranks):
    """Two ranks of `python -m data` (torchrun's RANK/WORLD_SIZE), or two jobs that know nothing of each other
    (two trainings on one corpus folder): every shard is generated exactly once, both end with the whole corpus."""
    generation_log = tmp_path / "generated.txt"
    jobs = []
    for number, rank in enumerate(ranks):
        env = {"RANK": rank[0], "WORLD_SIZE": rank[1]} if rank else {}
        jobs.append(launch(corpus_job(tmp_path, generation_log, 3.0), env, tmp_path / f"job{number}.log"))
    for number, job in enumerate(jobs):
        assert job.wait(timeout=300) == 0, (tmp_path / f"job{number}.log").read_text()[-3000:]
    generated = generation_log.read_text().split()
    assert len(generated) == 2 * 4  # (pid, batch size) per generation batch: 4 batches, one per shard
    assert len(set(generated[::2])) == 2  # both processes generated
    corpus = next((tmp_path / "corpora").iterdir())
    assert json.loads((corpus / "corpus.json").read_text())["complete"]
    assert sorted(p.name for p in corpus.iterdir() if p.name.startswith((".", "shard")) and "sha256" not in p.name) == [
        shard_name(i) for i in range(4)
    ]  # no claim and no temporary file left behind
    import re

    for number in range(2):
        log = (tmp_path / f"job{number}.log").read_text()
        assert "corpus complete" in log
        progress = r"rank \d: shard-0000\d.tar written \(\d+ of this rank's \d+ images\); its share done in ~\d"
        assert re.search(progress, log)  # a log line per shard with an ETA, also without a terminal


def test_a_killed_builder_leaves_nothing_that_blocks_the_next(tiny_backbone, tmp_path):
    """A build killed mid-shard leaves a claim and a temporary file: the next build (same host, dead pid) takes
    the claim over, removes the temporary file and finishes."""
    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=4)
    directory = tmp_path / "corpus"
    directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_path(directory / shard_name(1)).write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout)}))
    (directory / f".{shard_name(1)}.abc123.tmp").write_bytes(b"half a shard")
    build_corpus(tiny_backbone, directory, spec)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["corpus.json", shard_name(0), shard_name(0) + ".sha256", shard_name(1), shard_name(1) + ".sha256"]
    )


def test_a_live_claim_is_respected_and_a_silent_one_expires(tmp_path):
    shard = tmp_path / shard_name(0)
    claim = try_claim(shard)
    assert claim is not None and try_claim(shard) is None  # our own live process holds it
    old = time.time() - 100
    os.utime(lock_path(shard), (old, old))
    assert try_claim(shard, stale_after_s=50) is not None  # no heartbeat for longer than allowed: taken over


@pytest.mark.slow  # DDP on CPU with a process group timeout
def test_ddp_ranks_outlast_a_short_process_group_timeout_while_the_corpus_is_built(tmp_path):
    """Two DDP ranks (gloo, CPU) with a 15 s process-group timeout (the ranks' rendezvous must fit in it too) and a
    corpus whose 3 shards take 20 s each: one rank waits for the other's last shard longer than the timeout.
    Waiting in a barrier (the former design) kills the run; waiting by reading the directory does not. Held-out
    shards are read by every rank: one val shard for two ranks left one rank out of validation, a deadlock."""
    generation_log = tmp_path / "generated.txt"
    command = [
        "-m",
        "train",
        *slow_backbone(20.0, generation_log),
        "data=corpus_tiny",
        "data.spec.num_images=24",  # 3 shards: 2 for training, 1 held out
        "head=ssd_tiny",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "+trainer.strategy.timeout={_target_: datetime.timedelta, seconds: 15}",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "logger=csv",
        "callbacks.samples=null",
        "train.evaluate=null",
        f"paths.root_dir={tmp_path}",
        f"export.dir={tmp_path / 'export'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    job = launch(command, {"MASTER_PORT": "29531"}, tmp_path / "train.log")
    output = tmp_path / "train.log"
    assert job.wait(timeout=600) == 0, output.read_text()[-4000:]
    assert "waiting for shards" in output.read_text()  # a rank did wait, longer than the timeout
    assert len(generation_log.read_text().split()) == 2 * 3  # each shard generated once
    assert (tmp_path / "export" / "heads.safetensors").is_file()


def test_training_can_wait_for_a_corpus_job_instead_of_generating(tiny_backbone, tmp_path):
    """data.generate=false: the build only reads the directory until another job has written every shard."""
    import threading

    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=4)
    job = threading.Timer(1.0, build_corpus, args=(tiny_backbone, tmp_path, spec))
    job.start()
    started = time.monotonic()
    build_corpus(tiny_backbone, tmp_path, spec, generate=False, poll_s=0.2)
    job.join()
    assert time.monotonic() - started >= 1.0  # it waited for the job, which did all the work
    assert json.loads((tmp_path / "corpus.json").read_text())["complete"]
