"""Experiment loggers that need more than a `_target_`."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path

from pytorch_lightning.loggers import WandbLogger

log = logging.getLogger(__name__)


def wandb_credentials_found() -> bool:
    """An API key in the environment or in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_logger(project: str, name: str, save_dir: str, **kwargs) -> WandbLogger:
    """A WandbLogger that falls back to offline mode, loudly, when there are no credentials."""
    offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_found()
    if offline:
        os.environ["WANDB_MODE"] = "offline"
        message = (
            f"wandb: no credentials found (WANDB_API_KEY or `wandb login`): logging offline to {save_dir}/wandb; "
            "upload later with `wandb sync`"
        )
        log.warning(message)
        print(f"[train] {message}")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(project=project, name=name, save_dir=save_dir, offline=offline, **kwargs)
