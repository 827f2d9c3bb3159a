"""A tiny digits backbone that generates slowly and logs every generation batch (corpus scheduling tests).

Importable by subprocesses with PYTHONPATH=tests: ``backbone._target_=slow_generation.slow_digits_backbone``.
"""

from __future__ import annotations

import os
import time

from backbones.digits import random_digits_backbone


def slow_digits_backbone(delay_s: float, log_path: str, **architecture):
    """`random_digits_backbone(**architecture)` whose every generation batch (prefill) first sleeps `delay_s`
    and appends "<pid> <batch size>" to `log_path`."""
    backbone = random_digits_backbone(**architecture)
    prefill = backbone.prefill

    def slow_prefill(condition, guided):
        time.sleep(delay_s)
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()} {condition.batch_size}\n")
        return prefill(condition, guided)

    backbone.prefill = slow_prefill
    return backbone
