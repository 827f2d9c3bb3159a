"""The decode CLI writes the figures every report is made of."""

import json

import numpy as np
import pytest
import torch
from conftest import COMPARISON_METHODS, compose_config

from decode.cli import run_decode
from decode.sampling import SamplingConfig


def test_decode_writes_metrics_pngs_and_tokens(tmp_path, classifier_cache):
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "backbone=digits_tiny",
            "decode.num_images=6",
            "decode.batch_size=4",
            f"decode.out={out}",
            "decode.save_tokens=true",
            f"paths.checkpoints_dir={classifier_cache}",
        ],
        tmp_path,
    )
    run_decode(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    ar = metrics["methods"]["ar"]
    for key in ("forward_passes_per_image", "seconds_per_image", "speedup_vs_ar", "nfe_reduction_vs_ar"):
        assert key in ar
    assert set(ar["quality"]) == {"classifier_accuracy", "frechet_distance"}
    assert ar["forward_passes_per_image"] == 64 and ar["speedup_vs_ar"] == 1.0
    # The passes are part of the wall-clock, so the bound on the speedup is never below the speedup itself.
    assert 0 < ar["backbone_seconds_per_image"] <= ar["seconds_per_image"]
    assert ar["speedup_bound_vs_ar"] >= ar["speedup_vs_ar"]
    assert (out / "ar.png").is_file()
    tokens = np.load(out / "tokens_ar.npy")
    assert tokens.shape == (6, 8, 8) and tokens.dtype == np.int64
    # The methods took turns batch by batch; each batch's time is kept, and its spread reported.
    assert metrics["interleaved"] and set(ar["seconds_per_image_spread"]) == {"p10", "p50", "p90"}
    assert ar["generator"] == "decode.ar" and ar["lossless"]
    assert "| ar | yes | 64.0 |" in (out / "summary.md").read_text()


def test_unknown_method_is_refused_before_anything_is_built(tmp_path, classifier_cache):
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "backbone=digits_tiny",
            "decode.methods=[ar,ssd_exact_g2]",
            f"decode.out={out}",
            f"paths.checkpoints_dir={classifier_cache}",
        ],
        tmp_path,
    )
    with pytest.raises(
        ValueError,
        match=r"unknown decode method 'ssd_exact_g2'.*ssd_autocorrect, ssd_exact.*"
        r"\+method@decode.presets.ssd_exact_g2=<preset>",
    ):
        run_decode(cfg)
    assert not out.exists()  # nothing was written


def test_committed_classifier_is_a_competent_judge():
    import torch
    from conftest import PROJECT_ROOT

    from decode.quality import feature_statistics, load_classifier
    from train.digits_classifier import reference_digits

    classifier, reference = load_classifier(PROJECT_ROOT / "checkpoints" / "digits-classifier", 24, 16)
    images, labels = reference_digits(24, 16)
    with torch.no_grad():
        logits, features = classifier(images)
    assert (logits.argmax(-1) == labels).float().mean() >= 0.95
    # The stored statistics of the real held-out digits are those of their features.
    # Up to float32 summation order, which differs between CPUs (kernels): an AVX-512 EPYC is 7e-6 off on
    # covariances up to 26, near-zero entries included; another classifier's features are off by O(1).
    recomputed = feature_statistics(features.numpy())
    for key in ("mean", "covariance"):
        scale = float(np.abs(reference[key]).max())
        np.testing.assert_allclose(reference[key], recomputed[key], rtol=1e-5, atol=1e-6 * scale)


def test_a_missing_classifier_names_the_command_that_trains_it(tmp_path):
    from decode.quality import DigitsQuality

    with pytest.raises(FileNotFoundError, match="python -m train.digits_classifier --grid-size 12 --levels 4"):
        DigitsQuality(12, 4, tmp_path)


def _export_tiny_heads(backbone, directory):
    from conftest import random_ssd_heads

    from heads.export import export_heads

    export_heads(random_ssd_heads(backbone.hidden_size, grid=True), directory, backbone.identity())


