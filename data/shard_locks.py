"""Claims on corpus shards, so that any number of processes can build one corpus without talking to each other.

A process about to generate a shard creates ``shard-NNNNN.tar.lock`` exclusively
(``O_CREAT | O_EXCL``: exactly one creator wins, on a local or a network file
system) holding its host and pid, and touches it after every generation batch
(a heartbeat). Another process that finds the lock leaves the shard to its owner
and comes back later; a lock whose owner is gone (same host, pid not running)
or whose heartbeat stopped for `stale_after_s` is taken over. The lock is
removed once the shard and its checksum are written.

This is what lets DDP ranks, the ranks of a ``torchrun``/SLURM corpus job, and
two trainings pointed at one corpus folder share the work with no collective
wait: nothing blocks while another process generates, so no process-group
timeout can expire during generation.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from common.atomic_io import remove_leftover_temporaries

STALE_AFTER_S = 1800.0  # a heartbeat older than this marks an abandoned claim (one batch must take less)


def lock_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".lock")


class ShardClaim:
    """An exclusive claim on one shard; `beat` keeps it alive, `release` ends it."""

    def __init__(self, path: Path):
        self.path = path

    def beat(self) -> None:
        try:
            os.utime(self.path)
        except FileNotFoundError:  # taken over as stale by another process: it regenerates the shard too
            pass

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def try_claim(shard: Path, stale_after_s: float = STALE_AFTER_S) -> ShardClaim | None:
    """Claim `shard` for generation; None while another live process holds it."""
    path = lock_path(shard)
    for _ in range(2):  # a second try after removing a stale claim
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not _is_stale(path, stale_after_s):
                return None
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}, handle)
        remove_leftover_temporaries(shard)  # what a killed writer of this shard left
        remove_leftover_temporaries(shard.with_name(shard.name + ".sha256"))  # its checksum (data/corpus.py)
        return ShardClaim(path)
    return None


def is_claimed(shard: Path, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether a live process is generating `shard` now."""
    path = lock_path(shard)
    return path.is_file() and not _is_stale(path, stale_after_s)


def _is_stale(path: Path, stale_after_s: float) -> bool:
    try:
        owner = json.loads(path.read_text() or "{}")
        age = time.time() - path.stat().st_mtime
    except (FileNotFoundError, json.JSONDecodeError):
        return False  # removed meanwhile, or being written this instant: not ours to judge yet
    if age > stale_after_s:
        return True
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return not _pid_running(owner["pid"])
    return False


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
