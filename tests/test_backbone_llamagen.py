"""The LlamaGen adapter: official key names, cache and rollback, CFG, greedy AR and SSD, loading errors."""

import hydra
import pytest
import torch
from conftest import CONF_DIR, assert_greedy_lossless_methods_equal_greedy_ar, compose_config

from backbones.base import Condition, ImageGeometry
from backbones.llamagen import (
    GPT_SIZES,
    LlamaGenBackbone,
    LlamaGenGPT,
    VQ16Decoder,
    llamagen_config,
    load_llamagen_backbone,
    random_llamagen_backbone,
    rope_table_2d,
)
from decode import SamplingConfig, generate_ar

GRID, VOCAB, CLASSES = 4, 64, 10  # the tiny config


@pytest.fixture
def llamagen():
    return random_llamagen_backbone(seed=0)


def official_keys(n_layer: int) -> set[str]:
    """Parameter names of FoundationVision/LlamaGen autoregressive/models/gpt.py `Transformer` (c2i)."""
    keys = {"cls_embedding.embedding_table.weight", "tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(n_layer):
        keys |= {
            f"layers.{i}.attention.wqkv.weight",
            f"layers.{i}.attention.wo.weight",
            f"layers.{i}.feed_forward.w1.weight",
            f"layers.{i}.feed_forward.w2.weight",
            f"layers.{i}.feed_forward.w3.weight",
            f"layers.{i}.attention_norm.weight",
            f"layers.{i}.ffn_norm.weight",
        }
    return keys


def test_geometry_and_sizes(llamagen):
    assert llamagen.geometry == ImageGeometry(rows=GRID, cols=GRID, end_of_line=False)
    assert llamagen.codebook_size == VOCAB and llamagen.hidden_size == 32 and llamagen.cfg_space == "logits"
    assert llamagen_config("GPT-XL", 384).grid_size == 24 and llamagen_config("GPT-B", 256).grid_size == 16
    assert GPT_SIZES["GPT-B"] == {"n_layer": 12, "n_head": 12, "dim": 768}
    assert GPT_SIZES["GPT-L"] == {"n_layer": 24, "n_head": 16, "dim": 1024}
    assert GPT_SIZES["GPT-XL"] == {"n_layer": 36, "n_head": 20, "dim": 1280}


def test_state_dict_has_the_official_key_names(llamagen):
    assert set(llamagen.model.state_dict()) == official_keys(2)
    assert "layers.0.attention.wqkv.weight" in official_keys(1)  # spelled out, as in the source
    # An official-style checkpoint state dict loads strictly.
    foreign = {k: torch.randn_like(v) for k, v in llamagen.model.state_dict().items()}
    fresh = LlamaGenGPT(llamagen.config)
    fresh.load_state_dict(foreign, strict=True)


def test_gpt_xl_384_shapes_match_the_official_model():
    with torch.device("meta"):
        model = LlamaGenGPT(llamagen_config("GPT-XL", 384))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(shapes) == official_keys(36)
    assert shapes["cls_embedding.embedding_table.weight"] == (1001, 1280)  # 1000 classes + null
    assert shapes["tok_embeddings.weight"] == (16384, 1280) and shapes["output.weight"] == (16384, 1280)
    assert shapes["layers.0.attention.wqkv.weight"] == (3 * 1280, 1280)
    assert shapes["layers.0.feed_forward.w1.weight"] == (3584, 1280)  # find_multiple(int(2*4*1280/3), 256)
    assert model.rope.shape == (1 + 24 * 24, 1280 // 20 // 2, 2)


def test_rope_table_prefix_is_zero_and_grid_is_row_then_column():
    table = rope_table_2d(grid_size=3, head_dim=8, base=10000.0, prefix=1)
    assert table.shape == (10, 4, 2) and torch.equal(table[0], torch.zeros(4, 2))
    # head_dim 8 -> 2 frequencies per axis, the first (freq 1) for the row then for the column.
    cell = 1 + 1 * 3 + 2  # row 1, column 2
    torch.testing.assert_close(
        table[cell, 0], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))])
    )
    torch.testing.assert_close(
        table[cell, 2], torch.tensor([torch.cos(torch.tensor(2.0)), torch.sin(torch.tensor(2.0))])
    )