def _export_tiny_drafter(backbone, directory):
    """A random one-layer MuLo drafter (r = 2) for `backbone`, exported to `directory`."""
    from heads.export import export_heads
    from heads.mulo import MuLoDrafter, MuLoDrafterConfig

    drafter = MuLoDrafter(
        MuLoDrafterConfig.for_backbone(
            backbone, scale=2, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32
        )
    )
    export_heads(drafter, directory, backbone.identity())


def _methods(overrides, tmp_path):
    import hydra

    from decode.registry import check_methods, load_artefacts

    cfg = compose_config(
        [
            "backbone=digits_tiny",
            f"decode.heads={tmp_path / 'heads'}",
            f"decode.drafter={tmp_path / 'drafter'}",
            *overrides,
        ],
        tmp_path,
    )
    backbone = hydra.utils.instantiate(cfg.backbone)
    if not (tmp_path / "heads").exists():
        _export_tiny_heads(backbone, tmp_path / "heads")
        _export_tiny_drafter(backbone, tmp_path / "drafter")
    methods = check_methods(cfg.decode)
    load_artefacts(methods, backbone)
    return {method.name: method for method in methods}


def test_presets_bind_names_to_generators_and_settings(tmp_path):
    from decode.mulo import MuLoDecodeConfig
    from decode.ssd import SSDDecodeConfig

    methods = _methods(["decode.methods=[ssd_exact,ssd_autocorrect,mulo,mulo_exact]"], tmp_path)
    assert list(methods) == ["ar", "ssd_exact", "ssd_autocorrect", "mulo", "mulo_exact"]  # the baseline first
    assert isinstance(methods["ssd_exact"].settings, SSDDecodeConfig) and methods["ssd_exact"].settings.mode == "exact"
    assert methods["ssd_exact"].lossless and not methods["ssd_autocorrect"].lossless
    assert methods["ssd_autocorrect"].settings.mode == "autocorrect"
    assert isinstance(methods["mulo"].settings, MuLoDecodeConfig) and methods["mulo_exact"].settings.mode == "exact"
    assert methods["ssd_exact"].artefact is methods["ssd_autocorrect"].artefact  # one export, loaded once
    assert methods["mulo"].artefact.config.scale == 2


def test_any_setting_is_overridden_and_two_presets_of_one_method_run_side_by_side(tmp_path):
    methods = _methods(
        [
            "decode.methods=[ssd_autocorrect,ssd_w4]",
            "decode.presets.ssd_autocorrect.rounds=2",
            "+method@decode.presets.ssd_w4=ssd_autocorrect",
            "decode.presets.ssd_w4.lookahead=false",
            "decode.presets.ssd_w4.window=4",
        ],
        tmp_path,
    )
    first, second = methods["ssd_autocorrect"].settings, methods["ssd_w4"].settings
    assert (first.rounds, first.window, first.lookahead) == (2, 0, True)
    assert (second.rounds, second.window, second.lookahead, second.correction) == (6, 4, False, "prefix")


@pytest.mark.parametrize(
    "override,message",
    [
        ("decode.presets.ssd_autocorrect.rounds=abc", "decode.presets.ssd_autocorrect.rounds must be an integer"),
        ("decode.presets.ssd_autocorrect.rounds=-1", "decode.presets.ssd_autocorrect: SSD rounds"),
        ("decode.presets.ssd_autocorrect.correction=both", "correction must be one of 'target', 'residual', 'prefix'"),
        ("+decode.presets.ssd_autocorrect.windw=3", "decode.presets.ssd_autocorrect: unknown setting windw"),
        ("decode.presets.mulo.delta=nan", "decode.presets.mulo.delta must be a finite number"),
        ("decode.presets.mulo.delta=5", r"MuLo delta must be in \[0, 1\]"),  # a budget above 1 accepts anything
        ("decode.presets.ssd_autocorrect.relax_delta=5", r"relax_delta in \[0, 1\]"),
        ("decode.presets.ssd_autocorrect.generator=decode.medusa", "no generator module 'decode.medusa'"),
        ("decode.presets.ssd_autocorrect.generator=decode.sampling", "declares no METHOD"),
        ("decode.methods=ssd_exact", "decode.methods must be a list of preset names"),
    ],
)
def test_bad_presets_are_refused_naming_the_key(tmp_path, override, message):
    from decode.registry import check_methods

    cfg = compose_config(["backbone=digits_tiny", "decode.methods=[ssd_autocorrect,mulo]", override], tmp_path)
    with pytest.raises(ValueError, match=message):
        check_methods(cfg.decode)


