"""Corpus conditions: prompt corpora (order, cycling, digest, ragged token lengths) and class counts."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from backbones.base import Condition
from backbones.emu3 import random_emu3_backbone
from data.corpus import CorpusSpec, build_corpus, corpus_dataset, shard_name
from decode.ar import generate_ar
from decode.conditions import load_prompts
from decode.sampling import SamplingConfig
from train.ssd_module import SSDDistillation

PROMPTS = ["a red cat", "a photo of a blue dog in the sky", "a cat", "a green tree", "a dog"]


@pytest.fixture
def emu3():
    return random_emu3_backbone(seed=0, tokenizer=True)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def read_all(directory, spec):
    return list(corpus_dataset(directory, [shard_name(i) for i in range(spec.num_shards)]))


def test_prompt_corpus_round_trip_keeps_the_prompt_order_and_cycles(emu3, prompt_file, tmp_path):
    spec = CorpusSpec(
        num_images=12,
        shard_size=5,
        batch_size=3,
        conditions="prompts",
        prompt_source=str(prompt_file),
        cfg_scale=3.0,
        top_k=1,
    )  # top-k 1: every image is its prompt's greedy image
    build_corpus(emu3, tmp_path / "corpus", spec)
    samples = read_all(tmp_path / "corpus", spec)
    assert [s["prompt"] for s in samples] == [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    assert all("class_id" not in s for s in samples)
    manifest = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    assert manifest["spec"]["conditions"] == "prompts" and manifest["complete"]
    # Generated in groups of equal token length, written back in image order: each image is its prompt's own.
    for sample in samples[:5]:
        alone = generate_ar(emu3, Condition(prompts=[sample["prompt"]]), SamplingConfig(cfg_scale=3.0, greedy=True))
        assert torch.equal(sample["tokens"], alone.tokens.flatten())
    batch = torch.utils.data.default_collate(samples[:4])
    assert batch["prompt"] == PROMPTS[:4]  # default collation: a list of str


def test_digest_follows_the_prompt_source_and_its_content_but_not_for_digits(emu3, prompt_file, tmp_path):
    identity = emu3.identity()
    smoke = CorpusSpec(conditions="prompts")
    from_file = CorpusSpec(conditions="prompts", prompt_source=str(prompt_file))
    assert smoke.prompts() == load_prompts("smoke")
    assert smoke.digest(identity) != from_file.digest(identity)
    before = from_file.digest(identity)
    prompt_file.write_text("a different prompt\n")
    assert CorpusSpec(conditions="prompts", prompt_source=str(prompt_file)).digest(identity) != before
    # The digits default: the condition fields stay out of the identity, so existing corpora keep their digest.
    new_fields = {"conditions", "num_classes", "prompt_source", "prompt_column"}
    assert CorpusSpec().identity() == {k: v for k, v in asdict(CorpusSpec()).items() if k not in new_fields}
    assert CorpusSpec(prompt_source="other.txt").digest(identity) == CorpusSpec().digest(identity)
    assert CorpusSpec(num_classes=1000).digest(identity) != CorpusSpec().digest(identity)


def test_class_id_corpora_balance_num_classes(tmp_path):
    from backbones.llamagen import random_llamagen_backbone

    backbone = random_llamagen_backbone(seed=0)  # 10 classes
    spec = CorpusSpec(num_images=12, shard_size=6, batch_size=4, num_classes=4)
    build_corpus(backbone, tmp_path, spec)
    classes = sorted(int(s["class_id"]) for s in read_all(tmp_path, spec))
    assert classes == sorted(list(range(4)) * 3)


def test_offline_and_online_targets_agree_on_a_ragged_prompt_corpus(emu3, prompt_file, tmp_path):
    spec = CorpusSpec(
        num_images=5,
        shard_size=5,
        batch_size=5,
        conditions="prompts",
        prompt_source=str(prompt_file),
        cfg_scale=3.0,
        store_hidden=True,
    )
    build_corpus(emu3, tmp_path, spec)
    batch = torch.utils.data.default_collate(read_all(tmp_path, spec))
    module = SSDDistillation(emu3, head=dict(width=16, depth=1), optimizer=torch.optim.AdamW, cfg_scale=3.0)
    offline, _ = module.losses(batch, noise=False)
    online, _ = module.losses({k: v for k, v in batch.items() if k != "hidden"}, noise=False)
    torch.testing.assert_close(offline, online, rtol=1e-3, atol=1e-4)  # offline states are stored in fp16


def test_an_interrupted_prompt_corpus_resumes_to_the_same_images(emu3, prompt_file, tmp_path):
    spec = CorpusSpec(num_images=8, shard_size=4, batch_size=2, conditions="prompts", prompt_source=str(prompt_file))
    build_corpus(emu3, tmp_path, spec)
    first = read_all(tmp_path, spec)
    (tmp_path / shard_name(1)).unlink()
    manifest = json.loads((tmp_path / "corpus.json").read_text())
    (tmp_path / "corpus.json").write_text(json.dumps({**manifest, "complete": False}))
    build_corpus(emu3, tmp_path, spec)
    again = read_all(tmp_path, spec)
    assert [s["prompt"] for s in again] == [s["prompt"] for s in first]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, again))


def test_bad_condition_settings_name_the_key():
    with pytest.raises(ValueError, match="data.spec.conditions"):
        CorpusSpec(conditions="captions")
    with pytest.raises(ValueError, match="data.spec.num_classes"):
        CorpusSpec(num_classes=0)
    with pytest.raises(ValueError, match="data.spec.conditions=prompts"):
        CorpusSpec().prompts()
