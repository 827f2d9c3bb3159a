"""What a run generates: class ids for class-conditional backbones, prompts for text-to-image ones.

Prompts come from local files through Hugging Face ``datasets`` (``.jsonl``,
``.json``, ``.parquet``, ``.csv`` with a caption column; ``.txt`` with one prompt
per line), from a hub dataset id where the machine has network, or from the
small list this package ships for smoke runs (``smoke``). Class-conditional
backbones take balanced class ids instead.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from backbones.base import ARImageBackbone, Condition, group_by_prompt_length

log = logging.getLogger(__name__)

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
        raise FileNotFoundError(
            f"prompt file {path} does not exist; give a .txt/.jsonl/.json/.parquet/.csv file, "
            f"a hub dataset id, or one of the shipped sets {sorted(SHIPPED)}"
        )
    return Path(path)


def _text_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _dataset_column(name: str, column: str, split: str, **kwargs) -> list:
    import datasets

    try:
        table = datasets.load_dataset(name, split=split, **kwargs)
    except Exception as error:  # noqa: BLE001 - a missing dataset surfaces as many error types
        raise ValueError(
            f"could not load prompts from {kwargs.get('data_files', name)!r} ({error}); a hub id needs "
            "network access, otherwise download it and give the local file"
        ) from error
    if column not in table.column_names:
        raise ValueError(f"prompt column {column!r} not in {table.column_names}; set the caption column name")
    return table[column]


@dataclass
class Conditions:
    """What a run generates, one entry per image: class ids (class-conditional) or prompts (text-to-image)."""

    class_ids: torch.Tensor | None = None  # (N,) long
    prompts: list[str] | None = None
    num_classes: int | None = None  # the classes the ids are balanced over

    def __len__(self) -> int:
        return len(self.class_ids) if self.class_ids is not None else len(self.prompts)

    def batches(self, batch_size: int, backbone: ARImageBackbone) -> list[tuple[torch.Tensor, Condition]]:
        """(image indices, Condition) per batch, every image once.

        Class ids are cut in order. Prompts are grouped by their tokenized length first
        (in order of first appearance), because the text-to-image adapters do not pad:
        every prompt of a batch must have the same length.
        """
        whole = Condition(class_ids=self.class_ids) if self.class_ids is not None else Condition(prompts=self.prompts)
        return group_by_prompt_length(backbone, whole, max_batch=batch_size)

    def subset(self, indices: torch.Tensor) -> Condition:
        """The Condition of the images `indices`."""
        if self.class_ids is not None:
            return Condition(class_ids=self.class_ids[indices])
        return Condition(prompts=[self.prompts[i] for i in indices.tolist()])


def condition_rows(condition: Condition, indices: list[int]) -> Condition:
    """The condition of these rows (class ids, prompt ids or prompts), in this order: the images a
    continuous-batching generator starts next."""
    if condition.class_ids is not None:
        return Condition(class_ids=condition.class_ids[indices])
    if condition.token_ids is not None:
        return Condition(token_ids=condition.token_ids[indices])
    return Condition(prompts=[condition.prompts[i] for i in indices])


class PromptQueue:
    """The conditions a continuous batch starts next, in queue order, their prompts prefilled `ahead` at a time.

    A refill that finds no prefilled prompt left spends one backbone pass on the next `ahead` (at least as many
    as it needs) in prompt-sized caches (`ARImageBackbone.prefill_prompts`); the refills after it copy from
    them without a pass. With `ahead` 1 every refill round spends its own pass, as one prefill per round would.
    """

    def __init__(self, backbone: ARImageBackbone, condition: Condition, indices, guided: bool, ahead: int):
        if ahead < 1:
            raise ValueError(f"a prompt queue prefills at least one prompt at a time, got ahead={ahead}")
        self.backbone, self.condition, self.guided, self.ahead = backbone, condition, guided, ahead
        self.waiting = deque(indices)  # condition indices not prefilled yet
        self.ready: list[int] = []  # prefilled, not started yet: their rows of `self.state` in `self.rows`
        self.rows: list[int] = []
        self.state = None
        self.first: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ready) + len(self.waiting)

    def take(self, count: int):
        """The next `count` images: (their condition indices, the prefilled state holding them, their images in
        it (count,), their first states (rows, 1, H), whether a pass was spent prefilling)."""
        prefilled = len(self.ready) < count
        if prefilled:  # the ones left are prefilled again with the next, in one pass
            self.waiting.extendleft(reversed(self.ready))
            fill = [self.waiting.popleft() for _ in range(min(len(self.waiting), max(count, self.ahead)))]
            self.state, self.first = self.backbone.prefill_prompts(condition_rows(self.condition, fill), self.guided)
            self.ready, self.rows = fill, list(range(len(fill)))
        images, rows = self.ready[:count], self.rows[:count]
        self.ready, self.rows = self.ready[count:], self.rows[count:]
        rows = torch.tensor(rows, device=self.first.device)
        return images, self.state, rows, self.first[self.state.rows_of(rows)], prefilled


def refill_slots(backbone: ARImageBackbone, state, queue: PromptQueue, freed: torch.Tensor):
    """Start the next images of `queue` in the `freed` slots of a running batch: as many as the queue holds, their
    prompts swapped into `state` (`ARImageBackbone.replace_images`).

    Returns (slots refilled, their image indices, their first states, whether a backbone pass was spent): the
    slots are the first of `freed` (the rest stay empty); with the queue empty, no slots, None, None, False.
    """
    refill = freed[: len(queue)]
    if not len(refill):
        return refill, None, None, False
    images, fresh, rows, first, prefilled = queue.take(len(refill))
    backbone.replace_images(state, refill, fresh, rows.to(refill.device))
    return refill, torch.tensor(images, device=freed.device), first, prefilled


def is_text_to_image(backbone: ARImageBackbone) -> bool:
    """Text-to-image adapters (Emu3, Janus-Pro, Lumina-mGPT, Tar) turn prompts into their own token ids."""
    return hasattr(backbone, "prompt_token_ids")


def build_conditions(
    backbone: ARImageBackbone,
    count: int,
    num_classes: int | None = None,
    prompts: str = "smoke",
    prompt_column: str = "caption",
) -> Conditions:
    """Balanced class ids for class-conditional backbones, prompts from `prompts` for text-to-image ones.

    `num_classes` None means the backbone's own class count (10 digits, 1000
    ImageNet classes for LlamaGen). Prompts repeat in order when there are fewer
    than `count`.
    """
    if is_text_to_image(backbone):
        texts = load_prompts(prompts, column=prompt_column)
        if len(texts) < count:
            log.info("%d prompts in %s for %d images: they repeat in order", len(texts), prompts, count)
        return Conditions(prompts=[texts[i % len(texts)] for i in range(count)])
    own = getattr(backbone, "num_classes", None) or getattr(getattr(backbone, "config", None), "num_classes", None)
    num_classes = num_classes or own
    if num_classes is None:
        raise ValueError(f"{backbone.name}: set decode.num_classes (the backbone does not say how many classes it has)")
    if own is not None and num_classes > own:
        raise ValueError(
            f"decode.num_classes={num_classes} but {backbone.name} has {own} classes; "
            f"set decode.num_classes<={own} (or null for all of them)"
        )
    return Conditions(class_ids=balanced_class_ids(count, num_classes), num_classes=num_classes)
