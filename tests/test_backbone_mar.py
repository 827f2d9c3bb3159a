"""The MAR adapter (backbones/mar.py): official names and shapes, loading, and the masked random-order sampler."""

from __future__ import annotations

import math
from itertools import accumulate

import pytest
import torch

from backbones.diffusion_head import DenoisingMLP, timestep_embedding
from backbones.mar import (
    MAR_SIZES,
    MARBackbone,
    load_mar_backbone,
    mar_config,
    mask_lengths,
    random_mar_backbone,
)

SEQ, DIM, CLASSES = 16, 4, 10  # the tiny config: 4x4 grid of 4-channel tokens


@pytest.fixture(scope="module")
def mar():
    return random_mar_backbone(seed=0)


def official_keys(enc_depth: int, dec_depth: int, head_depth: int) -> set[str]:
    """Parameter names of LTH14/mar ``models/mar.py`` ``MAR`` (timm Blocks, ``DiffLoss``), spelled out."""
    keys = {
        "class_emb.weight",
        "fake_latent",
        "z_proj.weight",
        "z_proj.bias",
        "z_proj_ln.weight",
        "z_proj_ln.bias",
        "encoder_pos_embed_learned",
        "encoder_norm.weight",
        "encoder_norm.bias",
        "decoder_embed.weight",
        "decoder_embed.bias",
        "mask_token",
        "decoder_pos_embed_learned",
        "decoder_norm.weight",
        "decoder_norm.bias",
        "diffusion_pos_embed_learned",
    }
    block = ["norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]
    for part, depth in (("encoder_blocks", enc_depth), ("decoder_blocks", dec_depth)):
        keys |= {f"{part}.{i}.{layer}.{p}" for i in range(depth) for layer in block for p in ("weight", "bias")}
    head = ["time_embed.mlp.0", "time_embed.mlp.2", "cond_embed", "input_proj"]
    head += ["final_layer.adaLN_modulation.1", "final_layer.linear"]
    head += [f"res_blocks.{i}.{layer}" for i in range(head_depth) for layer in ("in_ln", "mlp.0", "mlp.2")]
    head += [f"res_blocks.{i}.adaLN_modulation.1" for i in range(head_depth)]
    keys |= {f"diffloss.net.{layer}.{p}" for layer in head for p in ("weight", "bias")}
    return keys


def draws(batch: int, model: MARBackbone, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    orders = torch.stack([torch.randperm(SEQ, generator=generator) for _ in range(batch)])
    noise = torch.randn(batch, SEQ, model.diffusion.noise_steps, DIM, generator=generator)
    return orders, noise


# ---- architecture and official weights ---------------------------------------------------------


def test_released_sizes_match_the_readme_parameter_counts():
    # README table: MAR-B 208M, MAR-L 479M, MAR-H 943M (rounded up); built on the meta device, no memory.
    for size, millions in (("base", 208), ("large", 479), ("huge", 943)):
        with torch.device("meta"):
            model = MARBackbone(mar_config(size))
        count = sum(v.numel() for v in model.official_state_dict().values()) / 1e6
        assert millions - 1 < count <= millions, (size, count)
        assert model.seq_len == 256 and model.token_dim == 16 and model.buffer_size == 64
        assert model.class_emb.num_embeddings == 1000
        head = model.diffusion.config
        assert (head.depth, head.width) == {"base": (6, 1024), "large": (8, 1280), "huge": (12, 1536)}[size]
        assert head.sampling_steps == 100 and not head.final_step_noise and not head.clip_denoised
        assert model.official_state_dict()["diffloss.net.time_embed.mlp.0.weight"].shape == (head.width, 256)
    assert MAR_SIZES["large"]["encoder_dim"] == 1024 and MAR_SIZES["huge"]["encoder_heads"] == 16


def test_official_key_list(mar):
    c = mar.config
    assert set(mar.official_state_dict()) == official_keys(c.encoder_depth, c.decoder_depth, c.diffloss_depth)


def test_official_state_dict_round_trips(mar):
    state = mar.official_state_dict()
    other = random_mar_backbone(seed=1)
    assert not torch.equal(other.z_proj.weight, mar.z_proj.weight)
    other.load_official_state_dict(state)
    back = other.official_state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert all(torch.equal(v, mar.state_dict()[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("size", ["base", "large", "huge"])
def test_time_embedding_takes_the_official_256_frequencies_at_every_width(size):
    # DiT's TimestepEmbedder: cos then sin of t * exp(-ln(10000) k / 128), k < 128, into a width x 256 layer.
    config = mar_config(size)
    with torch.device("meta"):  # shapes only
        net = DenoisingMLP(config.diffusion_config())
    assert net.time_embed[0].weight.shape == (config.diffloss_width, 256)
    t = torch.arange(0, 1000, 37)
    k = torch.arange(128, dtype=torch.float32)
    args = t.float()[:, None] * torch.exp(-math.log(10000) * k / 128)[None]
    assert torch.equal(timestep_embedding(t, net.time_frequencies), torch.cat([args.cos(), args.sin()], dim=-1))


def test_bad_state_dicts_are_refused_naming_the_key(mar):
    state = mar.official_state_dict()
    renamed = dict(state)
    renamed["diffloss.net.res_blocks.0.in_norm.weight"] = renamed.pop("diffloss.net.res_blocks.0.in_ln.weight")
    with pytest.raises(ValueError, match=r"unexpected key 'diffloss\.net\.res_blocks\.0\.in_norm\.weight'"):
        random_mar_backbone(seed=1).load_official_state_dict(renamed)
    missing = {k: v for k, v in state.items() if k != "decoder_blocks.1.attn.qkv.bias"}
    with pytest.raises(ValueError, match=r"lacks 'decoder_blocks\.1\.attn\.qkv\.bias'"):
        random_mar_backbone(seed=1).load_official_state_dict(missing)
    wrong = dict(state, **{"diffloss.net.time_embed.mlp.0.weight": torch.zeros(64, 64)})
    with pytest.raises(
        ValueError, match=r"'diffloss\.net\.time_embed\.mlp\.0\.weight' has shape \(64, 64\).*\(64, 32\)"
    ):
        random_mar_backbone(seed=1).load_official_state_dict(wrong)


# ---- loading ----------------------------------------------------------------------------------


def test_missing_checkpoint_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_mar_backbone(tmp_path / "nowhere", size="base")
    message = str(error.value)
    assert "checkpoint-last.pth" in message and "dropbox.com" in message and "util/download.py" in message
    assert "huggingface-cli download jadechoghari/mar mar-base.safetensors --local-dir" in message
    with pytest.raises(FileNotFoundError, match="no MAR checkpoint at .*checkpoint-last.pth"):
        load_mar_backbone(tmp_path, size="large")  # an empty directory
    with pytest.raises(ValueError, match="unknown MAR size"):
        load_mar_backbone(tmp_path, size="xl")


def test_loads_model_ema_then_model_then_safetensors(tmp_path, mar):
    from safetensors.torch import save_file

    ema, raw = mar.official_state_dict(), random_mar_backbone(seed=2).official_state_dict()
    torch.save({"model": raw, "model_ema": ema, "epoch": 799}, tmp_path / "checkpoint-last.pth")
    loaded = load_mar_backbone(tmp_path, size="tiny")
    assert all(torch.equal(loaded.official_state_dict()[k], v) for k, v in ema.items())
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())

    torch.save({"model": raw}, tmp_path / "only_model.pth")
    loaded = load_mar_backbone(tmp_path / "only_model.pth", size="tiny")
    assert all(torch.equal(loaded.official_state_dict()[k], v) for k, v in raw.items())

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in ema.items()}, hf / "mar-tiny.safetensors")
    loaded = load_mar_backbone(hf, size="tiny")
    assert all(torch.equal(loaded.official_state_dict()[k], v) for k, v in ema.items())

    with pytest.raises(ValueError, match="is it a MAR-B checkpoint"):
        load_mar_backbone(tmp_path, size="base")  # tiny weights under the MAR-B architecture


# ---- sampling ---------------------------------------------------------------------------------


def test_sampling_is_deterministic_given_orders_and_noise():
    # float64: the untrained head makes tokens ~1e5 that feed the next steps, so float32 rounding (which differs
    # with the thread count's reduction order) grows past any fixed tolerance.
    mar = random_mar_backbone(seed=0).double()
    orders, noise = draws(2, mar)
    noise = noise.double()
    classes = torch.tensor([3, 7])
    for cfg in (1.0, 3.0):
        first = mar.sample(classes, num_iter=3, cfg_scale=cfg, orders=orders, noise=noise)
        assert first.shape == (2, SEQ, DIM) and torch.isfinite(first).all()
        assert torch.equal(first, mar.sample(classes, num_iter=3, cfg_scale=cfg, orders=orders, noise=noise))
        # Rows are independent: swapping them swaps the tokens, and each row alone gives the same tokens, up to
        # float64 rounding (other batch shapes run other matmul kernels).
        swapped = mar.sample(classes.flip(0), 3, cfg, orders=orders.flip(0), noise=noise.flip(0))
        torch.testing.assert_close(swapped.flip(0), first, rtol=1e-9, atol=1e-9)
        for row in range(2):
            alone = mar.sample(classes[row : row + 1], 3, cfg, orders=orders[row : row + 1], noise=noise[row : row + 1])
            torch.testing.assert_close(alone[0], first[row], rtol=1e-9, atol=1e-9)
    # Drawn with a generator: reproducible from its seed.
    a = mar.sample(classes, 3, 2.0, generator=torch.Generator().manual_seed(5))
    b = mar.sample(classes, 3, 2.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def expected_reveals(seq_len: int, num_iter: int) -> list[int]:
    """MaskGIT/MAR cosine schedule, written independently: tokens revealed at each step."""
    masked, counts = seq_len, []
    for step in range(num_iter):
        keep = max(1, min(masked - 1, math.floor(seq_len * math.cos(math.pi / 2 * (step + 1) / num_iter))))
        if step == num_iter - 1:
            keep = 0
        counts.append(masked - keep)
        masked = keep
    return counts


@pytest.mark.parametrize("num_iter,cfg", [(3, 1.0), (3, 2.5), (5, 1.0), (20, 2.0)])
def test_tokens_revealed_per_step_follow_the_cosine_schedule(mar, monkeypatch, num_iter, cfg):
    orders, noise = draws(2, mar)
    calls = []
    original = mar.diffusion.sample

    def recording(z, step_noise, cfg_scale, temperature, guided):
        calls.append((step_noise, cfg_scale, guided, z.shape[0]))
        return original(z, step_noise, cfg_scale, temperature, guided=guided)

    monkeypatch.setattr(mar.diffusion, "sample", recording)
    mar.sample(torch.tensor([1, 2]), num_iter=num_iter, cfg_scale=cfg, orders=orders, noise=noise)
    counts = expected_reveals(SEQ, num_iter)
    assert [len(n) // 2 for n, *_ in calls] == [c for c in counts if c]  # steps revealing nothing call no head
    lengths = mask_lengths(SEQ, num_iter)
    assert lengths[-1] == 0 and [SEQ - x for x in lengths] == list(accumulate(counts))
    masked, i = SEQ, 0
    for count in counts:
        if not count:
            continue
        step_noise, scale, guided, rows = calls[i]
        i += 1
        assert guided == (cfg != 1.0) and rows == len(step_noise) * (2 if guided else 1)
        # The head gets the noise of positions orders[:, mask_len:masked], row-major.
        revealed = orders[:, masked - count : masked]
        torch.testing.assert_close(step_noise, noise[torch.arange(2)[:, None], revealed].flatten(0, 1), rtol=0, atol=0)
        # Linear CFG reads the reference's mask_len, which is 1 (not 0) at the last step.
        mask_len = max(1, masked - count)
        assert scale == pytest.approx(1 + (cfg - 1) * (SEQ - mask_len) / SEQ)
        masked -= count


def test_cfg_scale_one_is_unguided_and_guidance_with_equal_twins_changes_nothing():
    model = random_mar_backbone(seed=3).double()  # float64: see the determinism test
    orders, noise = draws(2, model)
    noise = noise.double()
    classes = torch.tensor([4, 4])
    plain = model.sample(classes, 3, 1.0, orders=orders, noise=noise)
    assert torch.equal(plain, model.sample(classes, 3, 1.0, cfg_schedule="constant", orders=orders, noise=noise))
    # With the null condition equal to the class embedding, the twins agree and every guided mix is the cond
    # prediction: the guided path (twin rows, their order, the cond half's variance) must give unguided tokens.
    with torch.no_grad():
        model.fake_latent.copy_(model.class_emb.weight[4:5])
    for schedule in ("linear", "constant"):
        guided = model.sample(classes, 3, 4.0, cfg_schedule=schedule, orders=orders, noise=noise)
        torch.testing.assert_close(guided, plain, rtol=1e-9, atol=1e-9)
    # And an actual null condition does change the tokens.
    other = random_mar_backbone(seed=3).double()
    assert not torch.allclose(other.sample(classes, 3, 4.0, orders=orders, noise=noise), plain)


def test_temperature_scales_only_the_added_noise(mar):
    orders, noise = draws(1, mar)
    classes = torch.tensor([0])
    cold = mar.sample(classes, 1, 1.0, temperature=0.0, orders=orders, noise=noise)
    other_noise = noise.clone()
    other_noise[:, :, 1:] = torch.randn_like(noise[:, :, 1:])  # only x_T is read at temperature 0
    assert torch.equal(cold, mar.sample(classes, 1, 1.0, temperature=0.0, orders=orders, noise=other_noise))
    assert not torch.equal(cold, mar.sample(classes, 1, 1.0, temperature=1.0, orders=orders, noise=noise))


def test_bad_sampling_arguments_are_refused(mar):
    orders, noise = draws(1, mar)
    with pytest.raises(ValueError, match="permutation"):
        mar.sample(torch.tensor([0]), 3, orders=torch.zeros(1, SEQ, dtype=torch.long), noise=noise)
    with pytest.raises(ValueError, match="noise must be"):
        mar.sample(torch.tensor([0]), 3, orders=orders, noise=noise[:, :, :2])
    with pytest.raises(ValueError, match="cfg_schedule"):
        mar.sample(torch.tensor([0]), 3, 2.0, cfg_schedule="cosine", orders=orders, noise=noise)
    with pytest.raises(ValueError, match="class ids"):
        mar.sample(torch.tensor([CLASSES]), 3, orders=orders, noise=noise)
    with pytest.raises(NotImplementedError, match="KL-16"):
        mar.tokens_to_pixels(torch.zeros(1, SEQ, DIM))


# ---- the verifier's pass ----------------------------------------------------------------------


def test_predict_conditions_reads_only_known_tokens_and_rows_are_independent(mar):
    torch.manual_seed(0)
    tokens = torch.randn(3, SEQ, DIM)
    known = torch.rand(3, SEQ) < 0.5
    known[2] = False  # nothing known: the first step's conditions
    classes = torch.tensor([1, 5, 9])
    for guided in (False, True):
        z = mar.predict_conditions(tokens, known, classes, guided=guided)
        assert z.shape == ((6 if guided else 3), SEQ, mar.hidden_size)
        scrambled = torch.where(known[..., None], tokens, torch.randn_like(tokens))
        torch.testing.assert_close(mar.predict_conditions(scrambled, known, classes, guided), z, rtol=0, atol=0)
        for row in range(3):  # each row alone (the batch pads and masks rows that know fewer tokens)
            alone = mar.predict_conditions(tokens[row : row + 1], known[row : row + 1], classes[row : row + 1], guided)
            # (float32: the batch's masked attention runs another kernel than a row alone, ~1e-6 apart)
            torch.testing.assert_close(alone[0], z[row], rtol=1e-5, atol=1e-5)
            if guided:
                torch.testing.assert_close(alone[1], z[3 + row], rtol=1e-5, atol=1e-5)
        if guided:  # [cond; uncond]: the cond half is the unguided pass
            torch.testing.assert_close(z[:3], mar.predict_conditions(tokens, known, classes, False), rtol=0, atol=0)
    # One batch: rows that know different numbers of tokens are padded and masked, not run one count at a time.
    calls = []
    hook = mar.encoder_blocks[0].register_forward_hook(lambda *_: calls.append(1))
    mar.predict_conditions(tokens, known, classes, guided=True)
    hook.remove()
    assert len(calls) == 1


def test_predict_conditions_gives_the_samplers_conditions(mar, monkeypatch):
    # What a verifier computes from the tokens known before a step is what the sampler conditioned that step on.
    orders, noise = draws(1, mar)
    classes = torch.tensor([6])
    tokens = mar.sample(classes, 3, 1.0, orders=orders, noise=noise)
    seen = []
    original = mar.diffusion.sample
    monkeypatch.setattr(
        mar.diffusion, "sample", lambda z, n, s, t, guided: seen.append(z) or original(z, n, s, t, guided=guided)
    )
    mar.sample(classes, 3, 1.0, orders=orders, noise=noise)
    masked = SEQ
    for step, (z, count) in enumerate(zip(seen, expected_reveals(SEQ, 3))):
        known = torch.ones(1, SEQ, dtype=torch.bool)
        known[0, orders[0, :masked]] = False
        expected = mar.predict_conditions(tokens, known, classes, guided=False)[0, orders[0, masked - count : masked]]
        torch.testing.assert_close(z, expected, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        masked -= count
