"""AdamW as one Triton kernel over flat FP32 buffers, writing the model's BF16 copy as it goes (CUDA).

With FP32 masters beside a BF16 model (``trainers/torch/master_weights.py``) torch's fused AdamW is one
kernel per group of tensors over the masters, then the clip multiplies every gradient, and a copy rounds
the masters into the model (~26 ms at 1.5B on an H100: docs/performance.md). Here masters, gradients and
both moments are flat buffers per segment of the model (a decoder layer, or the rest), so one kernel per
segment reads a master, its gradient and moments once and writes the master, the moments and (for the
parameters with a BF16 copy, the front of the buffer) the copy: 30 bytes per parameter, no other pass. The clip coefficient and the non-finite flag are read by the
kernel from the device (no host synchronization); with the flag set it changes nothing.

After the update, a segment's FP8 decoder linears (the back of it, ``master_weights.Fp8Region``) are quantized
into their kept FP8 weights by one more launch (``quant_triton.quantize_weight_blocks``: the bytes and scales
``quantize_weight`` gives, 5 bytes per weight), so that no forward quantizes them again: the old way quantized
every weight in every micro-batch's forward. A kernel that also did the update, one program per 128x128 block
(29 bytes per weight instead of 33), ran at ~1.9 TB/s against this kernel pair's ~2.5-2.9 and took longer (H100,
``bench/flat_adamw.py``, session 27).

The arithmetic is torch's fused AdamW's (``ATen/native/cuda/fused_adam_utils.cuh``, ADAMW mode, FP32 opmath):
``p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)`` with g the clipped gradient (clipping multiplies first, as
``clip_grads_with_norm_`` does). GPU test: ``tests/test_master_weights_gpu.py`` (equal to torch's fused AdamW
within FP32 rounding, skip on a non-finite norm).

One difference: torch's AdamW leaves a parameter without a gradient untouched, while here every parameter of
the model is updated (a missing gradient counts as zero: its moments decay and weight decay applies). In the
trainer every parameter takes part in every training forward, so none lacks a gradient.

``FlatAdamW`` is a ``torch.optim.AdamW`` for checkpoints and schedules: the same param groups, and per
parameter the state ``step`` / ``exp_avg`` / ``exp_avg_sq`` (the moments are views of the flat buffers), so a
checkpoint written by either loads into the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from infir2_rl.fp8 import quant_triton

if TYPE_CHECKING:
    from infir2_rl.trainers.torch.master_weights import Segment

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

_BLOCK = 2048


def available(device: torch.device) -> bool:
    return _HAVE_TRITON and device.type == "cuda"


if _HAVE_TRITON:

    @triton.jit
    def _adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, n, n_copy, coef_ptr, skip_ptr,
        lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK: tl.constexpr,
    ):  # fmt: skip
        if tl.load(skip_ptr) != 0.0:
            return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        coef = tl.load(coef_ptr)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0) * coef
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p - lr * decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(v) / bc2_sqrt + eps
        p = p - step_size * m / denom
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=offs < n_copy)


class FlatAdamW(torch.optim.AdamW):
    """AdamW over the masters of ``segments`` (``master_weights.Segment``: flat FP32 masters and gradients, the
    front of each also written, rounded, into its BF16 ``copy``): one kernel launch per segment. ``params``
    are the masters (``MasterWeights.optimizer_params``); one param group."""

    def __init__(
        self,
        params: Sequence[Tensor],
        segments: Sequence[Segment],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        device = segments[0].flat.device
        if not available(device):
            raise RuntimeError(f"FlatAdamW needs a CUDA device with Triton, got {device}")
        self.segments = list(segments)
        # The FP8 linears' kept FP8 weights are written by step() (the trainer need not invalidate them).
        self.keeps_fp8 = any(seg.fp8 is not None for seg in self.segments)
        # The moments, one pair per segment, made at the first step as torch's AdamW makes them (so that they
        # are not held through the first forward).
        self.moments: list[tuple[Tensor, Tensor]] = []
        self.steps = 0  # optimizer steps taken (host copy of state["step"], for the bias corrections)
        self._step_t = torch.zeros((), dtype=torch.float32, device=device)

    def _bind_state(self) -> None:
        if not self.moments:
            self.moments = [(torch.zeros_like(seg.flat), torch.zeros_like(seg.flat)) for seg in self.segments]
        for seg, (exp_avg, exp_avg_sq) in zip(self.segments, self.moments, strict=True):
            for _, master, offset in seg.slots:
                n = master.numel()
                self.state[master] = {
                    "step": self._step_t,
                    "exp_avg": exp_avg[offset : offset + n].view_as(master),
                    "exp_avg_sq": exp_avg_sq[offset : offset + n].view_as(master),
                }

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update; reads ``self.clip_coef`` / ``self.found_inf`` (device scalars) when set."""
        if closure is not None:
            raise ValueError("FlatAdamW.step takes no closure")
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        if not self.moments:
            self._bind_state()
        self.steps += 1
        coef = getattr(self, "clip_coef", None)
        skip = getattr(self, "found_inf", None)
        one = torch.ones((), dtype=torch.float32, device=self._step_t.device)
        coef = one if coef is None else coef.float()
        skip = torch.zeros_like(one) if skip is None else skip.float()
        lr = float(group["lr"])
        step_size, bc2_sqrt = lr / (1.0 - beta1**self.steps), math.sqrt(1.0 - beta2**self.steps)
        hyper = (lr, beta1, beta2, group["eps"], group["weight_decay"], step_size, bc2_sqrt)
        for seg, (exp_avg, exp_avg_sq) in zip(self.segments, self.moments, strict=True):
            n = seg.flat.numel()
            _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
                seg.flat, seg.ensure_grads(), exp_avg, exp_avg_sq, seg.copy, n, seg.copy.numel(), coef, skip,
                *hyper, BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip
            if seg.fp8 is not None:  # the updated FP8 masters into their kept FP8 weights
                fp8 = seg.fp8
                quant_triton.quantize_weight_blocks(
                    seg.flat, fp8.codes, fp8.scales, fp8.blocks, fp8.start, fp8.pow2, fp8.aligned
                )
                fp8.mark_fresh()
        self._step_t.add_(1.0 - skip)  # state["step"] counts applied updates, as torch's fused AdamW

    def rewind(self) -> None:
        """The last step was skipped (its non-finite flag was set): do not count it."""
        self.steps -= 1

    def state_dict(self) -> dict[str, Any]:
        # Each parameter its own step tensor, as torch's AdamW keeps them (here they share one).
        sd = super().state_dict()
        sd["state"] = {k: {**v, "step": v["step"].clone()} for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces the state tensors: copy them into the flat views
        loaded = {id(p): self.state[p] for p in self.param_groups[0]["params"]}
        self._bind_state()
        steps = 0.0
        for p in self.param_groups[0]["params"]:
            old, new = loaded[id(p)], self.state[p]
            if "exp_avg" in old:
                new["exp_avg"].copy_(old["exp_avg"])
                new["exp_avg_sq"].copy_(old["exp_avg_sq"])
                steps = float(old["step"])
        self.steps = int(steps)
        self._step_t.fill_(steps)
