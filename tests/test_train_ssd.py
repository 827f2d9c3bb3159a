"""SSD self-distillation: the corpus, offline == online targets, the experiment end to end."""

import json

import numpy as np
import pytest
import torch
from conftest import compose_config

from data.corpus import CorpusSpec, build_corpus, corpus_dataset, shard_name
from decode.cli import run_decode
from heads.export import load_heads
from train.pipeline import run_training
from train.ssd_module import SSDDistillation

TINY_SSD = [
    "+experiment=ssd_digits",
    "backbone=digits_tiny",
    "data=corpus_tiny",
    "head=ssd_tiny",
    "trainer=debug",
    "trainer.max_steps=3",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
]


def test_corpus_is_built_once_resumes_and_records_hidden_states(tiny_backbone, tmp_path):
    spec = CorpusSpec(num_images=12, shard_size=5, batch_size=4, store_hidden=True)
    build_corpus(tiny_backbone, tmp_path, spec)
    assert json.loads((tmp_path / "corpus.json").read_text())["complete"]
    first = [sample["tokens"] for sample in corpus_dataset(tmp_path, [shard_name(1)])]
    # An interrupted build: one shard lost, manifest not complete. Rebuilding regenerates exactly that shard.
    (tmp_path / shard_name(1)).unlink()
    manifest = json.loads((tmp_path / "corpus.json").read_text())
    (tmp_path / "corpus.json").write_text(json.dumps({**manifest, "complete": False}))
    build_corpus(tiny_backbone, tmp_path, spec)
    again = [sample["tokens"] for sample in corpus_dataset(tmp_path, [shard_name(1)])]
    assert len(again) == 5 and all(torch.equal(a, b) for a, b in zip(first, again))  # same seed, same images
    samples = list(corpus_dataset(tmp_path, [shard_name(i) for i in range(3)]))
    assert len(samples) == 12
    assert samples[0]["tokens"].shape == (64,) and samples[0]["hidden"].shape == (2, 64, 32)


def test_offline_and_online_targets_give_the_same_loss(tiny_backbone, tmp_path):
    spec = CorpusSpec(num_images=4, shard_size=4, batch_size=4, store_hidden=True, cfg_scale=3.0)
    build_corpus(tiny_backbone, tmp_path, spec)
    batch = torch.utils.data.default_collate(list(corpus_dataset(tmp_path, [shard_name(0)])))
    module = SSDDistillation(tiny_backbone, head=dict(width=16, depth=1), optimizer=torch.optim.AdamW, cfg_scale=3.0)
    offline, _ = module.losses(batch, noise=False)
    online, _ = module.losses({k: v for k, v in batch.items() if k != "hidden"}, noise=False)
    torch.testing.assert_close(offline, online, rtol=1e-3, atol=1e-4)  # offline states are stored in fp16


def test_only_head_parameters_are_optimised(tiny_backbone):
    module = SSDDistillation(tiny_backbone, head=dict(width=16, depth=1), optimizer=torch.optim.AdamW)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("heads.") for name in trainable)


@pytest.mark.slow
def test_ssd_experiment_trains_exports_and_decodes(tmp_path, classifier_cache):
    export = tmp_path / "export"
    cfg = compose_config(
        TINY_SSD
        + [
            f"export.dir={export}",
            f"paths.root_dir={tmp_path}",
            f"paths.checkpoints_dir={classifier_cache}",
            "callbacks.samples.every_n_steps=2",
        ],
        tmp_path / "run",
    )
    metrics = run_training(cfg)
    assert (tmp_path / "run" / "samples" / "step_000002.png").is_file()  # the periodic sample grid
    assert 0 < metrics["val/acceptance"] <= 1
    heads = load_heads(export)
    assert heads.config.width == 16
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any(k.startswith("backbone.") for k in checkpoint["state_dict"])  # heads only
    out = tmp_path / "decode"
    cfg = compose_config(
        TINY_SSD
        + [
            f"export.dir={export}",
            f"decode.out={out}",
            "decode.num_images=4",
            "decode.batch_size=2",
            "decode.greedy=true",
            "decode.save_tokens=true",
            "decode.methods=[ar,ssd_exact,ssd_autocorrect]",
            f"paths.checkpoints_dir={classifier_cache}",
        ],
        tmp_path / "run2",
    )
    report = run_decode(cfg)
    import numpy as np

    assert np.array_equal(np.load(out / "tokens_ssd_exact.npy"), np.load(out / "tokens_ar.npy"))  # greedy: lossless
    exact = report["methods"]["ssd_exact"]
    assert exact["forward_passes_per_image"] <= 64 and "mean_accepted_per_pass" in exact
    assert (out / "speed_quality.png").is_file()


