"""The packages form layers: each imports only the ones below it, so no two folders depend on each other.

    common  <-  backbones  <-  heads  <-  decode  <-  data  <-  train

decode/ is the inference module (tensors in, tokens out, with its evaluation);
data/ builds corpora with the baseline generator; train/ may use everything.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["common", "backbones", "heads", "decode", "data", "train"]


def _project_imports(path: Path) -> set[str]:
    """The project packages a file imports (lazily inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        )
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in LAYERS)
    return found


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package):
    allowed = set(LAYERS[: LAYERS.index(package) + 1])
    offenders = {
        f"{path.relative_to(ROOT)} imports {sorted(_project_imports(path) - allowed)}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if _project_imports(path) - allowed
    }
    assert not offenders, "\n".join(sorted(offenders))


def test_nothing_trains_inside_decode():
    """decode/ generates and evaluates; training (optimizers, backward passes) lives in train/."""
    for path in sorted((ROOT / "decode").rglob("*.py")):
        text = path.read_text()
        assert ".backward(" not in text and "torch.optim" not in text, path.relative_to(ROOT)


def test_decode_core_needs_neither_hydra_nor_lightning():
    """Only the CLI layer of decode/ reads Hydra configs; nothing in it uses Lightning."""
    cli_layer = {"__main__.py", "cli.py", "registry.py", "summary.py", "bench_device.py"}
    for path in sorted((ROOT / "decode").rglob("*.py")):
        text = path.read_text()
        assert "lightning" not in text, path.relative_to(ROOT)
        if path.name not in cli_layer:
            assert "import hydra" not in text and "omegaconf" not in text, path.relative_to(ROOT)
