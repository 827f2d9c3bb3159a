"""Atomic file writes: write to a temporary file beside the target, fsync, rename.

A crash or a kill mid-write leaves either the old file or the new one, never a
truncated one, so an interrupted export, shard or metrics file loses nothing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file


def _new_temporary(target: Path) -> Path:
    """An empty file beside `target`, its name unique to this writer (``.NAME.XXXX.tmp``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    return Path(tmp_name)


def _make_durable(tmp: Path) -> None:
    """Give a written temporary the usual permissions and flush it to disk before it becomes the target."""
    umask = os.umask(0)
    os.umask(umask)
    # mkstemp makes 0600, and some writers (safetensors) replace the file they are given: the usual
    # permissions are set on what was written, so colleagues on a shared machine can read it.
    os.chmod(tmp, 0o666 & ~umask)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `target` atomically."""
    target = Path(target)
    tmp = _new_temporary(target)
    try:
        yield tmp
        _make_durable(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def create_exclusively(target: str | Path, text: str) -> bool:
    """Create `target` holding `text` unless it exists; return whether this call created it.

    Of any number of processes calling it at once, exactly one creates the file and none ever sees
    it partly written: each writes its own temporary and hard-links it into place, which fails
    for all but the first. (A shared temporary name would let one writer delete another's.)
    """
    target = Path(target)
    tmp = _new_temporary(target)
    try:
        tmp.write_text(text)
        _make_durable(tmp)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def remove_leftover_temporaries(target: str | Path) -> list[Path]:
    """Delete what killed writes of `target` left beside it (`atomic_path`'s ``.NAME.*.tmp``); return them.

    Only for targets with one writer at a time (an export folder; a corpus shard under its claim).
    """
    target = Path(target)
    leftovers = sorted(target.parent.glob(f".{target.name}.*.tmp")) if target.parent.is_dir() else []
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def atomic_write_text(target: str | Path, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], target: str | Path, metadata: dict | None = None) -> None:
    """Save tensors as safetensors atomically."""
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
