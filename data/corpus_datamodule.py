"""Lightning DataModule over the distillation corpus (built on first use by the frozen backbone)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from backbones.base import ARImageBackbone, Condition
from data.corpus import CorpusSpec, build_corpus, corpus_dataset, shard_name

log = logging.getLogger(__name__)


class ResumedStream(IterableDataset):
    """The repeated training stream without the batches a checkpointed run already consumed.

    The skip applies once, to the whole endless stream. (webdataset's own
    ``.slice`` on a repeated dataset applies to every pass over the shards, so a
    skip longer than one pass leaves every pass empty and a resumed run waits
    forever.) With loader workers each worker streams its own shards and gave
    every ``num_workers``-th batch, so each skips its share.
    """

    def __init__(self, stream, batches: int, batch_size: int):
        self.stream, self.batches, self.batch_size = stream, batches, batch_size

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        batches = self.batches // workers + int(worker < self.batches % workers)
        return itertools.islice(iter(self.stream), batches * self.batch_size, None)


class CorpusDataModule(pl.LightningDataModule):
    """Streams (tokens, class_id or prompt[, hidden]) from the corpus; the last `val_shards` shards are held out."""

    def __init__(
        self,
        backbone: ARImageBackbone,
        corpus_root: str,
        spec: dict,
        batch_size: int = 16,
        val_shards: int = 1,
        num_workers: int = 0,
        shuffle_buffer: int = 256,
        seed: int = 0,
        generate: bool = True,
    ):
        super().__init__()
        self.spec = CorpusSpec(**spec)
        if not 0 < val_shards < self.spec.num_shards:
            raise ValueError(
                f"data.val_shards must be in [1, {self.spec.num_shards - 1}] for a corpus of "
                f"{self.spec.num_shards} shards (raise data.spec.num_images or lower data.spec.shard_size)"
            )
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        _check_conditions_fit(self.spec, backbone)
        self.backbone = backbone
        self.directory = Path(corpus_root) / f"{backbone.name}-{self.spec.digest(backbone.identity())}"
        self.batch_size, self.val_shards = batch_size, val_shards
        self.num_workers, self.shuffle_buffer, self.seed = num_workers, shuffle_buffer, seed
        self.generate = generate  # False: wait for a corpus job (python -m data) to write the shards
        self.skip_batches = 0  # set when resuming: the train stream continues where the checkpoint left it

    def setup(self, stage: str | None = None) -> None:
        # Every rank generates its share of the shards (data-parallel corpus generation), then all read.
        trainer = getattr(self, "trainer", None)
        training_shards = self.spec.num_shards - self.val_shards
        if trainer is not None and trainer.world_size > training_shards:
            raise ValueError(
                f"{trainer.world_size} ranks share {training_shards} training shard(s): every rank streams whole "
                "shards, so each needs one; raise data.spec.num_images or lower data.spec.shard_size to make "
                f"at least {trainer.world_size} (the corpus's digest changes: a new corpus is built)"
            )
        if trainer is None:
            build_corpus(self.backbone, self.directory, self.spec, generate=self.generate)
        else:
            # Lightning moves the module to this rank's device only after `setup`: generate there already.
            self.backbone.to(trainer.strategy.root_device)
            # No collective while the corpus is built: ranks share the shards through claims on the files and
            # wait for each other by reading the directory (data/shard_locks.py), so no process-group timeout
            # can expire during generation, however long it takes.
            build_corpus(
                self.backbone,
                self.directory,
                self.spec,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                generate=self.generate,
            )

    def _shards(self, split: str) -> list[str]:
        names = [shard_name(i) for i in range(self.spec.num_shards)]
        return names[: -self.val_shards] if split == "train" else names[-self.val_shards :]

    def train_dataloader(self) -> DataLoader:
        dataset = corpus_dataset(
            self.directory, self._shards("train"), shuffle=self.shuffle_buffer, repeat=True, seed=self.seed
        )
        if self.skip_batches:  # the stream is seeded, so skipping what was consumed restores the position
            log.info(
                "resuming: skipping the %d training batches (%d samples) the checkpoint consumed",
                self.skip_batches,
                self.skip_batches * self.batch_size,
            )
            dataset = ResumedStream(dataset, self.skip_batches, self.batch_size)
        return self._loader(dataset)

    def val_dataloader(self) -> DataLoader:
        # Every rank validates on every held-out shard: split by rank, a rank without a shard would skip
        # validation while the others wait for it in DDP's collectives (a hang until the process-group timeout).
        return self._loader(corpus_dataset(self.directory, self._shards("val"), split_by_rank=False))

    def _loader(self, dataset) -> DataLoader:
        # Its own generator: creating an iterator must not draw from the global RNG, or a resumed run would
        # see other random numbers (feature noise) than an uninterrupted one.
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def sample_condition(self, num_images: int) -> Condition:
        """Conditions for sample grids during training: the corpus's first prompts, or balanced class ids."""
        if self.spec.conditions == "prompts":
            prompts = self.spec.prompts()
            return Condition(prompts=[prompts[i % len(prompts)] for i in range(num_images)])
        return Condition(class_ids=torch.arange(num_images) % self.spec.num_classes)

    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: how many training batches of which size this rank has consumed."""
        trainer = getattr(self, "trainer", None)
        consumed = trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0
        return {"train_batches_consumed": consumed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("batch_size", self.batch_size)
        if saved != self.batch_size:  # the stream position is counted in batches: another size is another sample
            raise ValueError(
                f"the checkpoint consumed {state.get('train_batches_consumed', 0)} batches of {saved} samples but "
                f"data.batch_size is {self.batch_size}: resume with data.batch_size={saved} (the data stream "
                "would otherwise restart at another sample)"
            )
        self.skip_batches = int(state.get("train_batches_consumed", 0))


def _check_conditions_fit(spec: CorpusSpec, backbone: ARImageBackbone) -> None:
    """Refuse, before any generation, a condition kind or class count the backbone cannot take."""
    text_to_image = hasattr(backbone, "prompt_token_ids")
    if spec.conditions == "class_ids" and text_to_image:
        raise ValueError(
            f"data.spec.conditions=class_ids but {backbone.name} is text-to-image: set "
            "data.spec.conditions=prompts (and data.spec.prompt_source)"
        )
    if spec.conditions == "prompts" and not text_to_image:
        raise ValueError(
            f"data.spec.conditions=prompts but {backbone.name} is class-conditional: set "
            "data.spec.conditions=class_ids (and data.spec.num_classes)"
        )
    classes = getattr(getattr(backbone, "config", None), "num_classes", None)
    if spec.conditions == "class_ids" and isinstance(classes, int) and spec.num_classes > classes:
        raise ValueError(
            f"data.spec.num_classes={spec.num_classes} but {backbone.name} has {classes} classes; "
            f"set data.spec.num_classes={classes}"
        )


def build_experiment_corpus(cfg, rank: int = 0, world_size: int = 1) -> Path:
    """The corpus a training config (`cfg.data`, `cfg.backbone`) reads, built by this process as rank `rank`."""
    import hydra

    if "spec" not in cfg.data:
        raise ValueError(
            f"data={cfg.data.get('_target_')} reads no generated corpus (it has no data.spec): nothing to build"
        )
    backbone = hydra.utils.instantiate(cfg.backbone, _convert_="all")
    datamodule = hydra.utils.instantiate(cfg.data, backbone=backbone, _convert_="all")
    return build_corpus(backbone, datamodule.directory, datamodule.spec, rank=rank, world_size=world_size)
