"""Fused Triton kernels for blockwise FP8 quantization (CUDA only; ``quant.py`` holds the reference).

Why fused: quantizing is memory-bound (read 2 bytes, write 1 byte and a scale per 128 elements), but the
eager torch version makes ~6 passes over the data (abs, amax, divide, clamp, cast, pad/slice). Here each
kernel reads its input once and writes exactly what the GEMMs consume:

* ``quantize_rows``: 1x128 tiles along the last dim (fprop input X, dgrad input dY). The scale is written
  K-block-major, shape (Kb, M_pad) in memory, because ``F.scaled_mm`` wants the 1x128 scale of its left
  operand "outer-dim-major" (stride (1, M)); ``s_t.t()`` is then the (M, Kb) view it accepts as is.
* ``quantize_cols``: 1x128 tiles along the *token* dim, written transposed (K, M_pad) for the wgrad GEMM
  (dW = dY^T X contracts over tokens); the forward keeps only this FP8 copy of X for backward.
* ``quantize_rows_and_cols``: both, as the two kernels above: 6 bytes of traffic per element where one
  read of each 128x128 tile would move 4, but every single-pass kernel tried was slower (0.52 against 0.32
  ms at 8192 x 18944 on an H200, 0.58 against 0.35 on an H100: a program holding a whole tile and its
  transpose leaves too few programs resident to hide memory latency; docs/performance.md).
* ``quantize_weight``: one scale per 128x128 block; ``quantize_weight_with_transpose`` adds W^T in FP8 for
  the dgrad GEMM (``transpose_fp8``).
* ``add_row_bias_``: not a quantizer, the FP8 fprop's bias add (``ops._fast_fprop``), in place and vectorized,
  with torch's bits: torch runs a broadcast add on its strided kernel (1.3 ms of a 1.5B x 8K step on an H200,
  q|k|v's bias; docs/performance.md, session 56).

A tile or block holding a NaN or an infinity gets scale NaN, as in ``quant.py`` (its docstring says why).
Triton's ``tl.max`` does not propagate NaN (it lowers to maxnum), so the amax is taken as the integer max of
the values' absolute bit patterns, where NaN sorts above inf (``_scale_from_bits``). The block's codes are
NaN too (no clamp before the saturating cast), as in ``quant.py``.

``round_to`` (activation quantizers): quantize ``x.to(round_to)`` - BF16 or FP16, autocast's rounding of an
FP32 input - rounding each element as it is read instead of a separate cast pass and its copy.

Rows are padded with zeros (scale 1) up to ``pad_rows_to`` (16 for row tiles: cuBLASLt wants M % 16;
128 for token tiles, a whole tile). Numbers match the eager reference bit for bit (``quant.py``'s rule: a
correctly rounded reciprocal per tile, ``tl.math.div_rn``, since Triton's plain ``/`` on FP32 is an
approximate division; one FP32 product per element; round-to-nearest-even with saturation). Every kernel
here and the producers that quantize elsewhere (``fused_ops``, ``fp8_gemm``, ``trainers/torch/fused_layers``,
``models/invariant_ops``) use ``_tile_scales`` (or ``_scale_from_bits``) and ``_to_e4m3``: one rule,
so the engine's codes equal the trainer's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from infir2_rl.env import env_flag

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

_TILE = 128
# Launch shapes; bench/fp8_linear.py --sweep times the alternatives (docs/performance.md: on an H200 the
# defaults are within noise of the fastest candidate and were also checked bit for bit with FP32 input).
# rows: rows per program; cols: columns per program strip.
LAUNCH: dict[str, dict[str, Any]] = {
    "rows": {"bm": 32, "warps": 4},
    "cols": {"bk": 64, "warps": 4},
    "weight": {"warps": 8},
}

# The alternatives bench/fp8_linear.py --sweep times (and tests/test_fp8_gpu.py checks bit for bit).
LAUNCH_CANDIDATES: dict[str, list[dict[str, Any]]] = {
    "rows": [{"bm": bm, "warps": w} for bm, w in ((16, 4), (32, 4), (64, 4), (32, 2))],
    "cols": [{"bk": bk, "warps": w} for bk in (32, 64, 128) for w in (2, 4)],
    "weight": [{"warps": 4}, {"warps": 8}],
}


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the fused kernels can run: Triton imports and a CUDA device is present."""
    if env_flag("INFIR2_FP8_EAGER_QUANT", False):  # escape hatch to compare with the reference
        return False
    return _HAVE_TRITON and torch.cuda.is_available()


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


