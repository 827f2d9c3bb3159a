"""The speed-quality plot draws whichever quality metrics every method has."""

from PIL import Image

from decode.plots import plot_speed_quality


def report(quality_ar, quality_ssd):
    return {
        "batch_size": 1,
        "num_images": 4,
        "sampling": {"cfg_scale": 3.0},
        "device": "cpu",
        "methods": {
            "ar": {"speedup_vs_ar": 1.0, "forward_passes_per_image": 576, "quality": quality_ar},
            "ssd_exact": {"speedup_vs_ar": 2.0, "forward_passes_per_image": 150, "quality": quality_ssd},
        },
    }


def test_real_backbone_metrics_get_one_panel_each(tmp_path):
    assert plot_speed_quality(
        report({"fid": 20.0, "clip_score": 30.0}, {"fid": 21.0, "clip_score": 29.5}), tmp_path / "two.png"
    )
    assert plot_speed_quality(report({"fid": 20.0}, {"fid": 21.0}), tmp_path / "one.png")
    assert Image.open(tmp_path / "two.png").width > Image.open(tmp_path / "one.png").width


def test_no_plot_without_quality_for_every_method(tmp_path, capsys):
    assert not plot_speed_quality(report(None, None), tmp_path / "none.png")
    assert not plot_speed_quality(report({"fid": 20.0}, {"clip_score": 30.0}), tmp_path / "mixed.png")
    assert not (tmp_path / "none.png").exists() and not (tmp_path / "mixed.png").exists()
    assert "no quality metric was measured" in capsys.readouterr().out
