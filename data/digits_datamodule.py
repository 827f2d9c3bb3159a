"""Lightning DataModule for training the embedded digits backbones (intensity tokens, or continuous patches)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from backbones.digits import DigitsTokenizer
from backbones.digits_continuous import PatchTokenizer
from data.digits import DigitsAugment, load_digit_images, render_digits


class AugmentedDigitsDataset(Dataset):
    """Each access renders a digit afresh with a random warp, so no two epochs repeat.

    Randomness comes from torch's global generator, which Lightning seeds per
    worker (`seed_everything(workers=True)`).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        grid_size: int,
        tokenizer: DigitsTokenizer | PatchTokenizer,
        augment: DigitsAugment,
        repeats: int,
    ):
        self.images, self.labels = images, labels
        self.grid_size, self.tokenizer, self.augment, self.repeats = grid_size, tokenizer, augment, repeats

    def __len__(self) -> int:
        return len(self.labels) * self.repeats

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index %= len(self.labels)
        rendered = render_digits(self.images[index : index + 1], self.grid_size, self.augment)
        return self.tokenizer.encode_sequence(rendered)[0], self.labels[index]


def fixed_augmented_split(
    split: str,
    grid_size: int,
    tokenizer: DigitsTokenizer | PatchTokenizer,
    augment: DigitsAugment,
    copies: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split rendered `copies` times with a fixed seed: (token sequences (N*copies, ...), labels)."""
    images, labels = load_digit_images(split)
    generator = torch.Generator().manual_seed(seed)
    images, labels = images.repeat(copies, 1, 1), labels.repeat(copies)
    return tokenizer.encode_sequence(render_digits(images, grid_size, augment, generator)), labels


class DigitsDataModule(pl.LightningDataModule):
    """Token grids of the bundled digits: augmented on the fly for training, fixed for validation."""

    def __init__(
        self,
        grid_size: int = 24,
        levels: int = 16,
        batch_size: int = 32,
        num_workers: int = 0,
        epoch_repeats: int = 4,
        val_copies: int = 2,
        augment: dict | None = None,
        seed: int = 1234,
        patch_size: int | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.grid_size, self.batch_size, self.num_workers = grid_size, batch_size, num_workers
        self.epoch_repeats, self.val_copies, self.seed = epoch_repeats, val_copies, seed
        # patch_size set: continuous patch tokens for the continuous backbone (no quantisation).
        self.tokenizer = DigitsTokenizer(levels) if patch_size is None else PatchTokenizer(patch_size)
        self.augment = DigitsAugment(**(augment or {}))

    def setup(self, stage: str | None = None) -> None:
        images, labels = load_digit_images("train")
        self.train_set = AugmentedDigitsDataset(
            images, labels, self.grid_size, self.tokenizer, self.augment, self.epoch_repeats
        )
        self.val_set = TensorDataset(
            *fixed_augmented_split("val", self.grid_size, self.tokenizer, self.augment, self.val_copies, self.seed)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size * 2, num_workers=self.num_workers)
