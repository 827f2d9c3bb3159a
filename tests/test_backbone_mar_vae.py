"""MAR's KL-16 VAE (backbones/mar_vae.py): official names and shapes, loading, refusals, and MAR's pixels."""

from __future__ import annotations

import pytest
import torch

from backbones.mar import load_mar_backbone, random_mar_backbone
from backbones.mar_vae import MARKLVAE, KLVAEConfig, load_kl16_vae, random_kl_vae

TINY = {"ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1, "resolution": 8, "encoder_attn_resolutions": (4,)}


def test_the_released_shape_has_the_official_names_and_parameter_count():
    """Pinned from the one-time check against LTH14/mar models/vae.py (module doc): the official
    AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4)) has exactly these 312 tensors."""
    with torch.device("meta"):
        vae = MARKLVAE()
    shapes = {name: tuple(value.shape) for name, value in vae.state_dict().items()}
    assert len(shapes) == 312 and sum(p.numel() for p in vae.parameters()) == 66_456_019
    assert shapes["quant_conv.weight"] == (32, 32, 1, 1) and shapes["post_quant_conv.weight"] == (16, 16, 1, 1)
    assert shapes["encoder.conv_out.weight"] == (32, 512, 3, 3) and shapes["decoder.conv_in.weight"] == (512, 16, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3)
    for name in [
        "encoder.down.0.block.1.norm2.bias",
        "encoder.down.2.block.0.nin_shortcut.weight",  # 128 -> 256 channels
        "encoder.down.3.downsample.conv.weight",
        "encoder.down.4.attn.1.proj_out.bias",  # attention at 16x16, the encoder's lowest level
        "encoder.mid.attn_1.q.weight",
        "decoder.mid.block_2.conv1.weight",
        "decoder.up.4.block.2.conv2.weight",  # three blocks a level on the way up
        "decoder.up.4.upsample.conv.weight",
        "decoder.up.3.block.0.nin_shortcut.weight",  # 512 -> 256
        "decoder.up.1.block.0.nin_shortcut.weight",  # 256 -> 128
    ]:
        assert name in shapes, name
    assert not any(".attn." in name for name in shapes if not name.startswith("encoder.down.4."))
    assert "encoder.down.4.downsample.conv.weight" not in shapes and "decoder.up.0.upsample.conv.weight" not in shapes


def save_checkpoint(vae: MARKLVAE, path, **extra) -> None:
    """As kl16.ckpt: the state dict under "model" (what the official init_from_ckpt reads)."""
    torch.save({"model": {**vae.state_dict(), **extra}}, path)


def test_load_round_trips_and_skips_keys_that_are_not_parameters(tmp_path):
    vae = random_kl_vae(seed=3)
    save_checkpoint(vae, tmp_path / "kl16.ckpt", **{"loss.logvar": torch.zeros(())})  # a training leftover
    loaded = load_kl16_vae(tmp_path, config=vae.config)  # the directory: kl16.ckpt in it
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in vae.state_dict().items())
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    latents = torch.randn(2, vae.config.embed_dim, 3, 3)
    torch.testing.assert_close(loaded.decode(latents), vae.decode(latents), rtol=0, atol=0)


