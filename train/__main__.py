"""`python -m train [+experiment=NAME] [overrides]`: self-distil draft heads (or train a backbone)."""

import hydra
from omegaconf import DictConfig

from common.paths import register_config_resolvers

register_config_resolvers()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from train.pipeline import run_training  # imported late so that `--help` stays fast

    metrics = run_training(cfg)
    return metrics.get(cfg.get("optimized_metric", ""), None)


if __name__ == "__main__":
    main()