def test_damaged_shards_are_named(tiny_backbone, tmp_path):
    import pytest

    from data.corpus import CorruptShardError

    build_corpus(tiny_backbone, tmp_path, CorpusSpec(num_images=8, shard_size=4, batch_size=4))
    shard = tmp_path / shard_name(1)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2 + 100])  # truncated mid-sample
    with pytest.raises(CorruptShardError, match=r"shard-00001.tar does not match its checksum"):
        list(corpus_dataset(tmp_path, [shard_name(0), shard_name(1)]))
    # A corpus built before checksums: the damage is still named, by the sample or the tar header.
    manifest = json.loads((tmp_path / "corpus.json").read_text())
    (tmp_path / "corpus.json").write_text(json.dumps({**manifest, "checksums": False}))
    with pytest.raises(CorruptShardError, match=r"sample 0000000\d of .*shard-00001.tar"):
        list(corpus_dataset(tmp_path, [shard_name(0), shard_name(1)]))
    shard.write_bytes(data[:1000] + b"\x00garbage" * 100 + data[1800:])  # a damaged tar header
    with pytest.raises(CorruptShardError, match=r"shard-00001.tar is unreadable"):
        list(corpus_dataset(tmp_path, [shard_name(0), shard_name(1)]))


def test_nan_loss_stops_with_the_step_and_batch(tiny_backbone):
    import pytest

    module = SSDDistillation(tiny_backbone, head=dict(width=16, depth=1), optimizer=torch.optim.AdamW, cfg_scale=3.0)
    hidden = torch.randn(2, 2, 64, 32).half()
    hidden[0, 0, 5] = float("nan")
    batch = {"tokens": torch.randint(0, 8, (2, 64)), "class_id": torch.tensor([1, 2]), "hidden": hidden}
    with pytest.raises(FloatingPointError, match=r"step 0 \(batch 7\)"):
        module.training_step(batch, 7)


def test_a_bad_config_value_fails_at_start_naming_the_key(tmp_path):
    import pytest
    from hydra.errors import InstantiationException

    cfg = compose_config(TINY_SSD + ["head.width=0", f"paths.root_dir={tmp_path}"], tmp_path / "run")
    with pytest.raises(InstantiationException, match="head.width must be >= 1"):
        run_training(cfg)
    assert not (tmp_path / "corpora").exists()  # refused before any corpus or training work


def test_grid_head_targets_line_up_with_the_state_they_predict(tiny_backbone):
    """A grid head that returned the true state would have zero loss: the unrolled inputs and targets align."""
    module = SSDDistillation(
        tiny_backbone,
        head=dict(width=16, depth=1, grid=True, horizontal_unroll=2),
        optimizer=torch.optim.AdamW,
        cfg_scale=1.0,
    )
    rows, cols, size = 4, 5, tiny_backbone.hidden_size
    # States that encode their own grid position: the target of (r, c) is recognisable.
    hidden = torch.arange(rows * cols, dtype=torch.float32).view(1, rows, cols, 1).expand(1, rows, cols, size)
    tokens = torch.zeros(1, rows * cols, dtype=torch.long)
    seen = []

    # Training prepares the share from above once for whole rows (as decoding does), each step adds the left.
    module.heads.grid.prepare_above = lambda above, above_embedding: above

    def from_above(above, left, left_embedding):
        seen.append((above[..., 0].clone(), left[..., 0].clone()))
        return above + cols  # the state below the one above: exactly the target

    module.heads.grid.from_above = from_above
    predictions = {name: (predicted, target) for name, predicted, target in module.predictions(hidden, tokens, False)}
    for step in (1, 2):
        predicted, target = predictions[f"grid_{step}"]
        assert torch.equal(predicted, target)  # (r, c) predicted for target (r, c), r >= 1, c >= step
    above, left = seen[0]
    assert torch.equal(above, hidden[:, :-1, 1:, 0]) and torch.equal(left, hidden[:, 1:, :-1, 0])
    _, left_step_2 = seen[1]
    assert torch.equal(left_step_2, hidden[:, 1:, 1:-1, 0])  # step 2's left input is step 1's prediction


