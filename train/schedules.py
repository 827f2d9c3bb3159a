"""Learning-rate schedules shared by the training modules."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, final_fraction: float = 0.05
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for `warmup_steps`, then cosine decay to `final_fraction` of the peak at `total_steps`."""
    total_steps = max(total_steps, warmup_steps + 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_cosine_optimizers(module, parameters) -> dict:
    """`configure_optimizers` of the project's modules: ``module.optimizer_factory`` over `parameters`, stepped
    by `warmup_cosine` over the run's ``module.warmup_steps`` and estimated optimizer steps."""
    optimizer = module.optimizer_factory(params=parameters)
    scheduler = warmup_cosine(optimizer, module.warmup_steps, int(module.trainer.estimated_stepping_batches))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
