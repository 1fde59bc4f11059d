"""A W8A8 blockwise FP8 GEMM for decode on Hopper, written in Gluon so that the FP32 promotion of one 128-deep
K block overlaps the tensor-core product of the next: measured in session 42, correct and slower than what the
engine runs, so a bench variant, not a chooser candidate (docs/performance.md, "Session 42").

    python bench/decode_gemm.py --batches 64 128 256 --gluon     # times it beside the engine's candidates

Same contract and arithmetic as ``fp8_gemm._w8a8_kernel`` with producer-quantized input (``QuantizedRows``):
``y = sum over K blocks kb of fma(P_kb, s_x[row, kb] * s_w[col block, kb], acc)`` in K order, where P_kb is the
FP8 product of one 128-wide K block; its output equals the Triton kernel's bit for bit at every shape measured
(``decode_gemm.py --gluon`` checks it). What differs is the schedule. In Triton (``tl.dot`` with a loop-carried
result) each iteration issues the block's ``wgmma`` and waits for it before the promotion FMAs (Triton 3.6
cannot express the overlap, session 19). Gluon exposes the asynchronous ``wgmma`` and its wait, so here
block j's product is issued, then block j - 1's awaited (``warpgroup_mma_wait(1)``) and promoted while block
j's runs.

Two ptxas findings on the way (``ptxas -v`` on the kernel's PTX): (1) a product still in flight at a loop's
back edge is a loop-carried value, which LLVM copies there (phi moves); the copy reads registers a ``wgmma``
is still writing, and ptxas then serialises every ``wgmma`` of the kernel (warning C7514), so the K loop runs
UNROLL blocks per iteration and awaits the last one outright; (2) BN 128 needs more than 255 registers per
thread here (three register tiles, the cp.async addresses, the scale vectors): spills, or serialisation for
lack of registers (C7512). Tiles stream through a ring of ``STAGES`` shared-memory buffers by ``cp.async``,
STAGES - 2 blocks ahead, with a CTA barrier per block; a TMA producer (one thread, mbarriers, no address
registers) is what a next version would try.

Split-K (``split_k > 1``) writes FP32 partials (split, M, N) as ``fp8_gemm.w8a8_partials`` does. K must be a
multiple of 128.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native.fp8_gemm import split_k_launch  # noqa: E402
from infir2_rl.engines.native.fused_ops import SplitPartials  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - CPU-only installs, or a Triton without Gluon
    _HAVE_GLUON = False


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch shape of the Gluon kernel: output tile BM x BN (BM = 16 x warps: one m16 slice per warp),
    ``split_k`` programs along K, ``stages`` shared-memory buffers (each BM x 128 + BN x 128 bytes)."""

    bm: int
    bn: int
    split_k: int
    stages: int = 4  # >= 3: STAGES - 2 blocks load while one multiplies
    unroll: int = 4  # K blocks per loop iteration: all but the last one's promotion overlap a product

    @property
    def warps(self) -> int:
        return self.bm // 16

    def __str__(self) -> str:
        return f"gluon wgmma bm{self.bm} bn{self.bn} sk{self.split_k} s{self.stages} u{self.unroll}"


def candidates(m: int) -> list[WgmmaConfig]:
    """Launch shapes timed at M rows: BM 64 (4 warps) or 128 (8 warps); BN 64-256; split-K for the narrow
    GEMMs (o_proj, down_proj: N = hidden size) whose tiles alone do not fill the GPU. None below M = 64 (the
    BM-64 tile would be mostly padding rows)."""
    if m < 64:
        return []
    out = [WgmmaConfig(64, bn, sk) for bn, sk in ((128, 1), (256, 1), (64, 4), (128, 4), (128, 8))]
    if m > 64:
        out += [WgmmaConfig(128, bn, sk) for bn, sk in ((128, 1), (64, 1), (128, 4), (64, 4), (128, 8))]
    return out