def test_tv_weight_adds_the_expected_rejection_rate_of_every_prediction(tiny_backbone, tmp_path):
    spec = CorpusSpec(num_images=4, shard_size=4, batch_size=4, store_hidden=True, cfg_scale=3.0)
    build_corpus(tiny_backbone, tmp_path, spec)
    batch = torch.utils.data.default_collate(list(corpus_dataset(tmp_path, [shard_name(0)])))
    totals = {}
    for tv_weight in (0.0, 2.0):
        torch.manual_seed(0)
        module = SSDDistillation(
            tiny_backbone,
            head=dict(width=16, depth=1, horizontal_unroll=1),
            optimizer=torch.optim.AdamW,
            cfg_scale=3.0,
            tv_weight=tv_weight,
        )
        totals[tv_weight], logs = module.losses(batch, noise=False)
    # One vertical and one horizontal prediction: the TV term is 2 * ((1 - acc_v) + (1 - acc_h)).
    expected = 2.0 * (2 - logs["acceptance_vertical"] - logs["acceptance_horizontal"])
    torch.testing.assert_close(totals[2.0] - totals[0.0], expected)


def test_grid_heads_train_and_log_their_acceptance(tiny_backbone, tmp_path):
    spec = CorpusSpec(num_images=4, shard_size=4, batch_size=4, store_hidden=True, cfg_scale=3.0)
    build_corpus(tiny_backbone, tmp_path, spec)
    batch = torch.utils.data.default_collate(list(corpus_dataset(tmp_path, [shard_name(0)])))
    module = SSDDistillation(
        tiny_backbone, head=dict(width=16, depth=1, grid=True), optimizer=torch.optim.AdamW, cfg_scale=3.0
    )
    loss, logs = module.losses(batch, noise=True)
    assert torch.isfinite(loss) and 0 < float(logs["acceptance_grid"]) <= 1
    loss.backward()
    assert module.heads.grid.mlp[-1].weight.grad.abs().sum() > 0


def test_following_the_damaged_shard_advice_regenerates_the_same_images(tiny_backbone, tmp_path):
    """Delete the shard the error names, rerun the build: it comes back with the images it held."""
    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=4)
    build_corpus(tiny_backbone, tmp_path, spec)
    before = [sample["tokens"] for sample in corpus_dataset(tmp_path, [shard_name(1)])]
    (tmp_path / shard_name(1)).unlink()
    build_corpus(tiny_backbone, tmp_path, spec)  # what rerunning the training command does first
    after = [sample["tokens"] for sample in corpus_dataset(tmp_path, [shard_name(1)])]
    assert len(after) == 4 and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("damage", ["flipped payload bytes", "a shard of another corpus", "no checksum"])
def test_shards_are_checked_against_their_checksums(tiny_backbone, tmp_path, damage):
    from data.corpus import CorruptShardError, checksum_path

    build_corpus(tiny_backbone, tmp_path / "a", CorpusSpec(num_images=8, shard_size=4, batch_size=4))
    shard = tmp_path / "a" / shard_name(1)
    if damage == "flipped payload bytes":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside a sample's payload: the tar still reads
        shard.write_bytes(bytes(data))
    elif damage == "a shard of another corpus":
        build_corpus(tiny_backbone, tmp_path / "b", CorpusSpec(num_images=8, shard_size=4, batch_size=4, seed=1))
        shard.write_bytes((tmp_path / "b" / shard_name(1)).read_bytes())
    else:
        checksum_path(shard).unlink()
    with pytest.raises(CorruptShardError, match="shard-00001.tar does not match its checksum"):
        list(corpus_dataset(tmp_path / "a", [shard_name(0), shard_name(1)]))
    if damage == "no checksum":  # killed between the shard and its checksum: the build makes it again
        build_corpus(tiny_backbone, tmp_path / "a", CorpusSpec(num_images=8, shard_size=4, batch_size=4))
        assert len(list(corpus_dataset(tmp_path / "a", [shard_name(1)]))) == 4


def test_a_shard_copied_from_another_corpus_with_its_checksum_is_refused(tiny_backbone, tmp_path):
    from data.corpus import CorruptShardError, checksum_path

    build_corpus(tiny_backbone, tmp_path / "a", CorpusSpec(num_images=8, shard_size=4, batch_size=4))
    build_corpus(tiny_backbone, tmp_path / "b", CorpusSpec(num_images=8, shard_size=4, batch_size=4, seed=1))
    for name in (shard_name(1), checksum_path(tmp_path / "b" / shard_name(1)).name):
        (tmp_path / "a" / name).write_bytes((tmp_path / "b" / name).read_bytes())
    with pytest.raises(CorruptShardError, match="shard-00001.tar belongs to another corpus"):
        list(corpus_dataset(tmp_path / "a", [shard_name(0), shard_name(1)]))


