"""Quality metrics of generated images: classifier accuracy and Fréchet distance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from scipy import linalg

from decode.digits_classifier import load_or_train_classifier, reference_digits


def frechet_distance(features_a: np.ndarray, features_b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (N, D) (the FID formula)."""
    mu_a, mu_b = features_a.mean(0), features_b.mean(0)
    cov_a, cov_b = np.cov(features_a, rowvar=False), np.cov(features_b, rowvar=False)
    covmean, _ = linalg.sqrtm(cov_a @ cov_b, disp=False)
    if np.iscomplexobj(covmean):  # numerical noise can leave a tiny imaginary part
        covmean = covmean.real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * covmean))


class DigitsQuality:
    """Scores generated digit images with the independent classifier (see decode/digits_classifier.py)."""

    def __init__(self, grid_size: int, levels: int, classifier_dir: str | Path):
        self.classifier = load_or_train_classifier(classifier_dir, grid_size, levels)
        reference_images, _ = reference_digits(grid_size, levels)
        with torch.no_grad():
            self.reference_features = self.classifier(reference_images)[1].numpy()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, class_ids: torch.Tensor) -> dict:
        """images (N, 1, G, G) in [0, 1], requested classes (N,) -> {classifier_accuracy, frechet_distance}."""
        logits, features = self.classifier(images.float().cpu())
        return {
            "classifier_accuracy": float((logits.argmax(-1) == class_ids.cpu()).float().mean()),
            "frechet_distance": frechet_distance(features.numpy(), self.reference_features),
        }
