"""The Harmon adapter (backbones/harmon.py): official names, loading, prompts, the LLM between MAR's halves."""

from __future__ import annotations

import hydra
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config

from backbones.harmon import (
    HarmonBackbone,
    interpolate_grid,
    load_harmon_backbone,
    random_harmon_backbone,
)

# Harmon's (written out, not imported: a changed template must fail here).
TEMPLATE = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
CFG_PROMPT = "Generate an image."
PROMPTS = ["a red cat on the tree with a blue car", "dog"]  # different token counts: right padding in a batch


@pytest.fixture(scope="module")
def harmon():
    return random_harmon_backbone(seed=0, dtype="float64")  # 8x8 grid interpolated from the learned 4x4


def draws(model: HarmonBackbone, batch: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    orders = torch.stack([torch.randperm(model.seq_len, generator=generator) for _ in range(batch)])
    shape = (batch, model.seq_len, model.diffusion.noise_steps, model.token_dim)
    return orders, torch.randn(shape, generator=generator, dtype=torch.float64)


def templated_ids(model: HarmonBackbone, text: str) -> list[int]:
    return model.tokenizer.encode(TEMPLATE.format(input=text), add_special_tokens=True)


# ---- official weights and loading ---------------------------------------------------------------


def test_official_names_and_shapes(harmon):
    state = harmon.official_state_dict()
    assert {key.split(".")[0] for key in state} == {"llm", "mar", "proj_in", "proj_out"}
    # Harmon's build_mlp: Sequential(Linear, SiLU, Linear); proj_in encoder_dim -> H -> H, proj_out back.
    enc, hidden = harmon.config.encoder_dim, harmon.llm_hidden_size
    assert {k: tuple(v.shape) for k, v in state.items() if k.startswith("proj_")} == {
        "proj_in.0.weight": (hidden, enc),
        "proj_in.0.bias": (hidden,),
        "proj_in.2.weight": (hidden, hidden),
        "proj_in.2.bias": (hidden,),
        "proj_out.0.weight": (hidden, hidden),
        "proj_out.0.bias": (hidden,),
        "proj_out.2.weight": (enc, hidden),
        "proj_out.2.bias": (enc,),
    }
    # mar.* are LTH14/mar's names (the diffusion head's included); the LLM is Qwen2ForCausalLM's `model`.
    assert {k.removeprefix("mar.") for k in state if k.startswith("mar.")} == set(harmon.mar.official_state_dict())
    assert "mar.diffloss.net.res_blocks.0.in_ln.weight" in state and "mar.fake_latent" in state
    assert state["llm.model.layers.1.self_attn.k_proj.weight"].shape == (16, hidden)  # 2 KV heads of 8
    assert "llm.model.norm.weight" in state and "llm.model.embed_tokens.weight" in state


def test_state_dict_round_trips_through_a_file(harmon, tmp_path):
    state = harmon.official_state_dict()
    # What Harmon saves beyond the generator (the unused LM head, VAE weights) is skipped.
    extra = {"llm.lm_head.weight": torch.zeros(64, 32), "vae.decoder.conv_in.weight": torch.zeros(1)}
    torch.save({**state, **extra}, tmp_path / "harmon_tiny.pth")
    other = random_harmon_backbone(seed=1, dtype="float64")
    assert other.weights_fingerprint() != harmon.weights_fingerprint()
    other.load_official_state_dict(torch.load(tmp_path / "harmon_tiny.pth", weights_only=True))
    back = other.official_state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert other.weights_fingerprint() == harmon.weights_fingerprint()


def test_bad_state_dicts_are_refused_naming_the_key(harmon):
    state = harmon.official_state_dict()
    cases = [
        ({k: v for k, v in state.items() if k != "llm.model.layers.1.mlp.up_proj.weight"}, "lacks 'llm.model.layers"),
        (dict(state, **{"proj_in.0.weight": torch.zeros(32, 8)}), r"'proj_in\.0\.weight' has shape \(32, 8\)"),
        (dict(state, **{"projector.weight": torch.zeros(1)}), "unexpected key 'projector.weight'"),
        ({k: v for k, v in state.items() if k != "mar.mask_token"}, r"mar\.\*: .*lacks 'mask_token'"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            random_harmon_backbone(seed=1).load_official_state_dict(bad)


def test_load_from_files_and_missing_files_say_where_to_get_them(harmon, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"huggingface-cli download wusize/harmon harmon_0\.5b\.pth"):
        load_harmon_backbone(tmp_path / "nowhere.pth", tmp_path)
    torch.save(harmon.official_state_dict(), tmp_path / "harmon_tiny.pth")
    with pytest.raises(FileNotFoundError, match=r"Qwen/Qwen2\.5-.*backbone\.llm_path"):
        load_harmon_backbone(tmp_path, tmp_path / "no-llm")
    llm_dir = tmp_path / "llm"
    harmon.llm.config.save_pretrained(llm_dir)
    harmon.tokenizer.save_pretrained(llm_dir)
    loaded = load_harmon_backbone(tmp_path, llm_dir, device="cpu", dtype="float64", grid_size=8)
    assert loaded.name == "harmon-tiny" and loaded.geometry.rows == 8 and not loaded.training
    assert loaded.weights_fingerprint() == harmon.weights_fingerprint()
    assert loaded.tokenizer.eos_token_id == harmon.tokenizer.eos_token_id  # the LLM directory's tokenizer


# ---- prompts and guidance --------------------------------------------------------------------


def test_cfg_twins_use_the_cfg_prompt(harmon):
    condition = harmon.prompt_condition(PROMPTS, guided=True)
    assert condition.rows == 4 and condition.batch == 2
    rows = [templated_ids(harmon, f"Generate an image: {p}") for p in PROMPTS] + [templated_ids(harmon, CFG_PROMPT)] * 2
    for row, ids in enumerate(rows):  # each row's tokens, then EOS padding outside the mask
        length = int(condition.attention_mask[row].sum())
        assert condition.input_ids[row, :length].tolist() == ids
        assert set(condition.input_ids[row, length:].tolist()) <= {harmon.tokenizer.eos_token_id}
    # The unconditional half of a guided pass is the cfg prompt's own pass.
    tokens = torch.randn(2, harmon.seq_len, harmon.token_dim, dtype=torch.float64)
    known = torch.rand(2, harmon.seq_len, generator=torch.Generator().manual_seed(0)) < 0.4
    guided = harmon.predict_conditions(tokens, known, PROMPTS, guided=True)
    alone = harmon.predict_conditions(tokens, known, harmon.condition_from_ids(rows[2:], guided=False), guided=False)
    torch.testing.assert_close(guided[2:], alone, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(guided[:2], guided[2:], atol=1e-3)  # the prompt changes the conditions


def straightforward_conditions(model: HarmonBackbone, tokens, known, ids: list[int]) -> torch.Tensor:
    """One row's z (seq_len, dim) written out: no batch, no padding, no cache; the LLM reads the whole sequence."""
    mar, buffer = model.mar, model.buffer_size
    enc_pos, dec_pos, diff_pos = model.position_embeddings()
    visible = known.nonzero()[:, 0]  # ascending
    x = torch.cat([mar.fake_latent.expand(buffer, -1), mar.z_proj(tokens[visible])])
    x = mar.z_proj_ln(x + enc_pos[0, torch.cat([torch.arange(buffer), buffer + visible])])[None]
    for block in mar.encoder_blocks:
        x = block(x)
    x_enc = mar.encoder_norm(x)  # (1, buffer + n, enc)
    z = model.proj_in(x_enc)
    sequence = torch.cat([model.llm.embed_tokens(torch.tensor([ids])), z[:, buffer:], z[:, :buffer]], dim=1)
    hidden = model.llm(inputs_embeds=sequence).last_hidden_state[:, len(ids) :]  # causal, positions 0..
    x_enc = x_enc + model.proj_out(torch.cat([hidden[:, -buffer:], hidden[:, :-buffer]], dim=1))
    full = mar.mask_token.expand(1, buffer + model.seq_len, -1).clone()
    full[0, torch.cat([torch.arange(buffer), buffer + visible])] = mar.decoder_embed(x_enc)[0]
    x = full + dec_pos
    for block in mar.decoder_blocks:
        x = block(x)
    return (mar.decoder_norm(x)[:, buffer:] + diff_pos)[0]


def test_conditions_equal_an_unbatched_recomputation(harmon):
    # Rows of different prompt lengths and different known counts (a verifier's batch), [cond; uncond].
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randn(2, harmon.seq_len, harmon.token_dim, generator=generator, dtype=torch.float64)
    known = torch.zeros(2, harmon.seq_len, dtype=torch.bool)
    known[0, torch.randperm(harmon.seq_len, generator=generator)[:29]] = True
    known[1, torch.randperm(harmon.seq_len, generator=generator)[:5]] = True
    condition = harmon.prompt_condition(PROMPTS, guided=True)
    with torch.no_grad():
        z = harmon.conditions(tokens.repeat(2, 1, 1), known.repeat(2, 1), condition)
        texts = [f"Generate an image: {p}" for p in PROMPTS] + [CFG_PROMPT] * 2
        for row, text in enumerate(texts):
            expected = straightforward_conditions(harmon, tokens[row % 2], known[row % 2], templated_ids(harmon, text))
            torch.testing.assert_close(z[row], expected, rtol=1e-10, atol=1e-10)


# ---- sampling --------------------------------------------------------------------------------


def test_sampling_is_deterministic_and_rows_are_independent():
    harmon = random_harmon_backbone(seed=0, dtype="float64", grid_size=4)  # (a 4x4 grid keeps it fast)
    orders, noise = draws(harmon, 2)
    batched = harmon.sample(PROMPTS, num_iter=4, cfg_scale=3.0, orders=orders, noise=noise)
    assert batched.shape == (2, 16, harmon.token_dim) and torch.isfinite(batched).all()
    assert torch.equal(batched, harmon.sample(PROMPTS, num_iter=4, cfg_scale=3.0, orders=orders, noise=noise))
    for row, prompt in enumerate(PROMPTS):  # alone: the other prompt (longer or shorter) is not beside it
        alone = harmon.sample(
            [prompt], num_iter=4, cfg_scale=3.0, orders=orders[row : row + 1], noise=noise[row : row + 1]
        )
        torch.testing.assert_close(alone[0], batched[row], rtol=1e-9, atol=1e-9)
    other = harmon.sample(["green house"], num_iter=4, cfg_scale=3.0, orders=orders[1:], noise=noise[1:])
    assert not torch.allclose(other[0], batched[1])  # the prompt matters


def test_sampling_without_guidance_and_bad_draws(harmon):
    orders, noise = draws(harmon, 1, seed=2)
    tokens = harmon.sample(PROMPTS[1:], num_iter=3, cfg_scale=1.0, orders=orders, noise=noise)
    assert tokens.shape == (1, harmon.seq_len, harmon.token_dim)
    with pytest.raises(ValueError, match="made with guided=True"):
        harmon.sample(harmon.prompt_condition(PROMPTS[1:], True), cfg_scale=1.0, orders=orders, noise=noise)
    with pytest.raises(ValueError, match="one permutation"):
        harmon.sample(PROMPTS[1:], num_iter=3, orders=torch.zeros(1, harmon.seq_len), noise=noise)
    with pytest.raises(NotImplementedError, match="kl16.ckpt"):
        harmon.tokens_to_pixels(tokens.view(1, 8, 8, -1))


# ---- the grid --------------------------------------------------------------------------------


def test_position_embeddings_are_interpolated_to_the_grid():
    native = random_harmon_backbone(seed=0, grid_size=4)  # the learned 4x4
    assert native.position_embeddings()[0] is native.mar.encoder_pos_embed_learned
    learned = native.mar.decoder_pos_embed_learned  # (1, 4 + 16, dim)
    # Halving with align_corners=False averages 2x2 blocks; the buffer part is kept.
    half = interpolate_grid(learned, 4, 4, 2)
    blocks = learned[0, 4:].view(2, 2, 2, 2, -1).mean(dim=(1, 3)).reshape(4, -1)
    torch.testing.assert_close(half[0, 4:], blocks)
    assert torch.equal(half[0, :4], learned[0, :4])
    small = random_harmon_backbone(seed=0, grid_size=2)
    assert small.seq_len == 4 and small.geometry.rows == 2
    torch.testing.assert_close(small.position_embeddings()[1], half)
    # Doubling: the official call, whose corners are the learned corners.
    diffusion = native.mar.diffusion_pos_embed_learned
    double = random_harmon_backbone(seed=0, grid_size=8).position_embeddings()[2]
    reference = F.interpolate(diffusion.view(1, 4, 4, -1).permute(0, 3, 1, 2), size=(8, 8), mode="bilinear")
    torch.testing.assert_close(double, reference.flatten(2).transpose(1, 2))
    torch.testing.assert_close(double[0, [0, 7, 56, 63]], diffusion[0, [0, 3, 12, 15]])


# ---- configs ---------------------------------------------------------------------------------


def test_hydra_tiny_config_instantiates(tmp_path):
    backbone = hydra.utils.instantiate(compose_config(["backbone=harmon_tiny"], tmp_path).backbone)
    assert isinstance(backbone, HarmonBackbone) and backbone.geometry.rows == 8 and backbone.config.final_step_noise
    assert backbone.identity()["num_iter"] == 8 and backbone.token_kind == "masked"


def test_hydra_real_config_has_the_official_defaults_and_says_where_the_weights_are(tmp_path):
    real = compose_config(["backbone=harmon"], tmp_path).backbone
    assert (real.num_iter, real.cfg_schedule, real.grid_size, real.dtype) == (64, "constant", 32, "bfloat16")
    real.path = str(tmp_path / "none")
    with pytest.raises(Exception, match="huggingface-cli download wusize/harmon"):
        hydra.utils.instantiate(real)


def test_pixels_come_from_an_attached_kl_vae():
    from backbones.mar_vae import random_kl_vae

    harmon = random_harmon_backbone(seed=0, grid_size=4)
    fingerprint, names = harmon.weights_fingerprint(), set(harmon.official_state_dict())
    with pytest.raises(NotImplementedError, match="backbone.vae_path"):
        harmon.tokens_to_pixels(torch.randn(2, 4, 4, 4))
    vae = random_kl_vae(seed=0, embed_dim=4)
    harmon.attach_vae(vae)
    assert harmon.weights_fingerprint() == fingerprint and set(harmon.official_state_dict()) == names
    tokens = torch.randn(2, 4, 4, 4)
    pixels = harmon.tokens_to_pixels(tokens)
    assert pixels.shape == (2, 3, 8, 8) and 0 <= pixels.min() and pixels.max() <= 1
    torch.testing.assert_close(pixels, vae.tokens_to_pixels(tokens), rtol=0, atol=0)  # Harmon.decode: / 0.2325
