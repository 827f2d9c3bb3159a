"""`python -m decode` on the real backbone families (tiny random instances): conditions, figures, quality notes."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config, random_eagle_head, random_ssd_heads

from backbones.llamagen import VQ16Decoder, random_llamagen_backbone
from decode.cli import run_decode
from heads.export import export_heads

TINY_VQ = {"z_channels": 32, "ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1}  # 4x4 tokens -> 8x8 pixels


def tiny_llamagen_with_pixels(vq_path: str, seed: int = 0):
    """Hydra target: the tiny LlamaGen of llamagen_tiny.yaml with a tiny VQ-16 decoder, so it makes images."""
    backbone = random_llamagen_backbone(seed=seed)
    backbone.vq_path, backbone.vq_architecture = Path(vq_path), TINY_VQ
    return backbone


def save_tiny_vq(path: Path, codebook_size: int = 64) -> Path:
    """A random VQ-16 checkpoint in the official layout (codebook + decoder), tiny."""
    torch.manual_seed(3)
    state = {"quantize.embedding.weight": torch.randn(codebook_size, 8), **VQ16Decoder(**TINY_VQ).state_dict()}
    torch.save({"model": state}, path)
    return path


@pytest.fixture
def llamagen_heads(tmp_path):
    """Random SSD heads exported for the tiny LlamaGen of conf/backbone/llamagen_tiny.yaml (seed 0)."""
    backbone = random_llamagen_backbone(seed=0)
    return export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())


def test_llamagen_decodes_balanced_class_ids_with_ar_and_ssd(tmp_path, llamagen_heads, capsys):
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "backbone=llamagen_tiny",
            "decode.methods=[ar,ssd_exact]",
            "decode.num_images=5",
            "decode.batch_size=2",
            "decode.greedy=true",
            "decode.save_tokens=true",
            f"decode.heads={llamagen_heads}",
            f"decode.out={out}",
        ],
        tmp_path,
    )
    run_decode(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["methods"]) == ["ar", "ssd_exact"]
    assert metrics["conditions"] == {"kind": "class_ids", "num_classes": 10}  # null: the model's own 10 classes
    assert "quality not measured" in metrics["quality_note"]
    for figures in metrics["methods"].values():
        assert figures["quality"] is None
        for key in ("forward_passes_per_image", "seconds_per_image", "speedup_vs_ar", "nfe_reduction_vs_ar"):
            assert figures[key] > 0
    ar, ssd = metrics["methods"]["ar"], metrics["methods"]["ssd_exact"]
    assert ar["forward_passes_per_image"] == 16  # 4x4 grid: one pass per token
    assert ssd["forward_passes_per_image"] <= 16 and "draft_acceptance_rate" in ssd
    # greedy exact SSD is lossless
    assert np.array_equal(np.load(out / "tokens_ssd_exact.npy"), np.load(out / "tokens_ar.npy"))
    assert np.load(out / "tokens_ar.npy").shape == (5, 4, 4)
    # no VQ decoder in the tiny LlamaGen: no PNGs, and the log says why
    assert not list(out.glob("*.png"))
    assert "no PNG grids" in capsys.readouterr().out


def test_quality_asked_for_without_pixels_fails_before_generating(tmp_path, llamagen_heads):
    cfg = compose_config(
        ["backbone=llamagen_tiny", f"decode.quality.reference_dir={tmp_path}", f"decode.out={tmp_path / 'out'}"],
        tmp_path,
    )
    with pytest.raises(ValueError, match=r"decode\.quality\.reference_dir=null"):
        run_decode(cfg)
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_too_many_classes_are_refused(tmp_path):
    cfg = compose_config(["backbone=llamagen_tiny", "decode.num_classes=1000", f"decode.out={tmp_path}"], tmp_path)
    with pytest.raises(ValueError, match=r"decode\.num_classes<=10"):
        run_decode(cfg)


def test_llamagen_with_pixels_writes_pngs_and_fid(tmp_path, llamagen_heads):
    from test_real_quality import save_reference_images

    save_reference_images(tmp_path / "ref", count=12)
    vq = save_tiny_vq(tmp_path / "vq.pt")
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "backbone=llamagen_tiny",
            "backbone._target_=test_decode_cli_real.tiny_llamagen_with_pixels",
            f"+backbone.vq_path={vq}",
            "decode.methods=[ar,ssd_autocorrect]",
            "decode.num_images=6",
            "decode.batch_size=3",
            f"decode.heads={llamagen_heads}",
            f"decode.out={out}",
            f"decode.quality.reference_dir={tmp_path / 'ref'}",
            "decode.quality.fid_features={_target_:test_real_quality.TinyFeatures}",
            "decode.quality.clip=/nowhere",
        ],  # class-conditional: the CLIP key is ignored
        tmp_path,
    )
    run_decode(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["quality_note"].startswith("fid")
    for name in ("ar", "ssd_autocorrect"):
        quality = metrics["methods"][name]["quality"]
        assert set(quality) == {"fid"} and math.isfinite(quality["fid"]) and quality["fid"] >= 0
        assert (out / f"{name}.png").is_file()


class _PromptLengths:
    """Stands in for a text-to-image backbone: a prompt's token length is its word count."""

    @staticmethod
    def prompt_token_ids(condition):
        return torch.zeros(1, len(condition.prompts[0].split()), dtype=torch.long)


