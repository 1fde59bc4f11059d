"""Fused elementwise kernels of the decode step (Triton, CUDA), each with its plain-torch twin (CPU).

Why: inside a CUDA graph the host cost is gone, and what remained of a 1.5B decode step at batch 64 was
~40 tiny kernels per layer (RMSNorm alone is 7 torch ops, rotary embedding ~10, the KV write 2, SiLU*up 2):
3 ms of 5 ms per step on an H100 (bench/rollout.py --profile, docs/performance.md). Here each is one kernel:

* ``add_rms_norm``: residual add (in place, rounded to the model dtype as torch does) then Qwen2RMSNorm
  (FP32 statistics, cast, times the weight).
* ``rope_write_kv``: rotary embedding of q and k straight from the fused qkv output, k and v written into
  the cache slot at the row's position; returns q (B, H, D).
* ``silu_mul``: ``silu(gate) * up`` from the fused gate|up output, by the trainer's formula
  (``trainers/torch/fused_layers._silu``: Triton's exponential, its plain FP32 division), so that both give
  the same bits from the same gate and up (GPU test in tests/test_fused_layers_gpu.py). Until session 61 it
  divided correctly rounded (``div_rn``): ~9 more instructions per element, which the quantizing form,
  issue-bound, paid in time (docs/performance.md, "Rollout decode", session 61).

FP8 (``quant=True``): ``add_rms_norm`` and ``silu_mul`` also quantize their output in 1x128 tiles with the
trainer's rule (``fp8.quant_triton``: scale = amax / 448, codes = x times its correctly rounded reciprocal, rounded
to nearest even with saturation),
so the next GEMM reads FP8 activations quantized once, in the producer, instead of once per GEMM call;
they return ``QuantizedRows`` (the layout ``F.scaled_mm`` takes) in place of the BF16 tensor.

On Hopper and later every kernel here (and the attention and FP8 GEMM kernels) is launched with
programmatic dependent launch and waits for its predecessor inside (``pdl.py``).

The roundings follow torch's op by op (each product rounded to the model dtype where torch rounds), so
the outputs equal the torch versions up to the order of the FP32 sums (RMSNorm's mean) and, in SiLU, the
last bits of Triton's exponential and division.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native import pdl
    from infir2_rl.engines.native.pdl import wait_then_release
    from infir2_rl.fp8.quant_triton import _tile_scales, _to_e4m3

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False


@dataclass
class QuantizedRows:
    """FP8 activations quantized in 1x128 tiles: q (M_pad, K) e4m3, s_t (Kb, M_pad) FP32; m real rows."""

    q: Tensor
    s_t: Tensor
    m: int


@dataclass
class SplitPartials:
    """A split-K GEMM's FP32 partial products ``part`` (split, M, N) and its ``bias``, not yet summed
    (``fp8_gemm.w8a8_partials``): the kernel that consumes the output (``add_rms_norm``, ``rope_write_kv``)
    sums them as the GEMM's sum kernel would (in split order, then the bias, rounded once to ``dtype``), so
    the result has the same bits and the decode step one launch fewer. One part in ``dtype`` (a GEMM's
    rounded output, ``linears.FusedLinear._invariant``) leaves only the bias to add: rounded as torch's
    ``y + bias``."""

    part: Tensor
    dtype: torch.dtype
    bias: Tensor | None = None

    def total(self) -> Tensor:
        """The sum kernel's result, in torch."""
        acc = self.part[0].to(torch.float32, copy=True)
        for p in self.part[1:]:
            acc += p
        if self.bias is not None:
            acc += self.bias.float()
        return acc.to(self.dtype)


def use_triton(x: Tensor) -> bool:
    return _HAVE_TRITON and x.is_cuda