@pytest.mark.parametrize(
    "override,message",
    [
        ("decode.cfg_scale=abc", "decode.cfg_scale must be a number"),
        ("decode.cfg_scale=nan", "decode.cfg_scale must be a finite number"),
        ("decode.temperature=inf", "decode.temperature must be a finite number"),
        ("decode.num_images=0", "decode.num_images must be >= 1"),
        ("decode.seeds=1.5", "decode.seeds must be an integer"),
        ("decode.greedy=maybe", "decode.greedy must be true or false"),
    ],
)
def test_bad_run_settings_are_refused_before_anything_is_built(tmp_path, override, message):
    cfg = compose_config(["backbone=digits_tiny", f"decode.out={tmp_path / 'out'}", override], tmp_path)
    with pytest.raises(ValueError, match=message):
        run_decode(cfg)
    assert not (tmp_path / "out").exists()


def test_seeds_run_every_method_again_and_interleaving_changes_no_token(tmp_path, classifier_cache):
    """decode.seeds=2 runs each method at seeds 0 and 1 (the band from one run); a method run beside others
    produces exactly the tokens it produces alone, at each seed."""
    common = [
        "backbone=digits_tiny",
        "decode.num_images=4",
        "decode.batch_size=2",
        "decode.save_tokens=true",
        f"decode.heads={tmp_path / 'heads'}",
        f"paths.checkpoints_dir={classifier_cache}",
    ]
    import hydra

    _export_tiny_heads(hydra.utils.instantiate(compose_config(common, tmp_path).backbone), tmp_path / "heads")
    together = run_decode(
        compose_config(
            [
                *common,
                "decode.methods=[ar,ssd_exact,ssd_autocorrect]",
                "decode.seeds=2",
                f"decode.out={tmp_path / 'together'}",
            ],
            tmp_path,
        )
    )
    assert together["seeds"] == [0, 1]
    assert len(together["methods"]["ssd_exact"]["quality_per_seed"]) == 2
    low, high = together["baseline_band"]["classifier_accuracy"]
    assert low <= together["methods"]["ar"]["quality"]["classifier_accuracy"] <= high
    tolerance = together["baseline_tolerance"]
    assert tolerance["classifier_accuracy"] > 0 and tolerance["frechet_distance"] > 0
    assert "baseline tolerance (8 images, sampling error)" in (tmp_path / "together" / "summary.md").read_text()
    alone = tmp_path / "alone"
    run_decode(
        compose_config([*common, "decode.methods=[ssd_exact]", "decode.seed=1", f"decode.out={alone}"], tmp_path)
    )
    assert np.array_equal(
        np.load(tmp_path / "together" / "tokens_ssd_exact_seed1.npy"), np.load(alone / "tokens_ssd_exact.npy")
    )
    assert not np.array_equal(
        np.load(tmp_path / "together" / "tokens_ssd_exact.npy"), np.load(alone / "tokens_ssd_exact.npy")
    )  # seed 0 differs from seed 1