def test_prompts_are_batched_by_token_length_in_order():
    from decode.conditions import Conditions

    conditions = Conditions(prompts=["a red fox", "a cat", "a blue bird", "a dog", "the small grey cat", "an owl"])
    batches = conditions.batches(2, _PromptLengths())
    assert [indices.tolist() for indices, _ in batches] == [[0, 2], [1, 3], [5], [4]]
    assert [c.prompts for _, c in batches][0] == ["a red fox", "a blue bird"]
    assert sorted(i for indices, _ in batches for i in indices.tolist()) == list(range(6))


@pytest.mark.parametrize(
    "name, build",
    [("janus_tiny", "backbones.janus.random_janus_backbone"), ("emu3_tiny", "backbones.emu3.random_emu3_backbone")],
)
def test_text_to_image_decodes_prompts_with_fid_and_clip(tmp_path, name, build):
    import hydra
    from test_real_quality import save_reference_images, save_tiny_clip

    from backbones.base import Condition
    from decode import SamplingConfig, generate_ar
    from decode.conditions import load_prompts

    backbone = hydra.utils.instantiate({"_target_": build, "seed": 0, "tokenizer": True})
    heads = export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())
    save_reference_images(tmp_path / "ref", count=8)
    out = tmp_path / "out"
    cfg = compose_config(
        [
            f"backbone={name}",
            "++backbone.tokenizer=true",
            "decode.methods=[ar,ssd_exact]",
            "decode.num_images=5",
            "decode.batch_size=2",
            "decode.greedy=true",
            "decode.save_tokens=true",
            f"decode.heads={heads}",
            f"decode.out={out}",
            f"decode.quality.reference_dir={tmp_path / 'ref'}",
            "decode.quality.fid_features={_target_:test_real_quality.TinyFeatures}",
            f"decode.quality.clip={save_tiny_clip(tmp_path / 'clip')}",
        ],
        tmp_path,
    )
    run_decode(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["conditions"] == {"kind": "prompts", "source": "smoke", "distinct": 5}
    for method in ("ar", "ssd_exact"):
        quality = metrics["methods"][method]["quality"]
        assert set(quality) == {"fid", "clip_score"} and all(math.isfinite(v) for v in quality.values())
        assert (out / f"{method}.png").is_file()
    # prompts of different token lengths ran in separate batches and came back in order: greedy SSD is lossless,
    # and each image is what its own prompt gives alone
    tokens = np.load(out / "tokens_ar.npy")
    assert np.array_equal(np.load(out / "tokens_ssd_exact.npy"), tokens)
    prompts = load_prompts("smoke")[:5]
    alone = [
        generate_ar(backbone, Condition(prompts=[p]), SamplingConfig(cfg_scale=3.0, greedy=True)).tokens[0]
        for p in prompts
    ]
    assert np.array_equal(torch.stack(alone).numpy(), tokens)


def test_float32_heads_decode_on_a_bf16_backbone(tmp_path, monkeypatch):
    """The real backbones run in bf16; heads are trained and exported in float32: loading casts them."""
    import backbones.llamagen

    monkeypatch.setattr(
        backbones.llamagen, "random_llamagen_backbone", lambda **kwargs: random_llamagen_backbone(**kwargs).bfloat16()
    )
    backbone = backbones.llamagen.random_llamagen_backbone(seed=0)
    heads = export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())
    eagle = export_heads(random_eagle_head(backbone), tmp_path / "eagle", backbone.identity())
    out = tmp_path / "out"
    methods = ["ar", "ssd_exact", "ssd_autocorrect", "sjd", "gsd", "zipar", "eagle"]
    overrides = ["backbone=llamagen_tiny", f"decode.methods=[{','.join(methods)}]", "decode.num_images=4"]
    overrides += ["decode.greedy=true", "decode.save_tokens=true", f"decode.heads={heads}"]
    run_decode(compose_config([*overrides, f"decode.eagle_heads={eagle}", f"decode.out={out}"], tmp_path))
    assert list(json.loads((out / "metrics.json").read_text())["methods"]) == methods
    ar = np.load(out / "tokens_ar.npy")
    for exact in ("ssd_exact", "eagle"):  # they feed AR's own passes here: equal in bf16 too
        assert np.array_equal(np.load(out / f"tokens_{exact}.npy"), ar), exact
