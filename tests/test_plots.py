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


def test_the_throughput_plot_and_table_read_runs_at_several_batch_sizes(tmp_path, capsys):
    import json

    from decode.throughput_plot import main

    for batch, ssd_seconds in ((1, 0.5), (16, 0.1)):
        run = {
            "batch_size": batch,
            "num_images": 4,
            "seeds": [0, 1],
            "sampling": {"cfg_scale": 3.0},
            "device": "cpu",
            "torch_threads": 2,
            "methods": {
                "ar": {"seconds_per_image": 1.0 / batch**0.5, "speedup_vs_ar": 1.0, "forward_passes_per_image": 576},
                "ssd_ragged": {"seconds_per_image": ssd_seconds, "speedup_vs_ar": 2.0, "forward_passes_per_image": 90},
            },
        }
        (tmp_path / f"b{batch}").mkdir()
        (tmp_path / f"b{batch}" / "metrics.json").write_text(json.dumps(run))
    main([str(tmp_path / "b16"), str(tmp_path / "b1"), "--out", str(tmp_path / "throughput.png")])
    table = capsys.readouterr().out
    assert "| method | batch 1 | batch 16 |" in table  # ordered by batch size
    assert "| ssd_ragged | 2.00 img/s, 2.00x, 90.0 passes | 10.00 img/s" in table
    assert Image.open(tmp_path / "throughput.png").width > 0
