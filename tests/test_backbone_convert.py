"""`python -m backbones.convert lumina` on a tiny random release written the way Lumina-mGPT's are.

The release (`_write_release`) is what ``save_pretrained`` of Lumina-mGPT's
``ChameleonXLLMXForConditionalGeneration`` writes after ``finetune_solver.py`` deleted the VQ-VAE:
transformers' Chameleon key names in two safetensors shards with an index; q/k norms of shape
(model_parallel_size, head_dim); no ``model.vqmodel.*``; a config.json with Lumina-mGPT's fields
(``ChameleonXLLMXForConditionalGeneration``, ``model_parallel_size``, ``z_loss_weight``,
``mask_image_logits``, ``dropout``, ``rope_theta``/``rope_scaling``); the tokenizer beside it. The
VQ-VAE comes as Meta's ``vqgan.ckpt`` (``{"state_dict": ...}`` under the VQModel's own module names,
decoder and loss included).

The reference is the original forward: transformers' Chameleon with the released tensors and, in
place of its q/k norms, `_PerRankNorm`, written here from Lumina-mGPT's ``ChameleonLayerNorm``
semantics (statistics over head_dim, then rank r's row for heads r*H/R .. (r+1)*H/R - 1). The
converted checkpoint must give its logits; the same weights with the rows tiled instead of repeated
per rank must not (so the test can tell the two orders apart: 8 query heads on 2 ranks).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import ChameleonForConditionalGeneration

from backbones.base import Condition
from backbones.convert import (
    INDEX_FILE,
    ConversionError,
    convert_lumina,
    lumina_release_problems,
    main,
)
from backbones.lumina import load_lumina_backbone, tiny_lumina_config, tiny_lumina_prompt, tiny_lumina_tokenizer

HEADS, KV_HEADS, RANKS, HEAD_DIM = 8, 4, 2, 4  # hidden 32: 4 query and 2 key heads per rank
EOL = 3
PROMPTS = torch.tensor([tiny_lumina_prompt([10, 11, 12]), tiny_lumina_prompt([20, 21, 22])])


def _config():
    config = tiny_lumina_config(num_heads=HEADS)
    config.num_key_value_heads = KV_HEADS
    return config


def _released_tensors(seed=0):
    """(LM tensors in the released layout, the VQ-VAE's tensors under model.vqmodel.*) of one random model."""
    torch.manual_seed(seed)
    state = {k: v.clone() for k, v in ChameleonForConditionalGeneration(_config()).state_dict().items()}
    vq = {k: state.pop(k) for k in list(state) if k.startswith("model.vqmodel.")}
    generator = torch.Generator().manual_seed(seed + 1)
    for key in [k for k in state if ".self_attn.q_norm." in k or ".self_attn.k_norm." in k]:
        # one row per rank, distinct rows (transformers' init would give ones and zeros: no test at all)
        state[key] = (1.0 if key.endswith("weight") else 0.0) + 0.5 * torch.randn(RANKS, HEAD_DIM, generator=generator)
    return state, vq


def _lumina_config_json(config):
    """config.json as Lumina-mGPT's save_pretrained (transformers 4.4x, ChameleonXLLMXConfig) writes it."""
    fields = config.to_dict()
    for key in ("rope_parameters", "image_token_id", "qk_layernorm", "dtype"):
        fields.pop(key, None)
    fields.update(
        architectures=["ChameleonXLLMXForConditionalGeneration"],
        model_parallel_size=RANKS,
        z_loss_weight=1e-5,
        mask_image_logits=True,
        dropout=0.05,
        rope_theta=10000.0,
        rope_scaling=None,
        torch_dtype="bfloat16",
        transformers_version="4.44.0",
    )
    return fields


def _write_release(directory, dtype=torch.float32, seed=0):
    """A tiny Lumina-mGPT release in `directory` and Meta's vqgan.ckpt beside it; (release, vqgan path)."""
    from safetensors.torch import save_file

    state, vq = _released_tensors(seed)
    state = {k: v.to(dtype) for k, v in state.items()}
    release = directory / "release"
    release.mkdir()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2]}
    shards["model-00002-of-00002.safetensors"] = keys[len(keys) // 2 :]
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, release / name, metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in state.values())
    weight_map = {k: name for name, names in shards.items() for k in names}
    (release / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (release / "config.json").write_text(json.dumps(_lumina_config_json(_config())))
    (release / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 2}))
    tiny_lumina_tokenizer().save_pretrained(release)
    meta = {k.removeprefix("model.vqmodel."): v for k, v in vq.items()}
    meta["decoder.conv_in.weight"] = torch.randn(4, 4, 3, 3)  # Meta's file has the decoder and the loss too
    meta["loss.logvar"] = torch.zeros(())
    vqgan = directory / "vqgan.ckpt"
    torch.save({"state_dict": meta}, vqgan)
    return release, vqgan


