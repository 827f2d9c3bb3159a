"""`python -m data [+experiment=NAME] [overrides]`: build an experiment's distillation corpus as a job of its own.

The corpus `python -m train` would build for the same config (data/corpus.py),
generated on any number of GPUs and nodes with no process group and no
collective wait: every rank writes the shards ``i % world == rank`` first, then
helps with any shard nobody is generating, and waits for the rest by reading
the directory. Resumable shard by shard: rerun the same command after a kill.

    python -m data +experiment=ssd_emu3 backbone.path=<dir>                      # one GPU
    torchrun --nproc-per-node=8 -m data +experiment=ssd_emu3 backbone.path=<dir> # 8 GPUs (RANK, WORLD_SIZE)
    srun --ntasks=16 --gpus-per-task=1 python -m data +experiment=ssd_emu3 ...   # SLURM (SLURM_PROCID, SLURM_NTASKS)

Then train from the complete corpus (``data.generate=false`` makes training only
wait for it, should it start before the job ends).
"""

import os

import hydra
from omegaconf import DictConfig

from common.paths import register_config_resolvers

register_config_resolvers()


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from torchrun's or SLURM's environment; (0, 1) when launched alone."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in os.environ and world_key in os.environ:
            rank, world = int(os.environ[rank_key]), int(os.environ[world_key])
            if not 0 <= rank < world:
                raise ValueError(f"{rank_key}={rank} is not a rank of {world_key}={world}")
            return rank, world
    return 0, 1


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from data.corpus_datamodule import build_experiment_corpus  # imported late so that `--help` stays fast

    rank, world = launcher_rank()
    directory = build_experiment_corpus(cfg, rank, world)
    print(f"[data] rank {rank}/{world}: corpus complete in {directory}")


if __name__ == "__main__":
    main()
