"""AdamW, the guarded optimizer step and learning-rate schedules of the torch trainer.

AdamW keeps FP32 moments for FP32 master weights. On CUDA it is ``torch.optim.AdamW(fused=True)``: one
kernel per group of tensors reads each parameter, gradient and moment once (the unfused ``foreach`` path
makes ~10 passes; docs/performance.md measured 65 ms for it at the 1.5B shape against a ~8 ms memory floor).
On CPU it stays the per-parameter loop (as fast for tiny models, and the demo's numbers depend on its
arithmetic). The FP32 masters of a BF16 model (``trainer.param_dtype``) on CUDA get ``flat_adamw.FlatAdamW``
instead: the same update as one Triton kernel per layer over flat buffers, writing the model's BF16 copy too.

Guarded step (``step_unless_nonfinite``): a non-finite global gradient norm skips the update. On CPU the
norm is read on the host first. On CUDA that read would stall the launch queue between backward and
optimizer, so the decision stays on the device: clipping multiplies by max_norm / (norm + 1e-6) (NaN when
the norm is), and the fused kernel gets the flag as ``found_inf`` (the hook ``torch.amp.GradScaler`` uses):
with it set, the kernel leaves parameters and moments untouched and the step counter is restored. The
host reads the flag once, after the whole update is queued, to skip the lr schedule and report the step.

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.utils import clip_grads_with_norm_
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from infir2_rl.trainers.torch.master_weights import MasterWeights

from infir2_rl.config import OptimizerConfig
from infir2_rl.trainers import flat_adamw


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


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, masters: MasterWeights | None = None
) -> torch.optim.AdamW:
    """AdamW over FP32 parameters (moments in the parameters' dtype, i.e. FP32); fused when they are on CUDA.
    With ``masters`` (a BF16 model's FP32 masters, ``params`` their ``optimizer_params``) on CUDA: one Triton
    kernel per segment of their flat buffers that also writes the BF16 copy (trainers/flat_adamw.py)."""
    trainable = [p for p in params if p.requires_grad]
    if masters is not None and flat_adamw.available(masters.segments[0].flat.device):
        return flat_adamw.FlatAdamW(
            trainable,
            masters.segments,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
    on_cuda = bool(trainable) and all(p.is_cuda for p in trainable)
    return torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # CPU: the per-parameter loop (foreach=None picks it there), as fast for tiny models.
        foreach=None if not on_cuda else False,
        fused=on_cuda or None,
    )


def step_unless_nonfinite(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    grad_norm: Tensor,
    grad_clip: float,
) -> bool:
    """Clip to ``grad_clip`` (0 = off) and step, unless ``grad_norm`` is NaN/inf; True when skipped.

    See the module docstring: with a fused optimizer nothing here waits for the device until the update is
    queued; otherwise the norm is checked on the host before anything changes.
    """
    if isinstance(optimizer, flat_adamw.FlatAdamW):  # clip and skip inside its kernel
        flagged = torch.isfinite(grad_norm).logical_not().float()
        coef = (grad_clip / (grad_norm.float() + 1e-6)).clamp(max=1.0) if grad_clip > 0 else None
        optimizer.found_inf, optimizer.clip_coef = flagged, coef  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.clip_coef  # type: ignore[attr-defined]
        if bool(flagged.item()):
            optimizer.rewind()
            return True
        return False
    if not optimizer.defaults.get("fused"):
        if not bool(torch.isfinite(grad_norm).item()):
            return True
        if grad_clip > 0:
            clip_grads_with_norm_(params, grad_clip, grad_norm)
        optimizer.step()
        return False
    found_inf = torch.isfinite(grad_norm).logical_not().float()
    if grad_clip > 0:
        clip_grads_with_norm_(params, grad_clip, grad_norm)
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by Adam(W).step for fused kernels
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
    return bool(found_inf.item())


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, LrFactor(cfg, total_steps))