class _PerRankNorm(nn.Module):
    """Lumina-mGPT's q/k norm: LayerNorm statistics per head, rank r's (weight, bias) row on its heads."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)

    def forward(self, x):  # (tokens, heads, head_dim)
        tokens, heads, dim = x.shape
        ranks = self.weight.shape[0]
        normed = F.layer_norm(x, (dim,), eps=1e-5).view(tokens, ranks, heads // ranks, dim)
        return (normed * self.weight[None, :, None] + self.bias[None, :, None]).view(tokens, heads, dim)


def _original_model(seed=0):
    """The released weights run with the original per-rank q/k norms (the reference forward)."""
    state, vq = _released_tensors(seed)
    model = ChameleonForConditionalGeneration(_config()).eval()
    norms = {k: state.pop(k) for k in list(state) if "_norm." in k and ".self_attn." in k}
    missing, unexpected = model.load_state_dict({**state, **vq}, strict=False)
    assert not unexpected and set(missing) == set(norms)
    for index, layer in enumerate(model.model.layers):
        for name in ("q_norm", "k_norm"):
            prefix = f"model.layers.{index}.self_attn.{name}."
            setattr(layer.self_attn, name, _PerRankNorm(norms[prefix + "weight"], norms[prefix + "bias"]))
    return model


def _all_logits(model, ids):
    with torch.no_grad():
        return model.lm_head(model.model(input_ids=ids, use_cache=False).last_hidden_state)  # (B, L, vocab)


@pytest.fixture
def release(tmp_path):
    return _write_release(tmp_path)


def test_converted_checkpoint_gives_the_original_forwards_logits(release, tmp_path):
    released, vqgan = release
    out = convert_lumina(released, tmp_path / "converted", vqgan=vqgan)
    converted, info = ChameleonForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    norm = converted.model.layers[0].self_attn.q_norm.weight
    assert norm.shape == (HEADS, HEAD_DIM) and converted.model.layers[0].self_attn.k_norm.weight.shape[0] == KV_HEADS
    reference = _original_model()
    torch.testing.assert_close(_all_logits(converted.eval(), PROMPTS), _all_logits(reference, PROMPTS))
    # the other order of the rows (rank rows tiled over heads) is a different model: the check has power
    for index, layer in enumerate(converted.model.layers):
        per_rank = reference.model.layers[index].self_attn.q_norm.weight.data
        layer.self_attn.q_norm.weight.data = per_rank.repeat(HEADS // RANKS, 1)
    assert not torch.allclose(_all_logits(converted, PROMPTS), _all_logits(reference, PROMPTS), atol=1e-3)


def test_adapter_loads_the_converted_directory_and_refuses_the_release(release, tmp_path):
    released, vqgan = release
    with pytest.raises(ValueError, match="python -m backbones.convert lumina") as error:
        load_lumina_backbone(str(released), device="cpu", dtype="float32", rows=3, cols=4, eol_token_id=EOL)
    assert "one row per model-parallel rank" in str(error.value) and "no VQ-VAE" in str(error.value)
    out = convert_lumina(released, tmp_path / "converted", vqgan=vqgan)
    assert lumina_release_problems(out) == []
    backbone = load_lumina_backbone(str(out), device="cpu", dtype="float32", rows=3, cols=4, eol_token_id=EOL)
    assert backbone.processor is not None  # the release's tokenizer files came along
    reference = _original_model()
    img2bpe = reference.model.vocabulary_mapping.img2bpe
    image_ids = torch.tensor([img2bpe[k] for k in range(backbone.codebook_size)])
    _, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=False)
    torch.testing.assert_close(backbone.logits(hidden)[:, 0], _all_logits(reference, PROMPTS)[:, -1, image_ids])
    meta_codebook = torch.load(vqgan)["state_dict"]["quantize.embedding.weight"]
    assert torch.equal(backbone.codebook_latents(), meta_codebook)  # not transformers' random init


def test_transformers_alone_refuses_the_release_and_its_suggested_flag_gives_another_model(release):
    """Why the converter exists: the per-rank norms do not fit transformers' per-head ones, and the
    way out transformers' error offers (ignore_mismatched_sizes) re-initialises them, and the VQ-VAE."""
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        ChameleonForConditionalGeneration.from_pretrained(release[0])
    wrong = ChameleonForConditionalGeneration.from_pretrained(
        release[0], dtype=torch.float32, ignore_mismatched_sizes=True
    )
    wrong.eval()
    assert not torch.allclose(_all_logits(wrong, PROMPTS), _all_logits(_original_model(), PROMPTS), atol=1e-3)


