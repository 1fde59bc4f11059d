"""Fused RMSNorm and SwiGLU for the torch trainer (Triton, CUDA): one kernel forward, one backward.

Why: in a 1.5B train step the elementwise work between the GEMMs ("other" in docs/performance.md) is half
the step in both precisions, and the same in BF16 and FP8. Qwen2RMSNorm is ~5 torch kernels forward and ~10
backward over the FP32 residual stream, and saves an FP32 copy of ``x * rsqrt(var)`` for its backward;
``act_fn(gate) * up`` is 2 forward and 3 backward kernels and saves ``silu(gate)`` beside gate and up. Here
each is one kernel each way; the norm saves its input (kept alive anyway: it is the residual) and one FP32
number per row, SwiGLU saves gate and up and recomputes ``silu(gate)``.

The numbers follow torch's op by op, so the change is a matter of the last bit:

* RMSNorm (Qwen2RMSNorm.forward): statistics in FP32, ``x * rsqrt(mean(x^2) + eps)`` rounded to the input's
  dtype, times the weight, output in ``promote(weight, input)`` (FP32 on the trainer's FP32 residual stream,
  as before). Only the order of the mean's FP32 sum differs. The weight gradient sums the rows' products
  in FP32 per program, then over programs (deterministic for a given shape).
* SwiGLU (Qwen2MLP with ``hidden_act: silu``): ``silu(gate)`` and the product are rounded to the activation
  dtype where torch rounds them (BF16 under autocast), and so are the gradients.

With FP8 decoder linears (``fp8/linear.py``, GPU fast path) SwiGLU also quantizes what the FP8 GEMMs around
it read: the SwiGLU kernels write h's 1x128 row tiles for down_proj (forward) and those of the gradients of
gate and up for gate_proj's and up_proj's backward, as they write h, dgate and dup; the token tiles of
dgate and dup come from ``quant_triton.quantize_cols``. Together they are ``quantize_rows_and_cols``'s codes,
scales and layouts bit for bit. The FP8 linears take them from ``fp8.ops`` (``offer_input_quantization`` /
``offer_grad_quantization``) instead of quantizing h, dgate and dup again (these three tokens x intermediate
tensors were ~73% of the FP8 step's quantization bytes at 1.5B): 1.13-1.15x faster than SwiGLU followed by
the quantizers (bench/swiglu_quant.py, docs/performance.md).

What the FP8 step keeps for backward (docs/performance.md, "FP8 keeps no copy of what its backward can remake"):

* h's token tiles (down_proj's weight-gradient operand) are not made in the forward: down_proj's backward
  makes them from gate and up (``swiglu_token_tiles``, an ``ops.TokenTilesLater``), which SwiGLU's backward
  keeps anyway, so the forward keeps no tokens x intermediate FP8 copy of h (1 byte per element: 1.9 GiB at
  1.5B and 8,192 tokens). The cost is reading gate and up (4 bytes per element) where quantizing h read 2.
* A decoder layer's RMSNorms, once linked to the FP8 linears that read them (``link_norms_to_fp8_linears``:
  q|k|v, and gate and up), write their output's row tiles as they compute it, and the readers' token tiles
  are made at backward from the norm's input, weight and inverse RMS (``rms_token_tiles``), which the norm's
  backward keeps anyway (0.66 GiB at 1.5B).
* With the quantizations in hand, the norm's output and h themselves are not written (``NormPlan.skip_output``,
  ``Fp8Plan.skip_h``): their only readers are the planned FP8 linears. The tensors are marked, and an FP8
  linear whose quantization does not match raises (``ops._quantize_input_fast``) rather than read them. Where
  a forward hook could see them (the mismatch probe's taps, ``_hooks_see_output``) they are written.

``apply_fused_layers(model)`` switches the model's Qwen2/Llama RMSNorm and MLP modules to subclasses whose
``forward`` calls these kernels, and its attention modules to subclasses whose rotary embedding runs
``fused_rope``'s kernels; parameters, names and state dicts are untouched. Off the GPU the subclasses run the
parent's torch code, so the CPU path is unchanged (``trainer.fused_kernels``, trainer.py).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from infir2_rl.fp8 import gemm, ops, quant_triton
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.graph_capture import sm_count
from infir2_rl.trainers.torch import fused_rope

try:
    import triton
    import triton.language as tl

    from infir2_rl.fp8.quant_triton import _quant_cols_store, _tile_scales, _to_e4m3

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False


def available(device: torch.device) -> bool:
    return _HAVE_TRITON and device.type == "cuda"


if _HAVE_TRITON:

    @triton.jit
    def _token_tile(M, N, BK: tl.constexpr):
        """This program's 128 tokens (program_id 0) x BK features (program_id 1) of an (M, N) tensor, for token
        tiles: pid_m, rows, cols, mask, offsets (``_row_tile``'s counterpart)."""
        pid_m = tl.program_id(0)
        rows = pid_m * 128 + tl.arange(0, 128)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        return pid_m, rows, cols, mask, rows[:, None].to(tl.int64) * N + cols[None, :]

    @triton.jit
    def _rms_apply(x, r, w, x_ptr):
        # The norm's output in FP32 from x (FP32 values of x_ptr's dtype), the rows' inverse RMS r and the
        # weight w: (x * r).to(input dtype) * weight; the caller rounds it to the output dtype.
        xr = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # hidden_states.to(input_dtype)
        return xr * w[None, :]

    @triton.jit
    def _rms_fwd_kernel(
        x_ptr, w_ptr, y_ptr, r_ptr, q_ptr, s_ptr, M, K, rows_q, inv_k, eps,
        QUANT: tl.constexpr, STORE_Y: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.arange(0, BK)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        offs = rows[:, None].to(tl.int64) * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # 1 / sqrt_rn as the engine's add_rms_norm (fused_ops.py)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) * inv_k + eps)
        w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = _rms_apply(x, r, w, x_ptr).to(y_ptr.dtype.element_ty)
        if STORE_Y:
            tl.store(y_ptr + offs, y, mask=mask)
        tl.store(r_ptr + rows, r, mask=rows < M)
        # With QUANT, y's 1x128 row tiles: quant_triton.quantize_rows's codes and layout (rows padded to rows_q)
        if QUANT:
            y3 = tl.reshape(y.to(tl.float32), (BM, BK // 128, 128))
            s = _tile_scales(y3, 2, POW2)  # (BM, BK/128)
            q = tl.reshape(_to_e4m3(y3, s[:, :, None]), (BM, BK))
            q_mask = (rows[:, None] < rows_q) & (cols[None, :] < K)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=q_mask)
            kb = tl.arange(0, BK // 128)
            s_mask = (rows[:, None] < rows_q) & (kb[None, :] * 128 < K)
            tl.store(s_ptr + kb[None, :] * rows_q + rows[:, None], s, mask=s_mask)

    @triton.jit
    def _rms_cols_kernel(
        x_ptr, w_ptr, r_ptr, qt_ptr, st_ptr, M, K, rows_qt,
        POW2: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # The norm's output made again from x, r and w (output dtype = x's), in token tiles: 128 tokens x BK
        # features per program, quant_triton.quantize_cols's arithmetic and layout. Padding rows: r = 0, y = 0.
        pid_m, rows, cols, mask, offs = _token_tile(M, K, BK)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = _rms_apply(x.to(tl.float32), r, w, x_ptr).to(x_ptr.dtype.element_ty).to(tl.float32)
        _quant_cols_store(y, rows, cols, K, rows_qt, pid_m, qt_ptr, st_ptr, POW2, 128, BK)

    @triton.jit
    def _rms_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        r_ptr,
        dx_ptr,
        dw_ptr,
        M,
        K,
        inv_k,
        rows_per_prog,
        BM: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BK)
        w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        dw = tl.zeros((BK,), tl.float32)
        start = pid * rows_per_prog
        for r0 in range(start, start + rows_per_prog, BM):
            rows = r0 + tl.arange(0, BM)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            offs = rows[:, None].to(tl.int64) * K + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
            xr = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            dw += tl.sum(dy * xr, axis=0)
            dxr = dy * w[None, :]  # the gradient reaching x * r (the rounding passes it through, as .to does)
            dot = tl.sum(dxr * x, axis=1) * inv_k
            dx = r[:, None] * dxr - x * (r * r * r * dot)[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + pid.to(tl.int64) * K + cols, dw, mask=cols < K)

    @triton.jit
    def _silu(g):
        return g / (1.0 + tl.exp(-g))

    # SwiGLU's arithmetic, shared by the plain kernels and the quantizing ones below (same bits by
    # construction). g, u, dh: FP32 values of the stored tensors; results in the output pointers' dtype.
    @triton.jit
    def _swiglu_h(g, u, h_ptr):
        s = _silu(g).to(h_ptr.dtype.element_ty).to(tl.float32)  # act_fn(gate) is a tensor of gate's dtype
        return (s * u).to(h_ptr.dtype.element_ty)

    @triton.jit
    def _swiglu_grads(dh, g, u, dg_ptr, du_ptr):
        sig = 1.0 / (1.0 + tl.exp(-g))
        s = (g * sig).to(dg_ptr.dtype.element_ty).to(tl.float32)
        ds = (dh * u).to(dg_ptr.dtype.element_ty).to(tl.float32)  # mul's backward, in the product's dtype
        dg = (ds * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty)
        return dg, (dh * s).to(du_ptr.dtype.element_ty)

    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, _swiglu_h(g, u, h_ptr), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dg, du = _swiglu_grads(dh, g, u, dg_ptr, du_ptr)
        tl.store(dg_ptr + offs, dg, mask=mask)
        tl.store(du_ptr + offs, du, mask=mask)

    # ---- SwiGLU with the FP8 row quantization of its output (forward) or of its two gradients (backward):
    # a program owns BM tokens x one 128-feature tile, so each row's 1x128 tile is complete in registers.
    # The token tiles (128 tokens per scale, stored transposed) are left to quant_triton.quantize_cols: one
    # kernel owning 128 tokens x 128 features for both ran at ~1.2 TB/s forward and far below backward
    # (bench/swiglu_quant.py, H100, docs/performance.md). Same arithmetic as quant_triton's kernels.

    @triton.jit
    def _quant_rows_store(
        v, rows, cols, N, rows_q, pid_n, q_ptr, s_ptr, POW2: tl.constexpr, BM: tl.constexpr
    ):
        s = _tile_scales(v, 1, POW2)
        q = _to_e4m3(v, s[:, None])
        q_mask = (rows[:, None] < rows_q) & (cols[None, :] < N)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=q_mask)
        tl.store(s_ptr + pid_n * rows_q + rows, s, mask=rows < rows_q)

    @triton.jit
    def _row_tile(M, N, pid_n, BM: tl.constexpr):
        """This program's BM tokens x 128 features (tile pid_n) of an (M, N) tensor: rows, cols, mask, offsets."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = pid_n * 128 + tl.arange(0, 128)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        return rows, cols, mask, rows[:, None].to(tl.int64) * N + cols[None, :]

    @triton.jit
    def _swiglu_fwd_rows_kernel(
        g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, M, N, rows_q,
        STORE_H: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(1)
        rows, cols, mask, offs = _row_tile(M, N, pid_n, BM)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = _swiglu_h(g, u, h_ptr)
        if STORE_H:
            tl.store(h_ptr + offs, h, mask=mask)
        _quant_rows_store(h.to(tl.float32), rows, cols, N, rows_q, pid_n, q_ptr, s_ptr, POW2, BM)

    @triton.jit
    def _swiglu_bwd_rows_kernel(
        dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, M, N, rows_q,
        POW2: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(1)
        rows, cols, mask, offs = _row_tile(M, N, pid_n, BM)
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dg, du = _swiglu_grads(dh, g, u, dg_ptr, du_ptr)
        tl.store(dg_ptr + offs, dg, mask=mask)
        tl.store(du_ptr + offs, du, mask=mask)
        _quant_rows_store(dg.to(tl.float32), rows, cols, N, rows_q, pid_n, gq_ptr, gs_ptr, POW2, BM)
        _quant_rows_store(du.to(tl.float32), rows, cols, N, rows_q, pid_n, uq_ptr, us_ptr, POW2, BM)

    @triton.jit
    def _swiglu_cols_kernel(
        g_ptr, u_ptr, qt_ptr, st_ptr, M, N, rows_qt,
        POW2: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # h's token tiles from gate and up: 128 tokens x BK features per program, h rounded as the forward
        # stored it (_swiglu_h), then quant_triton.quantize_cols's arithmetic and layout.
        pid_m, rows, cols, mask, offs = _token_tile(M, N, BK)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = _swiglu_h(g, u, g_ptr).to(tl.float32)  # h has gate's dtype; padding rows give h = 0
        _quant_cols_store(h, rows, cols, N, rows_qt, pid_m, qt_ptr, st_ptr, POW2, 128, BK)


def _token_tiles(
    kernel: Any, m: int, k: int, device: torch.device, pow2: bool, *args: Any
) -> tuple[Tensor, Tensor]:
    """Launch a kernel that makes an (m, k) tensor's token tiles (``_token_tile`` programs, ending in
    ``quant_triton._quant_cols_store``) from ``args``: ``quant_triton.quantize_cols``'s (qt, st) layout."""
    rows_qt = -(-m // 128) * 128
    qt = torch.empty((k, rows_qt), dtype=torch.float8_e4m3fn, device=device)
    st = torch.empty((rows_qt // 128, k), dtype=torch.float32, device=device)
    cfg = quant_triton.LAUNCH["cols"]
    if m:
        kernel[(rows_qt // 128, triton.cdiv(k, cfg["bk"]))](
            *args, qt, st, m, k, rows_qt, POW2=pow2, BK=cfg["bk"], num_warps=cfg["warps"]
        )
    return qt, st


def swiglu_token_tiles(gate: Tensor, up: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """``quant_triton.quantize_cols(silu(gate) * up, pow2)`` bit for bit, from gate and up without h: the
    fused SwiGLU's h token tiles made at down_proj's backward (``ops.TokenTilesLater``) instead of kept from
    the forward. Reads gate and up (4 bytes per element) where quantizing a kept h read 2, and keeps 1 byte
    per element out of the saved activations (module docstring)."""
    k = gate.shape[-1]
    g2, u2 = gate.reshape(-1, k), up.reshape(-1, k)
    return _token_tiles(_swiglu_cols_kernel, g2.shape[0], k, gate.device, pow2, g2, u2)


def rms_token_tiles(x2d: Tensor, weight: Tensor, r: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """``quant_triton.quantize_cols(y, pow2)`` bit for bit for the fused RMSNorm's output y = norm(x2d) of
    x2d's dtype, from the input, weight and inverse RMS that the norm's backward keeps (``ops.TokenTilesLater``:
    the FP8 linears after the norm keep no FP8 copy of y)."""
    m, k = x2d.shape
    return _token_tiles(_rms_cols_kernel, m, k, x2d.device, pow2, x2d, weight, r)


def _rms_launch(k: int) -> tuple[int, int, int]:
    """(BK, BM, warps): a row fits one program's registers whole; ~8K elements per program."""
    bk = triton.next_power_of_2(k)
    bm = max(1, min(16, 8192 // bk))
    return bk, bm, 8 if bk >= 4096 else 4


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, eps: float, plan: NormPlan | None, handoff: list[Any]
    ) -> Tensor:
        """With ``plan`` (output dtype = x's), y's quantization for the FP8 linears after the norm goes to
        ``handoff``: row tiles, and with ``plan.cols`` a ``TokenTilesLater`` for their backward."""
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        m = x2d.shape[0]
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty((m, k), dtype=out_dtype, device=x.device)
        r = torch.empty((m,), dtype=torch.float32, device=x.device)
        bk, bm, warps = _rms_launch(k)
        quant = plan is not None and m > 0
        if quant:
            bk = max(bk, 128)  # whole 128-wide tiles in registers (a row narrower than a tile is zero-padded)
        rows_q = -(-m // 16) * 16 if quant else 0
        q = torch.empty((rows_q, k), dtype=torch.float8_e4m3fn, device=x.device) if quant else y
        s_t = torch.empty((-(-k // 128), rows_q), dtype=torch.float32, device=x.device) if quant else r
        if m:
            _rms_fwd_kernel[(triton.cdiv(max(m, rows_q), bm),)](
                x2d, weight, y, r, q, s_t, m, k, rows_q, 1.0 / k, eps, QUANT=quant,
                STORE_Y=not (quant and plan is not None and plan.skip_output),
                POW2=plan is not None and plan.pow2, BM=bm, BK=bk, num_warps=warps,
            )  # fmt: skip
        if quant:
            assert plan is not None and out_dtype == x.dtype
            later = None
            if plan.cols:
                later = ops.TokenTilesLater(
                    functools.partial(rms_token_tiles, pow2=plan.pow2), (x2d, weight, r)
                )
            handoff.append((q, s_t, later, None))
        ctx.save_for_backward(x2d, weight, r)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*x.shape[:-1], k)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:  # type: ignore[override]
        x2d, weight, r = ctx.saved_tensors
        dx, dw = _rms_backward(dy, x2d, weight, r, ctx.x_dtype, ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dw, None, None, None


def _rms_backward(
    dy: Tensor, x2d: Tensor, weight: Tensor, r: Tensor, x_dtype: torch.dtype, need_dw: bool
) -> tuple[Tensor, Tensor | None]:
    """(dx (M, K) in x_dtype, dw or None) of ``weight * (x * r).to(x_dtype)`` for rows x2d (M, K), r (M,) FP32."""
    m, k = x2d.shape
    dy2d = dy.reshape(-1, k).contiguous()
    dx = torch.empty((m, k), dtype=x_dtype, device=x2d.device)
    if m == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    bk, bm, warps = _rms_launch(k)
    # A fixed number of programs per GPU (each loops over its rows and keeps one FP32 partial of dw),
    # so dw sums the same partials in the same order for a given shape.
    progs = min(triton.cdiv(m, bm), 4 * sm_count(x2d.device))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs), bm) * bm
    progs = triton.cdiv(m, rows_per_prog)
    partial = torch.empty((progs, k), dtype=torch.float32, device=x2d.device)
    _rms_bwd_kernel[(progs,)](
        dy2d, x2d, weight, r, dx, partial, m, k, 1.0 / k, rows_per_prog, BM=bm, BK=bk, num_warps=warps
    )
    return dx, partial.sum(0).to(weight.dtype) if need_dw else None


def rms_norm_grads(dy: Tensor, x2d: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dw) of Qwen2RMSNorm over rows x2d (M, K) for the output gradient dy, by this module's backward kernel
    (CUDA), the reciprocal RMS of each row recomputed in FP32: for a forward whose kernel kept no statistics
    (the true_on_policy walk's norm, ``models/invariant_ops.rms_norm``)."""
    x2d = x2d.contiguous()
    r = torch.rsqrt(x2d.float().square().mean(-1) + eps)
    dx, dw = _rms_backward(dy, x2d, weight, r, x2d.dtype, True)
    assert dw is not None
    return dx, dw


_SWIGLU_BLOCK = 2048


class Fp8Plan(NamedTuple):
    """What the fused SwiGLU quantizes for FP8 neighbours (``_fp8_plan``)."""

    pow2: bool  # power-of-two scales, as the FP8 linears use
    h: bool  # h in 1x128 row tiles, for down_proj's forward
    h_cols: bool  # h also in token tiles, for down_proj's weight gradient
    grads: bool  # dgate and dup in both tilings, for gate_proj's and up_proj's backward
    skip_h: bool = False  # h itself left unwritten: its one reader, down_proj, takes the quantization


# Tokens per program of the quantizing SwiGLU kernels, and their warps (bench/swiglu_quant.py).
QUANT_LAUNCH: dict[str, int] = {"bm": 16, "warps": 8}


def _rows_quantized(
    kernel: Any, n_out: int, m: int, n: int, device: torch.device, pow2: bool, *args: Any, **flags: bool
) -> list[tuple[Tensor, Tensor]]:
    """Launch a quantizing SwiGLU kernel that quantizes ``n_out`` of its outputs; returns their
    (q (M_16, N), s_t (Nb, M_16)) pairs, the layout of quant_triton.quantize_rows (rows padded to 16 with
    zero codes and scale 1)."""
    rows_q = -(-m // 16) * 16
    pairs = [
        (
            torch.empty((rows_q, n), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((-(-n // 128), rows_q), dtype=torch.float32, device=device),
        )
        for _ in range(n_out)
    ]
    bm = QUANT_LAUNCH["bm"]
    kernel[(triton.cdiv(rows_q, bm), triton.cdiv(n, 128))](
        *args, *(t for pair in pairs for t in pair), m, n, rows_q, POW2=pow2, BM=bm, **flags,
        num_warps=QUANT_LAUNCH["warps"],
    )  # fmt: skip
    return pairs


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, gate: Tensor, up: Tensor, plan: Fp8Plan | None, handoff: list[Any]
    ) -> Tensor:
        """h's quantization (``plan.h``) goes to ``handoff``: the caller offers it with the returned tensor."""
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"swiglu: gate {gate.dtype} {tuple(gate.shape)} vs up {up.dtype} {tuple(up.shape)}"
            )
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        n = gate.numel()
        ctx.plan = plan
        if n and plan is not None and plan.h:
            k = gate.shape[-1]
            ((q, s_t),) = _rows_quantized(
                _swiglu_fwd_rows_kernel, 1, n // k, k, h.device, plan.pow2, gate, up, h,
                STORE_H=not plan.skip_h,
            )  # fmt: skip
            # (grad mode is off inside forward: the plan says whether down_proj's backward will want h's
            # token tiles.) They are made there from gate and up, which this backward keeps anyway.
            later = None
            if plan.h_cols:
                later = ops.TokenTilesLater(functools.partial(swiglu_token_tiles, pow2=plan.pow2), (gate, up))
            handoff.append((q, s_t, later, None))
        elif n:
            _swiglu_fwd_kernel[(triton.cdiv(n, _SWIGLU_BLOCK),)](
                gate, up, h, n, BLOCK=_SWIGLU_BLOCK, num_warps=8
            )
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx: Any, dh: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        n = gate.numel()
        plan = ctx.plan
        if not (n and plan is not None and plan.grads):
            return (*swiglu_grads(dh, gate, up), None, None)
        dh = dh.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        k = gate.shape[-1]
        rows = _rows_quantized(
            _swiglu_bwd_rows_kernel, 2, n // k, k, dh.device, plan.pow2, dh, gate, up, dg, du
        )
        for grad, (q, s_t) in zip((dg, du), rows, strict=True):
            ops.offer_grad_quantization(
                grad, plan.pow2, (q, s_t, *quant_triton.quantize_cols(grad.view(-1, k), plan.pow2))
            )
        return dg, du, None, None


def swiglu_grads(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) of ``silu(gate) * up`` for the output gradient dh, by this module's backward kernel (CUDA;
    the true_on_policy walk's SiLU*up backward, ``models/invariant_ops.silu_mul``)."""
    gate, up, dh = gate.contiguous(), up.contiguous(), dh.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, _SWIGLU_BLOCK),)](
            dh, gate, up, dg, du, n, BLOCK=_SWIGLU_BLOCK, num_warps=8
        )
    return dg, du


class NormPlan(NamedTuple):
    """What the fused RMSNorm quantizes for the FP8 linears after it (``_norm_plan``)."""

    pow2: bool  # power-of-two scales, as those linears use
    cols: bool  # token tiles too (a TokenTilesLater), for their weight gradients
    skip_output: bool = False  # the output itself left unwritten: its readers take the quantization


def rms_norm(x: Tensor, weight: Tensor, eps: float, plan: NormPlan | None = None) -> Tensor:
    """Qwen2RMSNorm's forward, differentiable (CUDA tensors; elsewhere the module keeps torch's code).

    ``plan``: quantize the output for FP8 linears (``_norm_plan``; the output must have x's dtype)."""
    handoff: list[Any] = []
    out = _RMSNormFn.apply(x, weight, eps, plan, handoff)
    assert isinstance(out, Tensor)
    if handoff:
        assert plan is not None
        ops.offer_input_quantization(out, plan.pow2, handoff[0], unwritten=plan.skip_output)
    return out


def swiglu(gate: Tensor, up: Tensor, plan: Fp8Plan | None = None) -> Tensor:
    """``silu(gate) * up``, differentiable (CUDA tensors; elsewhere the module keeps torch's code).

    ``plan``: what to quantize for FP8 neighbours (module docstring, ``_fp8_plan``)."""
    handoff: list[Any] = []
    out = _SwiGLUFn.apply(gate, up, plan, handoff)
    assert isinstance(out, Tensor)
    if handoff:
        assert plan is not None
        ops.offer_input_quantization(out, plan.pow2, handoff[0], unwritten=plan.skip_h)
    return out


def _fp8_fast(linear: nn.Module, x: Tensor) -> bool:
    return (
        type(linear) is Fp8Linear
        and linear.fp8_enabled
        and gemm.fast_path_ok(x, linear.out_features, linear.in_features)
    )


def _fp8_plan(mlp: Any, x: Tensor) -> Fp8Plan | None:
    """What to quantize when the MLP's linears are FP8 linears on the GPU fast path (h for down_proj, the
    gradients for gate_proj and up_proj), else None. One pow2 setting for all."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    grad = torch.is_grad_enabled()
    quant_h = _fp8_fast(down, x)
    quant_grads = grad and _fp8_fast(gate, x) and _fp8_fast(up, x)
    pow2 = {m.pow2_scales for m, on in ((down, quant_h), (gate, quant_grads), (up, quant_grads)) if on}
    if len(pow2) != 1:  # nothing to quantize, or mixed settings (never made by swap_to_fp8_training)
        return None
    h_cols = quant_h and grad and down.weight.requires_grad
    skip_h = quant_h and not _hooks_see_output(mlp, [down])  # h is down_proj's input
    return Fp8Plan(pow2.pop(), quant_h, h_cols, quant_grads, skip_h=skip_h)


# ---------------------------------------------------------------------------------------------- model swap
_FUSED_CLASSES: dict[type, type] = {}
_NORM_CLASSES = ("Qwen2RMSNorm", "LlamaRMSNorm")
_MLP_CLASSES = ("Qwen2MLP", "LlamaMLP")
_ATTENTION_CLASSES = ("Qwen2Attention", "LlamaAttention")  # their rotary embedding: fused_rope.py


def _norm_plan(norm: Any, x: Tensor) -> NormPlan | None:
    """A NormPlan when every linear that reads the norm's output (``link_norms_to_fp8_linears``) is an FP8
    linear on the GPU fast path with one pow2 setting, and they quantize the output's own values (output
    dtype = x's = the autocast dtype, if autocast is on); else None."""
    linears = getattr(norm, "_fp8_readers", None)
    if not linears or not all(_fp8_fast(m, x) for m in linears):
        return None
    out_dtype = torch.promote_types(norm.weight.dtype, x.dtype)
    device = x.device.type
    if out_dtype != x.dtype or (
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != out_dtype
    ):
        return None
    pow2 = {m.pow2_scales for m in linears}
    if len(pow2) != 1:
        return None
    grad = torch.is_grad_enabled() and any(m.weight.requires_grad for m in linears)
    return NormPlan(pow2.pop(), grad, skip_output=not _hooks_see_output(norm, linears))


def _hooks_see_output(producer: nn.Module, readers: list[nn.Module]) -> bool:
    """True when a forward hook could read the producer's output: the producer's forward hooks, a reader's
    forward pre-hooks, or global module hooks (the mismatch probe records module outputs so). The output is
    then written, though its planned readers only take its quantization."""
    from torch.nn.modules import module as module_hooks

    return bool(
        producer._forward_hooks
        or any(m._forward_pre_hooks for m in readers)
        or module_hooks._global_forward_hooks
        or module_hooks._global_forward_pre_hooks
    )


def _fused_norm_forward(self: Any, hidden_states: Tensor) -> Tensor:
    if not available(hidden_states.device):
        return super(type(self), self).forward(hidden_states)  # type: ignore[misc]
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, _norm_plan(self, hidden_states))


# A decoder layer's norms and the linears that read their outputs (Qwen2 / Llama).
_NORM_READERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def link_norms_to_fp8_linears(model: nn.Module) -> int:
    """Tell each fused RMSNorm of a Qwen2/Llama decoder layer which FP8 linears read its output, so that it
    quantizes the output for them (row tiles as it writes it; token tiles made at their backward from what
    the norm keeps anyway: module docstring). Returns how many norms were linked; a layer whose readers are
    not all ``Fp8Linear``s is left alone. Call after ``apply_fused_layers`` and the FP8 swap."""
    count = 0
    for layer in model.modules():
        for norm_name, reader_names in _NORM_READERS.items():
            norm = getattr(layer, norm_name, None)
            if norm is None or type(norm).forward is not _fused_norm_forward:
                continue
            readers = [layer.get_submodule(n) if _has_submodule(layer, n) else None for n in reader_names]
            if all(type(m) is Fp8Linear for m in readers):
                norm._fp8_readers = readers
                count += 1
    return count


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _fused_mlp_forward(self: Any, x: Tensor) -> Tensor:
    if not available(x.device):
        return super(type(self), self).forward(x)  # type: ignore[misc]
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), _fp8_plan(self, x)))


def _fused_subclass(cls: type, forward: Any) -> type:
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(
            f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__}
        )
    return _FUSED_CLASSES[cls]


def _mlp_is_swiglu(module: nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    has_bias = any(
        getattr(getattr(module, n, None), "bias", None) is not None for n in ("gate_proj", "up_proj")
    )
    return act in ("silu", "swish") and not getattr(module, "mlp_bias", False) and not has_bias


_COUNT_OF_FORWARD = {
    _fused_norm_forward: "rms_norm",
    _fused_mlp_forward: "swiglu_mlp",
    fused_rope.fused_attention_forward: "rope_attention",
}


def apply_fused_layers(model: nn.Module) -> dict[str, int]:
    """Switch the model's RMSNorm and SwiGLU MLP modules to the fused kernels, and its attention modules'
    rotary embedding to ``fused_rope``'s; returns how many of each.

    Only the exact classes named in ``_NORM_CLASSES`` / ``_MLP_CLASSES`` / ``_ATTENTION_CLASSES`` are switched
    (a subclass or another architecture's norm, such as Gemma's ``1 + weight``, may compute something else).
    """
    counts = {"rms_norm": 0, "swiglu_mlp": 0, "rope_attention": 0}
    for module in model.modules():
        cls = type(module)
        if cls in _FUSED_CLASSES.values():  # switched already
            counts[_COUNT_OF_FORWARD[cls.forward]] += 1
        elif cls.__name__ in _ATTENTION_CLASSES and fused_rope.install(sys.modules[cls.__module__]):
            module.__class__ = _fused_subclass(cls, fused_rope.fused_attention_forward)
            counts["rope_attention"] += 1
        elif cls.__name__ in _NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.__class__ = _fused_subclass(cls, _fused_norm_forward)
            counts["rms_norm"] += 1
        elif cls.__name__ in _MLP_CLASSES and _mlp_is_swiglu(module):
            module.__class__ = _fused_subclass(cls, _fused_mlp_forward)
            counts["swiglu_mlp"] += 1
    return counts
