"""The decode CLI writes the figures every report is made of."""

import json

import numpy as np
import pytest
from conftest import compose_config

from decode.cli import run_decode


def test_decode_writes_metrics_pngs_and_tokens(tmp_path, classifier_cache):
    out = tmp_path / "out"
    cfg = compose_config(["backbone=digits_tiny", "decode.num_images=6", "decode.batch_size=4",
                          f"decode.out={out}", "decode.save_tokens=true", f"paths.checkpoints_dir={classifier_cache}"],
                         tmp_path)
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


def test_unknown_method_is_refused(tmp_path, classifier_cache):
    cfg = compose_config(["backbone=digits_tiny", "decode.methods=[ar,medusa9]", f"decode.out={tmp_path}",
                          f"paths.checkpoints_dir={classifier_cache}"], tmp_path)
    with pytest.raises(ValueError, match="medusa9"):
        run_decode(cfg)


def test_committed_classifier_is_a_competent_judge():
    import torch
    from conftest import PROJECT_ROOT

    from decode.digits_classifier import load_or_train_classifier, reference_digits

    classifier = load_or_train_classifier(PROJECT_ROOT / "checkpoints" / "digits-classifier", 24, 16,
                                          log=lambda message: pytest.fail(f"the committed classifier was retrained: {message}"))
    images, labels = reference_digits(24, 16)
    with torch.no_grad():
        accuracy = (classifier(images)[0].argmax(-1) == labels).float().mean()
    assert accuracy >= 0.95


def test_ssd_method_names_set_mode_rounds_window_and_relaxation(tmp_path, classifier_cache):
    import hydra
    from conftest import random_ssd_heads

    from decode.cli import build_methods
    from heads.export import export_heads

    cfg = compose_config(["backbone=digits_tiny", f"decode.heads={tmp_path / 'heads'}", f"decode.out={tmp_path}",
                          f"paths.checkpoints_dir={classifier_cache}"], tmp_path)
    backbone = hydra.utils.instantiate(cfg.backbone)
    export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())
    names = ["ssd_exact", "ssd_exact_w8", "ssd_autocorrect_r2_prefix_w4_k2_d0.4", "ssd_autocorrect_r0_target",
             "ssd_exact_g2_la", "ssd_autocorrect_r3_la30"]
    cfg.decode.methods = names
    configs = {name: method.generate.keywords["config"] for name, method in build_methods(cfg, backbone).items()
               if name != "ar"}
    assert (configs["ssd_exact"].mode, configs["ssd_exact"].window, configs["ssd_exact"].relax_delta) == ("exact", 0, 0.0)
    assert configs["ssd_exact_w8"].window == 8
    relaxed = configs["ssd_autocorrect_r2_prefix_w4_k2_d0.4"]
    assert (relaxed.mode, relaxed.rounds, relaxed.correction, relaxed.window, relaxed.relax_k, relaxed.relax_delta) == (
        "autocorrect", 2, "prefix", 4, 2, 0.4)
    assert (configs["ssd_autocorrect_r0_target"].rounds, configs["ssd_autocorrect_r0_target"].correction) == (0, "target")
    assert not configs["ssd_exact"].lookahead
    assert (configs["ssd_exact_g2_la"].grid_steps, configs["ssd_exact_g2_la"].lookahead,
            configs["ssd_exact_g2_la"].lookahead_confidence) == (2, True, 0.0)
    assert (configs["ssd_autocorrect_r3_la30"].lookahead, configs["ssd_autocorrect_r3_la30"].lookahead_confidence) == (
        True, 0.3)


def _export_tiny_drafter(backbone, directory):
    """A random one-layer MuLo drafter (r = 2) for `backbone`, exported to `directory`."""
    from heads.export import export_heads
    from heads.mulo import MuLoDrafter, MuLoDrafterConfig

    drafter = MuLoDrafter(MuLoDrafterConfig.for_backbone(backbone, scale=2, hidden_size=16, num_layers=1, num_heads=1,
                                                         intermediate_size=32))
    export_heads(drafter, directory, backbone.identity())


def test_mulo_method_names_set_mode_operating_point_rounds_and_proposal(tmp_path, classifier_cache):
    import hydra

    from decode.cli import build_methods

    cfg = compose_config(["backbone=digits_tiny", f"decode.mulo.drafter={tmp_path / 'drafter'}", f"decode.out={tmp_path}",
                          f"paths.checkpoints_dir={classifier_cache}"], tmp_path)
    backbone = hydra.utils.instantiate(cfg.backbone)
    _export_tiny_drafter(backbone, tmp_path / "drafter")
    cfg.decode.methods = ["mulo", "mulo_exact", "mulo_k6_d0.5_r0", "mulo_k2_d0.1_r2_rounds1_bicubic_point"]
    configs = {name: method.generate.keywords["config"] for name, method in build_methods(cfg, backbone).items()
               if name != "ar"}
    default = configs["mulo"]
    assert (default.mode, default.k, default.delta, default.radius, default.rounds, default.proposal) == (
        "relaxed", cfg.decode.mulo.k, cfg.decode.mulo.delta, cfg.decode.mulo.radius, 0, "drafter")
    assert configs["mulo_exact"].mode == "exact"
    assert (configs["mulo_k6_d0.5_r0"].k, configs["mulo_k6_d0.5_r0"].delta, configs["mulo_k6_d0.5_r0"].radius) == (6, 0.5, 0)
    assert default.upsample_mode == cfg.decode.mulo.upsample_mode
    last = configs["mulo_k2_d0.1_r2_rounds1_bicubic_point"]
    assert (last.k, last.delta, last.radius, last.rounds, last.upsample_mode, last.proposal) == (
        2, 0.1, 2, 1, "bicubic", "point")
    with pytest.raises(ValueError, match="unknown decode method"):
        build_methods(compose_config(["backbone=digits_tiny", "decode.methods=[mulo_pointy]"], tmp_path), backbone)


def test_seed_suffix_reruns_any_method_with_an_offset_seed(tmp_path, classifier_cache):
    import hydra

    from decode.cli import build_methods

    cfg = compose_config(["backbone=digits_tiny", f"decode.out={tmp_path}", f"paths.checkpoints_dir={classifier_cache}",
                          "decode.methods=[ar_seed2,mulo_exact_seed1,mulo_exact]"], tmp_path)
    backbone = hydra.utils.instantiate(cfg.backbone)
    _export_tiny_drafter(backbone, tmp_path / "drafter")
    cfg.decode.mulo.drafter = str(tmp_path / "drafter")
    methods = build_methods(cfg, backbone)
    assert list(methods) == ["ar", "ar_seed2", "mulo_exact_seed1", "mulo_exact"]
    assert [m.seed_offset for m in methods.values()] == [0, 2, 1, 0]
    assert methods["ar_seed2"].generate is methods["ar"].generate
    assert methods["mulo_exact_seed1"].generate.keywords["config"] == methods["mulo_exact"].generate.keywords["config"]
    with pytest.raises(ValueError, match="unknown decode method 'mulo_seed'"):
        build_methods(compose_config(["backbone=digits_tiny", "decode.methods=[mulo_seed]"], tmp_path), backbone)
