"""Training a MAR here (train/mar_module.py) and saving it where `load_mar_backbone` reads it (backbones/mar.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import truncnorm

from backbones.mar import MARBackbone, load_mar_backbone, mar_config
from train.mar_module import initialise_like_mar, mar_loss, mask_ratio, random_masks

# The test-sized MAR (backbones/mar.py's "tiny") with pixel-patch tokens, smaller still.
TINY = dict(encoder_depth=1, decoder_depth=1, diffloss_depth=1, diffloss_width=32, sampling_steps=5, pixel_patch_size=2)


def tiny_model(seed: int = 0) -> MARBackbone:
    torch.manual_seed(seed)
    return initialise_like_mar(MARBackbone(mar_config("tiny", **TINY), num_iter=4))


def test_mask_ratios_follow_mars_truncated_normal():
    generator = torch.Generator().manual_seed(0)
    ratios = torch.tensor([mask_ratio(0.7, generator) for _ in range(4000)])
    assert 0.7 <= ratios.min() and ratios.max() <= 1.0
    reference = truncnorm((0.7 - 1.0) / 0.25, 0, loc=1.0, scale=0.25)
    # Mean and spread of LTH14/mar's scipy draw, within 5 standard errors.
    assert abs(ratios.mean() - reference.mean()) < 5 * reference.std() / math.sqrt(4000)
    assert abs(ratios.std() - reference.std()) < 0.1 * reference.std()


def test_masks_hide_as_many_positions_in_every_row():
    mask = random_masks(6, 16, 11, "cpu", torch.Generator().manual_seed(0))
    assert mask.sum(1).tolist() == [11] * 6
    assert len({tuple(row.tolist()) for row in mask}) > 1  # each row its own order


def test_the_loss_is_the_diffusion_loss_of_the_masked_tokens_given_the_visible_ones(monkeypatch):
    model = tiny_model()
    tokens = torch.rand(5, 16, 4) * 2 - 1
    class_ids = torch.arange(5)
    seen = {}
    loss_of = model.diffusion.loss

    def spy(z, target, generator=None):
        seen["z"], seen["target"] = z, target
        return loss_of(z, target, generator)

    monkeypatch.setattr(model.diffusion, "loss", spy)
    mar_loss(model, tokens, class_ids, 0.0, 0.7, repeats=3, generator=torch.Generator().manual_seed(4))
    masked = random_masks(5, 16, _masked_count(4), "cpu", _after_ratio(4))
    # The targets are the masked tokens, each `repeats` times, conditioned on states that do not read them.
    torch.testing.assert_close(seen["target"], tokens[masked].repeat(3, 1))
    changed = torch.where(masked[..., None], torch.zeros_like(tokens), tokens)
    seen_before = seen["z"]
    mar_loss(model, changed, class_ids, 0.0, 0.7, repeats=3, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(seen["z"], seen_before)


def _masked_count(seed: int) -> int:
    generator = torch.Generator().manual_seed(seed)
    torch.rand(5, generator=generator)  # the class-dropout draw comes first
    return math.ceil(16 * mask_ratio(0.7, generator))


def _after_ratio(seed: int) -> torch.Generator:
    generator = torch.Generator().manual_seed(seed)
    torch.rand(5, generator=generator)
    mask_ratio(0.7, generator)
    return generator


def test_class_dropout_conditions_on_the_fake_latent(monkeypatch):
    model = tiny_model()
    seen = []
    conditions = model.conditions
    monkeypatch.setattr(model, "conditions", lambda t, k, e: seen.append(e) or conditions(t, k, e))
    tokens, class_ids = torch.zeros(64, 16, 4), torch.arange(64) % 10
    mar_loss(model, tokens, class_ids, 0.5, 0.7, 1, torch.Generator().manual_seed(0))
    is_fake = (seen[0] == model.fake_latent).all(1)
    assert 10 < int(is_fake.sum()) < 54  # about half
    torch.testing.assert_close(seen[0][~is_fake], model.class_emb(class_ids)[~is_fake])


def test_a_few_steps_fit_a_batch():
    model = tiny_model()
    tokens = (torch.rand(16, 16, 4) > 0.5).float() * 2 - 1
    class_ids = torch.arange(16) % 10
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        loss = mar_loss(model, tokens, class_ids, 0.1, 0.7, 4, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), losses


def test_init_is_mars_outside_the_diffusion_head():
    model = tiny_model()
    assert 0.01 < model.mask_token.std() < 0.03 and 0.01 < model.encoder_pos_embed_learned.std() < 0.03
    assert model.encoder_blocks[0].attn.qkv.bias.abs().max() == 0
    # The head keeps its own zero-initialised modulations (every block starts as the identity).
    assert model.diffusion.net.blocks[0].modulation[-1].weight.abs().max() == 0


# ---- saving and loading ---------------------------------------------------------------------------


def test_a_saved_mar_loads_under_the_official_names_in_the_loaders_settings(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "model.safetensors")) == set(model.official_state_dict())
    assert json.loads((tmp_path / "config.json").read_text())["pixel_patch_size"] == 2
    loaded = load_mar_backbone(tmp_path, num_iter=6, cfg_schedule="constant", final_step_noise=True)
    assert loaded.weights_fingerprint() == model.weights_fingerprint()
    assert (loaded.num_iter, loaded.cfg_schedule, loaded.config.final_step_noise) == (6, "constant", True)
    tokens = loaded.sample(torch.tensor([1, 2]), num_iter=6, generator=torch.Generator().manual_seed(0))
    pixels = loaded.tokens_to_pixels(tokens.view(2, 4, 4, 4))
    assert pixels.shape == (2, 1, 8, 8) and 0 <= pixels.min() and pixels.max() <= 1
    # Pixel-patch tokens decode without a VAE, and refuse one.
    with pytest.raises(ValueError, match="without a VAE"):
        loaded.attach_vae(object())
    loaded.attach_vae(None)  # (nothing to detach: its pixels are its tokens)
    assert loaded.tokens_to_pixels(tokens.view(2, 4, 4, 4)).shape == (2, 1, 8, 8)


def test_a_damaged_or_incomplete_export_names_the_fix(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="size=auto"):
        load_mar_backbone(tmp_path, size="base")
    (tmp_path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="export it again"):
        load_mar_backbone(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="export it again"):
        load_mar_backbone(tmp_path)


# ---- the experiments, end to end --------------------------------------------------------------------


@pytest.mark.slow  # two trainings and a decode run
def test_the_embedded_mar_recipes_train_export_and_decode_with_cspd(tmp_path, monkeypatch):
    from conftest import compose_config

    from decode.cli import run_decode
    from train.pipeline import run_training

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tiny = [
        "data=digits_continuous_tiny",  # 8x8 digits: a 4x4 grid of 2x2 patches
        "module.architecture.grid_size=4",
        "module.architecture.buffer_size=4",
        "module.architecture.diffloss_width=32",
        "module.architecture.sampling_steps=4",
        "module.sample_num_iter=4",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=1",
        "callbacks.ema.update_starting_at_step=1",
        "callbacks.samples.every_n_steps=2",
        "callbacks.samples.num_images=2",
        f"paths.root_dir={tmp_path}",
    ]
    exports = {}
    for experiment, width in (("backbone_mar_digits", 32), ("mar_drafter_digits", 16)):
        export = tmp_path / experiment
        overrides = [f"+experiment={experiment}", f"export.dir={export}", *tiny]
        overrides += [f"module.architecture.{k}_dim={width}" for k in ("encoder", "decoder")]
        metrics = run_training(compose_config(overrides, tmp_path / experiment / "run"))
        assert metrics["train/diffusion_loss"] > 0
        exports[experiment] = export
    target = load_mar_backbone(exports["backbone_mar_digits"], num_iter=16, final_step_noise=True)
    assert target.config.clip_denoised and target.config.pixel_patch_size == 2 and target.seq_len == 16
    decode = [
        "+experiment=cspd_mar_digits",
        f"backbone.path={exports['backbone_mar_digits']}",
        "backbone.num_iter=16",
        f"decode.mar_drafter={exports['mar_drafter_digits']}",
        "decode.num_images=2",
        "decode.seeds=1",
        f"decode.out={tmp_path / 'decode'}",
        f"paths.root_dir={tmp_path}",
    ]
    from train.digits_classifier import train_and_save

    train_and_save(tmp_path / "checkpoints" / "digits-classifier", 8, 16, log=lambda _: None)  # scores 8x8 digits
    report = run_decode(compose_config(decode + [f"paths.checkpoints_dir={tmp_path / 'checkpoints'}"], tmp_path / "d"))
    assert report["methods"]["cspd_mar"]["lossless"] and not report["methods"]["mar_grouped"]["lossless"]
    assert report["methods"]["cspd_mar_auto"]["lossless"]
    assert report["methods"]["ar"]["forward_passes_per_image"] == 16
    assert report["methods"]["mar_grouped"]["forward_passes_per_image"] < 16
