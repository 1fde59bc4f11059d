"""Can a Triton W8A8 kernel give cuBLASLt's blockwise FP8 GEMM bits, so decode need not run cuBLASLt? (CUDA)

true_on_policy runs each FP8 GEMM on cuBLASLt (``F.scaled_mm``, 1x128 x 128x128 blocks) on both sides, since
cuBLASLt is batch-invariant (``bench/invariant_gemm.py --cublaslt``), and at decode sizes cuBLASLt is slower
than the engine's Triton kernel. If a Triton kernel computed each output with cuBLASLt's arithmetic, the
engine could decode on it and the trainer keep cuBLASLt. The arithmetic of a blockwise GEMM on Hopper: per
128-wide K block, a tensor-core partial sum (four chained e4m3 wgmma k32 instructions), then promotion into an
FP32 accumulator with the block's two scales. What cuBLASLt does not document is the promotion's rounding, so
this tries each candidate against cuBLASLt's rows of the largest batch (FP32 and BF16 output, several M, every
launch shape for the roundings that match), checks the engine's kernel (``engines/native/fp8_gemm``) alike, and
times the match against cuBLASLt. On an H100 ``fma(p, sx * sw, acc)`` matches at every M and launch shape, and
the engine's kernel now rounds so (docs/mismatch.md, "The Triton W8A8 kernel rounds as cuBLASLt").

    python bench/cublaslt_bits.py [--shapes 'q|o' down ...] [--rows 64 256 4096]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

SHAPES = {  # name: (K, N)
    "q|o": (1536, 1536), "k|v": (1536, 256), "gate|up": (1536, 8960), "down": (8960, 1536),
    "qkv": (1536, 2048), "gateup": (1536, 17920),
    "7b:q|o": (3584, 3584), "7b:down": (18944, 3584),
}  # fmt: skip
VARIANTS = {
    0: "acc += p * sx * sw",
    1: "acc += p * (sx * sw)",
    2: "acc = fma(p, sx * sw, acc)",
    3: "acc = fma(p * sx, sw, acc)",
    4: "acc = fma(p * sw, sx, acc)",
    5: "acc += p * (sx * sw), no FMA contraction",
    6: "acc += p * sx * sw, no FMA contraction",
}
CONFIGS = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 32, 4, 4), (128, 64, 4, 3), (64, 64, 4, 6)]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, KB, xs_rows,
        VARIANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        kk = tl.arange(0, 128)
        acc = tl.zeros((BM, BN), tl.float32)
        for kb in range(0, KB):
            ks = kb * 128 + kk
            q = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )
            sx = tl.load(xs_ptr + kb * xs_rows + rows, mask=rows < M, other=0.0)[:, None]
            sw = tl.load(ws_ptr + (cols // 128) * KB + kb, mask=cols < N, other=0.0)[None, :]
            p = tl.dot(q, w)
            if VARIANT == 0 or VARIANT == 6:
                acc += p * sx * sw
            elif VARIANT == 1 or VARIANT == 5:
                acc += p * (sx * sw)
            elif VARIANT == 2:
                acc = tl.fma(p, sx * sw, acc)
            elif VARIANT == 3:
                acc = tl.fma(p * sx, sw, acc)
            else:
                acc = tl.fma(p * sw, sx, acc)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(
            y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask
        )


def triton_gemm(
    q: torch.Tensor,
    s_t: torch.Tensor,
    m: int,
    w8: torch.Tensor,
    s8: torch.Tensor,
    variant: int,
    cfg: tuple[int, int, int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    n, k = w8.shape
    bm, bn, warps, stages = cfg
    y = torch.empty(m, n, dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _kernel[grid](
        q, s_t, w8, s8, y, m, n, k, s8.shape[1], s_t.shape[1],
        VARIANT=variant, BM=bm, BN=bn, num_warps=warps, num_stages=stages,
        enable_fp_fusion=variant not in (5, 6),
    )  # fmt: skip
    return y


def _check(name: str, args: argparse.Namespace, gen: torch.Generator) -> None:
    """One shape: which roundings give the reference bits, in which launch shapes, and their kernel times."""
    from invariant_gemm import _device_time

    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8 import gemm as cublas_gemm
    from infir2_rl.fp8 import quant_triton

    k, n = SHAPES[name]
    big = max(args.rows)
    x = (torch.randn(big, k, device="cuda", generator=gen) * 2).bfloat16()
    w8, s8 = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05, args.pow2)
    q_all, s_all = quant_triton.quantize_rows(x, args.pow2)  # a row's codes do not depend on the batch
    refs = {
        dt: cublas_gemm.mm_1x128_128x128(q_all, s_all, w8, s8, dt)[:big]
        for dt in (torch.float32, torch.bfloat16)
    }
    print(
        f"-- {name} (K {k}, N {n}): elements differing from the reference (cuBLASLt's rows of the {big}-row "
        "batch), FP32 | BF16 output, and the M where any does"
    )

    def report(label: str, fn: Callable[[int, torch.dtype], torch.Tensor]) -> bool:
        totals, differ = [0, 0], []
        for m in args.rows:
            bad = [int((fn(m, dt) != ref[:m]).sum()) for dt, ref in refs.items()]
            totals = [t + b for t, b in zip(totals, bad)]
            if any(bad):
                differ.append(m)
        where = "M " + " ".join(map(str, differ)) if differ else "none"
        print(f"   {label:62s} {totals[0]:>9d} | {totals[1]:>8d}   {where}")
        return not differ

    def cublaslt(m: int, dt: torch.dtype) -> torch.Tensor:
        q, s_t = quant_triton.quantize_rows(x[:m].contiguous(), args.pow2)
        return cublas_gemm.mm_1x128_128x128(q, s_t, w8, s8, dt)[:m]

    def triton_at(variant: int, cfg: tuple[int, int, int, int]) -> Callable[[int, torch.dtype], torch.Tensor]:
        return lambda m, dt: triton_gemm(q_all, s_all, m, w8, s8, variant, cfg, dt)

    report("cuBLASLt itself on the first M rows", cublaslt)
    matching = [v for v, label in VARIANTS.items() if report(f"v{v} {label}", triton_at(v, CONFIGS[0]))]
    for variant in matching:
        for cfg in CONFIGS[1:]:
            report(f"v{variant} launch {cfg}", triton_at(variant, cfg))
    for engine_cfg in (fp8_gemm.GemmConfig(64, 64, 1), fp8_gemm.GemmConfig(128, 128, 1, 8)):
        report(
            f"the engine's kernel (fp8_gemm), {engine_cfg}",
            functools.partial(
                lambda m, dt, c: fp8_gemm.w8a8_fused(q_all, w8, s8, None, c, args.pow2, s_all, m, dt),
                c=engine_cfg,
            ),
        )
    v = (matching or [2])[0]
    print(f"   kernel us at M = {args.time_rows} (L2-warm weights): cuBLASLt | Triton v{v} at {CONFIGS}")
    for m in args.time_rows:
        q, s_t = quant_triton.quantize_rows(x[:m].contiguous(), args.pow2)
        t_lt = _device_time(functools.partial(cublas_gemm.mm_1x128_128x128, q, s_t, w8, s8, torch.bfloat16))
        ts = [
            _device_time(functools.partial(triton_gemm, q, s_t, m, w8, s8, v, cfg, torch.bfloat16))
            for cfg in CONFIGS
        ]
        print(f"   M {m:5d}: {t_lt:8.1f} | " + " ".join(f"{t:8.1f}" for t in ts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["q|o", "k|v", "down", "gate|up", "qkv", "7b:down"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 17, 64, 96, 256, 1000, 4096])
    parser.add_argument("--time-rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--pow2", action="store_true", help="power-of-two scales (products exact)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/cublaslt_bits.py needs a CUDA GPU")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        _check(name, args, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
