"""FP8 GEMMs on blockwise-scaled operands: cuBLASLt through ``F.scaled_mm`` (v2) on Hopper GPUs.

Layouts (cuBLASLt on sm90 only multiplies a row-major A by a column-major B, "TN"):

* ``mm_1x128_128x128``: A (M, K) e4m3 row-major with 1x128 scales, B = W_fp8.t() with W (N, K) row-major and
  its 128x128 ``weight_scale_inv`` (Nb, Kb). fprop (X @ W^T) and dgrad (dY @ W, with W^T materialized).
  The A scale is passed as the (M, Kb) view of a (Kb, M) buffer ("outer-dim-major"). The B scale must be
  (round_up(Kb, 4), Nb) with stride (1, round_up(Kb, 4)): cuBLASLt reads the 128x128 scale grid with
  16-byte aligned rows, so ``weight_scale_inv`` is zero-padded to a multiple of 4 K-blocks first (a copy per
  call, unless its storage already has the padding: ``scale_grid``, which the engine's weights use). The old
  ``torch._scaled_mm`` (v1) took the unpadded grid and returned silent garbage when Kb % 4 != 0
  (K = 640, 1408, 8960: the Qwen2.5-1.5B down-projection), which is why only v2 is used here.
* ``mm_1x128_1x128``: both operands with 1x128 scales; wgrad dW = dY^T X, both quantized along tokens.

``use_fast_accum`` stays off: cuBLASLt refuses it with 128x128 blockwise scaling (seen on an H200, torch 2.11);
the blockwise kernels apply the block scales to FP32 partial sums, one 128-element K block at a time.

Before first use on a device, ``fast_path_ok`` multiplies small random operands with Kb = 5 (not a multiple
of 4) through each path and compares with dequantize-then-matmul; any error or mismatch disables the fast
path with one loud warning, and callers emulate (same numbers up to accumulation order and output rounding).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from infir2_rl.env import env_flag
from infir2_rl.fp8 import quant_triton
from infir2_rl.fp8.quant import dequantize_activation, dequantize_weight_blockwise

log = logging.getLogger(__name__)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _scaling_types() -> tuple[Any, Any]:
    st = F.ScalingType  # type: ignore[attr-defined]
    return st.BlockWise1x128, st.BlockWise128x128


def mm_1x128_128x128(
    a_fp8: torch.Tensor,
    a_scale_t: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(A * sA) @ (W * sW)^T``: A (M, K) with a_scale_t (Kb, M); W (N, K) with w_scale_inv (Nb, Kb)."""
    bw1x128, bw128 = _scaling_types()
    return F.scaled_mm(  # type: ignore[attr-defined]
        a_fp8,
        w_fp8.t(),
        a_scale_t.t(),
        bw1x128,
        padded_grid(w_scale_inv).t(),  # (Kb4, Nb), stride (1, Kb4)
        bw128,
        output_dtype=out_dtype,
    )


def scale_grid(nb: int, kb: int, device: torch.device | str, fill: float = 1.0) -> torch.Tensor:
    """An (nb, kb) FP32 ``weight_scale_inv`` filled with ``fill``, its rows stored round_up(kb, 4) apart (a
    view of an (nb, round_up(kb, 4)) buffer, zero padding): ``mm_1x128_128x128`` hands such a grid to
    cuBLASLt as it is, where a contiguous one with kb % 4 != 0 costs a padded copy (two kernels) per GEMM.
    For weights that live long (the engine's) and are overwritten in place by weight sync."""
    buf = torch.zeros(nb, _round_up(kb, 4), dtype=torch.float32, device=device)
    return buf[:, :kb].fill_(fill)