def test_a_rerun_into_the_same_folder_leaves_only_what_its_metrics_describe(tmp_path, classifier_cache):
    out = tmp_path / "out"
    common = [
        "backbone=digits_tiny",
        "decode.num_images=2",
        f"decode.out={out}",
        f"paths.checkpoints_dir={classifier_cache}",
    ]
    _export_tiny_heads(hydra_backbone(common, tmp_path), tmp_path / "heads")
    run_decode(
        compose_config(
            [*common, "decode.methods=[ar,ssd_exact]", "decode.save_tokens=true", f"decode.heads={tmp_path / 'heads'}"],
            tmp_path,
        )
    )
    assert {p.name for p in out.iterdir()} >= {"ar.png", "ssd_exact.png", "tokens_ssd_exact.npy", "speed_quality.png"}
    (out / "notes.txt").write_text("mine")
    run_decode(compose_config([*common, "decode.methods=[ar]"], tmp_path))
    assert {p.name for p in out.iterdir()} == {"metrics.json", "summary.md", "ar.png", "notes.txt"}


def hydra_backbone(overrides, tmp_path):
    import hydra

    return hydra.utils.instantiate(compose_config(overrides, tmp_path).backbone)


def test_the_comparison_experiment_runs_every_method_at_both_batch_sizes(tmp_path):
    from hydra import compose, initialize_config_dir

    from common.paths import PROJECT_ROOT
    from decode.registry import check_methods

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=compare_digits"], return_hydra_config=True)
    names = [m.name for m in check_methods(cfg.decode)]
    assert names == COMPARISON_METHODS
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.hydra.sweeper.params["decode.batch_size"] == "1,16"
    assert cfg.decode.seeds >= 2 and cfg.decode.heads.endswith("checkpoints/ssd_digits")


def test_a_missing_export_names_the_experiment_that_makes_it(tmp_path):
    from decode.registry import check_methods, load_artefacts

    cfg = compose_config(
        ["backbone=digits_tiny", "decode.methods=[ar,mulo]", f"decode.drafter={tmp_path / 'none'}"], tmp_path
    )
    methods = check_methods(cfg.decode)
    with pytest.raises(FileNotFoundError, match=r"python -m train \+experiment=mulo_digits"):
        load_artefacts(methods, hydra_backbone(["backbone=digits_tiny"], tmp_path))


def test_continuous_turns_give_a_queue_to_ssd_ragged_and_count_its_passes_per_batch(tmp_path, classifier_cache):
    """decode.queue_batches=2: ssd_ragged decodes each turn's 4 images as one queue over 2 slots, AR batch by
    batch; the ragged method's passes are counted per batch of 2 (its rounds over the turn's two batches), and
    its tokens are those of one direct call on the same queue."""
    import hydra

    from decode.ssd_ragged import RaggedSSDConfig, generate_ssd_ragged
    from heads.export import load_heads

    common = [
        "backbone=digits_tiny",
        "decode.num_images=8",
        "decode.batch_size=2",
        "decode.queue_batches=2",
        "decode.save_tokens=true",
        "decode.presets.ssd_ragged.window=2",
        f"decode.heads={tmp_path / 'heads'}",
        f"paths.checkpoints_dir={classifier_cache}",
    ]
    backbone = hydra.utils.instantiate(compose_config(common, tmp_path).backbone)
    _export_tiny_heads(backbone, tmp_path / "heads")
    report = run_decode(
        compose_config([*common, "decode.methods=[ar,ssd_ragged]", f"decode.out={tmp_path / 'out'}"], tmp_path)
    )
    assert report["queue_batches"] == 2
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "mean open positions verified per image and pass: ssd_ragged 2.0" in summary
    assert report["methods"]["ar"]["forward_passes_per_image"] == backbone.geometry.num_tokens
    tokens = np.load(tmp_path / "out" / "tokens_ssd_ragged.npy")
    heads = load_heads(tmp_path / "heads", backbone, kind="ssd")
    from decode.conditions import build_conditions

    conditions = build_conditions(backbone, 8, None, "smoke", "caption")
    generator = torch.Generator().manual_seed(0)
    first_turn = generate_ssd_ragged(
        backbone,
        heads,
        conditions.subset(torch.arange(4)),
        SamplingConfig(cfg_scale=3.0),
        generator,
        RaggedSSDConfig(window=2, slots=2),
    )
    assert np.array_equal(tokens[:4], first_turn.tokens.numpy())