if _HAVE_TRITON:
    # quant.MIN_SCALE, FP32's smallest normal: the least scale (its comment says why). Not imported from
    # quant.py, which imports this module.
    _MIN_SCALE = tl.constexpr(2.0**-126)

    @triton.jit
    def _scale_from_amax(amax, num_nonfinite, POW2: tl.constexpr):
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        # All-zero, or amax / 448 underflowed to 0: scale 1; an FP32 subnormal: 2^-126, so that 1 / s is
        # finite (quant._scales_from_amax).
        s = tl.where(s > 0, tl.maximum(s, _MIN_SCALE), 1.0)
        if POW2:
            # Round up to a power of two on the bit pattern (same rule as quant.round_scale_up_pow2).
            bits = s.to(tl.int32, bitcast=True)
            expo = bits & 0x7F800000
            bits = tl.where((bits & 0x007FFFFF) != 0, expo + 0x00800000, expo)
            s = bits.to(tl.float32, bitcast=True)
        # A NaN or inf anywhere in the tile: scale NaN, the tile dequantizes to NaN (module docstring).
        return tl.where(num_nonfinite > 0, float("nan"), s)

    @triton.jit
    def _abs_bits(v):
        # |v|'s FP32 bit patterns as int32: ordered as the values are, with NaN above inf (_scale_from_bits).
        return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _scale_from_bits(amax_bits, POW2: tl.constexpr):
        """``_scale_from_amax`` from the integer max of a tile's ``_abs_bits``. That max orders finite values
        as the float max does and puts NaN's bits above inf's, so one integer max per element both finds the
        amax and detects a non-finite value (amax bits >= inf's), where the float max drops NaN and needed a
        separate count of non-finite values per element."""
        bad = (amax_bits >= 0x7F800000).to(tl.float32)
        return _scale_from_amax(tl.where(bad > 0, 0.0, amax_bits.to(tl.float32, bitcast=True)), bad, POW2)

    @triton.jit
    def _tile_scales(v, AXIS: tl.constexpr, POW2: tl.constexpr):
        """The scales of v's tiles along AXIS (v FP32)."""
        return _scale_from_bits(tl.max(_abs_bits(v), axis=AXIS), POW2)

    @triton.jit
    def _to_e4m3(x, s):
        """e4m3 codes of x (FP32) in tiles of scale ``s`` (shaped to broadcast against x: (BM, 1) for row tiles,
        (1, BK) for token tiles, (1, 1) for a weight block): RN(x * r) with r = RN(1 / s) per tile, then
        round-to-nearest-even with saturation (``cvt.rn.satfinite``; only x = amax can exceed 448, by an FP32
        ulp or so). ``quant.py``'s rule (its docstring says why a product and not the quotient); a scale is
        never below 2^-126 (``_scale_from_amax``), so r is finite. A NaN scale (non-finite tile) gives NaN
        codes, as the eager reference's do. GPU tests: tests/test_fp8_gpu.py, tests/test_producer_quant_gpu.py.
        """
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        return (x * tl.broadcast_to(r, x.shape)).to(tl.float8e4nv)

    @triton.jit
    def _act_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        qt_ptr,
        st_ptr,
        M,
        K,
        stride_xm,
        rows_q,
        rows_qt,
        POW2: tl.constexpr,
        ROUND: tl.constexpr,
        COLS: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_k * BK + tl.arange(0, BK)
        in_mask = (rows[:, None] < M) & (cols[None, :] < K)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
        x = tl.load(x_ptrs, mask=in_mask, other=0.0)
        if ROUND == 1:
            x = x.to(tl.bfloat16)
        elif ROUND == 2:
            x = x.to(tl.float16)
        x = x.to(tl.float32)
        if COLS:  # token tiles; BM == 128: one program row is one token tile
            _quant_cols_store(x, rows, cols, K, rows_qt, pid_m, qt_ptr, st_ptr, POW2, BM, BK)
        else:  # row tiles; BK == 128: one program column is one K-block
            s = _tile_scales(x, 1, POW2)
            q = _to_e4m3(x, s[:, None])
            q_mask = (rows[:, None] < rows_q) & (cols[None, :] < K)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=q_mask)
            tl.store(s_ptr + pid_k * rows_q + rows, s, mask=rows < rows_q)

    @triton.jit
    def _quant_cols_store(
        x, rows, cols, K, rows_qt, pid_m, qt_ptr, st_ptr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """Token tiles of x (BM = 128 tokens x BK features, FP32 values), stored transposed (feature k's 128
        tokens contiguous) with one scale per feature; ``quantize_cols``'s layout. The codes are transposed
        after the cast (a quarter of the bytes through shared memory). Also used by the kernels that make
        token tiles of a recomputed tensor (trainers/torch/fused_layers.py)."""
        sc = _tile_scales(x, 0, POW2)
        qc_t = tl.trans(_to_e4m3(x, sc[None, :]))  # (BK, BM): row k of X^T, tokens contiguous
        t_mask = (cols[:, None] < K) & (rows[None, :] < rows_qt)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * rows_qt + rows[None, :], qc_t, mask=t_mask)
        tl.store(st_ptr + pid_m * K + cols, sc, mask=cols < K)

    @triton.jit
    def _weight_quant_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, KB, POW2: tl.constexpr, B: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * B + tl.arange(0, B)
        cols = pid_k * B + tl.arange(0, B)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], mask=mask, other=0.0)
        q, s = _weight_block(w.to(tl.float32), POW2)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=mask)
        tl.store(s_ptr + pid_n * KB + pid_k + tl.arange(0, 1), s)

    @triton.jit
    def _weight_block(w, POW2: tl.constexpr):
        """A 128x128 weight block (FP32, zeros where masked) -> (e4m3 codes, its scale as a 1-element tensor)."""
        amax_bits = tl.max(tl.max(_abs_bits(w), axis=1), axis=0)
        s = _scale_from_bits(tl.full((1,), 0, tl.int32) + amax_bits, POW2)
        return _to_e4m3(w, s[:, None]), s

    @triton.jit
    def _weight_blocks_kernel(
        w_ptr, q_ptr, s_ptr, blocks_ptr, start, POW2: tl.constexpr, ALIGNED: tl.constexpr, B: tl.constexpr
    ):  # fmt: skip
        """``_weight_quant_kernel`` for many weights in one flat buffer: program i quantizes the 128x128 block
        of row i of ``blocks`` (weight offset in ``w_ptr``, N, K, block row, block column, scale index); the
        codes go to the weight's offset minus ``start`` in ``q_ptr``. ``ALIGNED``: every offset, K and
        ``start`` are multiples of 16, which the kernel cannot see in values it loads; without the hints its
        loads and stores were not vectorized (1.7x the per-weight kernel's time at 1.5B, H100)."""
        row = blocks_ptr + tl.program_id(0).to(tl.int64) * 6
        base, n, k = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        bi, bj, si = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
        if ALIGNED:
            base, k, start = tl.multiple_of(base, 16), tl.multiple_of(k, 16), tl.multiple_of(start, 16)
        rows = bi * B + tl.arange(0, B)
        cols = bj * B + tl.arange(0, B)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        offs = base + rows[:, None] * k + cols[None, :]
        q, s = _weight_block(tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32), POW2)
        tl.store(q_ptr + (offs - start), q, mask=mask)
        tl.store(s_ptr + si + tl.arange(0, 1), s)

    @triton.jit
    def _add_row_bias_kernel(y_ptr, b_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        # y[i, j] = RN(y[i, j] + b[j]) in y's dtype, summed in FP32: torch's add of two 16-bit tensors.
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (y + b[None, :]).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _transpose_bytes_kernel(x_ptr, y_ptr, R, C, B: tl.constexpr):
        # y (C, R) = x (R, C)^T for 1-byte elements, one B x B tile per program.
        rows = tl.program_id(0) * B + tl.arange(0, B)
        cols = tl.program_id(1) * B + tl.arange(0, B)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0)
        mask_t = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(y_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(x), mask=mask_t)


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """``q.t().contiguous()`` for a contiguous 2-D FP8 tensor, moved as bytes in 64x64 tiles.

    torch's strided copy of 1-byte elements ran at a few per cent of the memory bandwidth (9.3 ms per
    1.5B-shape step for the 196 weight transposes, H100, docs/performance.md); this is the same bytes.
    """
    assert q.dim() == 2 and q.is_contiguous() and q.element_size() == 1
    r, c = q.shape
    out = torch.empty((c, r), dtype=q.dtype, device=q.device)
    b = 64
    _transpose_bytes_kernel[(triton.cdiv(r, b), triton.cdiv(c, b))](
        q.view(torch.uint8), out.view(torch.uint8), r, c, B=b, num_warps=4
    )
    return out


