"""The `ssd_<model>` experiments of the real backbones, end to end on their tiny random-weight instances.

Each run composes ``+experiment=ssd_<model>`` exactly as the command line would,
swaps in the tiny backbone (with its in-memory tokenizer for the text-to-image
families), a tiny corpus and the CPU trainer, builds the corpus from the
experiment's conditions (prompts, or class ids for LlamaGen), trains two steps
with online targets and exports heads that load back onto that tiny backbone.
"""

from __future__ import annotations

import json

import hydra
import pytest
import torch
from conftest import compose_config

from backbones.base import Condition, group_by_prompt_length
from data.corpus import grouped_teacher_forced_hidden
from heads.export import load_heads
from train.pipeline import run_training

TEXT_TO_IMAGE = ["emu3", "janus", "lumina", "tar"]
MODELS = TEXT_TO_IMAGE + ["llamagen"]
# Tiny prompts of three different token lengths, so groups of equal length are exercised.
RAGGED = ["a red cat", "a photo of a blue dog in the sky", "a cat", "a green tree", "a dog"]


def tiny_experiment(model: str, tmp_path, extra: list[str] = (), kind: str = "ssd") -> list[str]:
    """`+experiment=<kind>_<model>` shrunk: tiny backbone on CPU, 8-image corpus, CPU trainer, 2 steps."""
    overrides = [
        f"+experiment={kind}_{model}",
        f"backbone={model}_tiny",
        "backbone.device=cpu",
        "data=corpus_tiny",
        "trainer=cpu",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.enable_model_summary=false",
        "logger=csv",
        "data.batch_size=3",
        "data.shuffle_buffer=4",
        "data.spec.num_images=8",
        "data.spec.shard_size=4",
        "data.spec.batch_size=4",
        f"paths.root_dir={tmp_path}",
        f"export.dir={tmp_path / 'export'}",
    ]
    if model in TEXT_TO_IMAGE:
        overrides.append("+backbone.tokenizer=true")
    else:
        overrides.append("data.spec.num_classes=10")  # the tiny LlamaGen has 10 classes, not ImageNet's 1000
    return overrides + list(extra)


@pytest.mark.parametrize("model", MODELS)
def test_real_experiment_trains_two_steps_and_exports_loadable_heads(model, tmp_path):
    extra = (
        ["callbacks.samples.every_n_steps=2", "callbacks.samples.num_images=3"] if model in ("emu3", "janus") else []
    )
    cfg = compose_config(tiny_experiment(model, tmp_path, extra), tmp_path / "run")
    assert cfg.trainer.precision == "32-true" and cfg.data.spec.store_hidden is False  # online mode on CPU
    metrics = run_training(cfg)
    assert 0 < metrics["val/acceptance"] <= 1
    backbone = hydra.utils.instantiate(cfg.backbone)
    heads = load_heads(tmp_path / "export", backbone, kind="ssd")
    assert heads.config.width == backbone.hidden_size  # head.width: null = the backbone's hidden size
    assert heads.config.row_attention_layers == 1
    corpus = next((tmp_path / "corpora").iterdir())
    manifest = json.loads((corpus / "corpus.json").read_text())
    assert manifest["complete"] and manifest["spec"]["conditions"] == (
        "class_ids" if model == "llamagen" else "prompts"
    )
    if model in ("emu3", "janus"):  # the sample grid decoded prompts of different lengths
        assert (tmp_path / "run" / "samples" / "step_000002.png").is_file()


