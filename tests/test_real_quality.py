"""FID and CLIP score for the real backbones, run with tiny random feature extractors (no weights here)."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from decode.real_quality import (
    QualitySetupError,
    RealQuality,
    load_clip,
    load_reference_images,
)


class TinyFeatures(nn.Module):
    """A random conv feature extractor standing in for InceptionV3: (B, 3, H, W) in [0, 1] -> (B, 8)."""

    num_features = 8

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(images.float())).mean(dim=(2, 3))  # (B, 8)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def save_tiny_clip(directory: Path, seed: int = 0) -> Path:
    """A random-weight CLIP (hidden 16, 32x32 images) with a byte-level tokenizer, saved with save_pretrained."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    directory.mkdir(parents=True, exist_ok=True)
    alphabet = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet)} | {c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")  # no merges: one token per character
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    torch.manual_seed(seed)
    end = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=end,
            pad_token_id=end,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=8,
    )
    CLIPModel(config).eval().save_pretrained(directory)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    return directory


def save_reference_images(directory: Path, count: int = 24, size: int = 16, seed: int = 0) -> torch.Tensor:
    """`count` random RGB PNGs in `directory`; returns them as (count, 3, size, size) in [0, 1] (exact bytes/255)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, size, size, 3), generator=generator, dtype=torch.uint8)
    for index, image in enumerate(pixels):
        Image.fromarray(image.numpy()).save(directory / f"{index:03d}.png")
    return pixels.permute(0, 3, 1, 2).float() / 255


def test_reference_images_are_resized_and_cropped(tmp_path):
    Image.new("RGB", (40, 20), (255, 0, 0)).save(tmp_path / "wide.jpg")
    images = load_reference_images([tmp_path / "wide.jpg"], 8, 8)
    assert images.shape == (1, 3, 8, 8)
    assert images[:, 0].min() > 0.9 and images[:, 1:].max() < 0.1


def test_fid_of_a_set_to_itself_is_zero_and_to_a_shifted_set_positive(tmp_path):
    reference = save_reference_images(tmp_path / "ref")
    quality = RealQuality(reference_dir=tmp_path / "ref", fid_features=TinyFeatures(), batch_size=10)
    assert quality.measures == ["fid"]
    same = quality(reference)["fid"]
    shifted = quality((reference + 0.3).clamp(0, 1))["fid"]
    assert abs(same) < 1e-3
    assert shifted > 0.01 and shifted > 100 * abs(same)
    # the reference statistics are kept between methods: the first figure again
    assert quality(reference)["fid"] == pytest.approx(same, abs=1e-6)


def test_clip_score_with_a_tiny_random_clip_loaded_by_path(tmp_path):
    clip_dir = save_tiny_clip(tmp_path / "clip")
    quality = RealQuality(clip=clip_dir)
    assert quality.measures == ["clip_score"]
    images = torch.rand(3, 3, 16, 16)
    prompts = ["a red fox in snow", "a bowl of ramen", "a lighthouse"]
    score = quality(images, prompts)["clip_score"]
    # torchmetrics' definition: max(mean(100 * cosine(image, text)), 0)
    model, processor = load_clip(clip_dir)
    pixels = list((images * 255).round().to(torch.uint8))
    with torch.no_grad():
        image_features = model.get_image_features(processor(images=pixels, return_tensors="pt")["pixel_values"])
        text = processor(text=prompts, return_tensors="pt", padding=True)
        text_features = model.get_text_features(text["input_ids"], text["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(image_features, text_features)
    mean = float((100 * cosine).mean())
    assert float(quality.clip.score / quality.clip.n_samples) == pytest.approx(mean, rel=1e-4, abs=1e-4)
    assert score == pytest.approx(max(mean, 0.0), rel=1e-4, abs=1e-4)
    assert quality(images) == {}  # no prompts (class-conditional): no CLIP score


def test_missing_clip_names_the_download_and_the_key(tmp_path):
    with pytest.raises(
        QualitySetupError, match=r"huggingface-cli download openai/clip-vit-large-patch14[\s\S]*decode\.quality\.clip="
    ):
        RealQuality(clip=tmp_path / "nowhere")


def test_missing_inception_names_the_package_or_the_weights(tmp_path):
    save_reference_images(tmp_path / "ref", count=2)
    with pytest.raises(QualitySetupError, match=r"torch-fidelity|decode\.quality\.fid_weights="):
        RealQuality(reference_dir=tmp_path / "ref", fid_weights=tmp_path / "missing.pth")


def test_missing_reference_folder_names_the_key(tmp_path):
    with pytest.raises(QualitySetupError, match=r"decode\.quality\.reference_dir"):
        RealQuality(reference_dir=tmp_path / "nowhere", fid_features=TinyFeatures())