def add_row_bias_(y: torch.Tensor, bias: torch.Tensor) -> bool:
    """``y += bias`` in place for a contiguous 2-D BF16/FP16 ``y`` on CUDA and a contiguous ``bias`` (N,) of its
    dtype, with torch's bits (each sum in FP32, rounded once to y's dtype); False (y untouched) for any other
    operands, which the caller adds as before."""
    if not (
        available()
        and y.is_cuda
        and y.dim() == 2
        and y.dtype in (torch.bfloat16, torch.float16)
        and bias.dtype == y.dtype
        and bias.shape == (y.shape[1],)
        and y.is_contiguous()
        and bias.is_contiguous()
        and bias.device == y.device
    ):
        return False
    m, n = y.shape
    if m and n:
        bm, bn = 16, 256
        _add_row_bias_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            y, bias, m, n, BM=bm, BN=bn, num_warps=4
        )
    return True


_ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}


def _round_code(x: torch.Tensor, round_to: torch.dtype | None) -> int:
    if round_to is None or round_to == x.dtype:
        return 0
    if x.dtype != torch.float32 or round_to not in _ROUND_CODES:
        raise ValueError(f"quantize: rounding {x.dtype} to {round_to} is not supported (FP32 to BF16/FP16)")
    return _ROUND_CODES[round_to]