def padded_grid(w_scale_inv: torch.Tensor) -> torch.Tensor:
    """``w_scale_inv`` (Nb, Kb) as the (Nb, round_up(Kb, 4)) row-major grid cuBLASLt reads: a view when its
    storage already holds the padding columns (``scale_grid``), else a zero-padded copy."""
    nb, kb = w_scale_inv.shape
    kb4 = _round_up(kb, 4)
    if w_scale_inv.stride() == (kb4, 1):
        end = w_scale_inv.storage_offset() + nb * kb4
        if end * w_scale_inv.element_size() <= w_scale_inv.untyped_storage().nbytes():
            return w_scale_inv.as_strided((nb, kb4), (kb4, 1))
    return F.pad(w_scale_inv, (0, kb4 - kb)).contiguous() if kb % 4 else w_scale_inv.contiguous()


def mm_1x128_1x128(
    a_fp8: torch.Tensor,
    a_scale_t: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_t: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(A * sA) @ (B * sB)^T``: A (M, K) with a_scale_t (Kb, M); B (N, K) with b_scale_t (Kb, N)."""
    bw1x128, _ = _scaling_types()
    return F.scaled_mm(  # type: ignore[attr-defined]
        a_fp8,
        b_fp8.t(),
        a_scale_t.t(),
        bw1x128,
        b_scale_t.t(),
        bw1x128,
        output_dtype=out_dtype,
    )


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _wgrad_operands(
    device: torch.device, gen: torch.Generator, m: int, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random wgrad operands for the self-checks: dY (m, n) and X (m, k) in BF16, quantized in 1x128 tiles
    along the m tokens (``quantize_cols``): codes and scales of dY^T, then of X^T."""
    dy = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    return (*quant_triton.quantize_cols(dy), *quant_triton.quantize_cols(x))


def _self_check(device: torch.device) -> str | None:
    """Run each GEMM layout once on random data; return why the fast path is unusable, or None."""
    gen = torch.Generator(device=device).manual_seed(1234)
    m, k, n = 64, 640, 384  # Kb = 5: the case v1 got wrong
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.05
    xq, xs_t = quant_triton.quantize_rows(x)
    wq, ws = quant_triton.quantize_weight(w)
    x_deq = dequantize_activation(xq, xs_t.t())
    ref = x_deq @ dequantize_weight_blockwise(wq, ws).t()
    for out_dtype in (torch.bfloat16, torch.float32):
        err = _rel_err(mm_1x128_128x128(xq, xs_t, wq, ws, out_dtype), ref)
        if not err < 1e-2:
            return f"1x128 x 128x128 scaled_mm ({out_dtype}) differs from emulation (rel err {err:.3g})"
    # Token-dim quantized operands as in wgrad: contract over m.
    ytq, yts, xtq, xts = _wgrad_operands(device, gen, m, n, k)
    ref2 = dequantize_activation(ytq, yts.t()) @ dequantize_activation(xtq, xts.t()).t()
    for out_dtype in (torch.bfloat16, torch.float32):
        err = _rel_err(mm_1x128_1x128(ytq, yts, xtq, xts, out_dtype), ref2)
        if not err < 1e-2:
            return f"1x128 x 1x128 scaled_mm ({out_dtype}) differs from emulation (rel err {err:.3g})"
    return None


@functools.cache
def _device_supported(device_index: int) -> bool:
    device = torch.device("cuda", device_index)
    reason: str | None = None
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        reason = (
            f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (v2); it needs torch >= 2.10"
        )
    elif torch.cuda.get_device_capability(device)[0] != 9:
        cap = torch.cuda.get_device_capability(device)
        reason = f"blockwise FP8 GEMMs need a Hopper GPU (sm90); {torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}"
    elif not quant_triton.available():
        reason = "Triton is not importable, so the fused FP8 quantizers cannot run"
    else:
        try:
            with torch.cuda.device(device):
                reason = _self_check(device)
        except Exception as exc:  # any failure here means: do not use the fast path
            reason = f"F.scaled_mm blockwise self-check raised {type(exc).__name__}: {exc}"
    if reason is not None:
        # logged (the package's logger, once per device: the probe is cached), not a Python warning, which
        # -W / PYTHONWARNINGS filters would hide
        log.warning(
            "FP8 fast path DISABLED on cuda:%d: %s. FP8 linears fall back to emulation (quantize, dequantize,"
            " matmul in FP32): same numbers, no speed-up.",
            device_index,
            reason,
        )
        return False
    _check_accumulate(device_index)  # here, with the fast path's check: before any CUDA graph capture
    return True


# The wgrad added into an FP32 gradient by the GEMM (``cublaslt.add_mm_1x128_1x128``): checked per device with
# the fast path; ``INFIR2_FUSED_WGRAD=0`` turns it off (the weight gradient is then returned and added apart).
FUSED_WGRAD_ENV = "INFIR2_FUSED_WGRAD"
_accumulate: dict[int, bool] = {}


def _accumulate_check(device: torch.device) -> str | None:
    """Why ``cublaslt.add_mm_1x128_1x128`` cannot stand for ``mm_1x128_1x128`` plus an FP32 add, or None: the
    two must give the same bits (same algorithm, one FP32 rounding of acc + C)."""
    from infir2_rl.fp8 import cublaslt

    gen = torch.Generator(device=device).manual_seed(4321)
    m, n, k = 640, 256, 384  # tokens (5 tiles), out and in features
    dytq, dyts, xtq, xts = _wgrad_operands(device, gen, m, n, k)
    start = torch.randn(n, k, device=device, generator=gen)
    ref = start + mm_1x128_1x128(dytq, dyts, xtq, xts, torch.float32)
    out = start.clone()
    cublaslt.add_mm_1x128_1x128(out, dytq, dyts, xtq, xts)
    if not torch.equal(out, ref):
        return f"differs from scaled_mm + add (max abs diff {(out - ref).abs().max().item():.3g})"
    return None


def fused_wgrad_requested() -> bool:
    """False when ``INFIR2_FUSED_WGRAD`` is ``0``, ``false``, ``off`` or ``no`` (for A/B benchmarks): weight
    gradients are then returned and added apart, in FP8 (``ops.WGRAD_INTO``) and BF16 (``MainGradLinear``)."""
    return env_flag(FUSED_WGRAD_ENV, True)


def _check_accumulate(device_index: int) -> None:
    reason: str | None = None
    if not fused_wgrad_requested():
        _accumulate[device_index] = False
        return
    try:
        with torch.cuda.device(device_index):
            reason = _accumulate_check(torch.device("cuda", device_index))
    except Exception as exc:  # e.g. no libcublasLt found, or an older cuBLASLt without VEC128 scaling
        reason = f"raised {type(exc).__name__}: {exc}"
    if reason is not None:
        log.warning(
            "FP8 wgrad accumulation in the GEMM DISABLED on cuda:%d: cuBLASLt with beta = 1 %s. Weight gradients"
            " are returned and added into the FP32 gradients apart: same numbers, slower.",
            device_index,
            reason,
        )
    _accumulate[device_index] = reason is None


def accumulate_ok(device: torch.device) -> bool:
    """True when the FP8 wgrad on ``device`` may add into an FP32 gradient inside the GEMM (ops.WGRAD_INTO)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supported(index) and _accumulate.get(index, False)


def fast_path_ok(t: torch.Tensor, n: int, k: int) -> bool:
    """True when a GEMM with N=n, K=k on ``t``'s device can use cuBLASLt blockwise FP8."""
    if not t.is_cuda:
        return False
    if n % 16 or k % 16:  # cuBLASLt's FP8 alignment; tiny or odd layers are emulated
        _say_emulated(n, k)
        return False
    return _device_supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _say_emulated(n: int, k: int) -> None:
    log.warning(
        "FP8 linear N=%d, K=%d on a GPU: not multiples of 16 (cuBLASLt's FP8 alignment), so it runs emulated"
        " (quantize, dequantize, matmul in FP32): same numbers, no speed-up",
        n,
        k,
    )
