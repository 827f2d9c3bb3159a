"""Train the independent judge of generated digits: a small CNN on the real digits only.

`python -m train.digits_classifier --grid-size 24 --levels 16 --out checkpoints/digits-classifier`
trains it (about a minute on 2 cores) and writes, under OUT/gridG_levelsL/, its
weights, its config and the feature statistics of the real held-out digits that
decode/quality.py compares generated images with. It never sees a generated
image. The 24x24, 16-level one is committed; other grids (tests, a backbone you
trained at another size) need this once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from backbones.digits import DigitsTokenizer
from common.atomic_io import atomic_path, atomic_save_safetensors, atomic_write_text
from data.digits import DigitsAugment, load_digit_images, render_digits
from decode.quality import (
    CLASSIFIER_VERSION,
    CONFIG_FILE,
    REFERENCE_FILE,
    WEIGHTS_FILE,
    DigitsClassifier,
    classifier_dir,
    feature_statistics,
)


def _quantised_renders(
    split: str, grid_size: int, levels: int, copies: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split rendered `copies` times with warps, passed through the tokenizer: (images (N,1,G,G), labels)."""
    images, labels = load_digit_images(split)
    tokenizer = DigitsTokenizer(levels)
    generator = torch.Generator().manual_seed(seed)
    rendered = render_digits(images.repeat(copies, 1, 1), grid_size, DigitsAugment(), generator)
    return tokenizer.decode(tokenizer.encode(rendered)).unsqueeze(1), labels.repeat(copies)


def reference_digits(grid_size: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real held-out digits generated images are compared with (test split, 4 warps each, tokenised)."""
    return _quantised_renders("test", grid_size, levels, copies=4, seed=2024)


def train_digits_classifier(
    grid_size: int, levels: int, epochs: int = 60, seed: int = 0, log=print
) -> DigitsClassifier:
    """Train on the real training digits (warped, tokenised as the backbone sees them).

    0.98 held-out accuracy at 24x24.
    """
    torch.manual_seed(seed)
    model = DigitsClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    images, labels = _quantised_renders("train", grid_size, levels, copies=epochs, seed=seed)
    order = torch.randperm(len(labels))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=len(order) // 64 + 1)
    model.train()
    for start in range(0, len(order), 64):
        batch = order[start : start + 64]
        loss = F.cross_entropy(model(images[batch])[0], labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    model.eval().requires_grad_(False)
    test_images, test_labels = reference_digits(grid_size, levels)
    with torch.no_grad():
        accuracy = (model(test_images)[0].argmax(-1) == test_labels).float().mean().item()
    log(f"[classifier] trained at {grid_size}x{grid_size}/{levels} levels: held-out accuracy {accuracy:.3f}")
    model.held_out_accuracy = accuracy
    return model


def save_reference_features(model: DigitsClassifier, folder: Path, grid_size: int, levels: int) -> None:
    """The real held-out digits' feature statistics, beside the weights (what Fréchet distances compare with)."""
    with torch.no_grad():
        features = model(reference_digits(grid_size, levels)[0])[1].numpy()
    statistics = {k: torch.from_numpy(v) for k, v in feature_statistics(features).items()}
    with atomic_path(folder / REFERENCE_FILE) as tmp:
        save_file(statistics, str(tmp))


def train_and_save(directory: str | Path, grid_size: int, levels: int, log=print) -> Path:
    """Train the classifier of one grid and codebook and write it under `directory`; return its folder."""
    folder = classifier_dir(directory, grid_size, levels)
    model = train_digits_classifier(grid_size, levels, log=log)
    atomic_save_safetensors(dict(model.state_dict()), folder / WEIGHTS_FILE)
    save_reference_features(model, folder, grid_size, levels)
    config = {
        "grid_size": grid_size,
        "levels": levels,
        "version": CLASSIFIER_VERSION,
        "held_out_accuracy": model.held_out_accuracy,
    }
    atomic_write_text(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid-size", type=int, default=24)
    parser.add_argument("--levels", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "checkpoints" / "digits-classifier"))
    args = parser.parse_args()
    print(f"[classifier] wrote {train_and_save(args.out, args.grid_size, args.levels)}")


if __name__ == "__main__":
    main()
