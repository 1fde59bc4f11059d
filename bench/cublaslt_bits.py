"""Can a Triton W8A8 kernel give cuBLASLt's blockwise FP8 GEMM bits, so decode need not run cuBLASLt? (CUDA)

true_on_policy runs each FP8 GEMM on cuBLASLt (``F.scaled_mm``, 1x128 x 128x128 blocks) on both sides, since
cuBLASLt is batch-invariant (``bench/invariant_gemm.py --cublaslt``). At decode sizes it is slow (M = 256:
1.7-1.8x the engine's Triton kernel), which makes FP8 rollout under true_on_policy slower than BF16's. If a
Triton kernel computed each output with cuBLASLt's arithmetic, the engine could decode on it and the trainer
keep cuBLASLt. The arithmetic of a blockwise GEMM on Hopper: per 128-wide K block, a tensor-core partial sum
(four chained e4m3 wgmma k32 instructions), then promotion into an FP32 accumulator with the block's two
scales. What cuBLASLt does not document is the promotion's rounding, so this tries each candidate against
it (FP32 and BF16 output, every Triton launch shape, several M) and times the ones that match.

    python bench/cublaslt_bits.py [--shapes 'q|o' down ...] [--rows 64 256 4096]
"""

from __future__ import annotations

import argparse
import functools
import sys

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
    6: "acc += p * (sx * sw), no FMA contraction",
    7: "acc += p * sx * sw, no FMA contraction",
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
            if VARIANT == 0 or VARIANT == 7:
                acc += p * sx * sw
            elif VARIANT == 1 or VARIANT == 6:
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
        enable_fp_fusion=variant not in (6, 7),
    )  # fmt: skip
    return y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["q|o", "down", "gate|up", "7b:down"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 17, 64, 256, 1000, 4096])
    parser.add_argument("--time-rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--pow2", action="store_true", help="power-of-two scales (products exact)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/cublaslt_bits.py needs a CUDA GPU")
        return 2
    from invariant_gemm import _device_time

    from infir2_rl.fp8 import gemm as cublas_gemm
    from infir2_rl.fp8 import quant_triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        k, n = SHAPES[name]
        big = max(args.rows)
        x = (torch.randn(big, k, device="cuda", generator=gen) * 2).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
        w8, s8 = quant_triton.quantize_weight(w, args.pow2)
        print(
            f"-- {name} (K {k}, N {n}): elements differing from cuBLASLt (FP32 out | BF16 out), per variant"
        )
        refs = {}
        quant = {}
        for m in args.rows:
            q, s_t = quant_triton.quantize_rows(x[:m].contiguous(), args.pow2)
            quant[m] = (q, s_t)
            refs[m] = {
                dt: cublas_gemm.mm_1x128_128x128(q, s_t, w8, s8, dt)[:m]
                for dt in (torch.float32, torch.bfloat16)
            }
        matching = []
        for variant, label in VARIANTS.items():
            counts = {dt: 0 for dt in (torch.float32, torch.bfloat16)}
            for m in args.rows:
                q, s_t = quant[m]
                for dt in counts:
                    y = triton_gemm(q, s_t, m, w8, s8, variant, CONFIGS[0], dt)
                    counts[dt] += int((y != refs[m][dt]).sum())
            total = sum(args.rows) * n
            print(
                f"   v{variant} {label:58s} {counts[torch.float32]:>9d} | {counts[torch.bfloat16]:>9d}  of {total}"
            )
            if counts[torch.float32] == 0:
                matching.append(variant)
        for variant in matching:
            for cfg in CONFIGS[1:]:
                bad = 0
                for m in args.rows:
                    q, s_t = quant[m]
                    y = triton_gemm(q, s_t, m, w8, s8, variant, cfg, torch.float32)
                    bad += int((y != refs[m][torch.float32]).sum())
                print(f"   v{variant} launch {cfg}: {bad} elements differ (FP32 out)")
        print(
            f"   kernel us at M = {args.time_rows}: cuBLASLt | Triton {CONFIGS} (variant {matching[:1] or [2]})"
        )
        for m in args.time_rows:
            xm = (torch.randn(m, k, device="cuda", generator=gen) * 2).bfloat16()
            q, s_t = quant_triton.quantize_rows(xm, args.pow2)
            t_lt = _device_time(
                functools.partial(cublas_gemm.mm_1x128_128x128, q, s_t, w8, s8, torch.bfloat16)
            )
            v = (matching or [2])[0]
            ts = [
                _device_time(functools.partial(triton_gemm, q, s_t, m, w8, s8, v, cfg, torch.bfloat16))
                for cfg in CONFIGS
            ]
            print(f"   M {m:5d}: {t_lt:8.1f} | " + " ".join(f"{t:8.1f}" for t in ts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