def test_the_output_keeps_everything_else(release, tmp_path):
    released, vqgan = release
    out = convert_lumina(released, tmp_path / "converted", vqgan=vqgan)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["ChameleonForConditionalGeneration"] and "z_loss_weight" not in config
    assert config["model_parallel_size"] == RANKS and config["vocabulary_map"] == _config().vocabulary_map
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (released / name).read_bytes()
    note = json.loads((out / "conversion.json").read_text())
    assert note["source"] == str(released) and note["vqgan"] == str(vqgan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "release", "vqgan.ckpt"]  # no leftovers


def test_bfloat16_release_stays_bfloat16_with_rows_repeated_per_rank(tmp_path):
    from safetensors import safe_open

    released, vqgan = _write_release(tmp_path, dtype=torch.bfloat16)
    out = convert_lumina(released, tmp_path / "converted", vqgan=vqgan)
    key = "model.layers.1.self_attn.q_norm.bias"
    weight_map = json.loads((released / INDEX_FILE).read_text())["weight_map"]
    with safe_open(released / weight_map[key], "pt") as before, safe_open(out / weight_map[key], "pt") as after:
        rows, converted = before.get_tensor(key), after.get_tensor(key)
    assert converted.dtype == torch.bfloat16 and converted.shape == (HEADS, HEAD_DIM)
    assert all(torch.equal(converted[h], rows[h // (HEADS // RANKS)]) for h in range(HEADS))


def test_the_vq_vae_may_come_from_a_transformers_chameleon_directory(release, tmp_path):
    released, vqgan = release
    first = convert_lumina(released, tmp_path / "first", vqgan=vqgan)
    second = convert_lumina(released, tmp_path / "second", vqgan=first)
    a = ChameleonForConditionalGeneration.from_pretrained(first).state_dict()
    b = ChameleonForConditionalGeneration.from_pretrained(second).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_errors_name_the_problem_and_the_fix(release, tmp_path):
    released, vqgan = release
    with pytest.raises(ConversionError, match="no VQ-VAE weights.*finetune_solver.*--vqgan.*vqgan.ckpt"):
        convert_lumina(released, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="exists; remove it or give another"):
        convert_lumina(released, tmp_path / "taken", vqgan=vqgan)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ConversionError, match="does not exist"):
        convert_lumina(released, tmp_path / "out", vqgan=tmp_path / "nowhere.ckpt")
    other = torch.load(vqgan)["state_dict"]
    other["quantize.embedding.weight"] = torch.zeros(3, 3)
    del other["quant_conv.bias"]
    torch.save({"state_dict": other}, tmp_path / "other.ckpt")
    with pytest.raises(ConversionError, match="missing model.vqmodel.quant_conv.bias.*quantize.embedding.weight"):
        convert_lumina(released, tmp_path / "out", vqgan=tmp_path / "other.ckpt")
    converted = convert_lumina(released, tmp_path / "out", vqgan=vqgan)
    with pytest.raises(ConversionError, match="already in transformers' Chameleon layout"):
        convert_lumina(converted, tmp_path / "again")
    with pytest.raises(ConversionError, match="not a directory"):
        convert_lumina(tmp_path / "nowhere", tmp_path / "again")


def test_a_norm_shape_no_rank_count_explains_is_refused(release, tmp_path):
    from safetensors.torch import load_file, save_file

    released, vqgan = release
    name = json.loads((released / INDEX_FILE).read_text())["weight_map"]["model.layers.0.self_attn.q_norm.weight"]
    tensors = load_file(released / name)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(3, HEAD_DIM)
    save_file(tensors, released / name)
    with pytest.raises(ConversionError, match=r"q_norm.weight \(3, 4\).*model_parallel_size=2"):
        convert_lumina(released, tmp_path / "out", vqgan=vqgan)
    assert not (tmp_path / "out").exists()


def test_a_failed_conversion_leaves_no_output_and_no_temporary(release, tmp_path, monkeypatch):
    import backbones.convert as convert

    def broken(plan, out):
        raise ConversionError("verification: planted failure")

    monkeypatch.setattr(convert, "_verify_lumina", broken)
    released, vqgan = release
    with pytest.raises(ConversionError, match="planted"):
        convert_lumina(released, tmp_path / "out", vqgan=vqgan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "vqgan.ckpt"]


def test_command_line(release, tmp_path, capsys):
    released, vqgan = release
    assert main(["lumina", str(released), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["lumina", str(released), str(tmp_path / "out"), "--vqgan", str(vqgan)]) == 0
    assert f"wrote {tmp_path / 'out'}" in capsys.readouterr().out
