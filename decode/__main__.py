"""`python -m decode [+experiment=NAME] decode.methods=[ar,...] decode.num_images=N decode.out=DIR`."""

import hydra
from omegaconf import DictConfig

from common.paths import register_config_resolvers

register_config_resolvers()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from decode.cli import run_decode  # imported late so that `--help` stays fast

    run_decode(cfg)


if __name__ == "__main__":
    main()
