"""Resume is hard to get wrong: an earlier run's checkpoint is never silently overwritten, and a changed batch size
does not resume the data stream at another sample."""

import pytest
from omegaconf import OmegaConf

from data.corpus_datamodule import CorpusDataModule
from train.pipeline import _resume_path


def test_starting_over_in_a_folder_with_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"an interrupted run")
    cfg = OmegaConf.create({"train": {"resume": False}, "paths": {"output_dir": str(tmp_path)}})
    with pytest.raises(FileExistsError, match="train.resume=true, or start a new run in another folder"):
        _resume_path(cfg)
    assert (tmp_path / "checkpoints" / "last.ckpt").read_bytes() == b"an interrupted run"
    cfg.train.resume = True  # the advice, followed
    assert _resume_path(cfg) == str(tmp_path / "checkpoints" / "last.ckpt")


def test_resuming_with_another_batch_size_is_refused_naming_the_saved_one(tiny_backbone, tmp_path):
    def datamodule(batch_size):
        spec = {"num_images": 8, "shard_size": 4}
        return CorpusDataModule(tiny_backbone, str(tmp_path), spec, batch_size=batch_size)

    saved = {"train_batches_consumed": 12, "batch_size": 16}
    with pytest.raises(ValueError, match="resume with data.batch_size=16"):
        datamodule(8).load_state_dict(saved)
    same = datamodule(16)
    same.load_state_dict(saved)
    assert same.skip_batches == 12