def available(device: torch.device) -> bool:
    """Gluon importable and a Hopper GPU (``wgmma`` is sm_90's instruction)."""
    return _HAVE_GLUON and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


if _HAVE_GLUON:

    @gluon.jit
    def _load_block(x_ptr, w_ptr, a_buf, b_buf, rows, cols, kk, kb, kb_end, M, N, K, stride_xm):
        """cp.async of K block kb's activation (BM x 128) and weight (BN x 128) tiles into one ring buffer,
        zero-filled past M, N and kb_end; one commit group either way."""
        ks = kb * 128 + kk
        live = kb < kb_end
        x_mask = (rows[:, None] < M) & live
        w_mask = (cols[:, None] < N) & live
        cp.async_copy_global_to_shared(
            a_buf, x_ptr + rows[:, None].to(gl.int64) * stride_xm + ks[None, :], x_mask
        )
        cp.async_copy_global_to_shared(b_buf, w_ptr + cols[:, None].to(gl.int64) * K + ks[None, :], w_mask)
        cp.commit_group()

    @gluon.jit
    def _next_block(
        x_ptr,
        w_ptr,
        a_ring,
        b_ring,
        rows,
        cols,
        kk,
        kb_start,
        kb_end,
        j,
        M,
        N,
        K,
        stride_xm,
        STAGES: gl.constexpr,
    ):
        """Before block j's product: wait until its tiles have landed (this thread's copies, then
        every thread's, at the barrier), then refill block j - 2's buffer with block j + STAGES - 2: every
        warp group waited for block j - 2's product before this barrier (it waits one block behind)."""
        cp.wait_group(STAGES - 3)
        fence_async_shared()
        gl.thread_barrier()
        nxt = j + STAGES - 2
        _load_block(
            x_ptr, w_ptr, a_ring.index(nxt % STAGES), b_ring.index(nxt % STAGES), rows, cols, kk,
            kb_start + nxt, kb_end, M, N, K, stride_xm,
        )  # fmt: skip

    @gluon.jit
    def _promote(prod, xs_ptr, ws_row, kb, kb_end, xs_rows, rows, row_ok, col_ok, acc):
        """acc + block kb's product times s_x[row] * s_w[col] in one FMA per element, cuBLASLt's promotion
        rounding as in ``fp8_gemm._w8a8_kernel``. Past kb_end (the last iteration's padding blocks) the
        scales are 0 and the product is 0: acc stays."""
        live = kb < kb_end
        s_x = gl.load(xs_ptr + kb * xs_rows + rows, mask=row_ok & live, other=0.0)
        s_w = gl.load(ws_row + kb, mask=col_ok & live, other=0.0)
        return gl.fma(prod, gl.expand_dims(s_x, 1) * gl.expand_dims(s_w, 0), acc)

    @gluon.jit
    def _wgmma_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr,
        M, N, K, KB, kb_per_split, stride_xm, xs_rows, stride_ws,
        HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32]
        )
        # cp.async layout: 16 bytes per thread, 8 threads per 128-byte row
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
        smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, 128], smem)
        b_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], smem)

        ld_rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        ld_cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
        kk = gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
        rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        row_ok = rows < M
        col_ok = cols < N
        ws_row = ws_ptr + (cols // 128) * stride_ws
        kb_start = pid_k * kb_per_split
        kb_end = gl.minimum(kb_start + kb_per_split, KB)
        nk = kb_end - kb_start

        for p in gl.static_range(STAGES - 2):  # blocks 0 .. STAGES - 3 requested; the loop requests the rest
            _load_block(
                x_ptr, w_ptr, a_ring.index(p), b_ring.index(p), ld_rows, ld_cols, kk,
                kb_start + p, kb_end, M, N, K, stride_xm,
            )  # fmt: skip
        zero = gl.zeros([BM, BN], gl.float32, layout=mma)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        # UNROLL blocks per loop iteration: block j's product is issued, then block j - 1's awaited and promoted
        # while j's runs; the last block of an iteration is awaited outright. So no product is in flight at the
        # back edge: a loop-carried tile still being written gets copied there (LLVM's phi moves), and ptxas then
        # serialises every wgmma of the kernel (its warning C7514), which loses the overlap. The last iteration
        # may run padding blocks past kb_end: zero tiles, scale 0, acc unchanged.
        for j0 in range(0, nk, UNROLL):
            _next_block(
                x_ptr, w_ptr, a_ring, b_ring, ld_rows, ld_cols, kk, kb_start, kb_end, j0, M, N, K, stride_xm, STAGES
            )  # fmt: skip
            prod = warpgroup_mma(
                a_ring.index(j0 % STAGES), b_ring.index(j0 % STAGES).permute((1, 0)), zero, use_acc=False,
                is_async=True,
            )  # fmt: skip
            for u in gl.static_range(1, UNROLL):
                j = j0 + u
                _next_block(
                    x_ptr, w_ptr, a_ring, b_ring, ld_rows, ld_cols, kk, kb_start, kb_end, j, M, N, K, stride_xm,
                    STAGES,
                )  # fmt: skip
                nxt = warpgroup_mma(
                    a_ring.index(j % STAGES), b_ring.index(j % STAGES).permute((1, 0)), zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prod,))
                acc = _promote(
                    done, xs_ptr, ws_row, kb_start + j - 1, kb_end, xs_rows, rows, row_ok, col_ok, acc
                )
                prod = nxt
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
            acc = _promote(
                done, xs_ptr, ws_row, kb_start + j0 + UNROLL - 1, kb_end, xs_rows, rows, row_ok, col_ok, acc
            )  # fmt: skip
        cp.wait_group(0)

        out_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(col_ok, 0)
        if SPLIT:
            offs = gl.expand_dims((pid_k * M + rows).to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(y_ptr + offs, acc, mask=out_mask)
        else:
            if HAS_BIAS:
                bias = gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)
                acc = acc + gl.expand_dims(bias, 0)
            offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def w8a8_partials(
    q: Tensor,
    s_t: Tensor,
    rows: int,
    w_fp8: Tensor,
    w_scale_inv: Tensor,
    bias: Tensor | None,
    cfg: WgmmaConfig,
    out_dtype: torch.dtype,
) -> Tensor | SplitPartials:
    """``quant(x) @ W^T (+ bias)`` for producer-quantized rows: q (M_pad, K) e4m3, s_t (Kb, M_pad) FP32 (the
    first ``rows`` rows are real), W (N, K) e4m3 with its 128x128 block scales. The output (rows, N) in
    ``out_dtype`` with one program along K, else the FP32 partials and the bias unsummed (``SplitPartials``)."""
    k = q.shape[1]
    if k % 128:
        raise ValueError(f"the Gluon W8A8 kernel needs K a multiple of 128, got {k}")
    if w_scale_inv.stride(1) != 1:
        w_scale_inv = w_scale_inv.contiguous()
    n = w_fp8.shape[0]
    kb = k // 128
    grid, kb_per_split, y = split_k_launch(rows, n, kb, cfg.bm, cfg.bn, cfg.split_k, out_dtype, q.device)
    _wgmma_kernel[grid](
        q, s_t, w_fp8, w_scale_inv, bias if bias is not None else w_scale_inv, y,
        rows, n, k, kb, kb_per_split, q.stride(0), s_t.shape[1], w_scale_inv.stride(0),
        HAS_BIAS=bias is not None, SPLIT=grid[2] > 1, BM=cfg.bm, BN=cfg.bn, STAGES=cfg.stages, UNROLL=cfg.unroll,
        num_warps=cfg.warps,
    )  # fmt: skip
    return y if grid[2] == 1 else SplitPartials(y, out_dtype, bias)
