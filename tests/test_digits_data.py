import torch

from backbones.digits import DigitsTokenizer
from data.digits import DigitsAugment, load_digit_images, render_digits


def test_splits_are_disjoint_and_cover_the_data():
    sizes = {split: len(load_digit_images(split)[1]) for split in ("train", "val", "test")}
    assert sizes == {"train": 1437, "val": 180, "test": 180}
    flat = {split: {tuple(img.flatten().tolist()) for img in load_digit_images(split)[0]} for split in sizes}
    # Some digits repeat pixel for pixel in the source data, so allow a handful of coincidences.
    assert len(flat["train"] & flat["test"]) < 5


def test_tokenizer_round_trip_and_latents():
    tokenizer = DigitsTokenizer(16)
    tokens = torch.randint(0, 16, (3, 24, 24))
    assert torch.equal(tokenizer.encode(tokenizer.decode(tokens)), tokens)
    latents = tokenizer.codebook_latents()
    assert latents.shape == (16, 1)
    # Neighbouring tokens are nearest in latent space: what relaxed acceptance relies on.
    assert torch.all(latents[1:, 0] > latents[:-1, 0])


def test_render_augments_but_keeps_the_digit_on_the_canvas():
    images, _ = load_digit_images("val")
    plain = render_digits(images[:8], 24)
    warped = render_digits(images[:8], 24, DigitsAugment(), torch.Generator().manual_seed(0))
    assert plain.shape == warped.shape == (8, 24, 24)
    assert (plain - warped).abs().mean() > 0.02  # the warp really changes the picture
    border = torch.cat([plain[:, 0], plain[:, -1], plain[:, :, 0], plain[:, :, -1]], dim=1)
    assert border.max() < 0.3  # the unaugmented digit leaves a margin


def test_invalid_levels_are_refused():
    import pytest

    with pytest.raises(ValueError, match="levels"):
        DigitsTokenizer(1)
