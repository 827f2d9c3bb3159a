"""Atomic writes: a file is either absent, the old one or the new one, and a file created once is created once."""

import json
import multiprocessing
import os
from pathlib import Path

import pytest

import common.atomic_io as atomic_io
from common.atomic_io import atomic_write_text, create_exclusively
from data.corpus import CorpusSpec, _open_manifest


def test_of_two_interleaved_creators_one_creates_the_file_and_the_other_keeps_it(tmp_path, monkeypatch):
    # The race CI hit between two DDP ranks: the second creator writes and links while the first is between
    # writing its temporary and linking it. Each must keep its own temporary, and the file stays whole.
    target = tmp_path / "corpus.json"
    link = os.link
    results = []

    def second_creator_in_the_window(source, destination):
        monkeypatch.setattr(atomic_io.os, "link", link)
        results.append(create_exclusively(target, "second\n"))
        link(source, destination)

    monkeypatch.setattr(atomic_io.os, "link", second_creator_in_the_window)
    with_first = create_exclusively(target, "first\n")
    assert results == [True] and with_first is False
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.json"]  # no temporary left behind


def test_an_existing_file_is_not_replaced_by_a_later_creator(tmp_path):
    target = tmp_path / "sub" / "manifest.json"
    assert create_exclusively(target, "kept\n") is True
    assert create_exclusively(target, "lost\n") is False
    assert target.read_text() == "kept\n" and sorted(p.name for p in target.parent.iterdir()) == ["manifest.json"]


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    atomic_write_text(target, "old\n")
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def _open_manifests(directory: str, start, identity: dict) -> dict:
    start.wait()
    return _open_manifest(Path(directory), CorpusSpec(num_images=8, shard_size=8), identity)


@pytest.mark.slow
def test_processes_opening_one_new_corpus_at_once_all_read_the_same_manifest(tmp_path):
    identity = {"name": "digits", "fingerprint": "0"}
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(4) as pool:
        for round_ in range(10):
            directory = tmp_path / f"corpus-{round_}"
            start = manager.Barrier(4)
            manifests = pool.starmap(_open_manifests, [(str(directory), start, identity)] * 4)
            assert all(m == manifests[0] for m in manifests) and manifests[0]["complete"] is False
            assert json.loads((directory / "corpus.json").read_text()) == manifests[0]
            assert sorted(p.name for p in directory.iterdir()) == ["corpus.json"]