@pytest.mark.parametrize("model", MODELS)
def test_real_experiment_runs_with_its_backbone_in_bfloat16(model, tmp_path, monkeypatch):
    """The real backbones' default dtype: corpus identity, training (bf16-mixed) and its sample grid, export,
    loading and greedy SSD.

    Until the weights fingerprint probed a bf16 head in its own dtype, every bf16 backbone failed at its first
    identity check (the corpus), before anything was generated.
    """
    module = __import__(f"backbones.{model}", fromlist=["_"])
    tiny = getattr(module, f"random_{model}_backbone")
    monkeypatch.setattr(module, f"random_{model}_backbone", lambda **kwargs: tiny(**kwargs).to(torch.bfloat16))
    # The sample grid (the experiments of the families with pixels) decodes outside the training step's autocast.
    samples = (
        ["callbacks.samples.every_n_steps=2", "callbacks.samples.num_images=3"] if model in ("emu3", "janus") else []
    )
    cfg = compose_config(tiny_experiment(model, tmp_path, ["trainer.precision=bf16-mixed", *samples]), tmp_path / "run")
    metrics = run_training(cfg)
    assert 0 < metrics["val/acceptance"] <= 1
    if samples:
        assert (tmp_path / "run" / "samples" / "step_000002.png").is_file()
    backbone = hydra.utils.instantiate(cfg.backbone)
    assert next(backbone.parameters()).dtype == torch.bfloat16
    heads = load_heads(tmp_path / "export", backbone, kind="ssd").to(torch.bfloat16)
    from decode import SamplingConfig, generate_ar, generate_ssd

    condition = Condition(class_ids=torch.tensor([1, 2])) if model == "llamagen" else Condition(prompts=RAGGED[3:])
    sampling = SamplingConfig(cfg_scale=cfg.decode.cfg_scale, greedy=True)
    for _, group in group_by_prompt_length(backbone, condition):
        # Plain exact SSD feeds AR's passes: equal in bf16 too (with lookahead, see test_lossless_bf16.py).
        assert torch.equal(
            generate_ssd(backbone, heads, group, sampling).tokens, generate_ar(backbone, group, sampling).tokens
        )


@pytest.mark.parametrize("model", MODELS)
def test_real_eagle_experiment_trains_two_steps_and_decodes_losslessly(model, tmp_path):
    """`+experiment=eagle_<model>`: the EAGLE head of that family trains, exports, loads and decodes greedy AR."""
    tiny_head = ["head.num_heads=1", "head.intermediate_size=64", "head.num_key_value_heads=null"]
    cfg = compose_config(tiny_experiment(model, tmp_path, tiny_head, kind="eagle"), tmp_path / "run")
    metrics = run_training(cfg)
    assert 0 < metrics["val/acceptance"] <= 1
    backbone = hydra.utils.instantiate(cfg.backbone)
    head = load_heads(tmp_path / "export", backbone, kind="eagle")
    assert head.config.hidden_size == backbone.hidden_size
    from decode import SamplingConfig, generate_ar
    from decode.eagle import generate_eagle

    condition = Condition(class_ids=torch.tensor([1, 2])) if model == "llamagen" else Condition(prompts=RAGGED[3:])
    sampling = SamplingConfig(cfg_scale=cfg.decode.cfg_scale, greedy=True)
    groups = group_by_prompt_length(backbone, condition)
    for _, group in groups:
        assert torch.equal(
            generate_eagle(backbone, head, group, sampling).tokens, generate_ar(backbone, group, sampling).tokens
        )


