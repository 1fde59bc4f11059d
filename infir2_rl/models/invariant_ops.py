"""Batch-invariant ops for true on-policy RL: a token's numbers never depend on what it is batched with.

Why: under ``true_on_policy`` the trainer's log-prob of every sampled token must equal, bit for bit, the
one the rollout engine reported, yet the two run different batches: the trainer scores whole sequences
(thousands of rows per GEMM, attention over a causal block), the engine decodes one token per row against
a KV cache. Fast kernels choose tiles, split-K and attention splits by shape, so the same token's FP32 sums
run in another order and its last bits differ; FP8 quantizers then turn those bits into whole e4m3 steps
(docs/mismatch.md). Each op here computes a row (a token) with one instruction sequence whatever the
number of rows:

* ``mm`` (BF16) and ``fp8_mm`` (the trainer's 1x128 activation quantizer, then a W8A8 blockwise GEMM): cuBLAS
  (cuBLASLt's blockwise FP8 for ``fp8_mm``) for every shape that ``plan`` found to give a row the same bits at
  every M, small batches padded to the rows from which it does (it splits K below them); the Triton kernels
  below for any other shape: no split-K, the bias added in FP32 before the single rounding, the tile shape
  following M only among shapes measured to give the same bits (``MM_TILES``, ``FP8_CONFIGS``; the W8A8
  kernel is the engine's, ``engines/native/fp8_gemm``). An FP8 shape with a long K and few output tiles
  (``_split_wanted``; at 1.5B: down_proj, K 8,960) runs as ``SPLIT_CHUNKS`` fixed K chunks, each chained from 0, their
  FP32 results added in chunk order and rounded once: a split fixed by K alone is batch-invariant too. Decode
  batches run the engine's split-K Triton launch (whose consumer kernel sums the partials), larger ones
  cuBLASLt per chunk, each chunk added into one FP32 output by the GEMM's epilogue (``_split_gemm``).
* ``attention``: one program per (token, KV head); the token's G query heads (padded to 16 rows) walk its
  keys from position 0 in fixed blocks of ``ATTN_BLOCK`` with an online softmax. A decode row and the same
  position of a full-sequence forward run the same loop; only where keys and values are read from differs
  (a cache slot or a sequence's own tensor). A fully masked block is an exact no-op (alpha 1, p 0), so a
  row's result does not depend on how far its neighbours' loops run. Its pipeline depth follows the grid's
  size (``ATTN_STAGES_RESIDENT``), which moves loads and changes no bit. Whole sequences (the trainer's walk,
  the engine's prefill: ``causal_rows``) give a program several consecutive tokens, their query heads
  stacked in the rows of the same products, so each K/V block is loaded once for them; a row's arithmetic
  is the one-token program's.
* ``rms_norm``, ``silu_mul``: the engine's decode kernels (``engines/native/fused_ops``), one program per
  row, so the trainer's values are the engine's by construction. ``rope``: the trainer's rotary kernel
  (``trainers/torch/fused_rope``), whose arithmetic is the engine's rotary kernel's (both ``_rotated``: each
  product rounded, then the sum, without FMA contraction).
* ``token_logprobs``: the sampler's chunked log-sum-exp (``engines/native/sampler``: chunks depend on the
  vocabulary size only) and its ``z / T`` with IEEE division.
Residual adds are elementwise torch ops, invariant as they are (the fused add of the engine's norm kernel
rounds as torch's add does).

Backward (the trainer's): ``mm``, ``attention``, ``rms_norm``, ``rope`` and ``silu_mul`` are autograd Functions
whose backward is plain torch math (cuBLAS matmuls, SDPA recomputed), except RMSNorm, SiLU*up and the rotary
embedding, which on CUDA take the torch trainer's fused backward kernels (``trainers/torch/fused_layers`` and
``fused_rope``, imported where used: the engine's prefill runs this walk's forward without a trainer), and
``mm``'s weight gradient, which goes into the FP32 master's gradient inside the GEMM where the weight names one
(``_Mm``). Gradients need not match anything bit for bit: only the forward values enter the policy ratio.

CPU (tests): the same functions fall back to their torch references (``F.linear``, masked SDPA, the torch
RMSNorm, FP8 emulation), so the model walk of ``invariant.py`` runs in CPU tests; bit equality between
trainer and engine is a promise of the CUDA kernels only (tests/test_true_on_policy_gpu.py), and the
trainer and engine refuse ``true_on_policy`` without them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from infir2_rl.engines.native import fp8_gemm, fused_ops, sampler
from infir2_rl.fp8 import cublaslt, quant_triton
from infir2_rl.fp8 import gemm as cublas_gemm
from infir2_rl.fp8.ops import fp8_linear_forward, gradient_target
from infir2_rl.graph_capture import cold_copies, sm_count, time_in_graph

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

# Launch shapes. What makes a row's result independent of M is the per-element arithmetic: the K steps in
# order from 0 (no split-K) on one kind of tensor-core instruction. bench/invariant_gemm.py measured (H100,
# 2026-11-24) that every BF16 tile shape tried (BM 16..128, BN 32..256, BK 32..128) gives the same bits, and
# every FP8 shape with BM >= 64 (wgmma) does, with the activation quantized inside the kernel or before it;
# BM 16 FP8 (mma.sync) does not. So the shape may follow M (small tiles for decode, large for the
# trainer), but FP8 never goes below BM 64, and tests/test_true_on_policy_gpu.py checks rows across the
# switch.
MM_SMALL_M = 256  # BF16: up to this many rows the decode shape, above it the trainer's
MM_TILES = {"small": ((64, 64, 128), 4, 3), "large": ((128, 128, 64), 8, 3)}  # (BM, BN, BK), warps, stages
# FP8: the activation quantized first (quant_triton.quantize_rows, the trainer's 1x128 rule), then the W8A8
# kernel: re-quantizing inside every N tile cost 3x at M = 256 for down_proj (K 8960) and 6x at M = 4096.
FP8_CONFIGS = {"small": fp8_gemm.GemmConfig(64, 64, 1, 4, 3), "large": fp8_gemm.GemmConfig(64, 128, 1, 4, 3)}
ATTN_ROWS = 16  # query rows per attention program: the G heads of one KV head, padded
ATTN_BLOCK = 64  # keys per step of the attention loop
# Whole sequences (the trainer's walk, the engine's prefill): consecutive tokens per program share each K/V
# block's load, their query heads stacked into this many rows of the products (``causal_rows``). 32 rows and 4
# warps keep the one-token kernel's bits; 64 rows did not (bench/walk_attention.py, H200, session 60).
ATTN_TILE_ROWS = 32
# The attention kernel's pipeline depth. Three stages (Triton's default) take ~70 KB of shared memory per program,
# so three programs fit an SM of Hopper; two stages take less and fit five (then registers limit it). A grid
# larger than three programs per SM (decode batch 256 at 1.5B: 512 programs) runs in one wave at two stages
# instead of two waves at three: 12.8 against 16.9 us at 256 rows x 192 keys, 484 against 553 at 8,192 keys;
# smaller grids keep three, which hides a lone program's latency better (64 rows x 4,096 keys: 70 against 111
# us). The depth does not change a bit (it only moves loads earlier): bench/producer_kernels.py, H200,
# docs/mismatch.md (session 53); tests/test_true_on_policy_gpu.py.
ATTN_STAGES_RESIDENT = 3  # programs per SM at Triton's default depth


def kernels_available(device: torch.device) -> bool:
    """Whether the bit-for-bit kernels run on ``device`` (CUDA with Triton)."""
    return _HAVE_TRITON and device.type == "cuda"


if _HAVE_TRITON:
    from infir2_rl.fp8.quant_triton import _tile_scales, _to_e4m3  # the trainer's 1x128 rule

    @triton.jit(do_not_specialize=["M"])
    def _mm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + kk
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )
            acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(
            y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _attend(q, k_base, v_base, sk_t, sv_t, n, n_row, sm_scale, D: tl.constexpr, BLOCK: tl.constexpr):
        """q's rows (R, D) over keys 0..n-1 of one sequence and KV head, in blocks of BLOCK from key 0 with an
        online softmax; row i sees keys below n_row[i], the rest -inf (a fully masked block is an exact no-op:
        alpha 1, p 0). The (R, D) output in FP32, normalized."""
        d = tl.arange(0, D)
        offs = tl.arange(0, BLOCK)
        m_i = tl.full(n_row.shape, float("-inf"), tl.float32)
        l_i = tl.zeros(n_row.shape, tl.float32)
        acc = tl.zeros(q.shape, tl.float32)
        for start in range(0, n, BLOCK):
            t = start + offs
            tm = t < n
            k = tl.load(k_base + t[:, None].to(tl.int64) * sk_t + d[None, :], mask=tm[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            s = tl.where(t[None, :] < n_row[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + t[:, None].to(tl.int64) * sv_t + d[None, :], mask=tm[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc / l_i[:, None]

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, len_ptr, codes_ptr, scales_ptr, R, rows_pad, sc_r,
        sq_r, sq_h, sk_s, sk_h, sk_t, sv_s, sv_h, sv_t, so_r, so_h, sm_scale,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
        POW2: tl.constexpr,
    ):  # fmt: skip
        r, kvh = tl.program_id(0), tl.program_id(1)
        valid = r < R  # QUANT: programs R..rows_pad-1 write the padding rows (codes 0, scale 1)
        seq = tl.load(seq_ptr + r, mask=valid, other=0).to(tl.int64)
        n = tl.load(len_ptr + r, mask=valid, other=0)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * G + g
        qm = (g < G)[:, None]
        q = tl.load(
            q_ptr + r.to(tl.int64) * sq_r + heads[:, None] * sq_h + d[None, :], mask=qm & valid, other=0.0
        )
        k_base = k_ptr + seq * sk_s + kvh * sk_h
        v_base = v_ptr + seq * sv_s + kvh * sv_h
        n_row = tl.full((GP,), n, tl.int32)
        out = _attend(q, k_base, v_base, sk_t, sv_t, n, n_row, sm_scale, D, BLOCK).to(o_ptr.dtype.element_ty)
        if QUANT:  # D == 128: head h of row r is tile h of o_proj's input row, quantized from the rounded out
            y = tl.where(valid, out.to(tl.float32), 0.0)  # (padding rows: 0/0 above)
            tile_scale = _tile_scales(y, 1, POW2)
            codes = _to_e4m3(y, tile_scale[:, None])
            tl.store(codes_ptr + r.to(tl.int64) * sc_r + heads[:, None] * D + d[None, :], codes, mask=qm)
            tl.store(scales_ptr + heads * rows_pad + r, tile_scale, mask=g < G)
        else:
            tl.store(o_ptr + r.to(tl.int64) * so_r + heads[:, None] * so_h + d[None, :], out, mask=qm)

    @triton.jit
    def _causal_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, L, tiles, sq_r, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_r, so_h,
        sm_scale, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """``_attention_kernel`` for T consecutive tokens t0..t0+T-1 of sequence b (rows b * L + t, keys
        0..t): each K/V block is loaded once for the T tokens, whose G heads are rows i * G + g of the
        products (ROWS of them, the padding rows zero). Per row the arithmetic of ``_attention_kernel``: T
        divides BLOCK and t0 is a multiple of T, so each token walks the same blocks as alone (none fully
        masked for it); keys past a row's own length are masked to -inf there too (p = 0, an exact no-op in
        the sums). Bits measured equal at 32 rows and 4 warps, not at 64 (bench/walk_attention.py)."""
        pid, kvh = tl.program_id(0), tl.program_id(1)
        b = (pid // tiles).to(tl.int64)
        t0 = (pid % tiles) * T
        j = tl.arange(0, ROWS)
        tok = t0 + j // G
        d = tl.arange(0, D)
        heads = kvh * G + j % G
        real = (j < T * G) & (tok < L)
        row = b * L + tok
        q = tl.load(
            q_ptr + row[:, None] * sq_r + heads[:, None] * sq_h + d[None, :], mask=real[:, None], other=0.0
        )
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        n = tl.minimum(t0 + T, L)
        out = _attend(q, k_base, v_base, sk_t, sv_t, n, tok + 1, sm_scale, D, BLOCK).to(
            o_ptr.dtype.element_ty
        )
        tl.store(o_ptr + row[:, None] * so_r + heads[:, None] * so_h + d[None, :], out, mask=real[:, None])

    @triton.jit
    def _token_logprob_kernel(logits_ptr, temp_ptr, lse_ptr, tok_ptr, lp_ptr, stride):
        row = tl.program_id(0)
        tok = tl.load(tok_ptr + row)
        z = tl.math.div_rn(
            tl.load(logits_ptr + row.to(tl.int64) * stride + tok).to(tl.float32), tl.load(temp_ptr + row)
        )
        tl.store(lp_ptr + row, z - tl.load(lse_ptr + row))


# ---- GEMMs ------------------------------------------------------------------------------------------------


def mm_launch(
    x: Tensor, w: Tensor, bias: Tensor | None, tile: tuple[int, int, int], warps: int, stages: int
) -> Tensor:
    """The BF16 kernel at a given launch shape (``bench/invariant_gemm.py`` compares shapes bit for bit)."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = tile
    _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def _size(m: int) -> str:
    return "small" if m <= MM_SMALL_M else "large"


