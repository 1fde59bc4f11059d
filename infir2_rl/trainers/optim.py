"""AdamW and learning-rate schedules of the torch trainer.

Schedules are multipliers of the peak learning rate `lr`, evaluated at the number of optimizer steps
already taken (LambdaLR's convention: factor(0) is the learning rate of the first step).

* warmup: the first `num_warmup = round(warmup_ratio * total_steps)` steps ramp linearly
  from lr / num_warmup up to lr (factor (s + 1) / num_warmup at step s), so no step runs at lr 0.
* cosine: after warmup, lr follows min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2 with progress
  p = (s - num_warmup) / (total_steps - num_warmup) in [0, 1): it reaches min_lr exactly after the last step.
* constant: lr after warmup.

The factor is a picklable object (not a lambda) so the scheduler's state_dict round-trips through a
checkpoint; resuming rebuilds the same schedule from the config and restores `last_epoch`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from infir2_rl.config import OptimizerConfig


class LrFactor:
    """Multiplier of the peak lr at step s (see module docstring)."""

    def __init__(self, cfg: OptimizerConfig, total_steps: int) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps}: a schedule needs at least one optimizer step")
        self.schedule = cfg.schedule
        self.total_steps = total_steps
        self.num_warmup = round(cfg.warmup_ratio * total_steps)
        self.min_ratio = cfg.min_lr / cfg.lr

    def __call__(self, step: int) -> float:
        if step < self.num_warmup:
            return (step + 1) / self.num_warmup
        if self.schedule == "constant":
            return 1.0
        decay_steps = max(self.total_steps - self.num_warmup, 1)
        progress = min((step - self.num_warmup) / decay_steps, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over FP32 parameters; its moments are created in the parameters' dtype, i.e. FP32."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # foreach is the default on CUDA; on CPU the per-parameter loop is as fast for tiny models.
        foreach=None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, LrFactor(cfg, total_steps))