@pytest.mark.parametrize(
    "sample,named",
    [
        ({"tokens": np.zeros(36, np.int16)}, r"\(36,\) tokens where the backbone's grid has 64"),
        ({"tokens": np.full(64, 999, np.int16)}, "token ids outside the codebook's 0..7"),
        ({"tokens": np.zeros(64, np.int16), "hidden": None}, "no hidden states, which this corpus stores"),
        ({"tokens": np.zeros(64, np.int16), "hidden": np.zeros((2, 64, 16), np.float16)}, "hidden states of shape"),
    ],
    ids=["another geometry", "flipped token bytes", "no hidden states", "other hidden size"],
)
def test_a_sample_that_does_not_fit_the_corpus_is_named_with_its_shard(tiny_backbone, tmp_path, sample, named):
    """A corpus from before checksums (or a shard written by hand) is still checked sample by sample."""
    import io

    import webdataset as wds

    from data.corpus import CorruptShardError

    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=4, store_hidden=True)
    build_corpus(tiny_backbone, tmp_path, spec)
    manifest = json.loads((tmp_path / "corpus.json").read_text())
    (tmp_path / "corpus.json").write_text(json.dumps({**manifest, "checksums": False}))  # a corpus of before

    def npy(array):
        buffer = io.BytesIO()
        np.save(buffer, array)
        return buffer.getvalue()

    hidden = sample.get("hidden", np.zeros((2, 64, 32), np.float16))
    with wds.TarWriter(str(tmp_path / shard_name(1))) as sink:
        record = {"__key__": "00000004", "tokens.npy": npy(sample["tokens"]), "cond.json": b'{"class_id": 1}'}
        sink.write(record if hidden is None else {**record, "hidden.npy": npy(hidden)})
    message = f"sample 00000004 of .*shard-00001.tar does not fit this corpus: {named}"
    with pytest.raises(CorruptShardError, match=message):
        list(corpus_dataset(tmp_path, [shard_name(0), shard_name(1)]))


def test_row_sampled_steps_train_on_rows_with_the_row_above_and_matching_twins(tiny_backbone):
    """module.rows_per_image: each pair is (row r - 1, row r) of one image, the same rows for both CFG twins."""
    module = SSDDistillation(
        tiny_backbone, head=dict(width=16, depth=1), optimizer=torch.optim.AdamW, cfg_scale=3.0, rows_per_image=3
    )
    images, rows, cols = 4, 8, 8
    # State value = 1000 * twin + 100 * image + row: every gathered state says where it came from.
    twin = torch.arange(2)[:, None, None, None, None] * 1000
    image = torch.arange(images)[None, :, None, None, None] * 100
    row = torch.arange(rows)[None, None, :, None, None]
    hidden = (twin + image + row).expand(2, images, rows, cols, 1).flatten(0, 1).float()
    torch.manual_seed(0)
    pairs, embedded = module.sampled_row_pairs(hidden, hidden.clone())
    assert pairs.shape == (2 * images * 3, 2, cols, 1) and torch.equal(pairs, embedded)
    above, below = pairs[:, 0, 0, 0], pairs[:, 1, 0, 0]
    assert torch.equal(below - above, torch.ones_like(below))  # a row with the row above it
    conditional, unconditional = below.chunk(2)
    assert torch.equal(unconditional - conditional, torch.full_like(conditional, 1000))  # twins: the same rows
    for k in range(images):  # distinct rows >= 1 of the image itself
        own = conditional[3 * k : 3 * k + 3]
        assert ((own // 100) == k).all() and len(set((own % 100).tolist())) == 3 and (own % 100 >= 1).all()
    with pytest.raises(ValueError, match="rows_per_image"):
        SSDDistillation(tiny_backbone, head=dict(width=16), optimizer=torch.optim.AdamW, rows_per_image=0)


def test_row_sampled_steps_reduce_the_loss(tiny_backbone, tmp_path):
    spec = CorpusSpec(num_images=8, shard_size=8, batch_size=8, store_hidden=True, cfg_scale=3.0)
    build_corpus(tiny_backbone, tmp_path, spec)
    batch = torch.utils.data.default_collate(list(corpus_dataset(tmp_path, [shard_name(0)])))
    module = SSDDistillation(
        tiny_backbone, head=dict(width=16, depth=1, grid=True), optimizer=torch.optim.AdamW, rows_per_image=2
    )
    optimizer = torch.optim.AdamW(module.heads.parameters(), lr=3e-3)
    before, _ = module.losses(batch, noise=False)
    for _ in range(30):
        loss, _ = module.losses(batch, noise=True)  # training: sampled rows
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after, _ = module.losses(batch, noise=False)  # validation: whole images
    assert after < 0.8 * before, (before, after)
