"""Fused elementwise kernels of the decode step (Triton, CUDA), each with its plain-torch twin (CPU).

Why: inside a CUDA graph the host cost is gone, and what remained of a 1.5B decode step at batch 64 was
~40 tiny kernels per layer (RMSNorm alone is 7 torch ops, rotary embedding ~10, the KV write 2, SiLU*up 2):
3 ms of 5 ms per step on an H100 (bench/rollout.py --profile, docs/performance.md). Here each is one kernel:

* ``add_rms_norm``: residual add (in place, rounded to the model dtype as torch does) then Qwen2RMSNorm
  (FP32 statistics, cast, times the weight).
* ``rope_write_kv``: rotary embedding of q and k straight from the fused qkv output, k and v written into
  the cache slot at the row's position; returns q (B, H, D).
* ``silu_mul``: ``silu(gate) * up`` from the fused gate|up output.

FP8 (``quant=True``): ``add_rms_norm`` and ``silu_mul`` also quantize their output in 1x128 tiles with the
trainer's rule (``fp8.quant_triton``: scale = amax / 448, IEEE division, clamp, round to nearest even),
so the next GEMM reads FP8 activations quantized once, in the producer, instead of once per GEMM call;
they return ``QuantizedRows`` (the layout ``F.scaled_mm`` takes) in place of the BF16 tensor.

On Hopper and later every kernel here (and the attention and FP8 GEMM kernels) is launched with
programmatic dependent launch and waits for its predecessor inside (``pdl.py``).

The roundings follow torch's op by op (each product rounded to the model dtype where torch rounds), so
the outputs equal the torch versions up to the order of the FP32 sums (RMSNorm's mean).
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
    from infir2_rl.fp8.quant_triton import _is_nonfinite, _scale_from_amax

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
    """A split-K GEMM's FP32 partial products ``part`` (split, M, N), not yet summed (``fp8_gemm.w8a8_fused``
    with ``defer_sum``): ``add_rms_norm`` sums them as the GEMM's sum kernel would (in split order, from
    zero, rounded to ``dtype``), so the result has the same bits and the decode step one launch fewer."""

    part: Tensor
    dtype: torch.dtype

    def total(self) -> Tensor:
        """The sum kernel's result, in torch."""
        acc = torch.zeros_like(self.part[0])
        for p in self.part:
            acc += p
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
    def _quant_store(y, q_ptr, s_ptr, row, rows_pad, K, tiles, cols, POW2: tl.constexpr):
        """Quantize y (T, 128) FP32 (tiles x 128 columns of one row) and store q and the scales."""
        ay = tl.abs(y)
        s = _scale_from_amax(tl.max(ay, axis=1), tl.sum(_is_nonfinite(ay), axis=1), POW2)
        q = tl.math.div_rn(y, tl.broadcast_to(s[:, None], y.shape))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
        mask = cols < K
        tl.store(q_ptr + row.to(tl.int64) * K + cols, q, mask=mask)  # (padding rows: y = 0 -> q 0, s 1)
        tl.store(s_ptr + tiles * rows_pad + row, s[:, None], mask=tiles * 128 < K)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr, d_ptr, w_ptr, out_ptr, q_ptr, s_ptr, M, E, rows_pad, eps,
        HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr,
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
            if SPLIT > 0:  # SplitPartials: fp8_gemm._split_sum_kernel's sum and rounding, here
                d = tl.zeros((TILES, 128), tl.float32)
                for sp in tl.static_range(SPLIT):
                    d += tl.load(d_ptr + sp * M * E + offs, mask=mask, other=0.0)
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
        gu_ptr, out_ptr, q_ptr, s_ptr, M, inter, rows_pad,
        QUANT: tl.constexpr, POW2: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        row, part = tl.program_id(0), tl.program_id(1)  # rows M..rows_pad-1: padding (see the norm)
        tiles = part * TILES + tl.arange(0, TILES)[:, None]
        cols = tiles * 128 + tl.arange(0, 128)[None, :]
        mask = (cols < inter) & (row < M)
        base = row.to(tl.int64) * 2 * inter
        gate = tl.load(gu_ptr + base + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + base + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        if QUANT:
            _quant_store(out.to(tl.float32), q_ptr, s_ptr, row, rows_pad, inter, tiles, cols, POW2)
        else:
            tl.store(out_ptr + row.to(tl.int64) * inter + cols, out, mask=mask)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
        stride_qkv, k_offset, v_offset, stride_cs, stride_ch, stride_ct,
        H: tl.constexpr, KVH: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        b = tl.program_id(0)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        d = tl.arange(0, D)[None, :]
        half: tl.constexpr = D // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        heads = tl.arange(0, HP)[:, None]
        row = qkv_ptr + b.to(tl.int64) * stride_qkv
        # q: heads 0..H-1 at column h*D; k at k_offset; v at v_offset.
        qm = heads < H
        x = tl.load(row + heads * D + d, mask=qm, other=0.0)
        xr = tl.load(row + heads * D + partner, mask=qm, other=0.0).to(tl.float32) * sign
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        r = (xr.to(x.dtype).to(tl.float32) * sin).to(x.dtype).to(tl.float32)
        tl.store(q_ptr + (b * H + heads).to(tl.int64) * D + d, (a + r).to(x.dtype), mask=qm)
        km = heads < KVH
        k = tl.load(row + k_offset + heads * D + d, mask=km, other=0.0)
        kr = tl.load(row + k_offset + heads * D + partner, mask=km, other=0.0).to(tl.float32) * sign
        a = (k.to(tl.float32) * cos).to(k.dtype).to(tl.float32)
        r = (kr.to(k.dtype).to(tl.float32) * sin).to(k.dtype).to(tl.float32)
        dst = slot * stride_cs + heads * stride_ch + pos * stride_ct + d
        tl.store(k_ptr + dst, (a + r).to(k.dtype), mask=km)
        v = tl.load(row + v_offset + heads * D + d, mask=km, other=0.0)
        tl.store(v_ptr + dst, v, mask=km)


def quant_buffers(m: int, k: int, device: torch.device) -> QuantizedRows:
    """Uninitialized FP8 rows (M padded to 16) and scales: the producer kernel writes every row, padding
    included (codes 0, scale 1), so no fill kernel runs (they were 84 of a decode step's launches at 1.5B)."""
    rows = _pad16(m)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    return QuantizedRows(q, torch.empty(-(-k // 128), rows, dtype=torch.float32, device=device), m)


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
    bench/decode_elementwise.py). The warps set the order of the FP32 mean, so one setting per mode.
    ``delta`` may be a split-K GEMM's unsummed partials (``SplitPartials``), summed here."""
    if isinstance(delta, SplitPartials) and delta.dtype != h.dtype:
        raise ValueError(f"partials rounded to {delta.dtype} cannot be added to {h.dtype} rows")
    if not use_triton(h):
        if delta is not None:
            h.copy_(h + (delta.total() if isinstance(delta, SplitPartials) else delta))
        return rms_norm_torch(h, weight, eps)
    split = 0
    if isinstance(delta, SplitPartials):
        split, delta = delta.part.shape[0], delta.part
    m, e = h.shape
    num_warps = num_warps if num_warps is not None else 16 if quant else 8
    out = torch.empty_like(h) if not quant else h
    qr = quant_buffers(m, e, h.device) if quant else None
    _add_rms_norm_kernel[(qr.q.shape[0] if qr else m,)](
        h, delta if delta is not None else h, weight, out,
        qr.q if qr else h, qr.s_t if qr else h, m, e, qr.q.shape[0] if qr else 0, eps,
        HAS_DELTA=delta is not None, SPLIT=split, QUANT=quant, POW2=pow2,
        TILES=triton.next_power_of_2(-(-e // 128)), num_warps=num_warps, **pdl.launch_kwargs(h.device),
    )  # fmt: skip
    return qr if qr is not None else out


def silu_launch(m: int, quant: bool) -> tuple[int, int]:
    """(128-column tiles per program, warps) of SiLU*up at M rows: the fastest in
    ``bench/decode_elementwise.py`` at the 1.5B shape (H100, docs/performance.md). Few rows want short
    programs (more of them in flight); the quantizing kernel, which divides every element, wants shorter
    ones than the BF16 kernel up to M = 64."""
    if quant:
        return (2, 4) if m <= 64 else (8, 8)
    return (2, 4) if m <= 16 else (4, 4) if m <= 64 else (8, 8)


def silu_mul(
    gate_up: Tensor,
    quant: bool = False,
    pow2: bool = False,
    tiles: int | None = None,
    num_warps: int | None = None,
) -> Tensor | QuantizedRows:
    """``silu(gate) * up`` of a fused (M, 2I) gate|up output -> (M, I), or FP8 rows when ``quant``.
    One program per row and ``tiles`` 128-column tiles, ``num_warps`` warps (by default ``silu_launch``)."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if not use_triton(gate_up):
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return F.silu(gate) * up
    default_tiles, default_warps = silu_launch(m, quant)
    tiles = tiles if tiles is not None else default_tiles
    num_warps = num_warps if num_warps is not None else default_warps
    out = torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device) if not quant else gate_up
    qr = quant_buffers(m, inter, gate_up.device) if quant else None
    grid = (qr.q.shape[0] if qr else m, triton.cdiv(triton.cdiv(inter, 128), tiles))
    _silu_mul_kernel[grid](
        gate_up, out, qr.q if qr else gate_up, qr.s_t if qr else gate_up, m, inter,
        qr.q.shape[0] if qr else 0,
        QUANT=quant, POW2=pow2, TILES=tiles, num_warps=num_warps, **pdl.launch_kwargs(gate_up.device),
    )  # fmt: skip
    return qr if qr is not None else out


def rope_write_kv(
    qkv: Tensor,
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
    returns q (B, H, D). ``k_offset`` / ``v_offset``: first column of k / v in qkv."""
    num_rows, dim = qkv.shape[0], k_cache.shape[-1]
    if not use_triton(qkv):
        q = qkv[:, : heads * dim].reshape(num_rows, heads, dim)
        k = qkv[:, k_offset : k_offset + kv_heads * dim].reshape(num_rows, kv_heads, dim)
        v = qkv[:, v_offset : v_offset + kv_heads * dim].reshape(num_rows, kv_heads, dim)
        c, s = cos[positions][:, None], sin[positions][:, None]
        k_cache[slots, :, positions] = rotate_torch(k, c, s)
        v_cache[slots, :, positions] = v
        return rotate_torch(q, c, s)
    q_out = torch.empty(num_rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(num_rows,)](
        qkv, positions, slots, cos, sin, q_out, k_cache, v_cache,
        qkv.stride(0), k_offset, v_offset, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=heads, KVH=kv_heads, HP=max(triton.next_power_of_2(heads), 1), D=dim, num_warps=4,
        **pdl.launch_kwargs(qkv.device),
    )  # fmt: skip
    return q_out