@torch.no_grad()
def test_cached_steps_give_the_no_cache_logits_at_every_position(llamagen):
    tokens = torch.randint(0, VOCAB, (3, GRID * GRID))
    class_ids = torch.tensor([1, 5, 9])
    reference = llamagen(tokens, class_ids)  # one forward of the module, no cache
    state, hidden = llamagen.prefill(Condition(class_ids=class_ids), guided=False)
    stepped = [llamagen.logits(hidden)]
    for position in range(GRID * GRID - 1):
        stepped.append(llamagen.logits(llamagen.step(state, tokens[:, position : position + 1])))
    torch.testing.assert_close(torch.cat(stepped, dim=1), reference, atol=1e-4, rtol=1e-4)
    # and a multi-token step gives the same as the singles
    state_b, _ = llamagen.prefill(Condition(class_ids=class_ids), guided=False)
    block = llamagen.logits(llamagen.step(state_b, tokens[:, :-1]))
    torch.testing.assert_close(block, reference[:, 1:], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_rollback_reproduces_the_logits_of_a_fresh_prefill(llamagen):
    condition = Condition(class_ids=torch.tensor([2, 7]))
    prefix, wrong, right = (torch.randint(0, VOCAB, (2, n)) for n in (5, 4, 4))
    state, _ = llamagen.prefill(condition, guided=True)
    llamagen.step(state, torch.cat([prefix, wrong], dim=1))
    llamagen.rollback(state, 5)
    assert state.num_image_tokens == 5 and state.cache.get_seq_length() == 6  # class token + 5
    after = llamagen.step(state, right)
    fresh_state, _ = llamagen.prefill(condition, guided=True)
    fresh = llamagen.step(fresh_state, torch.cat([prefix, right], dim=1))[:, 5:]
    torch.testing.assert_close(llamagen.logits(after), llamagen.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_guidance_mixes_on_logits_and_scale_one_is_conditional(llamagen):
    class_ids = torch.tensor([4, 6])
    state, hidden = llamagen.prefill(Condition(class_ids=class_ids), guided=True)
    assert hidden.shape == (4, 1, 32)
    logits = llamagen.logits(hidden)
    cond, uncond = logits[:2], logits[2:]
    torch.testing.assert_close(llamagen.scores(state, hidden, 4.0), uncond + 4.0 * (cond - uncond))
    torch.testing.assert_close(llamagen.scores(state, hidden, 1.0), cond)
    # the unconditional twin is the null class (id = num_classes)
    null = llamagen(torch.zeros(2, 1, dtype=torch.long), torch.full((2,), CLASSES))
    torch.testing.assert_close(uncond, null, atol=1e-5, rtol=1e-4)
    _, unguided = llamagen.prefill(Condition(class_ids=class_ids), guided=False)
    torch.testing.assert_close(llamagen.logits(unguided), cond, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pre_norm_hidden_states(llamagen):
    tokens = torch.randint(0, VOCAB, (2, GRID * GRID))
    class_ids = torch.tensor([3, 8])
    hidden = llamagen.teacher_forced_hidden(Condition(class_ids=class_ids), tokens)
    assert not torch.allclose(hidden.pow(2).mean(-1), torch.ones(2, GRID * GRID), atol=0.05)
    torch.testing.assert_close(llamagen.logits(hidden), llamagen(tokens, class_ids), atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_generate_ar_equals_a_plain_no_cache_loop(llamagen, cfg_scale):
    class_ids = torch.tensor([0, 3, 7])
    result = generate_ar(llamagen, Condition(class_ids=class_ids), SamplingConfig(cfg_scale=cfg_scale, greedy=True))
    both = torch.cat([class_ids, torch.full_like(class_ids, CLASSES)])
    tokens = torch.zeros(3, 0, dtype=torch.long)
    for _ in range(GRID * GRID):
        padded = torch.cat([tokens, torch.zeros(3, 1, dtype=torch.long)], dim=1)  # forward drops the last input
        logits = llamagen(torch.cat([padded, padded]), both)[:, -1]
        cond, uncond = logits[:3], logits[3:]
        tokens = torch.cat([tokens, (uncond + cfg_scale * (cond - uncond)).argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(result.tokens, tokens.view(3, GRID, GRID))


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_exact_ssd_equals_greedy_ar(llamagen, cfg_scale):
    assert_greedy_lossless_methods_equal_greedy_ar(llamagen, Condition(class_ids=torch.tensor([1, 8])), cfg_scale)


def test_checkpoint_file_with_a_model_entry_loads(llamagen, tmp_path):
    path = tmp_path / "c2i_tiny.pt"
    state = {"_orig_mod." + k if k.startswith("norm") else k: v for k, v in llamagen.model.state_dict().items()}
    torch.save({"model": state, "steps": 1}, path)
    loaded = load_llamagen_backbone(path, model="tiny", device="cpu", dtype="float32")
    assert isinstance(loaded, LlamaGenBackbone) and not loaded.training
    tokens, class_ids = torch.randint(0, VOCAB, (2, GRID * GRID)), torch.tensor([1, 2])
    torch.testing.assert_close(loaded(tokens, class_ids), llamagen(tokens, class_ids))


def test_checkpoint_with_pickled_objects_needs_trust(llamagen, tmp_path):
    import argparse

    path = tmp_path / "c2i_tiny_args.pt"
    torch.save({"model": llamagen.model.state_dict(), "args": argparse.Namespace(gpt_model="tiny")}, path)
    with pytest.raises(RuntimeError, match="trust_pickle"):
        load_llamagen_backbone(path, model="tiny", device="cpu", dtype="float32")
    loaded = load_llamagen_backbone(path, model="tiny", device="cpu", dtype="float32", trust_pickle=True)
    assert torch.equal(loaded.model.output.weight, llamagen.model.output.weight)


@pytest.mark.parametrize("trust_pickle", [False, True])
def test_a_truncated_checkpoint_is_called_damaged_not_untrusted(llamagen, tmp_path, trust_pickle):
    """A cut-off download must not steer anyone to unsafe loading: it says to download again."""
    path = tmp_path / "c2i_tiny_cut.pt"
    torch.save({"model": llamagen.model.state_dict()}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="is damaged or not a PyTorch checkpoint") as raised:
        load_llamagen_backbone(path, model="tiny", device="cpu", dtype="float32", trust_pickle=trust_pickle)
    assert "trust_pickle" not in str(raised.value) and "download it again" in str(raised.value)


def test_bare_fsdp_style_state_dict_loads(llamagen, tmp_path):
    torch.save(llamagen.model.state_dict(), tmp_path / "c2i_tiny_64.pt")
    loaded = load_llamagen_backbone(tmp_path, model="tiny", image_size=64, device="cpu", dtype="float32")
    assert torch.equal(loaded.model.tok_embeddings.weight, llamagen.model.tok_embeddings.weight)


def test_missing_checkpoint_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="huggingface-cli download") as error:
        load_llamagen_backbone(tmp_path / "nowhere", model="GPT-XL", image_size=384, device="cpu")
    assert "c2i_XL_384.pt" in str(error.value)


def test_codebook_from_a_vq_checkpoint_and_no_decoder_without_one(llamagen, tmp_path):
    with pytest.raises(NotImplementedError, match="vq_ds16_c2i.pt"):
        llamagen.codebook_latents()
    with pytest.raises(NotImplementedError, match="VQ-16 decoder"):
        llamagen.tokens_to_pixels(torch.zeros(1, GRID, GRID, dtype=torch.long))
    codebook = torch.randn(VOCAB, 8)
    torch.save(
        {"model": {"quantize.embedding.weight": codebook, "decoder.conv_in.weight": torch.zeros(1)}}, tmp_path / "vq.pt"
    )
    with_vq = LlamaGenBackbone(llamagen.config, vq_path=tmp_path / "vq.pt")
    latents = with_vq.codebook_latents()
    assert latents.shape == (VOCAB, 8)
    torch.testing.assert_close(latents, torch.nn.functional.normalize(codebook, dim=-1))


def official_vq_decoder_keys() -> list[str]:
    """Some parameter names of the official VQ-16 VQModel (tokenizer/tokenizer_image/vq_model.py), decoder side."""
    return [
        "post_quant_conv.weight",
        "post_quant_conv.bias",
        "decoder.conv_in.weight",
        "decoder.mid.0.norm1.weight",
        "decoder.mid.0.conv2.bias",
        "decoder.mid.1.q.weight",
        "decoder.mid.1.proj_out.bias",
        "decoder.conv_blocks.0.res.2.conv1.weight",
        "decoder.conv_blocks.0.attn.2.k.weight",
        "decoder.conv_blocks.0.upsample.conv.weight",
        "decoder.conv_blocks.1.res.0.nin_shortcut.weight",
        "decoder.conv_blocks.3.res.0.nin_shortcut.weight",
        "decoder.conv_blocks.4.res.2.norm2.bias",
        "decoder.norm_out.weight",
        "decoder.conv_out.weight",
        "decoder.conv_out.bias",
    ]


def test_vq16_decoder_has_the_official_names_and_shapes():
    with torch.device("meta"):
        decoder = VQ16Decoder()
    shapes = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
    for key in official_vq_decoder_keys():
        assert key in shapes, key
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in shapes  # the last level does not upsample
    assert not any(
        k.startswith("decoder.conv_blocks.1.attn") for k in shapes
    )  # attention at the lowest resolution only
    assert shapes["post_quant_conv.weight"] == (256, 8, 1, 1)
    assert shapes["decoder.conv_in.weight"] == (512, 256, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3)


@torch.no_grad()
def test_tokens_to_pixels_through_a_vq_checkpoint(llamagen, tmp_path):
    tiny = {"z_channels": 32, "ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1}
    torch.manual_seed(3)
    decoder = VQ16Decoder(**tiny).eval()
    codebook = torch.randn(VOCAB, 8)
    state = {
        "quantize.embedding.weight": codebook,
        "quantize.codebook_used": torch.zeros(65536),
        "encoder.conv_in.weight": torch.zeros(1),
        "quant_conv.weight": torch.zeros(1),
        **decoder.state_dict(),
    }
    torch.save({"model": state}, tmp_path / "vq.pt")
    backbone = LlamaGenBackbone(llamagen.config, vq_path=tmp_path / "vq.pt")
    backbone.vq_architecture = tiny
    tokens = torch.randint(0, VOCAB, (2, GRID, GRID))
    images = backbone.tokens_to_pixels(tokens)
    assert images.shape == (2, 3, 2 * GRID, 2 * GRID) and 0 <= images.min() and images.max() <= 1
    latents = torch.nn.functional.normalize(codebook, dim=-1)[tokens].permute(0, 3, 1, 2)
    torch.testing.assert_close(images, ((decoder(latents) + 1) / 2).clamp(0, 1))
    assert set(backbone.state_dict()) == {"model." + k for k in llamagen.model.state_dict()}  # decoder kept apart


def test_hydra_configs(tmp_path):
    assert (CONF_DIR / "backbone" / "llamagen.yaml").is_file()
    tiny = hydra.utils.instantiate(compose_config(["backbone=llamagen_tiny"], tmp_path).backbone)
    assert isinstance(tiny, LlamaGenBackbone) and tiny.geometry.num_tokens == GRID * GRID
    cfg = compose_config(["backbone=llamagen", f"backbone.path={tmp_path / 'none'}", "backbone.device=cpu"], tmp_path)
    with pytest.raises(Exception, match="huggingface-cli download"):
        hydra.utils.instantiate(cfg.backbone)


@torch.no_grad()
def test_bfloat16_cast_keeps_the_rope_table_float32(llamagen):
    reference = llamagen.model.rope.clone()
    cast = random_llamagen_backbone(seed=0).to(torch.bfloat16)
    state, hidden = cast.prefill(Condition(class_ids=torch.tensor([1])), guided=True)
    hidden = cast.step(state, torch.tensor([[3, 4]]))
    assert hidden.dtype == torch.bfloat16 and cast.model.rope.dtype == torch.float32
    assert torch.equal(cast.model.rope, reference)
