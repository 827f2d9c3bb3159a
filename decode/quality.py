"""Quality of generated digits: an independent classifier's accuracy and the Fréchet distance of its features.

The classifier (train/digits_classifier.py trains it on the real digits only;
the 24x24 one is committed in checkpoints/digits-classifier/) plays the role
Inception/CLIP play for real image models: its class accuracy on generated
images says whether the backbone drew the requested digit, and the Fréchet
distance between its penultimate features on generated and on real held-out
digits says how close the two distributions are. The real digits' feature
statistics are stored beside its weights, so scoring needs no data set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from scipy import linalg
from torch import nn

from backbones.digits import NUM_CLASSES

CLASSIFIER_VERSION = 2  # bump when the architecture or recipe changes, so stored copies are refused
WEIGHTS_FILE, REFERENCE_FILE, CONFIG_FILE = "model.safetensors", "reference_features.safetensors", "config.json"


class DigitsClassifier(nn.Module):
    """4 conv layers -> 64-d features -> 10 classes; works at any grid size (global pooling)."""

    feature_dim = 64

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(64, self.feature_dim, 3, stride=2, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classify = nn.Linear(self.feature_dim, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images (B, 1, H, W) in [0, 1] -> (logits (B, 10), features (B, 64))."""
        features = self.features(images)
        return self.classify(features), features


def classifier_dir(directory: str | Path, grid_size: int, levels: int) -> Path:
    """Where the classifier of one grid and codebook lives under a classifiers folder."""
    return Path(directory) / f"grid{grid_size}_levels{levels}"


def load_classifier(directory: str | Path, grid_size: int, levels: int) -> tuple[DigitsClassifier, dict]:
    """The classifier for this grid and codebook and its real-digit feature statistics {mean, covariance}."""
    folder = classifier_dir(directory, grid_size, levels)
    wanted = {"grid_size": grid_size, "levels": levels, "version": CLASSIFIER_VERSION}
    config_path = folder / CONFIG_FILE
    stored = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if {k: stored.get(k) for k in wanted} != wanted or not (folder / REFERENCE_FILE).is_file():
        raise FileNotFoundError(
            f"no digits classifier (version {CLASSIFIER_VERSION}) for a {grid_size}x{grid_size} grid with {levels} "
            f"levels in {folder}; train one (about a minute on 2 cores): python -m train.digits_classifier "
            f"--grid-size {grid_size} --levels {levels} --out {Path(directory)}"
        )
    model = DigitsClassifier()
    model.load_state_dict(load_file(folder / WEIGHTS_FILE))
    reference = {k: v.double().numpy() for k, v in load_file(folder / REFERENCE_FILE).items()}
    return model.eval().requires_grad_(False), reference


def feature_statistics(features: np.ndarray) -> dict:
    """{mean (D,), covariance (D, D)} of features (N, D), in float64."""
    features = features.astype(np.float64)
    return {"mean": features.mean(0), "covariance": np.cov(features, rowvar=False)}


def frechet_distance(features: np.ndarray, reference: dict) -> float:
    """Fréchet distance between a Gaussian fitted to features (N, D) and reference statistics (the FID formula)."""
    generated = feature_statistics(features)
    mu_a, cov_a, mu_b, cov_b = generated["mean"], generated["covariance"], reference["mean"], reference["covariance"]
    covmean, _ = linalg.sqrtm(cov_a @ cov_b, disp=False)
    if np.iscomplexobj(covmean):  # numerical noise can leave a tiny imaginary part
        covmean = covmean.real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * covmean))


class DigitsQuality:
    """Scores generated digit images with the independent classifier."""

    def __init__(self, grid_size: int, levels: int, classifiers_dir: str | Path):
        self.classifier, self.reference = load_classifier(classifiers_dir, grid_size, levels)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, class_ids: torch.Tensor) -> dict:
        """images (N, 1, G, G) in [0, 1], requested classes (N,) -> {classifier_accuracy, frechet_distance}."""
        logits, features = self.classifier(images.float().cpu())
        return {
            "classifier_accuracy": float((logits.argmax(-1) == class_ids.cpu()).float().mean()),
            "frechet_distance": frechet_distance(features.numpy(), self.reference),
        }

    @torch.no_grad()
    def standard_errors(self, images: torch.Tensor, class_ids: torch.Tensor, resamples: int = 100) -> dict:
        """The sampling error of each metric of these N images: how much another N images of the same
        distribution would move it (one standard deviation).

        Accuracy: the binomial error sqrt(p (1 - p) / N) (p from (correct + 1) / (N + 2), so that 100% is not
        called certain). Fréchet distance: the spread of the distance over `resamples` bootstrap resamples of
        the images (seeded: the same images give the same error).
        """
        logits, features = self.classifier(images.float().cpu())
        n = len(images)
        correct = int((logits.argmax(-1) == class_ids.cpu()).sum())
        p = (correct + 1) / (n + 2)
        rng = np.random.default_rng(0)
        features = features.numpy()
        distances = [frechet_distance(features[rng.integers(0, n, n)], self.reference) for _ in range(resamples)]
        return {"classifier_accuracy": float(np.sqrt(p * (1 - p) / n)), "frechet_distance": float(np.std(distances))}
