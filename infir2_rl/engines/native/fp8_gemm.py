"""W8A8 blockwise FP8 GEMM for decode, with the activation quantization fused in (Triton, CUDA only).

``y = quant(x) @ W^T`` where x (M, K) is BF16, W (N, K) is e4m3 with one FP32 ``weight_scale_inv`` per
128x128 block, and quant(x) is the trainer's 1x128 activation quantizer (``fp8.quant_triton``: scale =
amax / 448 per 128 elements of a row, codes = x times its correctly rounded reciprocal, rounded to
nearest even with saturation). So the FP8 operands are byte for byte the ones the trainer's forward
multiplies; only the FP32 summation order differs.

Why a kernel of our own at decode sizes (M = batch <= 256): the GEMM reads N x K weight bytes and only
M x K activations, so it is bound by weight bandwidth, where FP8 halves the bytes against BF16. The
general path (quantize kernel, then cuBLASLt ``scaled_mm`` blockwise) is two launches and a round trip of
the quantized activations through memory, and cuBLASLt's blockwise kernels measured slower than BF16 GEMMs
at these M (docs/performance.md). Here one program owns a BM x BN output tile and walks K in 128-wide
blocks: it loads the BF16 activation block, quantizes it in registers (the row's scale for that block is
computed from the block itself, since a 1x128 tile is exactly one K block), multiplies with the FP8 weight
block on the tensor cores, and adds ``dot * (s_x[row] * s_w[block])`` to an FP32 accumulator in one FMA, the
rounding cuBLASLt's blockwise kernel applies (so, without split-K, the same bits as cuBLASLt on the same FP8
operands: ``bench/cublaslt_bits.py``). Every program quantizes the activations of its rows again; they are tiny
and come from L2.

Split-K (``split_k > 1``): the K blocks are divided among ``split_k`` programs per tile, which write FP32
partials summed afterwards (``_split_sum_kernel``: sum, bias and cast in one launch): needed when N / BN tiles
alone are too few programs to pull the weights at full bandwidth (o_proj and down_proj of a 1.5B model have
only 24 tiles of 64 rows). In decode every split-K layer's partials skip that kernel: the kernel after the
GEMM (add+RMSNorm after o_proj and down_proj, rotary+KV write after q|k|v) sums them in the same order
(``w8a8_partials``, ``fused_ops.SplitPartials``).
Which config (or cuBLASLt) runs at a given (M, N, K) is chosen by timing them (``linears.Fp8GemmChooser``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infir2_rl.engines.native.fused_ops import SplitPartials

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native import pdl
    from infir2_rl.engines.native.fused_ops import _sum_partials
    from infir2_rl.engines.native.pdl import wait_then_release
    from infir2_rl.fp8.quant_triton import _tile_scales, _to_e4m3

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of the fused kernel: output tile BM x BN, ``split_k`` programs along K, warps, stages."""

    bm: int
    bn: int
    split_k: int
    warps: int = 4
    stages: int = 3

    def __str__(self) -> str:
        return f"triton bm{self.bm} bn{self.bn} sk{self.split_k} w{self.warps} s{self.stages}"


def candidates(m: int, prequant: bool = True) -> list[GemmConfig]:
    """Launch shapes timed at start-up for M rows: BM 16 for tiny batches, else 64 (and 128 from M = 128);
    split-K for narrow N; more warps / stages to keep more weight bytes in flight. Each shape is one Triton
    compile on a fresh machine (~1 s), so the list stays short; ``bench/rollout.py --gemms`` prints every
    candidate's time per decode shape, which is how this list is pruned or extended. Prefill input
    (``prequant`` False) from M = 128 gets only the BM 128 shapes: cuBLASLt won every such shape measured on
    an H100 (M 96..16,384), and timing a dozen decode-sized kernels there cost seconds per new M bucket."""
    if not prequant and m >= 128:
        return [GemmConfig(128, 64, 1, 4, 3), GemmConfig(128, 128, 1, 8, 3)]
    bm = 16 if m <= 16 else 64
    shapes = [
        (32, 1, 4, 3), (64, 1, 4, 3), (128, 1, 4, 3), (32, 4, 4, 3), (64, 4, 4, 3), (64, 8, 4, 3),
        (64, 1, 4, 5), (128, 1, 8, 4), (64, 2, 4, 4), (128, 2, 8, 3),
    ]  # fmt: skip
    if prequant:  # seven stages of FP8 tiles fit shared memory; of BF16 input tiles (BM 64) they do not
        shapes.append((64, 1, 4, 7))
    if m > 16:  # the narrow GEMMs (q|k|v, o_proj) at M 128-256 on an H200: 0.2-0.6 us faster than the above
        shapes += [(64, 1, 8, 4), (32, 2, 4, 5)]  # (bench/decode_gemm.py --wide, session 42)
    out = [GemmConfig(bm, bn, sk, w, st) for bn, sk, w, st in shapes]
    if m >= 128:
        out += [GemmConfig(128, 64, 1, 4, 3), GemmConfig(128, 128, 1, 8, 3)]
    return out