def test_missing_wrong_and_damaged_checkpoints_are_refused_with_the_way_out(tmp_path):
    with pytest.raises(FileNotFoundError, match="kl16.ckpt") as error:
        load_kl16_vae(tmp_path / "nowhere")
    assert "backbone.vae_path" in str(error.value) and "util/download.py" in str(error.value)
    vae = random_kl_vae(seed=0)
    state = vae.state_dict()
    del state["decoder.up.1.upsample.conv.bias"]
    torch.save({"model": state}, tmp_path / "lacking.ckpt")
    with pytest.raises(ValueError, match="lacks 'decoder.up.1.upsample.conv.bias' \\(1 keys missing\\)"):
        load_kl16_vae(tmp_path / "lacking.ckpt", config=vae.config)
    with pytest.raises(ValueError, match="'encoder.conv_in.weight' has shape \\(32, 3, 3, 3\\), expected \\(128,"):
        save_checkpoint(vae, tmp_path / "tiny.ckpt")
        load_kl16_vae(tmp_path / "tiny.ckpt")  # tiny weights where the released shape is expected
    mar = random_mar_backbone(seed=0)
    torch.save({"model": mar.official_state_dict()}, tmp_path / "mar.ckpt")
    with pytest.raises(ValueError, match="lacks 'encoder.conv_in.weight'.*is it kl16.ckpt"):
        load_kl16_vae(tmp_path / "mar.ckpt", config=vae.config)
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "tiny.ckpt").read_bytes()[:500])
    with pytest.raises(RuntimeError, match="damaged or not a KL-16 VAE checkpoint"):
        load_kl16_vae(tmp_path / "cut.ckpt", config=vae.config)


def test_bad_shapes_are_refused_at_construction():
    with pytest.raises(ValueError, match="multiple of 32"):
        KLVAEConfig(ch=48)
    with pytest.raises(ValueError, match="not divisible"):
        KLVAEConfig(resolution=100)


@torch.no_grad()
def test_mar_tokens_decode_in_the_official_layout():
    """MAR's unpatchify (patch_size 1) puts flat token i at latent row i // w, column i % w, channels last:
    the decode CLI's (B, rows, cols, D) tokens become the VAE's (B, D, rows, cols) latents divided by 0.2325."""
    mar = random_mar_backbone(seed=0, vae_seed=1)
    batch, h, w, dim = 2, mar.geometry.rows, mar.geometry.cols, mar.token_dim
    flat = torch.randn(batch, h * w, dim)  # (B, seq_len, D), as MAR.sample_tokens returns them
    # The official unpatchify: reshape (B, h, w, c, p, p) and einsum "nhwcpq->nchpwq" with p = 1.
    latents = torch.einsum("nhwcpq->nchpwq", flat.reshape(batch, h, w, dim, 1, 1)).reshape(batch, dim, h, w)
    expected = ((mar.vae.decode(latents / 0.2325) + 1) / 2).clamp(0, 1)
    images = mar.tokens_to_pixels(flat.view(batch, h, w, dim))
    assert images.shape == (batch, 3, 2 * h, 2 * w) and 0 <= images.min() and images.max() <= 1
    torch.testing.assert_close(images, expected, rtol=0, atol=0)
    # Encoding: the posterior's mean times 0.2325, channels last.
    pixels = torch.rand(batch, 3, 2 * h, 2 * w)
    mean, _ = mar.vae.encode(pixels * 2 - 1)
    torch.testing.assert_close(mar.pixels_to_tokens(pixels), (mean * 0.2325).permute(0, 2, 3, 1))


def test_the_vae_is_kept_apart_from_mars_weights():
    plain, with_vae = random_mar_backbone(seed=0), random_mar_backbone(seed=0, vae_seed=1)
    assert plain.weights_fingerprint() == with_vae.weights_fingerprint()
    assert set(plain.state_dict()) == set(with_vae.state_dict())
    assert with_vae.official_state_dict().keys() == plain.official_state_dict().keys()
    with pytest.raises(NotImplementedError, match="backbone.vae_path"):
        plain.tokens_to_pixels(torch.zeros(1, plain.geometry.rows, plain.geometry.cols, plain.token_dim))
    with pytest.raises(ValueError, match="the VAE has 16 latent channels"):
        plain.attach_vae(random_kl_vae(seed=0, embed_dim=16))


def test_load_mar_backbone_reads_the_vae_before_generating(tmp_path):
    torch.save({"model_ema": random_mar_backbone(seed=0).official_state_dict()}, tmp_path / "checkpoint-last.pth")
    with pytest.raises(FileNotFoundError, match="no KL-16 VAE at .*kl16.ckpt"):
        load_mar_backbone(tmp_path, size="tiny", vae_path=tmp_path / "vae")