def _launch_act(
    x2d: torch.Tensor, pow2: bool, cols: bool, pad_rows_to: int, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row tiles (q, s_t) of ``x2d``, or with ``cols`` its token tiles (qt, st): ``_act_quant_kernel``."""
    assert x2d.dim() == 2
    round_code = _round_code(x2d, round_to)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    kb = -(-k // _TILE)
    dev = x2d.device
    if cols:
        rows_q, rows_qt = 0, _round_up(m, _TILE)
        q = torch.empty((k, rows_qt), dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty((rows_qt // _TILE, k), dtype=torch.float32, device=dev)
        bm, bk, warps = _TILE, LAUNCH["cols"]["bk"], LAUNCH["cols"]["warps"]
    else:
        rows_q, rows_qt = _round_up(m, pad_rows_to), 0
        q = torch.empty((rows_q, k), dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty((kb, rows_q), dtype=torch.float32, device=dev)
        bm, bk, warps = LAUNCH["rows"]["bm"], _TILE, LAUNCH["rows"]["warps"]
    grid = (triton.cdiv(max(rows_q, rows_qt), bm), triton.cdiv(k, bk))
    # The kernel's pointer slots of the other kind are compiled out (``COLS``); x2d stands in for them.
    row_out, col_out = ((x2d, x2d), (q, s)) if cols else ((q, s), (x2d, x2d))
    _act_quant_kernel[grid](
        x2d,
        *row_out,
        *col_out,
        m,
        k,
        x2d.stride(0),
        rows_q,
        rows_qt,
        POW2=pow2,
        ROUND=round_code,
        COLS=cols,
        BM=bm,
        BK=bk,
        num_warps=warps,
    )
    return q, s


def quantize_rows(
    x2d: torch.Tensor,
    pow2_scales: bool = False,
    pad_rows_to: int = 16,
    round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim of ``x2d`` (M, K) -> (q (M_pad, K), s_t (Kb, M_pad))."""
    return _launch_act(x2d, pow2_scales, False, pad_rows_to, round_to)


def quantize_cols(
    x2d: torch.Tensor, pow2_scales: bool = False, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the first (token) dim of ``x2d`` (M, K) -> (qt (K, M_128), st (M_128/128, K))."""
    return _launch_act(x2d, pow2_scales, True, 1, round_to)


def quantize_rows_and_cols(
    x2d: torch.Tensor,
    pow2_scales: bool = False,
    pad_rows_to: int = 16,
    round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both of the above, one kernel each: (q, s_t, qt, st)."""
    q, s_t = quantize_rows(x2d, pow2_scales, pad_rows_to, round_to)
    qt, st = quantize_cols(x2d, pow2_scales, round_to)
    return q, s_t, qt, st


def quantize_weight(
    w: torch.Tensor, pow2_scales: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of ``w`` (N, K) -> (w_fp8 (N, K), weight_scale_inv (ceil(N/128), ceil(K/128))), written
    into ``out`` (two contiguous tensors of those shapes and dtypes) when given."""
    if w.stride(-1) != 1:
        w = w.contiguous()
    n, k = w.shape
    nb, kb = -(-n // _TILE), -(-k // _TILE)
    if out is None:
        q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
    else:
        q, s = out
        if (q.shape, s.shape, q.dtype, s.dtype) != (
            (n, k),
            (nb, kb),
            torch.float8_e4m3fn,
            torch.float32,
        ) or not (q.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"quantize_weight: out must be contiguous e4m3 {(n, k)} and float32 {(nb, kb)}")
    _weight_quant_kernel[(nb, kb)](
        w, q, s, n, k, w.stride(0), kb, POW2=pow2_scales, B=_TILE, num_warps=LAUNCH["weight"]["warps"]
    )
    return q, s


def quantize_weight_blocks(
    flat: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    blocks: torch.Tensor,
    start: int,
    pow2_scales: bool,
    aligned: bool = False,
) -> None:
    """``quantize_weight`` of many weights stored one after another in ``flat`` (FP32), in one launch: row i
    of ``blocks`` (int64, (n, 6)) names a 128x128 block (weight offset in ``flat``, N, K, block row, block
    column, index in ``scales``); its codes go to ``codes`` at the weight's offset minus ``start``.
    ``aligned``: every weight offset, K and ``start`` are multiples of 16 (vectorized loads and stores).
    ``trainers/torch/master_weights.Fp8Region`` builds the table."""
    if blocks.shape[0] == 0:
        return
    _weight_blocks_kernel[(blocks.shape[0],)](
        flat, codes, scales, blocks, start, POW2=pow2_scales, ALIGNED=aligned, B=_TILE,
        num_warps=LAUNCH["weight"]["warps"],
    )  # fmt: skip


def quantize_weight_with_transpose(
    w: torch.Tensor, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``quantize_weight`` plus w_fp8^T (K, N) contiguous for dgrad, moved as bytes by ``transpose_fp8``.

    The weight kernel used to write W^T itself from the same registers (a second, transposed store). On an
    H100 the two kernels are faster for BF16 weights (2-20% by shape, bench/quantizers.py, docs/performance.md,
    session 25: Triton routed the BF16 input tile through shared memory for the transposed store and wrote W
    a byte at a time), and FP32 weights had taken this way since the fused store returned wrong bytes for
    FP32 input on an H200 (cause not established).
    """
    q, s = quantize_weight(w, pow2_scales)
    return q, s, transpose_fp8(q)
