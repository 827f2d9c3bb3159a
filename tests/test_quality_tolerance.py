"""The baseline's tolerance: how far a method with the baseline's distribution may land from its mean quality."""

import math

import numpy as np
import pytest
import torch

from decode.cli import baseline_tolerance
from decode.quality import DigitsQuality, frechet_distance
from decode.report import outside_tolerance, tolerance_line


class FixedErrors:
    """A scorer whose per-seed sampling errors are given."""

    def __init__(self, errors):
        self.errors = iter(errors)

    def standard_errors(self, images, class_ids):
        return next(self.errors)


class Run:
    tokens = torch.zeros(2, 8, 8, dtype=torch.long)


def test_the_tolerance_is_the_difference_of_two_seed_means(tiny_backbone, monkeypatch):
    """Two seeds with errors 0.02 and 0.04: the mean's error is sqrt(0.02^2 + 0.04^2) / 2, the difference of two
    such means sqrt(2) times that, and 19 in 20 of them lie within 1.96 of it."""
    import decode.cli as cli

    monkeypatch.setattr(cli, "_scored_images", lambda quality, backbone, run: None)
    scorer = FixedErrors([{"classifier_accuracy": 0.02}, {"classifier_accuracy": 0.04}])
    tolerance = baseline_tolerance(scorer, tiny_backbone, [Run(), Run()], conditions=type("C", (), {"class_ids": 0}))
    expected = 1.96 * math.sqrt(2) * math.sqrt(0.02**2 + 0.04**2) / 2
    assert tolerance == {"classifier_accuracy": pytest.approx(expected)}
    assert baseline_tolerance(object(), tiny_backbone, [Run()], None) is None  # no sampling errors (FID, CLIP)


def test_methods_further_than_the_tolerance_are_named():
    methods = {
        "ar": {"quality": {"classifier_accuracy": 0.95, "frechet_distance": 200.0}},
        "ssd_exact": {"quality": {"classifier_accuracy": 0.93, "frechet_distance": 240.0}},
        "lossy": {"quality": {"classifier_accuracy": 0.88, "frechet_distance": 260.0}},
    }
    tolerance = {"classifier_accuracy": 0.043, "frechet_distance": 50.0}
    assert outside_tolerance(methods, tolerance) == {"lossy": ["classifier_accuracy", "frechet_distance"]}
    line = tolerance_line(methods, tolerance, ["classifier_accuracy", "frechet_distance"], 200)
    assert "accuracy 0.907-0.993, Fréchet 150.000-250.000" in line
    assert line.endswith("outside it: lossy (accuracy, Fréchet)")


def test_sampling_errors_are_binomial_and_bootstrap(classifier_cache):
    quality = DigitsQuality(8, 8, classifier_cache / "digits-classifier")
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(60, 1, 8, 8, generator=generator)
    class_ids = torch.randint(0, 10, (60,), generator=generator)
    logits, features = quality.classifier(images)
    correct = int((logits.argmax(-1) == class_ids).sum())
    errors = quality.standard_errors(images, class_ids)
    p = (correct + 1) / 62
    assert errors["classifier_accuracy"] == pytest.approx(math.sqrt(p * (1 - p) / 60))
    assert errors == quality.standard_errors(images, class_ids)  # seeded: the same images, the same error
    # the bootstrap's spread is the spread of the distance over resampled image sets
    rng = np.random.default_rng(0)
    resampled = [frechet_distance(features.numpy()[rng.integers(0, 60, 60)], quality.reference) for _ in range(100)]
    assert errors["frechet_distance"] == pytest.approx(float(np.std(resampled)))
    assert errors["frechet_distance"] > 0


def test_the_tolerance_is_shown_within_the_values_a_metric_can_take():
    methods = {"ar": {"quality": {"classifier_accuracy": 0.98, "frechet_distance": 40.0}}}
    line = tolerance_line(
        methods, {"classifier_accuracy": 0.05, "frechet_distance": 60.0}, list(methods["ar"]["quality"]), 128
    )
    assert "accuracy 0.930-1.000, Fréchet 0.000-100.000" in line
