"""Triton kernels for ``token_scores``' chunks on CUDA: one pass over a chunk's logits each way.

Shapes: C tokens in the chunk, V vocabulary; z (C, V) is the lm_head GEMM's output in the compute dtype.

The plain chunk (``token_scores._plain_chunk`` and its backward) runs torch ops over FP32 copies of the
logits: forward cast, divide, log-sum-exp (max, subtract, exp, sum) and, for the entropy, log-softmax and
exp again; backward cast, divide, subtract, exp, multiply, scatter, divide, cast. At C = 2,048 and V =
151,936 that is ~10 GB of memory traffic per chunk each way. Here:

* ``scores_`` (forward): one program per token streams its row of z once, keeping per lane the running
  max m, sum s = sum e^(z - m) and t = sum e^(z - m) (z - m), rescaled when m grows. Then lse = m + log s,
  log p(y) = z_y - lse and the entropy H = log s - t / s: both terms are >= 0 in these shifted units
  (t <= 0), so nothing cancels on peaked rows (the plain path takes log-softmax for the same reason).
* ``grad_logits_`` (backward): elementwise over z, in place: p = exp(z - lse) and
  g = onehot(y) g_logp - p (g_logp + g_H (log p + H)), divided by T, rounded to z's dtype; the same
  operations in the same order as the plain backward, so only exp's last bits and the sums' order differ.

z = logits.float() / T with IEEE division, as torch divides. GPU test: tests/test_token_scores_gpu.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

_BLOCK = 2048  # forward: one row's z streamed in blocks of this many (8 warps: 8 values per thread)
_GRAD_BLOCK = 1024  # backward: the block of one row per program (4 warps: 8 values per thread)


def available(device: torch.device) -> bool:
    return _HAVE_TRITON and device.type == "cuda"


if _HAVE_TRITON:

    @triton.jit
    def _tempered(z_ptr, idx, mask, temp, HAS_T: tl.constexpr):
        z = tl.load(z_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_T:
            z = tl.math.div_rn(z, temp)
        return z

    @triton.jit
    def _scores_kernel(
        z_ptr, y_ptr, logp_ptr, lse_ptr, ent_ptr, V, stride, temp,
        HAS_T: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        t = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            z = _tempered(base, idx, idx < V, temp, HAS_T)
            m_new = tl.maximum(m, z)
            live = m_new > float("-inf")
            a = tl.where(live, tl.exp(m - m_new), 0.0)
            e = tl.where(live, tl.exp(z - m_new), 0.0)
            if ENTROPY:
                shift = tl.where(m > float("-inf"), m - m_new, 0.0)  # s is 0 while m is -inf
                t = a * (t + shift * s) + tl.where(e > 0.0, e * (z - m_new), 0.0)
            s = a * s + e
            m = m_new
        big = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)
        total = tl.sum(s * w, axis=0)
        lse = big + tl.log(total)
        z_y = tl.load(base + tl.load(y_ptr + row)).to(tl.float32)
        if HAS_T:
            z_y = tl.math.div_rn(z_y, temp)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, z_y - lse)
        if ENTROPY:
            t_all = tl.sum(w * (t + tl.where(m > float("-inf"), m - big, 0.0) * s), axis=0)
            tl.store(ent_ptr + row, tl.log(total) - t_all / total)

    @triton.jit
    def _grad_kernel(
        z_ptr, y_ptr, lse_ptr, gl_ptr, ent_ptr, ge_ptr, V, stride, temp,
        HAS_T: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, blk = tl.program_id(0), tl.program_id(1)
        base = z_ptr + row.to(tl.int64) * stride
        idx = blk * BLOCK + tl.arange(0, BLOCK)
        mask = idx < V
        lp = _tempered(base, idx, mask, temp, HAS_T) - tl.load(lse_ptr + row)
        gl = tl.load(gl_ptr + row)
        p = tl.exp(lp)
        if ENTROPY:
            g = -(((lp + tl.load(ent_ptr + row)) * tl.load(ge_ptr + row) + gl) * p)
        else:
            g = p * -gl
        g = tl.where(idx == tl.load(y_ptr + row), g + gl, g)
        if HAS_T:
            g = tl.math.div_rn(g, temp)
        tl.store(base + idx, g.to(z_ptr.dtype.element_ty), mask=mask)


def scores_(
    z_CV: Tensor,
    targets_C: Tensor,
    temperature: float,
    logp_C: Tensor,
    lse_C: Tensor,
    entropy_C: Tensor | None,
) -> None:
    """Fill ``logp_C``, ``lse_C`` (and ``entropy_C``) FP32 from the chunk's logits ``z_CV`` (module docstring)."""
    rows, vocab = z_CV.shape
    if rows == 0:
        return
    assert z_CV.stride(1) == 1
    ent = entropy_C if entropy_C is not None else lse_C
    _scores_kernel[(rows,)](
        z_CV, targets_C, logp_C, lse_C, ent, vocab, z_CV.stride(0), float(temperature),
        HAS_T=temperature != 1.0, ENTROPY=entropy_C is not None, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip


def grad_logits_(
    z_CV: Tensor,
    targets_C: Tensor,
    temperature: float,
    lse_C: Tensor,
    g_logp_C: Tensor,
    entropy_C: Tensor | None = None,
    g_entropy_C: Tensor | None = None,
) -> Tensor:
    """Overwrite the chunk's logits ``z_CV`` with d loss / d logits (module docstring); returns ``z_CV``.
    ``g_logp_C`` / ``g_entropy_C`` FP32; the entropy terms only when both entropy tensors are given."""
    rows, vocab = z_CV.shape
    if rows == 0:
        return z_CV
    assert z_CV.is_contiguous()
    entropy = entropy_C is not None and g_entropy_C is not None
    _grad_kernel[(rows, triton.cdiv(vocab, _GRAD_BLOCK))](
        z_CV, targets_C, lse_C, g_logp_C, entropy_C if entropy else lse_C, g_entropy_C if entropy else lse_C,
        vocab, z_CV.stride(0), float(temperature),
        HAS_T=temperature != 1.0, ENTROPY=entropy, BLOCK=_GRAD_BLOCK, num_warps=4,
    )  # fmt: skip
    return z_CV
