"""Rotary embedding of the trainer's queries and keys as one Triton kernel each way (CUDA), bit for bit torch's.

Why: transformers' ``apply_rotary_pos_emb`` is ``q * cos + rotate_half(q) * sin`` (and the same for k) on the
attention's q and k, which are transposed views of the projections' outputs. Its elementwise kernels mix that
layout with the contiguous ``rotate_half`` copies, so torch runs them on its strided (not vectorized) path: in a
1.5B training step at 8,192 tokens (H200, CUDA graphs, ``bench/train_step.py --profile``, docs/performance.md,
session 55) 224 such multiplications (5.1 ms) and 112-140 additions (2.8-4.1 ms) per step, in BF16 and FP8
alike, besides the negations and concatenations of ``rotate_half``. Here q and k are rotated by one launch
forward and one backward, reading and writing each element once.

The bits are torch's: each product is rounded to the inputs' dtype, then their sum (``fused_ops._rotated``, the
engine's decode kernel's arithmetic, launched without FMA contraction). The backward is autograd's of the same
expression: dq_lo = g_lo cos_lo + g_hi sin_hi and dq_hi = g_hi cos_hi - g_lo sin_lo, each product and the sum
rounded as autograd rounds them (the two contributions to dq are added in the gradient's dtype). The outputs are
laid out as torch lays out ``q * cos + ...`` on a transposed view (batch, position, head, feature in memory), so
the attention after it sees the strides it saw before.

How it is switched on: ``fused_layers.apply_fused_layers`` gives the Qwen2/Llama attention modules a forward that
marks its call (a context variable, so per thread) and runs transformers' own forward, whose module-level
``apply_rotary_pos_emb`` is replaced once by ``_Dispatcher``: inside a marked call on CUDA, with q, k, cos and
sin of one dtype and the default ``unsqueeze_dim``, it runs the kernels; everywhere else (another model of the
same class in this process, CPU, other dtypes) transformers' function, unchanged.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native.fused_ops import _rotated

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("infir2_fused_rope", default=False)


if _HAVE_TRITON:

    @triton.jit
    def _rope_heads(
        x_ptr, o_ptr, cos_ptr, sin_ptr, b, pos, sxb, sxh, sxl, sob, soh, sol, scb, scl,
        HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """Every head of one position of x (``HEADS`` heads, ``D`` features) rotated into o."""
        half: tl.constexpr = D // 2
        dh = tl.arange(0, half)
        cs = cos_ptr + b * scb + pos * scl
        sn = sin_ptr + b * scb + pos * scl
        cos_lo = tl.load(cs + dh).to(tl.float32)
        cos_hi = tl.load(cs + half + dh).to(tl.float32)
        sin_lo = tl.load(sn + dh).to(tl.float32)
        sin_hi = tl.load(sn + half + dh).to(tl.float32)
        h = tl.arange(0, HP)[:, None]
        mask = h < HEADS
        x_at = x_ptr + b * sxb + pos * sxl + h * sxh + dh[None, :]
        lo = tl.load(x_at, mask=mask)
        hi = tl.load(x_at + half, mask=mask)
        if BACKWARD:  # dq_lo = g_lo cos_lo + g_hi sin_hi, dq_hi = g_hi cos_hi - g_lo sin_lo
            out_lo = _rotated(lo, hi.to(tl.float32), cos_lo[None, :], sin_hi[None, :])
            out_hi = _rotated(hi, -lo.to(tl.float32), cos_hi[None, :], sin_lo[None, :])
        else:  # q cos + rotate_half(q) sin, rotate_half(q) = (-q_hi, q_lo)
            out_lo = _rotated(lo, -hi.to(tl.float32), cos_lo[None, :], sin_lo[None, :])
            out_hi = _rotated(hi, lo, cos_hi[None, :], sin_hi[None, :])
        o_at = o_ptr + b * sob + pos * sol + h * soh + dh[None, :]
        tl.store(o_at, out_lo, mask=mask)
        tl.store(o_at + half, out_hi, mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, L,
        sqb, sqh, sql, skb, skh, skl, sqob, sqoh, sqol, skob, skoh, skol, scb, scl,
        HQ: tl.constexpr, HQP: tl.constexpr, HK: tl.constexpr, HKP: tl.constexpr, D: tl.constexpr,
        BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """Program (t, 0): the query heads of token t (batch t // L, position t % L); (t, 1): its key heads."""
        t = tl.program_id(0)
        b, pos = (t // L).to(tl.int64), (t % L).to(tl.int64)
        if tl.program_id(1) == 0:
            _rope_heads(
                q_ptr, qo_ptr, cos_ptr, sin_ptr, b, pos, sqb, sqh, sql, sqob, sqoh, sqol, scb, scl,
                HQ, HQP, D, BACKWARD,
            )  # fmt: skip
        else:
            _rope_heads(
                k_ptr, ko_ptr, cos_ptr, sin_ptr, b, pos, skb, skh, skl, skob, skoh, skol, scb, scl,
                HK, HKP, D, BACKWARD,
            )  # fmt: skip


def _out_like(x: Tensor) -> Tensor:
    """An uninitialized (B, H, L, D) tensor stored as (B, L, H, D): the layout torch gives ``q * cos + ...``
    when q is the transposed view of a projection's output, and a free view back to (B, L, H * D)."""
    b, h, length, d = x.shape
    return torch.empty(b, length, h, d, dtype=x.dtype, device=x.device).transpose(1, 2)


def _launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    b, hq, length, d = q.shape
    hk = k.shape[1]
    qo, ko = _out_like(q), _out_like(k)
    if b * length:
        _rope_kernel[(b * length, 2)](
            q, k, qo, ko, cos, sin, length,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            cos.stride(0), cos.stride(1),
            HQ=hq, HQP=triton.next_power_of_2(hq), HK=hk, HKP=triton.next_power_of_2(hk), D=d,
            BACKWARD=backward, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return qo, ko


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        gq, gk = _launch(_feature_contiguous(dq), _feature_contiguous(dk), cos, sin, backward=True)
        return gq, gk, None, None


def _feature_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fusable(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> bool:
    """Whether ``rope`` computes what transformers' ``apply_rotary_pos_emb`` would for these arguments."""
    return (
        _HAVE_TRITON
        and q.is_cuda
        and unsqueeze_dim == 1
        and q.dim() == k.dim() == 4
        and cos.dim() == sin.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and q.shape[-1] >= 16
        and (q.shape[-1] & (q.shape[-1] - 1)) == 0  # a power of two: the kernel's feature block
        and q.shape[0] == k.shape[0]
        and q.shape[2:] == k.shape[2:]
        and cos.shape == sin.shape
        and cos.shape[1:] == (q.shape[2], q.shape[3])
        and cos.shape[0] in (1, q.shape[0])
        and cos.stride() == sin.stride()
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
        and not (cos.requires_grad or sin.requires_grad)  # the tables get no gradient here
    )


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary_pos_emb(q, k, cos, sin)`` (transformers, ``unsqueeze_dim=1``) on CUDA in one kernel each
    way; q (B, H, L, D), k (B, KH, L, D), cos and sin (B or 1, L, D), one dtype (``fusable``)."""
    b = q.shape[0]
    cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)  # a batch of one tables: stride 0
    out = _RopeFn.apply(q, k, cos, sin)
    return out[0], out[1]


class _Dispatcher:
    """Stands in for a modeling module's ``apply_rotary_pos_emb``: ``rope`` inside a fused attention's forward
    where ``fusable``, transformers' function (kept as ``original``) everywhere else."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args: Any, **kwargs: Any) -> Any:
        plain_call = not args and set(kwargs) <= {"unsqueeze_dim"}  # (transformers 5's signature)
        if _ACTIVE.get() and plain_call and fusable(q, k, cos, sin, kwargs.get("unsqueeze_dim", 1)):
            return rope(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def install(module: ModuleType) -> bool:
    """Route ``module.apply_rotary_pos_emb`` (a transformers modeling module) through ``_Dispatcher``, once.
    False where the module has no such function (the attention is then left to transformers)."""
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if not isinstance(current, _Dispatcher):
        module.apply_rotary_pos_emb = _Dispatcher(current)  # type: ignore[attr-defined]
    return True


def fused_attention_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The attention's own forward (that of the class the fused subclass derives from), with this thread's
    rotary calls fused. The fused subclass is found in the MRO, not taken as ``type(self)``: a wrapper class
    made later (FSDP2 makes one per module it shards) may sit above it."""
    mro = type(self).__mro__
    i = next(i for i, c in enumerate(mro) if c.__dict__.get("forward") is fused_attention_forward)
    token = _ACTIVE.set(True)
    try:
        parent: Any = mro[i + 1]  # the class the fused subclass derives from
        return parent.forward(self, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