def _pad16(m: int) -> int:
    return -(-m // 16) * 16


# ---- torch twins (CPU, and the reference in tests) --------------------------------------------------


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen2RMSNorm: normalize in FP32, cast back to x's dtype, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half convention) with cos/sin broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---- Triton ------------------------------------------------------------------------------------------

if _HAVE_TRITON:

    @triton.jit
    def _sum_partials(
        part_ptr,
        offs,
        part_stride,
        bias_ptr,
        bias_offs,
        mask,
        other,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """``SplitPartials``' sum in FP32: partials 0..SPLIT-1 (``part_stride`` elements apart) added in split
        order to zero, then the bias. The one place the order is written, so the GEMM's own sum kernel
        (``fp8_gemm._split_sum_kernel``) and the consumers that sum the partials themselves (add+RMSNorm,
        rotary+KV) give the same bits once each rounds the result to its dtype. ``mask`` / ``other``: as
        ``tl.load``'s (both None: every element is loaded). The sum starts from partial 0, not from a zero
        (0.0 + -0.0 is +0.0), so torch's ``p0 + p1 + ...`` in order gives the same bits
        (``models/invariant_ops``' split GEMM on cuBLASLt)."""
        acc = tl.load(part_ptr + offs, mask=mask, other=other).to(tl.float32)
        for sp in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + sp * part_stride + offs, mask=mask, other=other)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + bias_offs, mask=mask, other=other).to(tl.float32)
        return acc

    @triton.jit
    def _quant_store(y, q_ptr, s_ptr, row, rows_pad, K, tiles, cols, POW2: tl.constexpr):
        """Quantize y (T, 128) FP32 (tiles x 128 columns of one row) and store q and the scales."""
        s = _tile_scales(y, 1, POW2)
        q = _to_e4m3(y, s[:, None])
        mask = cols < K
        tl.store(q_ptr + row.to(tl.int64) * K + cols, q, mask=mask)  # (padding rows: y = 0 -> q 0, s 1)
        tl.store(s_ptr + tiles * rows_pad + row, s[:, None], mask=tiles * 128 < K)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr, d_ptr, bias_ptr, w_ptr, out_ptr, q_ptr, s_ptr, M, E, rows_pad, eps,
        HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr,
        POW2: tl.constexpr,
        TILES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        # Programs for rows M..rows_pad-1 (FP8 only) read zeros and so write the padding rows' codes 0 and
        # scales 1, which the GEMMs expect: no separate fill of the buffers.
        row = tl.program_id(0)
        tiles = tl.arange(0, TILES)[:, None]
        cols = tiles * 128 + tl.arange(0, 128)[None, :]
        mask = (cols < E) & (row < M)
        offs = row.to(tl.int64) * E + cols
        x = tl.load(h_ptr + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            if SPLIT > 0:  # SplitPartials: the sum kernel's sum, bias and rounding, here
                d = _sum_partials(d_ptr, offs, M * E, bias_ptr, cols, mask, 0.0, SPLIT, HAS_BIAS)
                d = d.to(x.dtype).to(tl.float32)
            else:
                d = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + d).to(x.dtype)
            tl.store(h_ptr + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(tl.sum(xf * xf, axis=1), axis=0) / E
        y = (xf * (1.0 / tl.sqrt_rn(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        if QUANT:
            _quant_store(out.to(tl.float32), q_ptr, s_ptr, row, rows_pad, E, tiles, cols, POW2)
        else:
            tl.store(out_ptr + offs, out, mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        gate_ptr, up_ptr, stride_row, out_ptr, q_ptr, s_ptr, M, inter, rows_pad,
        QUANT: tl.constexpr, POW2: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """gate and up: (M, inter) with one row stride (the halves of a fused gate|up output, or two tensors)."""
        if PDL:
            wait_then_release()
        row, part = tl.program_id(0), tl.program_id(1)  # rows M..rows_pad-1: padding (see the norm)
        tiles = part * TILES + tl.arange(0, TILES)[:, None]
        cols = tiles * 128 + tl.arange(0, 128)[None, :]
        mask = (cols < inter) & (row < M)
        base = row.to(tl.int64) * stride_row
        gate = tl.load(gate_ptr + base + cols, mask=mask, other=0.0)
        up = tl.load(up_ptr + base + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        if QUANT:
            _quant_store(out.to(tl.float32), q_ptr, s_ptr, row, rows_pad, inter, tiles, cols, POW2)
        else:
            tl.store(out_ptr + row.to(tl.int64) * inter + cols, out, mask=mask)

    @triton.jit
    def _qkv_load(
        row, cols, bias_ptr, part_stride, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr
    ):
        """Columns ``cols`` of one qkv row, in ``DTYPE``: loaded, or (SPLIT > 0) the partials' sum (then the
        bias) rounded as the sum kernel rounds it."""
        if SPLIT == 0:
            out = tl.load(row + cols)
        else:
            out = _sum_partials(row, cols, part_stride, bias_ptr, cols, None, None, SPLIT, HAS_BIAS).to(DTYPE)
        return out

    @triton.jit
    def _rotated(x, partner, cos, sin):
        """One half of rotate-half RoPE, rounded as torch's ``x * cos + rotated * sin`` in x's dtype: each
        product, then their sum. Launched with ``enable_fp_fusion=False``: with Triton's default, LLVM
        narrows the BF16 round trips to BF16 arithmetic and contracts one product and the sum into an FMA,
        which skips that product's rounding (1 ulp in a quarter of the outputs, H100, session 20)."""
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        r = (partner.to(tl.float32) * sin).to(x.dtype).to(tl.float32)
        return (a + r).to(x.dtype)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, bias_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
        stride_qkv, part_stride, k_offset, v_offset, stride_cs, stride_ch, stride_ct,
        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (b, h): query head h of row b when h < H, else kv head h - H (k rotated, both cached).
        Each half of a head is loaded once; the other half is its rotation partner."""
        if PDL:
            wait_then_release()
        b, h = tl.program_id(0), tl.program_id(1)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        half: tl.constexpr = D // 2
        dh = tl.arange(0, half)
        cos_lo = tl.load(cos_ptr + pos * D + dh).to(tl.float32)
        cos_hi = tl.load(cos_ptr + pos * D + half + dh).to(tl.float32)
        sin_lo = tl.load(sin_ptr + pos * D + dh).to(tl.float32)
        sin_hi = tl.load(sin_ptr + pos * D + half + dh).to(tl.float32)
        row = qkv_ptr + b.to(tl.int64) * stride_qkv
        dt = q_ptr.dtype.element_ty
        # q: heads 0..H-1 at column h*D; k at k_offset; v at v_offset.
        col = tl.where(h < H, h * D, k_offset + (h - H) * D)
        lo = _qkv_load(row, col + dh, bias_ptr, part_stride, SPLIT, HAS_BIAS, dt)
        hi = _qkv_load(row, col + half + dh, bias_ptr, part_stride, SPLIT, HAS_BIAS, dt)
        out_lo = _rotated(lo, -hi.to(tl.float32), cos_lo, sin_lo)  # negation: exact
        out_hi = _rotated(hi, lo, cos_hi, sin_hi)
        if h < H:
            q_at = (b * H + h).to(tl.int64) * D
            tl.store(q_ptr + q_at + dh, out_lo)
            tl.store(q_ptr + q_at + half + dh, out_hi)
        else:
            slot = tl.load(slot_ptr + b).to(tl.int64)
            kv_at = slot * stride_cs + (h - H) * stride_ch + pos * stride_ct
            tl.store(k_ptr + kv_at + dh, out_lo)
            tl.store(k_ptr + kv_at + half + dh, out_hi)
            d = tl.arange(0, D)
            v = _qkv_load(row, v_offset + (h - H) * D + d, bias_ptr, part_stride, SPLIT, HAS_BIAS, dt)
            tl.store(v_ptr + kv_at + d, v)


def quant_buffers(m: int, k: int, device: torch.device) -> QuantizedRows:
    """Uninitialized FP8 rows (M padded to 16) and scales: the producer kernel writes every row, padding
    included (codes 0, scale 1), so no fill kernel runs (they were 84 of a decode step's launches at 1.5B)."""
    rows = _pad16(m)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    return QuantizedRows(q, torch.empty(-(-k // 128), rows, dtype=torch.float32, device=device), m)


NORM_WARPS = 8  # add_rms_norm's warps without quantization (what the true_on_policy walk runs): see there


def add_rms_norm(
    h: Tensor,
    delta: Tensor | SplitPartials | None,
    weight: Tensor,
    eps: float,
    quant: bool = False,
    pow2: bool = False,
    num_warps: int | None = None,
) -> Tensor | QuantizedRows:
    """``h += delta`` (in place, if given), then RMSNorm(h) * weight; FP8 rows when ``quant``. h (M, E).
    One program per row of ``num_warps`` warps, by default 16 when quantizing and 8 otherwise: against 4,
    3.73 -> 2.13 and 1.41 -> 1.37 us per call at the 1.5B shape and batch 64 (H100,
    bench/decode_elementwise.py). The warps set the order of the FP32 mean, so one setting per mode: with
    16 the quantized rows differed from ``quantize_rows`` of the 8-warp kernel's output in 8 of 32,768 rows
    at hidden 1,536, so true_on_policy's decode quantizes with ``num_warps=NORM_WARPS``, which gives those
    codes (tests/test_true_on_policy_gpu.py). ``delta`` may be a split-K GEMM's unsummed partials
    (``SplitPartials``), summed here."""
    if isinstance(delta, SplitPartials) and delta.dtype != h.dtype:
        raise ValueError(f"partials rounded to {delta.dtype} cannot be added to {h.dtype} rows")
    if not use_triton(h):
        if delta is not None:
            h.copy_(h + (delta.total() if isinstance(delta, SplitPartials) else delta))
        return rms_norm_torch(h, weight, eps)
    split, bias = 0, None
    if isinstance(delta, SplitPartials):
        split, bias, delta = delta.part.shape[0], delta.bias, delta.part
    m, e = h.shape
    num_warps = num_warps if num_warps is not None else 16 if quant else NORM_WARPS
    out = torch.empty_like(h) if not quant else h
    qr = quant_buffers(m, e, h.device) if quant else None
    _add_rms_norm_kernel[(qr.q.shape[0] if qr else m,)](
        h, delta if delta is not None else h, bias if bias is not None else h, weight, out,
        qr.q if qr else h, qr.s_t if qr else h, m, e, qr.q.shape[0] if qr else 0, eps,
        HAS_DELTA=delta is not None, SPLIT=split, HAS_BIAS=bias is not None, QUANT=quant, POW2=pow2,
        TILES=triton.next_power_of_2(-(-e // 128)), num_warps=num_warps, **pdl.launch_kwargs(h.device),
    )  # fmt: skip
    return qr if qr is not None else out


def silu_launch(m: int, quant: bool) -> tuple[int, int]:
    """(128-column tiles per program, warps) of SiLU*up at M rows: the fastest in
    ``bench/decode_elementwise.py`` at the 1.5B shape (H100, docs/performance.md). Few rows want short
    programs (more of them in flight); the quantizing kernel wants shorter ones than the BF16 kernel up to
    M = 64. After the quantization's division became one per tile (session 21) the chain bench ranked
    8 tiles of 4 warps first, and 8 warps for the quantizing norm, but in the decode step they made FP8
    slower at batch 64 (1.94 against 1.87 ms per step, bench/rollout.py, one H100), so these stay."""
    if quant:
        return (2, 4) if m <= 64 else (8, 8)
    return (2, 4) if m <= 16 else (4, 4) if m <= 64 else (8, 8)


def silu_mul(
    gate_up: Tensor,
    quant: bool = False,
    pow2: bool = False,
    tiles: int | None = None,
    num_warps: int | None = None,
    rows: int = 0,
) -> Tensor | QuantizedRows:
    """``silu(gate) * up`` of a fused (M, 2I) gate|up output -> (M, I), or FP8 rows when ``quant``: the
    arguments as ``silu_mul_apart``'s, on the output's two halves."""
    inter = gate_up.shape[1] // 2
    return silu_mul_apart(gate_up[:, :inter], gate_up[:, inter:], quant, pow2, tiles, num_warps, rows)


def silu_mul_apart(
    gate: Tensor,
    up: Tensor,
    quant: bool = False,
    pow2: bool = False,
    tiles: int | None = None,
    num_warps: int | None = None,
    rows: int = 0,
) -> Tensor | QuantizedRows:
    """``silu(gate) * up`` of gate and up (M, I), read where they are (the halves of a fused gate|up output, or
    the true_on_policy walk's two GEMM outputs): one shape and one row stride, columns contiguous. One program
    per row and ``tiles`` 128-column tiles, ``num_warps`` warps (by default ``silu_launch``). ``rows`` > M
    (BF16): the output is the first M rows of a ``rows``-row buffer (the rest unwritten), for a GEMM that runs
    on that many rows (``models/invariant_ops``' padded plans) without copying."""
    if gate.shape != up.shape or gate.stride() != up.stride() or gate.stride(1) != 1:
        raise ValueError(
            f"silu_mul: gate {tuple(gate.shape)} strides {gate.stride()} and up {tuple(up.shape)} strides "
            f"{up.stride()}: need one shape and one row stride, columns contiguous"
        )
    m, inter = gate.shape
    if not use_triton(gate):
        return F.silu(gate) * up
    default_tiles, default_warps = silu_launch(m, quant)
    tiles = tiles if tiles is not None else default_tiles
    num_warps = num_warps if num_warps is not None else default_warps
    out = torch.empty(max(m, rows), inter, dtype=gate.dtype, device=gate.device)[:m] if not quant else gate
    qr = quant_buffers(m, inter, gate.device) if quant else None
    grid = (qr.q.shape[0] if qr else m, triton.cdiv(triton.cdiv(inter, 128), tiles))
    _silu_mul_kernel[grid](
        gate, up, gate.stride(0), out, qr.q if qr else gate, qr.s_t if qr else gate, m, inter,
        qr.q.shape[0] if qr else 0,
        QUANT=quant, POW2=pow2, TILES=tiles, num_warps=num_warps, **pdl.launch_kwargs(gate.device),
    )  # fmt: skip
    return qr if qr is not None else out


def rope_write_kv(
    qkv: Tensor | SplitPartials,
    positions: Tensor,
    slots: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    heads: int,
    kv_heads: int,
    k_offset: int,
    v_offset: int,
) -> Tensor:
    """Rotate q, k of a fused qkv output (B, N) at each row's position, write k, v into the cache slots;
    returns q (B, H, D). ``k_offset`` / ``v_offset``: first column of k / v in qkv. ``qkv`` may be a
    split-K GEMM's unsummed partials (``SplitPartials``), summed here."""
    if isinstance(qkv, SplitPartials) and not use_triton(qkv.part):
        qkv = qkv.total()
    if isinstance(qkv, SplitPartials):  # the kernel reads partial p of a row at rows_t[row] + p * stride
        split, part_stride, rows_t = len(qkv.part), qkv.part.stride(0), qkv.part[0]
        bias, dtype = qkv.bias, qkv.dtype
    else:
        split, part_stride, rows_t, bias, dtype = 0, 0, qkv, None, qkv.dtype
    num_rows, dim = rows_t.shape[0], k_cache.shape[-1]
    if not use_triton(rows_t):
        assert isinstance(qkv, Tensor)
        q = qkv[:, : heads * dim].reshape(num_rows, heads, dim)
        k = qkv[:, k_offset : k_offset + kv_heads * dim].reshape(num_rows, kv_heads, dim)
        v = qkv[:, v_offset : v_offset + kv_heads * dim].reshape(num_rows, kv_heads, dim)
        c, s = cos[positions][:, None], sin[positions][:, None]
        k_cache[slots, :, positions] = rotate_torch(k, c, s)
        v_cache[slots, :, positions] = v
        return rotate_torch(q, c, s)
    if dtype != k_cache.dtype:
        raise ValueError(f"qkv in {dtype} cannot be written to a {k_cache.dtype} KV cache")
    q_out = torch.empty(num_rows, heads, dim, dtype=dtype, device=rows_t.device)
    _rope_kv_kernel[(num_rows, heads + kv_heads)](
        rows_t, bias if bias is not None else rows_t, positions, slots, cos, sin, q_out, k_cache, v_cache,
        rows_t.stride(0), part_stride, k_offset, v_offset,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), SPLIT=split, HAS_BIAS=bias is not None,
        H=heads, D=dim, num_warps=1, enable_fp_fusion=False, **pdl.launch_kwargs(rows_t.device),
    )  # fmt: skip
    return q_out