if _HAVE_TRITON:

    @triton.jit(
        do_not_specialize=["M"]
    )  # one compiled kernel for every M (models/invariant_ops relies on it)
    def _w8a8_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr,
        M, N, K, KB, kb_per_split, stride_xm, xs_rows, stride_ws,
        HAS_BIAS, SPLIT, PREQUANT: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        kk = tl.arange(0, 128)
        acc = tl.zeros((BM, BN), tl.float32)
        kb_start = pid_k * kb_per_split
        kb_end = tl.minimum(kb_start + kb_per_split, KB)
        ws_row = ws_ptr + (cols // 128) * stride_ws
        if PDL:
            wait_then_release()
        # The scales of K block kb + 1 load during block kb. Triton pipelines the FP8 tile loads (they reach
        # the dot through shared memory) but not these register loads, so each iteration would otherwise wait
        # for them after its tensor-core product (bench/gemm_variants.py: 6-8% at M 64).
        s_w_next = tl.load(ws_row + kb_start, mask=cols < N, other=0.0)
        if PREQUANT:
            s_x_next = tl.load(xs_ptr + kb_start * xs_rows + rows, mask=rows < M, other=0.0)
        for kb in range(kb_start, kb_end):
            more = kb + 1 < kb_end
            s_w = s_w_next
            s_w_next = tl.load(ws_row + kb + 1, mask=(cols < N) & more, other=0.0)
            ks = kb * 128 + kk
            x_mask = (rows[:, None] < M) & (ks[None, :] < K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            if PREQUANT:  # FP8 rows quantized by the producer (fused_ops), scales (Kb, rows) K-block-major
                q = x
                s_x = s_x_next
                s_x_next = tl.load(xs_ptr + (kb + 1) * xs_rows + rows, mask=(rows < M) & more, other=0.0)
            else:
                x = x.to(tl.float32)
                s_x = _tile_scales(x, 1, POW2)
                q = _to_e4m3(x, s_x[:, None])
            w_mask = (cols[None, :] < N) & (ks[:, None] < K)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=w_mask, other=0.0)
            # cuBLASLt's promotion rounding, fma(partial, s_x * s_w, acc): with it this kernel gives the bits of
            # cuBLASLt's blockwise GEMM where that does not split K (bench/cublaslt_bits.py), so a decode row
            # may run here and its trainer row on cuBLASLt (models/invariant_ops, true_on_policy).
            acc = tl.fma(tl.dot(q, w), s_x[:, None] * s_w[None, :], acc)
        out_mask = (rows[:, None] < M) & (cols[None, :] < N)
        if SPLIT != 0:
            offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(y_ptr + offs, acc, mask=out_mask)
        else:
            if HAS_BIAS != 0:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _split_sum_kernel(
        part_ptr, bias_ptr, y_ptr, total, N,
        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """y = sum of the SPLIT FP32 partials (+ bias), cast to y's dtype: one launch, one rounding."""
        if PDL:
            wait_then_release()
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = _sum_partials(part_ptr, offs, total, bias_ptr, offs % N, mask, 0.0, SPLIT, HAS_BIAS)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def w8a8_partials(
    x: Tensor,
    w_fp8: Tensor,
    w_scale_inv: Tensor,
    bias: Tensor | None,
    cfg: GemmConfig,
    pow2_scales: bool = False,
    x_scale_t: Tensor | None = None,
    rows: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor | SplitPartials:
    """``w8a8_fused`` for a consumer that sums a split-K launch's partials itself (``fused_ops``'
    add+RMSNorm and rotary+KV kernels): the output (M, N) when ``cfg`` runs one program along K, else the
    FP32 partials and the bias, unsummed (``SplitPartials``), which saves the sum kernel's launch."""
    prequant = x_scale_t is not None
    if w_scale_inv.stride(1) != 1:  # rows may be stored apart (``fp8.gemm.scale_grid``), columns may not
        w_scale_inv = w_scale_inv.contiguous()
    m, k = (rows if rows is not None else x.shape[0]), x.shape[1]
    dtype = out_dtype if out_dtype is not None else x.dtype
    n = w_fp8.shape[0]
    kb = triton.cdiv(k, 128)
    grid, kb_per_split, y = split_k_launch(m, n, kb, cfg.bm, cfg.bn, cfg.split_k, dtype, x.device)
    _w8a8_kernel[grid](
        x, x_scale_t if x_scale_t is not None else w_scale_inv, w_fp8, w_scale_inv,
        bias if bias is not None else w_scale_inv, y,
        m, n, k, kb, kb_per_split, x.stride(0), x_scale_t.shape[1] if x_scale_t is not None else 0,
        w_scale_inv.stride(0), int(bias is not None), int(grid[2] > 1), PREQUANT=prequant, POW2=pow2_scales,
        BM=cfg.bm, BN=cfg.bn, num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch_kwargs(x.device),
    )  # fmt: skip
    return y if grid[2] == 1 else SplitPartials(y, dtype, bias)


def split_k_launch(
    m: int, n: int, kb: int, bm: int, bn: int, split_k: int, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[int, int, int], int, Tensor]:
    """The grid (M tiles, N tiles, splits), K blocks per split and output of a split-K launch over ``kb`` K
    blocks: at most ``split_k`` splits of equal length (the last may be shorter, none empty); the output is
    (M, N) in ``dtype`` without split, else FP32 partials (splits, M, N). Every W8A8 kernel that hands
    partials to ``SplitPartials`` consumers splits K this way, so their partials line up."""
    kb_per_split = -(-kb // min(split_k, kb))
    split = -(-kb // kb_per_split)
    grid = (-(-m // bm), -(-n // bn), split)
    if split == 1:
        return grid, kb_per_split, torch.empty(m, n, dtype=dtype, device=device)
    return grid, kb_per_split, torch.empty(split, m, n, dtype=torch.float32, device=device)


def sum_partials(p: SplitPartials) -> Tensor:
    """The partials' sum plus the bias, rounded once to their dtype (M, N): one launch."""
    split, m, n = p.part.shape
    out = torch.empty(m, n, dtype=p.dtype, device=p.part.device)
    block = 1024
    _split_sum_kernel[(triton.cdiv(m * n, block),)](
        p.part, p.bias if p.bias is not None else p.part, out, m * n, n,
        SPLIT=split, HAS_BIAS=p.bias is not None, BLOCK=block, num_warps=4, **pdl.launch_kwargs(out.device),
    )  # fmt: skip
    return out


def w8a8_fused(
    x: Tensor,
    w_fp8: Tensor,
    w_scale_inv: Tensor,
    bias: Tensor | None,
    cfg: GemmConfig,
    pow2_scales: bool = False,
    x_scale_t: Tensor | None = None,
    rows: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``quant(x) @ W^T (+ bias)`` for x (M, K) BF16 with unit last stride -> (M, N) in x's dtype.

    With ``x_scale_t`` x is already FP8 (M_pad, K) with scales (Kb, M_pad) (``fused_ops.QuantizedRows``);
    then ``rows`` is the real row count M and ``out_dtype`` the output dtype."""
    y = w8a8_partials(x, w_fp8, w_scale_inv, bias, cfg, pow2_scales, x_scale_t, rows, out_dtype)
    return y if isinstance(y, Tensor) else sum_partials(y)


def available(device: torch.device) -> bool:
    return _HAVE_TRITON and device.type == "cuda"