def _mm_forward(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    if not kernels_available(x.device):
        return F.linear(x, w, bias)
    rows = _planned_rows(x, False, w.shape[0], w.shape[1])
    if rows != TRITON:
        return _cublas(x, (w, None), bias, rows, x.dtype)
    tile, warps, stages = MM_TILES[_size(x.shape[0])]
    return mm_launch(x, w, bias, tile, warps, stages)


class _Mm(torch.autograd.Function):
    """The invariant GEMM forward; backward by cuBLAS. Where ``w`` is a parameter that names an FP32 gradient
    target (``fp8.ops.WGRAD_INTO``: the trainer's master gradient, as the fast path's ``MainGradLinear``) and
    the GEMMs run in 16 bits on CUDA, dW is added into that target by the GEMM (FP32 output, beta = 1) instead
    of being returned in BF16 for a hook to add."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.param = w  # the Parameter itself when the caller passed it (saved tensors lose its attributes)
        ctx.has_bias = bias is not None
        return _mm_forward(x, w, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            into = (
                gradient_target(ctx.param, "true_on_policy GEMM")
                if dy.is_cuda and dy.dtype in (torch.bfloat16, torch.float16) and x.dtype == dy.dtype
                else None
            )
            if into is None:
                dw = dy.t() @ x
            else:
                torch.addmm(into, dy.t(), x, out_dtype=torch.float32, out=into)
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def mm(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ w^T + bias`` for x (M, K), w (N, K) in one dtype (BF16 on GPU): every row computed alike."""
    if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(
            f"mm: x {x.dtype}, w {w.dtype}, bias {None if bias is None else bias.dtype}: cast first"
        )
    out = _Mm.apply(x, w, bias)
    assert isinstance(out, Tensor)
    return out


# ---- which GEMM runs a shape: cuBLAS where a probe finds it batch-invariant, else the Triton kernels -------
#
# cuBLAS is faster than the Triton kernels above at the trainer's M (FP8: cuBLASLt's blockwise GEMM, 1.1-1.9x
# the Triton W8A8 kernel at M = 4,096; BF16: 1.25-1.5x the BF16 kernel), about as fast at decode sizes (FP8: up
# to 4% slower for 1.5B q|o and k|v, faster for the rest), and it gives a row the same bits at every M and
# offset in the batch for most shapes. Where it does not, it splits K
# (or picks another kernel) at small M (H100, cuBLAS of torch 2.11, bench/invariant_gemm.py --cublaslt: FP8
# down_proj, K 8960, differs at M <= 80 and K 18944 at M <= 32, every other 1.5B and 7B FP8 shape never; BF16
# differs at scattered M up to 264 for 1.5B down_proj and 432 for 7B). That is a property of one library build
# on one GPU, so it is measured, not assumed: ``plan`` probes each shape the model multiplies, at every M up to
# 512 and a few larger ones at two offsets, and at trainer sizes (4,096-16,384 rows), fused (q|k|v, gate|up:
# the engine's) and separate (the trainer's), and records the number of rows from which every probed M gave
# the reference bits; smaller batches are padded to it. A shape with no such tail below ``_PROBE_MAX_PAD``
# rows, that differs at a trainer size, or that differs fused stays on the Triton kernel. On the cuBLAS path
# the bias is added after the GEMM, in the output dtype.

PROBE_ROWS = (*range(1, 513), 640, 1000, 2048)
PROBE_LARGE_ROWS = (4096, 8192, 16384)  # also probed, at offset 0, where the output stays under ~1 GB
PROBE_OFFSETS = (0, 333)
_PROBE_REF_ROWS = max(PROBE_ROWS) + max(PROBE_OFFSETS)
_PROBE_MAX_PAD = 448  # a shape needing more rows than this stays on Triton (decode would pay too much)
TRITON = 0  # plan value: this shape runs the Triton kernel
# FP8 shapes (device index, True, N, K) whose GEMMs of at most NO_WORKSPACE_ROWS rows run cuBLASLt without
# workspace (``fp8/cublaslt.py``): where ``plan`` timed that 5% faster at decode size (at 1.5B: gate|up, whose
# kernel with workspace needs a memset per call). The probe that follows checks the bits as they then run.
_NO_WORKSPACE: dict[tuple[int, bool, int, int], bool] = {}
NO_WORKSPACE_ROWS = 512
# FP8 shapes (device index, True, N, K) run as SPLIT_CHUNKS chunks of K (``_split_gemm``): those ``_split_wanted``
# names, by a rule of the shape. On an H200 (bench/invariant_split.py, 2026-11-29) the engine's split-K launch
# (SPLIT_CONFIG) ran down_proj at 1.5B (N 1,536, K 8,960), M = 256, in 21.2 us against cuBLASLt's 30.6 over the
# whole K, and the trainer pays 123 against 92 us per 4,096 rows for cuBLASLt's chunks (4 chunks: 19.4 / 150
# us); at 7B (N 3,584, K 18,944) the launch lost, 94.7 against 53.6. Shapes of fused groups (q|k|v, gate|up) are
# never split: the engine's fused GEMM must give each part's bits.
_SPLIT: dict[tuple[int, bool, int, int], bool] = {}
_IN_FUSED: set[tuple[int, bool, int, int]] = set()
SPLIT_CHUNKS = 2
SPLIT_MIN_K_BLOCKS = 32  # a shorter chain of K blocks is not split
# Split only GEMMs of at most this many 128 x 128 output tiles at 256 rows (1.5B down_proj: 24).
SPLIT_MAX_TILES = 32
SPLIT_CONFIG = fp8_gemm.GemmConfig(64, 32, SPLIT_CHUNKS, 4, 5)  # the decode launch; its partials line up
# (device index, fp8, N, K) -> the rows cuBLAS runs that GEMM at (smaller batches padded), or TRITON
_PLAN: dict[tuple[int, bool, int, int], int] = {}
_PLAN_LINES: dict[tuple[int, bool, int, tuple[int, ...]], str] = {}  # each probed group's plan, in words
Weight = tuple[Tensor, Tensor | None]  # (weight, FP8 weight_scale_inv or None for BF16)


def _index(device: torch.device) -> int:
    """The CUDA device's index (the plan's keys), the current device for a bare ``cuda``."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _cublas(
    x: Tensor, w: Weight, bias: Tensor | None, rows: int, out_dtype: torch.dtype, pow2: bool = False
) -> Tensor:
    """cuBLAS on at least ``rows`` rows (the padding rows' outputs are dropped), then the bias. FP8: x is
    quantized by ``quantize_rows`` (which pads to 16 rows) for cuBLASLt's blockwise GEMM."""
    weight, scale_inv = w
    m = x.shape[0]
    if scale_inv is None:
        if m < rows:  # a row's product does not read other rows: rows past x in its storage may pad it
            x = (
                _rows_in_storage(x, rows)
                if _has_rows(x, rows)
                else torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
            )
        y = F.linear(x, weight)[:m]
    else:
        y = _cublaslt(*_quantize(x, rows, pow2), m, weight, scale_inv, rows, out_dtype)
    return _add_bias(y, bias)


def _has_rows(x: Tensor, rows: int) -> bool:
    """Whether x (M, K), row-major, is the start of ``rows`` rows in its storage."""
    if x.stride(1) != 1 or x.stride(0) != x.shape[1]:
        return False
    return (x.storage_offset() + rows * x.shape[1]) * x.element_size() <= x.untyped_storage().nbytes()


def _rows_in_storage(x: Tensor, rows: int) -> Tensor:
    return x.as_strided((rows, x.shape[1]), x.stride())


def planned_input_rows(x: Tensor, fp8: bool, n: int, k: int) -> int:
    """The rows the GEMM of this (N, K) runs x's M rows at (at least M): a producer that allocates its output
    with that many rows (``fused_ops.silu_mul(rows=...)``) spares the GEMM a padded copy."""
    if not kernels_available(x.device):
        return x.shape[0]
    return max(x.shape[0], _planned_rows(x, fp8, n, k))


def _quantize(x: Tensor, rows: int, pow2: bool) -> tuple[Tensor, Tensor]:
    """The trainer's 1x128 quantization of x's rows (q, s_t), padded to at least ``rows`` rows."""
    m = x.shape[0]
    return quant_triton.quantize_rows(x.contiguous(), pow2, pad_rows_to=rows if m < rows else 16)


def _cublaslt(
    q: Tensor, s_t: Tensor, m: int, w_fp8: Tensor, scale_inv: Tensor, rows: int, out_dtype: torch.dtype
) -> Tensor:
    """cuBLASLt's blockwise GEMM of the first m of the quantized rows q (M_pad, K), s_t (Kb, M_pad), run on at
    least ``rows`` rows (zero rows appended where M_pad is smaller; their outputs are dropped)."""
    if q.shape[0] < rows:
        q = torch.cat([q, q.new_zeros(rows - q.shape[0], q.shape[1])])
        s_t = torch.cat([s_t, s_t.new_ones(s_t.shape[0], rows - s_t.shape[1])], dim=1)
    index = _index(q.device)
    if _SPLIT.get((index, True, *w_fp8.shape), False):
        return _split_gemm(q, s_t, m, w_fp8, scale_inv, out_dtype)
    if q.shape[0] <= NO_WORKSPACE_ROWS and _NO_WORKSPACE.get((index, True, *w_fp8.shape), False):
        grid = cublas_gemm.padded_grid(scale_inv)
        return cublaslt.mm_1x128_128x128_no_workspace(q, s_t.contiguous(), w_fp8, grid, out_dtype)[:m]
    return cublas_gemm.mm_1x128_128x128(q, s_t, w_fp8, scale_inv, out_dtype)[:m]


def split_chunks(kb: int, chunks: int = SPLIT_CHUNKS) -> list[tuple[int, int]]:
    """The K-block ranges of a split GEMM over ``kb`` blocks: the engine's split-K launch's
    (``fp8_gemm.split_k_launch``), so the partials of both forms line up."""
    per = -(-kb // min(chunks, kb))
    return [(b, min(b + per, kb)) for b in range(0, kb, per)]


def accumulate_chunks(
    q: Tensor, s_t: Tensor, w_fp8: Tensor, scale_inv: Tensor, chunks: int = SPLIT_CHUNKS
) -> Tensor:
    """The split GEMM's FP32 sum (M_pad, N) on cuBLASLt: one call per K chunk, chunk c added by the epilogue
    (beta = 1) into the FP32 output of chunks 0..c-1, as the sum kernel adds the partials in order."""
    out = torch.empty(q.shape[0], w_fp8.shape[0], dtype=torch.float32, device=q.device)
    for i, (b0, b1) in enumerate(split_chunks(scale_inv.shape[1], chunks)):
        cols = slice(b0 * 128, b1 * 128)
        grid = cublas_gemm.padded_grid(scale_inv[:, b0:b1])
        cublaslt.mm_1x128_128x128_into(out, q[:, cols], s_t[b0:b1].contiguous(), w_fp8[:, cols], grid, i > 0)
    return out


def _split_partials(
    q: Tensor, s_t: Tensor, m: int, w_fp8: Tensor, scale_inv: Tensor
) -> fused_ops.SplitPartials:
    """The engine's split-K Triton launch over the first m rows: the chunks' FP32 results, unsummed."""
    y = fp8_gemm.w8a8_partials(q, w_fp8, scale_inv, None, SPLIT_CONFIG, False, s_t, m, torch.bfloat16)
    if not isinstance(y, fused_ops.SplitPartials) or y.part.shape[0] != len(split_chunks(scale_inv.shape[1])):
        raise RuntimeError(
            f"the split GEMM (N {w_fp8.shape[0]}, K {w_fp8.shape[1]}) did not split as planned"
        )
    return y


def _split_gemm(
    q: Tensor, s_t: Tensor, m: int, w_fp8: Tensor, scale_inv: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``_cublaslt``'s product as the sum of its K chunks (module docstring), rounded once to out_dtype: up to
    NO_WORKSPACE_ROWS rows the engine's split-K launch and its sum kernel, above cuBLASLt per chunk
    (``accumulate_chunks``)."""
    if q.shape[0] <= NO_WORKSPACE_ROWS:
        parts = _split_partials(q, s_t, m, w_fp8, scale_inv)
        return fp8_gemm.sum_partials(fused_ops.SplitPartials(parts.part, out_dtype))
    return accumulate_chunks(q, s_t, w_fp8, scale_inv)[:m].to(out_dtype)


def _split_wanted(n: int, k: int) -> bool:
    """Whether the FP8 GEMM (N, K) runs in SPLIT_CHUNKS K chunks: a long chain of K blocks over too few output
    tiles to fill the GPU at decode size, where the split pays (see ``_SPLIT``). A rule of the shape, not a
    timing: the trainer and the engines plan in separate processes (Ray actors), and a split changes the bits,
    so both must decide alike whatever a timing would say on the day."""
    return -(-k // 128) >= SPLIT_MIN_K_BLOCKS and 2 * -(-n // 128) <= SPLIT_MAX_TILES


def _no_workspace_pays(n: int, k: int, device: torch.device, rows: int = 256) -> bool:
    """Whether cuBLASLt without workspace runs the FP8 GEMM (N, K) at ``rows`` rows >= 5% faster than with
    torch's, timed as the engine's chooser times (``graph_capture.time_in_graph`` over ``cold_copies``)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    q, s_t = quant_triton.quantize_rows((torch.randn(rows, k, device=device, generator=gen) * 2).bfloat16())
    w8, s_plain = quant_triton.quantize_weight(torch.randn(n, k, device=device, generator=gen) * 0.05)
    grid = cublas_gemm.padded_grid(s_plain).contiguous()
    copies = [(w8.clone(), grid.clone()) for _ in range(cold_copies(w8, grid))]
    with_ws = time_in_graph(
        [functools.partial(cublas_gemm.mm_1x128_128x128, q, s_t, w, g[:, : s_plain.shape[1]], torch.bfloat16)
         for w, g in copies]
    )  # fmt: skip
    without = time_in_graph(
        [functools.partial(cublaslt.mm_1x128_128x128_no_workspace, q, s_t, w, g, torch.bfloat16)
         for w, g in copies]
    )  # fmt: skip
    return without < 0.95 * with_ws


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _fused_weight(parts: list[Weight]) -> Weight:
    """The parts as one weight, the engine's layout (``linears.FusedLinear``): FP8 parts start at 128-row
    boundaries (their scale blocks stay whole), BF16 parts are contiguous."""
    if parts[0][1] is None:
        return torch.cat([w for w, _ in parts]), None
    k = parts[0][0].shape[1]
    starts = [0]
    for w, _ in parts:
        starts.append(starts[-1] + -(-w.shape[0] // 128) * 128)
    w_all = torch.zeros(starts[-1], k, dtype=parts[0][0].dtype, device=parts[0][0].device)
    s_all = torch.ones(starts[-1] // 128, -(-k // 128), dtype=torch.float32, device=w_all.device)
    for (w, s), start in zip(parts, starts):
        assert s is not None
        w_all[start : start + w.shape[0]] = w
        s_all[start // 128 : start // 128 + s.shape[0]] = s
    return w_all, s_all


def _fused_starts(parts: list[int], fp8: bool) -> list[int]:
    sizes = [-(-n // 128) * 128 if fp8 else n for n in parts]
    return [sum(sizes[:i]) for i in range(len(parts) + 1)]


def _probe(k: int, parts: list[int], fp8: bool, device: torch.device) -> tuple[int, str]:
    """Rows from which cuBLAS gives the reference bits for the GEMMs of K ``k`` and N ``parts`` (each alone
    and, for several parts, fused), or TRITON; and why, in words."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(_PROBE_REF_ROWS, k, device=device, generator=gen) * 2).to(torch.bfloat16)
    weights: list[Weight] = []
    for n in parts:
        w = torch.randn(n, k, device=device, generator=gen) * 0.05
        weights.append(quant_triton.quantize_weight(w) if fp8 else (w.to(torch.bfloat16), None))
    gemms = weights + ([_fused_weight(weights)] if len(parts) > 1 else [])
    unpadded = 16 if fp8 else 1
    refs = [_cublas(x, w, None, unpadded, torch.bfloat16) for w in gemms]
    if len(parts) > 1:  # the fused GEMM's columns against each part's own
        starts = _fused_starts(parts, fp8)
        if not all(torch.equal(refs[-1][:, o : o + n], r) for o, n, r in zip(starts, parts, refs)):
            return TRITON, "fused and separate GEMMs differ"
    flags = []
    for m in PROBE_ROWS:
        ys = [
            (_cublas(x[o : o + m], w, None, unpadded, torch.bfloat16) != r[o : o + m]).any()
            for o in PROBE_OFFSETS
            for w, r in zip(gemms, refs)
        ]
        flags.append(torch.stack(ys).any())
    # Trainer-sized batches whose first rows are the reference rows (the output kept under ~1 GB: at the
    # lm_head's N only the batches above are probed).
    large = [m for m in PROBE_LARGE_ROWS if m * max(w.shape[0] for w, _ in gemms) <= 1 << 29]
    for m in large:
        more = (torch.randn(m - x.shape[0], k, device=device, generator=gen) * 2).to(torch.bfloat16)
        xl = torch.cat([x, more])
        ys = [
            (_cublas(xl, w, None, unpadded, torch.bfloat16)[: x.shape[0]] != r).any()
            for w, r in zip(gemms, refs)
        ]
        flags.append(torch.stack(ys).any())
        del xl, more
    differ = [m for m, bad in zip([*PROBE_ROWS, *large], torch.stack(flags).tolist()) if bad]
    if not differ:
        return unpadded, "the same bits at every M"
    if max(differ) > max(PROBE_ROWS):
        return TRITON, f"differs at M = {max(differ)}"
    rows = -(-(max(differ) + 1) // 16) * 16
    if rows > _PROBE_MAX_PAD:
        return TRITON, f"differs at M up to {max(differ)}"
    return rows, f"differs at M <= {max(differ)}: padded to {rows} rows"


def plan(groups: list[tuple[int, list[int]]], fp8: bool, device: torch.device) -> list[str]:
    """Probe the GEMMs of ``groups`` ((K, [N of each part]), e.g. q|k|v, o, gate|up, down, lm_head) in FP8
    (W8A8 blockwise) or BF16, once per process and device; ``mm`` / ``fp8_mm`` then run each probed shape as
    planned. Returns each group's plan in words (one line each), for the log. The trainer and the engine both
    plan the model they hold (``invariant.plan_gemms``) before their first forward."""
    lines: list[str] = []
    if not kernels_available(device):
        return lines
    index = _index(device)
    probe = torch.empty(0, device=device)
    for k, parts in groups:  # the parts of fused groups first: their shapes are never split
        if len(parts) > 1:
            fused = {(index, fp8, n, k) for n in [*parts, _fused_starts(parts, fp8)[-1]]}
            if any(_SPLIT.get(key, False) for key in fused):
                raise RuntimeError(f"invariant GEMM K {k}, N {parts}: a part was planned split before, alone")
            _IN_FUSED.update(fused)
    for k, parts in groups:
        shapes = [*parts, _fused_starts(parts, fp8)[-1]] if len(parts) > 1 else parts
        keys = [(index, fp8, n, k) for n in shapes]
        said = _PLAN_LINES.get((index, fp8, k, tuple(parts)))
        if said is not None:
            lines.append(said)
            continue
        if fp8 and not all(cublas_gemm.fast_path_ok(probe, n, k) for n in shapes):
            rows, why = TRITON, "cuBLASLt's blockwise FP8 does not take this shape or GPU"
        else:
            no_ws: list[str] = []
            split = False
            if fp8:  # decided once per shape, before any probe runs it
                for key in keys:
                    if key not in _NO_WORKSPACE:
                        _NO_WORKSPACE[key] = _no_workspace_pays(key[2], k, device)
                    if key not in _SPLIT:
                        _SPLIT[key] = key not in _IN_FUSED and _split_wanted(key[2], k)
                no_ws = [str(key[2]) for key in keys if _NO_WORKSPACE[key] and not _SPLIT[key]]
                split = any(_SPLIT[key] for key in keys)
            rows, why = _probe(k, parts, fp8, device)
            if no_ws:
                why += f" (N {'|'.join(no_ws)}: cuBLASLt without workspace up to {NO_WORKSPACE_ROWS} rows)"
            if split:
                why += (
                    f" (K in {SPLIT_CHUNKS} chunks: the split-K Triton launch up to {NO_WORKSPACE_ROWS} rows, "
                    "cuBLASLt per chunk above)"
                )
        for key in keys:  # a shape in two groups (q and o at 1.5B) takes the stricter plan
            old = _PLAN.get(key, 1)
            _PLAN[key] = TRITON if TRITON in (old, rows) else max(old, rows)
        kind = "the Triton kernel" if rows == TRITON else f"cuBLAS{'Lt' if fp8 else ''} (>= {rows} rows)"
        said = f"{'FP8' if fp8 else 'BF16'} GEMM K {k}, N {'|'.join(map(str, parts))}: {kind}; {why}"
        _PLAN_LINES[(index, fp8, k, tuple(parts))] = said
        lines.append(said)
        torch.cuda.empty_cache()  # the probe's batches: not kept in the allocator's cache at start
    return lines


def _planned_rows(x: Tensor, fp8: bool, n: int, k: int) -> int:
    """The rows cuBLAS runs this shape at, or TRITON; an unplanned shape is planned alone now (outside a
    CUDA graph capture only: the probe synchronizes)."""
    index = _index(x.device)
    rows = _PLAN.get((index, fp8, n, k))
    if rows is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"invariant GEMM N {n}, K {k} ({'FP8' if fp8 else 'BF16'}) was not planned before a CUDA graph"
                " capture (invariant.plan_gemms)"
            )
        plan([(k, [n])], fp8, x.device)
        rows = _PLAN[(index, fp8, n, k)]
    return rows


def bias_after_rounding(x: Tensor, fp8: bool, n: int, k: int) -> bool:
    """Whether ``mm`` / ``fp8_mm`` of this (N, K) add the bias after rounding the product to the output dtype
    (a cuBLAS plan: then a consumer kernel may add it, ``fused_ops.SplitPartials``), not inside the kernel."""
    return kernels_available(x.device) and _planned_rows(x, fp8, n, k) != TRITON


@dataclass(frozen=True)
class QuantizedRows:
    """x (m, K) quantized by the trainer's 1x128 rule for several FP8 GEMMs: q (M_pad, K), s_t (Kb, M_pad),
    M_pad at least the rows each GEMM is planned at."""

    q: Tensor
    s_t: Tensor
    m: int


def quantize_rows(x: Tensor, weights: list[Tensor], pow2: bool) -> QuantizedRows:
    """One quantization of x for the FP8 GEMMs with these weights (``invariant.linears``)."""
    pad = max(_planned_rows(x, True, w.shape[0], w.shape[1]) for w in weights)
    return QuantizedRows(*_quantize(x, pad, pow2), x.shape[0])


def fp8_mm_rows(
    rows: QuantizedRows, x: Tensor, w_fp8: Tensor, scale_inv: Tensor, bias: Tensor | None, pow2: bool
) -> Tensor:
    """``fp8_mm(x, ...)`` from x's quantization ``rows`` (x itself is not read)."""
    return fp8_mm_quantized(rows.q, rows.s_t, rows.m, w_fp8, scale_inv, bias, pow2, x.dtype)


def fp8_mm(x: Tensor, w_fp8: Tensor, scale_inv: Tensor, bias: Tensor | None, pow2: bool) -> Tensor:
    """W8A8 ``quant(x) @ W^T + bias`` (no autograd; the trainer's goes through ``fp8.ops.fp8_linear``):
    cuBLASLt or the Triton kernel, as ``plan`` found for this shape."""
    if not kernels_available(x.device):
        return fp8_linear_forward(x, w_fp8, scale_inv, bias, pow2)
    return fp8_mm_rows(quantize_rows(x, [w_fp8], pow2), x, w_fp8, scale_inv, bias, pow2)


def fp8_mm_quantized(
    q: Tensor,
    s_t: Tensor,
    rows: int,
    w_fp8: Tensor,
    scale_inv: Tensor,
    bias: Tensor | None,
    pow2: bool,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``fp8_mm`` of rows already quantized by the trainer's rule: q (M_pad, K) e4m3, s_t (Kb, M_pad) (the
    engine's producer kernels write them, ``fused_ops.QuantizedRows``)."""
    planned = _planned_rows(q, True, w_fp8.shape[0], w_fp8.shape[1])
    if planned != TRITON:
        return _add_bias(_cublaslt(q, s_t, rows, w_fp8, scale_inv, planned, out_dtype), bias)
    cfg = FP8_CONFIGS[_size(rows)]
    return fp8_gemm.w8a8_fused(q, w_fp8, scale_inv, bias, cfg, pow2, s_t, rows, out_dtype)


def fp8_mm_partials(
    q: Tensor, s_t: Tensor, rows: int, w_fp8: Tensor, scale_inv: Tensor
) -> fused_ops.SplitPartials | None:
    """For a consumer kernel that sums split partials itself (the engine's decode step, ``fused_ops``'
    add+RMSNorm): ``fp8_mm_quantized``'s product (no bias) as its K chunks' FP32 results, unsummed, where
    the plan splits this shape and runs the split-K launch at this size; else None (call that instead)."""
    index = _index(q.device)
    planned = _planned_rows(q, True, w_fp8.shape[0], w_fp8.shape[1])
    if planned == TRITON or not _SPLIT.get((index, True, *w_fp8.shape), False):
        return None
    if q.shape[0] < planned or q.shape[0] > NO_WORKSPACE_ROWS:
        return None
    return _split_partials(q, s_t, rows, w_fp8, scale_inv)


# ---- attention --------------------------------------------------------------------------------------------


def attention(q_RHD: Tensor, k_SKTD: Tensor, v_SKTD: Tensor, seq_R: Tensor, len_R: Tensor) -> Tensor:
    """Row r (a token) attends to keys 0..len_R[r]-1 of sequence seq_R[r]: q (R, H, D), k / v (S, KVH, T, D)
    (a KV cache, or a batch of sequences) -> (R, H * D). No autograd (``causal_attention`` has it)."""
    rows, heads, dim = q_RHD.shape
    kv_heads = k_SKTD.shape[1]
    group = heads // kv_heads
    if not kernels_available(q_RHD.device):
        keys = k_SKTD[seq_R].repeat_interleave(group, dim=1)  # (R, H, T, D)
        values = v_SKTD[seq_R].repeat_interleave(group, dim=1)
        mask = torch.arange(keys.shape[2], device=q_RHD.device)[None, :] < len_R[:, None]
        out = F.scaled_dot_product_attention(q_RHD[:, :, None], keys, values, attn_mask=mask[:, None, None])
        return out.reshape(rows, heads * dim)
    q = q_RHD.contiguous()
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    _launch_attention(q, k_SKTD, v_SKTD, seq_R, len_R, out, None, False)
    return out.reshape(rows, heads * dim)


def attention_quantized(
    q_RHD: Tensor, k_SKTD: Tensor, v_SKTD: Tensor, seq_R: Tensor, len_R: Tensor, pow2: bool
) -> fused_ops.QuantizedRows:
    """``attention`` with its output quantized for o_proj in the kernel (CUDA, head dim 128: one head is one
    1x128 tile): the codes and scales of ``quantize_rows(attention(...))``, which the trainer's walk runs, for
    the engine's FP8 decode (its row buffers padded as ``fused_ops.quant_buffers``'; the padding rows get
    codes 0, scale 1). Saves the quantize kernel's launch per layer and decode step."""
    rows, heads, dim = q_RHD.shape
    if dim != 128 or not kernels_available(q_RHD.device):
        raise ValueError(f"attention_quantized needs CUDA and head dim 128, got {dim} on {q_RHD.device.type}")
    q = q_RHD.contiguous()
    out = fused_ops.quant_buffers(rows, heads * dim, q.device)
    _launch_attention(q, k_SKTD, v_SKTD, seq_R, len_R, q, out, pow2)
    return out


def _check_attention(heads: int, kv_heads: int, dim: int, k: Tensor, v: Tensor) -> None:
    if heads // kv_heads > ATTN_ROWS or dim & (dim - 1) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"invariant attention: {heads} query heads per {kv_heads} KV heads, head dim {dim}: needs at most"
            f" {ATTN_ROWS} query heads per KV head, a power-of-two head dim and unit-stride K/V rows"
        )


def _launch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq: Tensor,
    lens: Tensor,
    out: Tensor,
    quantized: fused_ops.QuantizedRows | None,
    pow2: bool,
    stages: int | None = None,
) -> None:
    """``_attention_kernel`` over q's rows (and, quantized, the padding rows of ``quantized``). ``out`` gives
    the dtype the output is rounded to (quantized: q, never written). ``stages``: the pipeline depth, by
    default by the grid's size (``ATTN_STAGES_RESIDENT``); any depth gives the same bits."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    _check_attention(heads, kv_heads, dim, k, v)
    codes, scales = (quantized.q, quantized.s_t) if quantized is not None else (out, out)
    grid_rows = codes.shape[0] if quantized is not None else rows
    if not grid_rows:
        return
    if stages is None:
        one_wave = grid_rows * kv_heads <= ATTN_STAGES_RESIDENT * sm_count(q.device)
        stages = 3 if one_wave else 2
    _attention_kernel[(grid_rows, kv_heads)](
        q, k, v, out, seq, lens, codes, scales, rows, scales.shape[-1], codes.stride(0),
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3], out.stride(0), out.stride(1),
        dim**-0.5, G=heads // kv_heads, GP=ATTN_ROWS, D=dim, BLOCK=ATTN_BLOCK, QUANT=quantized is not None,
        POW2=pow2, num_warps=4, num_stages=stages,
    )  # fmt: skip


def causal_rows(
    q_RHD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, tokens: int | None = None, warps: int = 4
) -> Tensor:
    """``attention`` of whole sequences: row b * L + t of q (R = B * L rows, H, D) attends to keys 0..t of
    sequence b, k / v (B, KVH, >= L, D) -> (R, H * D), with the bits of ``attention``. On CUDA one program
    takes ``tokens`` consecutive rows (default: as many as fill ``ATTN_TILE_ROWS`` rows with their query
    heads) and loads each K/V block once for them (``_causal_attention_kernel``); ``tokens=1`` runs
    ``attention`` itself. ``tokens`` and ``warps`` other than the defaults are for the bench: more rows than
    ``ATTN_TILE_ROWS``, or other than 4 warps, measured other bits. No autograd."""
    rows, heads, dim = q_RHD.shape
    batch, kv_heads = k_BKLD.shape[:2]
    length = rows // batch if batch else 0
    group = heads // kv_heads
    if tokens is None:
        tokens = 1 << max(0, (ATTN_TILE_ROWS // group).bit_length() - 1)  # a power of two: divides ATTN_BLOCK
    if rows != batch * length or length > k_BKLD.shape[2]:
        raise ValueError(
            f"causal_rows: {rows} rows are not whole sequences of the {tuple(k_BKLD.shape)} keys"
        )
    if not kernels_available(q_RHD.device) or tokens == 1:
        device = q_RHD.device
        seq = torch.arange(batch, device=device).repeat_interleave(length)
        lens = torch.arange(1, length + 1, device=device, dtype=torch.int32).repeat(batch)
        return attention(q_RHD, k_BKLD, v_BKLD, seq, lens)
    _check_attention(heads, kv_heads, dim, k_BKLD, v_BKLD)
    if ATTN_BLOCK % tokens:
        raise ValueError(f"causal_rows: {tokens} tokens per program must divide the key block {ATTN_BLOCK}")
    if q_RHD.stride(-1) != 1:
        q_RHD = q_RHD.contiguous()
    out = torch.empty(rows, heads, dim, dtype=q_RHD.dtype, device=q_RHD.device)
    if rows:
        tiles = -(-length // tokens)
        grid = (batch * tiles, kv_heads)
        one_wave = grid[0] * kv_heads <= ATTN_STAGES_RESIDENT * sm_count(q_RHD.device)
        _causal_attention_kernel[grid](
            q_RHD, k_BKLD, v_BKLD, out, length, tiles, q_RHD.stride(0), q_RHD.stride(1), *k_BKLD.stride()[:3],
            *v_BKLD.stride()[:3], out.stride(0), out.stride(1), dim**-0.5, G=group,
            ROWS=max(ATTN_ROWS, triton.next_power_of_2(tokens * group)), D=dim, BLOCK=ATTN_BLOCK, T=tokens,
            num_warps=warps, num_stages=3 if one_wave else 2,
        )  # fmt: skip
    return out.reshape(rows, heads * dim)


class _CausalAttention(torch.autograd.Function):
    """Forward: ``causal_rows`` (row (b, t) over keys 0..t of sequence b). Backward: causal SDPA recomputed."""

    @staticmethod
    def forward(ctx: Any, q_BLHD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor) -> Tensor:  # type: ignore[override]
        batch, length, heads, dim = q_BLHD.shape
        ctx.save_for_backward(q_BLHD, k_BKLD, v_BKLD)
        out = causal_rows(q_BLHD.reshape(batch * length, heads, dim), k_BKLD, v_BKLD)
        return out.view(batch, length, heads * dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():  # K/V not repeated per query head: 0.110 against 0.150 ms per 16 x 256
            # tokens at 1.5B, the same gradients (bench/walk_attention.py, H200, session 60)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, enable_gqa=q.shape[2] != k.shape[1]
            ).transpose(1, 2)
            grads = torch.autograd.grad(out.reshape(grad.shape), (q, k, v), grad)
        return grads


def causal_attention(q_BLHD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor) -> Tensor:
    """Causal self-attention of whole sequences through the invariant kernel, differentiable: q (B, L, H, D),
    k / v (B, KVH, L, D) -> (B, L, H * D). Row (b, t) sees keys 0..t (right padding is never attended to by
    a real token)."""
    out = _CausalAttention.apply(q_BLHD, k_BKLD.contiguous(), v_BKLD.contiguous())
    assert isinstance(out, Tensor)
    return out


# ---- RMSNorm ----------------------------------------------------------------------------------------------


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        out = fused_ops.add_rms_norm(x.contiguous(), None, weight, eps)
        assert isinstance(out, Tensor)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if kernels_available(grad.device):  # the torch trainer's fused RMSNorm backward kernel
            from infir2_rl.trainers.torch import fused_layers

            x, weight = ctx.saved_tensors
            dx, dw = fused_layers.rms_norm_grads(grad, x, weight, ctx.eps)
            return dx, dw, None
        x, weight = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = fused_ops.rms_norm_torch(x, weight, ctx.eps)
            dx, dw = torch.autograd.grad(out, (x, weight), grad)
        return dx, dw, None


def rms_norm(x_NE: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen2RMSNorm of rows x (N, E), one program per row on CUDA; weight in x's dtype."""
    out = _RmsNorm.apply(x_NE, weight, eps)
    assert isinstance(out, Tensor)
    return out


# ---- rotary embedding -----------------------------------------------------------------------------------


def rope(
    q_NHD: Tensor, k_NKD: Tensor, positions_N: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q (N, H, D) and k (N, KVH, D) at each row's position; ``cos`` / ``sin``: (max
    positions, D) tables. On CUDA the trainer's rotary kernels (``trainers/torch/fused_rope``, one launch each
    way over every head of a token): each product rounded to the dtype, then their sum, the arithmetic of the
    engine's decode kernel (``fused_ops.rope_write_kv``, both call ``fused_ops._rotated``), so the walk's q and
    k are the engine's bit for bit; the backward is autograd's of that expression, also one launch."""
    if not kernels_available(q_NHD.device):
        c, s = cos[positions_N][:, None], sin[positions_N][:, None]
        return fused_ops.rotate_torch(q_NHD, c, s), fused_ops.rotate_torch(k_NKD, c, s)
    from infir2_rl.trainers.torch import fused_rope

    # The rows as one batch of N positions: (1, heads, N, D) views, tables gathered to (1, N, D).
    q, k = q_NHD.unsqueeze(0).transpose(1, 2), k_NKD.unsqueeze(0).transpose(1, 2)
    c, s = cos[positions_N][None], sin[positions_N][None]
    if not fused_rope.fusable(q, k, c, s):
        raise ValueError(
            f"true_on_policy rotary: q {tuple(q_NHD.shape)} {q_NHD.dtype}, k {tuple(k_NKD.shape)}, tables "
            f"{cos.dtype}: the kernel needs one dtype, a power-of-two head size >= 16 and contiguous features"
        )
    q_out, k_out = fused_rope.rope(q, k, c, s)
    return q_out.transpose(1, 2)[0], k_out.transpose(1, 2)[0]  # (N, heads, D), contiguous


# ---- SiLU * up -------------------------------------------------------------------------------------------


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        if gate.stride() != up.stride() or gate.stride(-1) != 1:  # the kernel reads both at one row stride
            gate, up = gate.contiguous(), up.contiguous()
        out = fused_ops.silu_mul_apart(gate, up)
        assert isinstance(out, Tensor)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if kernels_available(grad.device):  # the torch trainer's fused SwiGLU backward kernel
            from infir2_rl.trainers.torch import fused_layers

            gate, up = ctx.saved_tensors
            return fused_layers.swiglu_grads(grad, gate, up)
        gate, up = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            dgate, dup = torch.autograd.grad(F.silu(gate) * up, (gate, up), grad)
        return dgate, dup


def silu_mul(gate_NI: Tensor, up_NI: Tensor) -> Tensor:
    """``silu(gate) * up`` by the engine's kernel (``fused_ops.silu_mul_apart``: its exponential and division
    are Triton's, which need not round like torch's), so the trainer's MLP input is the engine's bit for bit."""
    out = _SiluMul.apply(gate_NI, up_NI)
    assert isinstance(out, Tensor)
    return out


# ---- log-probs --------------------------------------------------------------------------------------------


def token_logprobs(logits_NV: Tensor, temperature_N: Tensor, tokens_N: Tensor) -> tuple[Tensor, Tensor]:
    """(log softmax(z)[token], logsumexp(z)) per row, z = logits.float() / T, as the engine's sampler
    computes them (FP32, (N,) each). ``temperature_N``: FP32 per row."""
    rows, vocab = logits_NV.shape
    if not (kernels_available(logits_NV.device) and sampler._HAVE_TRITON):
        z = logits_NV.float() / temperature_N[:, None]
        lse = torch.logsumexp(z, dim=-1)
        return z.gather(1, tokens_N[:, None]).squeeze(1) - lse, lse
    lse = sampler.logsumexp(logits_NV, temperature_N)
    logp = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
    if rows:
        _token_logprob_kernel[(rows,)](logits_NV, temperature_N, lse, tokens_N, logp, logits_NV.stride(0))
    return logp, lse
