"""Condition sets for text-to-image and class-conditional backbones.

Prompts come from local files through Hugging Face ``datasets`` (``.jsonl``,
``.json``, ``.parquet``, ``.csv`` with a caption column; ``.txt`` with one prompt
per line), from a hub dataset id where the machine has network, or from the
small list this package ships for smoke runs (``smoke``). Class-conditional
backbones take balanced class ids instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHIPPED = {"smoke": Path(__file__).parent / "prompts" / "smoke.txt"}
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompts(source: str, column: str = "caption", limit: int | None = None, split: str = "train") -> list[str]:
    """Prompts from `source` (a shipped name, a local file or a hub dataset id), at most `limit` of them."""
    if source in SHIPPED:
        prompts = _text_lines(SHIPPED[source])
    elif Path(source).suffix == ".txt":
        prompts = _text_lines(_existing(source))
    elif Path(source).suffix in _FORMATS:
        prompts = _dataset_column(_FORMATS[Path(source).suffix], column, split, data_files=str(_existing(source)))
    else:
        prompts = _dataset_column(source, column, split)
    prompts = [p.strip() for p in prompts if isinstance(p, str) and p.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {source!r} (column {column!r})")
    return prompts[:limit] if limit else prompts


def balanced_class_ids(num_images: int, num_classes: int) -> torch.Tensor:
    """0, 1, ..., num_classes - 1, 0, 1, ...: every class equally often (up to one)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return torch.arange(num_images) % num_classes


def _existing(path: str) -> Path:
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist; give a .txt/.jsonl/.json/.parquet/.csv file, "
                                f"a hub dataset id, or one of the shipped sets {sorted(SHIPPED)}")
    return Path(path)


def _text_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _dataset_column(name: str, column: str, split: str, **kwargs) -> list:
    import datasets

    try:
        table = datasets.load_dataset(name, split=split, **kwargs)
    except Exception as error:  # noqa: BLE001 - a missing dataset surfaces as many error types
        raise ValueError(f"could not load prompts from {kwargs.get('data_files', name)!r} ({error}); a hub id needs "
                         "network access, otherwise download it and give the local file") from error
    if column not in table.column_names:
        raise ValueError(f"prompt column {column!r} not in {table.column_names}; set the caption column name")
    return table[column]
