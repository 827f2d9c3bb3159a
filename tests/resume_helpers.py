"""Fault injection for the resume test: a callback that kills its own process with SIGKILL."""

import os
import signal

import pytorch_lightning as pl


class KillAtStep(pl.Callback):
    """`kill -9` this process once training reaches `step` (after that step's checkpoint, if any, is written)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
