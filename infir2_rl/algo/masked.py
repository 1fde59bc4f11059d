"""Masked reductions shared by the losses and the mismatch metrics.

Shapes: B sequences x T response tokens; ``mask_BT`` is 1.0 on valid response tokens and 0.0 on
padding (a bool mask is accepted and converted). Values at masked positions may be anything,
including NaN or inf from padding: they are replaced by zero *before* any arithmetic, because
``nan * 0`` is still NaN and a single padded -inf log-prob would otherwise poison the whole loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_float_mask(mask_BT: Tensor, like_BT: Tensor, name: str = "mask") -> Tensor:
    """Return ``mask_BT`` as a float tensor shaped like ``like_BT``, with entries in {0, 1}."""
    if mask_BT.shape != like_BT.shape:
        raise ValueError(f"{name} has shape {tuple(mask_BT.shape)}: it must match {tuple(like_BT.shape)}.")
    dtype = like_BT.dtype if like_BT.is_floating_point() else torch.float32
    return mask_BT.to(dtype=dtype)


def zero_masked(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """``x`` where the mask is set and exactly 0 elsewhere (safe for NaN/inf padding; keeps gradients)."""
    return torch.where(mask_BT > 0, x_BT, torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def masked_sum(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sum of ``x * mask`` over all elements (scalar)."""
    return (zero_masked(x_BT, mask_BT) * mask_BT).sum()


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of ``x`` over the valid tokens of the whole batch (scalar); 0 when there are none."""
    return masked_sum(x_BT, mask_BT) / mask_BT.sum().clamp_min(1.0)


def per_sample_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-sequence mean of ``x`` over that sequence's valid tokens, shape (B,); 0 for an empty row."""
    return (zero_masked(x_BT, mask_BT) * mask_BT).sum(dim=-1) / mask_BT.sum(dim=-1).clamp_min(1.0)