@pytest.mark.parametrize("model", MODELS)
def test_real_experiments_compose_with_the_published_settings(model, tmp_path, monkeypatch):
    cfg = compose_config([f"+experiment=ssd_{model}", "backbone.path=/weights"], tmp_path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert cfg.backbone.device == "cuda:3"  # every rank (torchrun / Lightning: LOCAL_RANK, SLURM) on its own GPU
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert cfg.backbone.device == "cuda:5"
    published = {
        "emu3": (3.0, 2048, 90),
        "janus": (5.0, 0, None),
        "lumina": (3.0, 2000, 48),
        "llamagen": (4.0, 2000, None),
        "tar": (1.0, 1200, 27),
    }[model]
    assert (cfg.decode.cfg_scale, cfg.decode.top_k) == published[:2]
    if published[2] is not None:
        assert cfg.backbone.rows == cfg.backbone.cols == published[2]
    assert cfg.trainer.precision == "bf16-mixed" and cfg.head.width is None
    assert cfg.data.spec.store_hidden is False
    assert cfg.data.spec.conditions == ("class_ids" if model == "llamagen" else "prompts")
    if model == "llamagen":
        assert cfg.data.spec.num_classes == 1000 and cfg.backbone.image_size == 384
    assert cfg.module.cfg_scale == cfg.decode.cfg_scale == cfg.data.spec.cfg_scale


def tiny_backbone_with_tokenizer(model: str):
    cfg = compose_config([f"backbone={model}_tiny", "+backbone.tokenizer=true"], "/unused")
    return hydra.utils.instantiate(cfg.backbone)


def expected_prompt_ids(model: str, backbone, prompt: str) -> list[int]:
    """The prompt prefix written out by hand in the tiny vocabulary (format of each family)."""
    if model == "emu3":
        words = backbone.processor.convert_tokens_to_ids(prompt.split())
        return [1, *words, 3, 13, 20, 14, 4]  # BOS, prompt, <|image start|> 3 * 4 <|image token|>
    if model == "janus":
        vocab = backbone.processor.tokenizer
        words = vocab.convert_tokens_to_ids(prompt.split())
        colon = vocab.convert_tokens_to_ids(":")
        return [1, 5, colon, *words, 6, colon, 2]  # <bos> <|User|>: prompt <|Assistant|>: <begin_of_image>
    if model == "lumina":
        from backbones.lumina import tiny_lumina_prompt

        vocab = backbone.processor
        text = f"Generate an image of 64x48 according to the following prompt : {prompt}".split()
        return tiny_lumina_prompt([*vocab.convert_tokens_to_ids(text), 16], rows=3, cols=4)  # 16: <reserved08706>
    vocab = backbone.tokenizer  # tar: Qwen2 chat, then <im_start><S0>
    ids = vocab.convert_tokens_to_ids
    system = ids(["system", "You", "are", "a", "helpful", "assistant", "."])
    return [3, *system, 2, 3, *ids(["user", *prompt.split()]), 2, 3, ids("assistant"), 4, 5]


@pytest.mark.parametrize("model", TEXT_TO_IMAGE)
def test_a_prompt_gives_the_tokens_of_its_token_ids_condition(model):
    backbone = tiny_backbone_with_tokenizer(model)
    prompt = "a photo of a red cat"
    expected = torch.tensor([expected_prompt_ids(model, backbone, prompt)])
    assert torch.equal(backbone.prompt_token_ids(Condition(prompts=[prompt])), expected)
    _, from_prompt = backbone.prefill(Condition(prompts=[prompt]), guided=True)
    _, from_ids = backbone.prefill(Condition(token_ids=expected), guided=True)
    torch.testing.assert_close(from_prompt, from_ids, rtol=0, atol=0)


@pytest.mark.parametrize("model", TEXT_TO_IMAGE)
def test_ragged_prompts_run_in_groups_of_equal_length_in_batch_order(model):
    backbone = tiny_backbone_with_tokenizer(model)
    lengths = [backbone.prompt_token_ids(Condition(prompts=[p])).shape[1] for p in RAGGED]
    assert len(set(lengths)) >= 3
    with pytest.raises(ValueError, match="same length"):  # the adapters do not pad: a ragged batch is refused
        backbone.prompt_token_ids(Condition(prompts=RAGGED))
    groups = group_by_prompt_length(backbone, Condition(prompts=RAGGED), max_batch=1)
    assert sorted(i for indices, _ in groups for i in indices.tolist()) == list(range(len(RAGGED)))
    tokens = torch.randint(0, backbone.codebook_size, (len(RAGGED), backbone.geometry.num_tokens))
    grouped = grouped_teacher_forced_hidden(backbone, Condition(prompts=RAGGED), tokens, guided=True)
    assert grouped.shape == (2 * len(RAGGED), backbone.geometry.num_tokens, backbone.hidden_size)
    for j, prompt in enumerate(RAGGED):  # each image alone: its [cond; uncond] rows sit at j and B + j
        alone = backbone.teacher_forced_hidden(Condition(prompts=[prompt]), tokens[j : j + 1], guided=True)
        torch.testing.assert_close(grouped[[j, len(RAGGED) + j]], alone, rtol=1e-4, atol=1e-5)


def test_a_class_conditional_backbone_refuses_prompt_corpora_and_too_many_classes(tmp_path):
    from hydra.errors import InstantiationException

    cfg = compose_config(tiny_experiment("llamagen", tmp_path, ["data.spec.num_classes=1000"]), tmp_path / "run")
    with pytest.raises(InstantiationException, match="data.spec.num_classes=10"):
        run_training(cfg)
    cfg = compose_config(tiny_experiment("llamagen", tmp_path, ["data.spec.conditions=prompts"]), tmp_path / "run")
    with pytest.raises(InstantiationException, match="data.spec.conditions=class_ids"):
        run_training(cfg)
    cfg = compose_config(tiny_experiment("emu3", tmp_path, ["data.spec.conditions=class_ids"]), tmp_path / "run")
    with pytest.raises(InstantiationException, match="data.spec.conditions=prompts"):
        run_training(cfg)
    assert not (tmp_path / "corpora").exists()
