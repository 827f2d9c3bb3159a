"""The README's Python example runs as printed (heads: a random export in place of a trained one)."""

import re

from conftest import PROJECT_ROOT, random_ssd_heads

from backbones.digits import DigitsBackbone
from heads.export import export_heads


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    readme = (PROJECT_ROOT / "README.md").read_text()
    example = re.search(r"## Use exported heads from your own script\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert 'load_heads("checkpoints/ssd_digits", backbone)' in example
    backbone = DigitsBackbone.from_pretrained(PROJECT_ROOT / "checkpoints" / "digits-backbone")
    export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "checkpoints" / "ssd_digits", backbone.identity())
    (tmp_path / "checkpoints" / "digits-backbone").symlink_to(PROJECT_ROOT / "checkpoints" / "digits-backbone")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["images"].shape == (2, 1, 24, 24)
    assert "backbone passes instead of 576" in capsys.readouterr().out


def test_readme_mar_example_runs(tmp_path):
    """The README's CSpD-on-MAR script, on tiny random MARs saved in the official layout at its paths."""
    from safetensors.torch import save_file

    from backbones.mar import random_mar_backbone

    readme = (PROJECT_ROOT / "README.md").read_text()
    example = re.search(r"From a script:\n\n```python\n(.*?)```", readme, re.S).group(1)
    for name, seed in (("mar_huge", 0), ("mar_base", 1)):
        (tmp_path / name).mkdir()
        state = {k: v.contiguous() for k, v in random_mar_backbone(seed=seed).official_state_dict().items()}
        save_file(state, tmp_path / name / "mar-tiny.safetensors")
    example = example.replace("/models/", f"{tmp_path}/").replace('device="cuda"', 'device="cpu"')
    example = example.replace("[207, 360]", "[2, 3]").replace("num_iter=256", "num_iter=8")  # 10 classes, 16 tokens
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["result"].tokens.shape == (2, 4, 4, 4) and namespace["result"].forward_passes <= 8
