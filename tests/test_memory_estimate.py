"""The memory arithmetic of train/memory_estimate.py, checked on tiny models where it can be measured."""

import json

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from train.memory_estimate import (
    BF16,
    EXPERIMENTS,
    Experiment,
    TransformerShape,
    _hf_shape,
    count_parameters,
    estimate,
    main,
    ssd_head_parameters,
)

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    tie_word_embeddings=False,
)


def tiny_qwen2(**overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**(TINY | overrides))).eval()


def test_meta_counts_equal_the_numels_of_a_real_instance():
    with torch.device("meta"):
        meta = tiny_qwen2()
    real = tiny_qwen2()
    assert count_parameters(meta) == count_parameters(real) == sum(p.numel() for p in real.state_dict().values())
    # closed form: embeddings + head + per layer (q, o: H x H; k, v: H x kv; biases of q, k, v; SwiGLU; 2 norms) + norm
    h, i, layers, v, kv = 32, 48, 2, 100, 2 * 8
    per_layer = 2 * h * h + 2 * h * kv + (h + 2 * kv) + 3 * h * i + 2 * h
    assert count_parameters(real) == 2 * v * h + layers * per_layer + h


def test_tied_weights_are_counted_once():
    tied = tiny_qwen2(tie_word_embeddings=True)
    assert count_parameters(tied) == count_parameters(tiny_qwen2()) - 100 * 32


def test_head_count_is_the_heads_numel():
    from heads.ssd import SSDHeadConfig, SSDHeads

    heads = SSDHeads(SSDHeadConfig(hidden_size=24, width=24, depth=2))
    assert ssd_head_parameters(24) == sum(p.numel() for p in heads.parameters())


def test_kv_bytes_match_a_real_cache():
    model = tiny_qwen2().to(torch.bfloat16)
    shape = _hf_shape(model.config)
    rows, length = 3, 7
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 100, (rows, length)), cache=cache, use_cache=True)
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == shape.kv_bytes_per_token * length * rows


def tiny_experiment(**overrides) -> Experiment:
    settings = dict(
        name="tiny",
        build=tiny_qwen2,
        shape=lambda m: _hf_shape(m.config),
        rows=3,
        cols=4,
        end_of_line=True,
        prompt_tokens=5,
        codebook=16,
        batch_per_gpu=2,
    )
    return Experiment(**(settings | overrides))


def test_estimate_terms_add_up_and_grow_linearly_with_the_batch():
    experiment = tiny_experiment()
    assert experiment.sequence == 5 + 3 * 5  # prompt + rows * (cols + EOL)
    shape = TransformerShape(layers=2, hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8)
    one, two = (estimate(experiment, 1000, shape, 10, batch=b) for b in (1, 2))
    assert one.weights == 1000 * BF16 and one.heads_adam == 10 * 16
    assert one.train_total == one.weights + one.heads_adam + one.teacher_kv + one.teacher_activations + one.student
    assert two.train_total - one.train_total == one.per_image == two.per_image
    assert one.teacher_kv == shape.kv_bytes_per_token * experiment.sequence * 2  # [cond; uncond]
    assert one.decode_kv[16] == 16 * one.decode_kv[1] == one.teacher_kv * 16
    assert estimate(tiny_experiment(cfg=False), 1000, shape, 10, batch=1).decode_kv[1] == one.decode_kv[1] // 2
    budget = one.train_total + 3 * one.per_image
    assert one.max_batch(budget) == 4 and one.max_batch(one.weights) == 0


def test_every_real_experiment_builds_on_meta_and_is_written_as_json(tmp_path, capsys):
    out = tmp_path / "memory.json"
    payload = main(["--only", "llamagen-gpt-xl-384px", "tar-7b-s0", "--out", str(out)])
    assert json.loads(out.read_text()) == payload
    xl = payload["experiments"]["llamagen-gpt-xl-384px"]
    assert 0.7e9 < xl["backbone_params"] < 0.8e9  # GPT-XL: 775M
    assert xl["sequence"] == 1 + 24 * 24
    assert 7.5e9 < payload["experiments"]["tar-7b-s0"]["backbone_params"] < 8.5e9
    assert "llamagen-gpt-xl-384px" in capsys.readouterr().out
    assert {e.name for e in EXPERIMENTS} >= {
        "emu3-gen-8b-720px",
        "janus-pro-7b-384px",
        "lumina-mgpt-7b-768px",
        "llamagen-gpt-xxl-384px",
    }


def test_unknown_experiment_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="available"):
        main(["--only", "nope", "--out", str(tmp_path / "m.json")])
