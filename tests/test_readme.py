"""The README's and its docs' Python examples run as printed (heads: a random export in place of a trained one), and
the paths, experiments, presets, modules and links they cite exist."""

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
    assert namespace["many"].tokens.shape == (8, 24, 24)
    assert "backbone passes instead of 576" in capsys.readouterr().out


def test_readme_mar_example_runs(tmp_path):
    """docs/continuous.md's CSpD-on-MAR script, on tiny random MARs saved in the official layout at its paths."""
    from safetensors.torch import save_file

    from backbones.mar import random_mar_backbone

    continuous = (PROJECT_ROOT / "docs" / "continuous.md").read_text()
    example = re.search(r"From a script:\n\n```python\n(.*?)```", continuous, re.S).group(1)
    for name, seed in (("mar_huge", 0), ("mar_base", 1)):
        (tmp_path / name).mkdir()
        state = {k: v.contiguous() for k, v in random_mar_backbone(seed=seed).official_state_dict().items()}
        save_file(state, tmp_path / name / "mar-tiny.safetensors")
    example = example.replace("/models/", f"{tmp_path}/").replace('device="cuda"', 'device="cpu"')
    example = example.replace("[207, 360]", "[2, 3]").replace("num_iter=256", "num_iter=8")  # 10 classes, 16 tokens
    namespace = {}
    exec(compile(example, "docs/continuous.md", "exec"), namespace)
    assert namespace["result"].tokens.shape == (2, 4, 4, 4) and namespace["result"].forward_passes <= 8


# The README and the docs moved out of it (issue 31); docs/architecture.md and docs/results_log.md are not checked.
DOCUMENTS = ["README.md"] + [
    f"docs/{name}.md" for name in ("methods", "results", "continuous", "real_backbones", "backbones", "training")
]
README_MAX_LINES = 260  # a five-minute read; the rest lives in the docs above
# Top-level folders of this repository: a `path/...` starting with one of them is a file of ours and must exist
# (`models/vae.py` of LTH14/mar does not start with one).
PROJECT_DIRS = ("backbones", "checkpoints", "common", "conf", "data", "decode", "docs", "heads", "tests", "train")
# What the commands in the README write, so not in a fresh clone.
OUTPUTS = {"checkpoints/ssd_digits", "checkpoints/mulo_digits"}
# `name=option` of a config group, as the commands write it (conf/<group>/<option>.yaml).
CONFIG_GROUPS = ("backbone", "data", "head", "logger", "module", "trainer", "hydra/launcher", "hydra/sweeper")


def _documents():
    return [(name, (PROJECT_ROOT / name).read_text()) for name in DOCUMENTS]


def test_readme_is_short_and_links_every_doc():
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md has {len(readme.splitlines())} lines"
    for name in DOCUMENTS[1:]:
        assert f"]({name})" in readme, f"README.md does not link {name}"


def test_cited_repository_paths_exist():
    missing = []
    for name, text in _documents():
        for span in re.findall(r"`([^`\n]+)`", text):
            path = span.split(":")[0].rstrip("/")  # `decode/sjd.py:verify_window`, `checkpoints/ssd_digits/`
            if not re.fullmatch(r"[\w.\-/]+", path) or path.split("/")[0] not in PROJECT_DIRS or "/" not in path:
                continue  # not a path of ours, or a pattern (`conf/method/base/<module>.yaml`)
            if path not in OUTPUTS and not (PROJECT_ROOT / path).exists():
                missing.append(f"{name}: `{span}`")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_cited_experiments_presets_and_config_options_exist():
    missing = []
    for name, text in _documents():
        for experiment in re.findall(r"\+experiment=(\w+)(?![\w<])", text):
            if experiment != "NAME" and not (PROJECT_ROOT / "conf" / "experiment" / f"{experiment}.yaml").exists():
                missing.append(f"{name}: +experiment={experiment}")
        for preset in re.findall(r"\+method@[\w.]+=(\w+)", text):
            if not (PROJECT_ROOT / "conf" / "method" / f"{preset}.yaml").exists():
                missing.append(f"{name}: preset {preset}")
        for group, option in re.findall(rf"(?<![\w./+@])({'|'.join(CONFIG_GROUPS)})=(\w+)", text):
            if not (PROJECT_ROOT / "conf" / group / f"{option}.yaml").exists():
                missing.append(f"{name}: {group}={option}")
        # "preset `sjd`", "presets `eagle`, `eagle_depth3`", the README's "`mulo` (no)"
        named = re.findall(r"presets? ((?:`\w+`(?:, )?)+)", text) + re.findall(r"(`\w+`) \((?:yes|no)[,)]", text)
        for preset in re.findall(r"`(\w+)`", " ".join(named)):
            if not (PROJECT_ROOT / "conf" / "method" / f"{preset}.yaml").exists():
                missing.append(f"{name}: preset `{preset}`")
        # the first column of a table of experiments (docs/real_backbones.md)
        for table in re.findall(r"^\| experiment \|.*?(?=^[^|]|\Z)", text, re.M | re.S):
            for experiment in re.findall(r"^\| ([^|]+)\|", table, re.M)[1:]:
                for found in re.findall(r"`(\w+)`", experiment):
                    if not (PROJECT_ROOT / "conf" / "experiment" / f"{found}.yaml").exists():
                        missing.append(f"{name}: experiment `{found}`")
    assert not missing, "cited configs that do not exist:\n" + "\n".join(missing)


def test_cited_python_modules_exist():
    missing = []
    for name, text in _documents():
        for module in re.findall(r"python -m ([\w.]+)", text):
            if module.split(".")[0] not in PROJECT_DIRS:
                continue  # pytest
            path = PROJECT_ROOT / module.replace(".", "/")
            if not (path.with_suffix(".py").exists() or (path / "__main__.py").exists()):
                missing.append(f"{name}: python -m {module}")
    assert not missing, "cited modules that do not exist:\n" + "\n".join(missing)


def test_relative_links_resolve():
    broken = []
    for name, text in _documents():
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:|#", target):
                continue  # web addresses, anchors
            if not ((PROJECT_ROOT / name).parent / target.split("#")[0]).exists():
                broken.append(f"{name}: {target}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)
