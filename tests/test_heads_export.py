"""Exported heads round-trip bit-exactly and refuse the wrong backbone."""

import json
import re

import pytest
import torch
from conftest import TINY_BACKBONE

from backbones.digits import random_digits_backbone
from heads.export import (
    CONFIG_FILE,
    HEADS_FILE,
    HeadsMismatchError,
    export_heads,
    load_heads,
)
from heads.ssd import SSDHeadConfig, SSDHeads


def trained_looking_heads(hidden_size=32):
    heads = SSDHeads(SSDHeadConfig(hidden_size=hidden_size, width=16, depth=2))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter)
    return heads


def test_round_trip_is_bit_exact(tiny_backbone, tmp_path):
    heads = trained_looking_heads()
    export_heads(heads, tmp_path, tiny_backbone.identity())
    loaded = load_heads(tmp_path, tiny_backbone)
    assert loaded.config == heads.config
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    readable = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert readable["kind"] == "ssd" and readable["backbone"]["geometry"] == {
        "rows": 8,
        "cols": 8,
        "end_of_line": False,
    }


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(hidden_size=48, num_heads=2), "hidden_size"),
        (dict(grid_size=12), "geometry"),
        (dict(levels=16), "codebook_size"),
    ],
)
def test_heads_for_another_backbone_are_refused(tiny_backbone, tmp_path, change, named):
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    other = random_digits_backbone(**{**TINY_BACKBONE, **change})
    with pytest.raises(HeadsMismatchError, match=named):
        load_heads(tmp_path, other)


def test_other_weights_of_the_same_backbone_warn(tiny_backbone, tmp_path):
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    retrained = random_digits_backbone(seed=99, **TINY_BACKBONE)
    with pytest.warns(UserWarning, match="fingerprint"):
        load_heads(tmp_path, retrained)


def test_truncated_export_is_a_clear_error(tiny_backbone, tmp_path):
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    data = (tmp_path / HEADS_FILE).read_bytes()
    (tmp_path / HEADS_FILE).write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="truncated"):
        load_heads(tmp_path, tiny_backbone)


@pytest.mark.parametrize(
    "directory, kind, command",
    [
        ("ssd_digits", None, "`python -m train`"),  # the default job
        ("eagle_digits", None, "`python -m train +experiment=eagle_digits`"),  # each experiment exports to its name
        ("mulo_digits", "mulo", "`python -m train +experiment=mulo_digits`"),
        ("my_heads", None, "`python -m train +experiment=NAME export.dir="),
        # A directory of the user's own naming, for a known kind: the digits experiment of that kind, exporting there.
        ("my_heads", "eagle", "`python -m train +experiment=eagle_digits export.dir="),
        ("my_heads", "ssd", "`python -m train export.dir="),
    ],
)
def test_missing_export_says_how_to_make_that_one(tmp_path, directory, kind, command):
    with pytest.raises(FileNotFoundError, match=re.escape(command)):
        load_heads(tmp_path / directory, kind=kind)


def test_an_interrupted_export_leaves_the_previous_one_loadable(tiny_backbone, tmp_path, monkeypatch):
    first = trained_looking_heads()
    export_heads(first, tmp_path, tiny_backbone.identity())

    import common.atomic_io as atomic_io

    def crash_mid_write(tensors, path, metadata=None):
        with open(path, "wb") as handle:
            handle.write(b"partial")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(atomic_io, "save_file", crash_mid_write)
    with pytest.raises(KeyboardInterrupt):
        export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    loaded = load_heads(tmp_path, tiny_backbone)
    assert torch.equal(loaded.vertical.mlp[0].weight, first.vertical.mlp[0].weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_row_attention_heads_round_trip_and_stay_lossless(tiny_backbone, tmp_path):
    from backbones.base import Condition
    from decode import SamplingConfig, generate_ar, generate_ssd

    heads = SSDHeads(SSDHeadConfig(hidden_size=32, width=16, depth=1, row_attention_layers=1, row_attention_heads=2))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    export_heads(heads, tmp_path, tiny_backbone.identity())
    loaded = load_heads(tmp_path, tiny_backbone)
    rows = torch.randn(3, 8, 32), torch.randn(3, 8, 32)
    with torch.no_grad():
        assert torch.equal(loaded.vertical(*rows), heads.eval().vertical(*rows))
    condition, sampling = Condition(class_ids=torch.tensor([2, 8])), SamplingConfig(greedy=True, cfg_scale=2.0)
    assert torch.equal(
        generate_ssd(tiny_backbone, loaded, condition, sampling).tokens,
        generate_ar(tiny_backbone, condition, sampling).tokens,
    )


def _rewrite(directory, change_config=None, change_tensors=None):
    """Rewrite an export's safetensors with its embedded config and tensors changed (as a damaged or hostile
    file would be)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = directory / HEADS_FILE
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    config = json.loads(metadata["config"])
    if change_config:
        change_config(config)
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, str(path), metadata={"config": json.dumps(config)})


def test_a_config_that_does_not_describe_the_tensors_is_refused_before_anything_is_built(tiny_backbone, tmp_path):
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    _rewrite(tmp_path, change_config=lambda config: config["head"].update(width=10**12))  # 10^24 parameters
    with pytest.raises(ValueError, match="describes heads that cannot be built"):
        load_heads(tmp_path, tiny_backbone)
    _rewrite(tmp_path, change_config=lambda config: config["head"].update(width=10**12 // 10**6))
    with pytest.raises(ValueError, match="has shape .* but heads.json describes"):
        load_heads(tmp_path, tiny_backbone)


def test_heads_with_non_finite_weights_are_refused(tiny_backbone, tmp_path):
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    _rewrite(tmp_path, change_tensors=lambda tensors: next(iter(tensors.values())).fill_(float("nan")))
    with pytest.raises(ValueError, match="NaN or infinite"):
        load_heads(tmp_path, tiny_backbone)


def test_an_export_removes_what_a_killed_export_left_behind(tiny_backbone, tmp_path):
    leftovers = [tmp_path / ".heads.safetensors.k1ll3d.tmp", tmp_path / ".heads.json.k1ll3d.tmp"]
    for path in leftovers:
        path.write_bytes(b"half written")
    export_heads(trained_looking_heads(), tmp_path, tiny_backbone.identity())
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_FILE, HEADS_FILE]
    assert oct((tmp_path / HEADS_FILE).stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # readable by colleagues


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
