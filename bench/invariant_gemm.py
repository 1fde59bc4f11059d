"""Which launch shapes of the batch-invariant GEMMs give the same bits, and how fast each runs (CUDA).

true_on_policy needs a row's GEMM result to be the same whatever the batch (``models/invariant_ops``). One
fixed launch shape guarantees it; different shapes may give the same bits too when they run the same
per-element arithmetic (the tensor-core instruction and the order of K steps), which would allow a shape
per M range. For each decoder GEMM shape of Qwen2.5-1.5B (and its lm_head), this computes M = 4096 rows
with the reference shape and every candidate at M in ``--rows``, compares bit for bit, and times each
candidate (CUDA events, median of 20 after 3 warm-ups) at each M. FP8: the in-kernel quantizing W8A8 kernel
and the pre-quantized variant (``quant_triton.quantize_rows`` then the kernel), every launch shape.

    python bench/invariant_gemm.py
    python bench/invariant_gemm.py --cublaslt --shapes 'q|o' 'k|v' 'gate|up' down '7b:q|o' 7b:down

``--cublaslt`` asks instead whether cuBLASLt's blockwise FP8 GEMM (and cuBLAS's BF16 one) gives a row the same
bits at every M and offset in the batch, and times it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable

import torch

SHAPES = {  # name: (K, N) of the 1.5B shape (the default), then the 7B one
    "q|o": (1536, 1536), "k|v": (1536, 256), "gate|up": (1536, 8960), "down": (8960, 1536), "lm_head": (1536, 151936),
    "7b:q|o": (3584, 3584), "7b:k|v": (3584, 512), "7b:gate|up": (3584, 18944), "7b:down": (18944, 3584),
}  # fmt: skip
# M of the cuBLASLt invariance check (--cublaslt): decode sizes, odd sizes, the trainer's micro-batches
CHECK_ROWS = [*range(1, 520), 640, 1000, 1024, 2000, 2048, 4000, 4096, 8192, 16384]
CHECK_OFFSETS = [0, 333]  # where the rows start in the reference batch
BF16_TILES = [  # (BM, BN, BK, warps, stages); the first is the reference
    (64, 64, 64, 4, 3), (16, 64, 64, 4, 3), (64, 32, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3), (64, 64, 128, 4, 3), (128, 128, 32, 4, 4),
    # narrower and shorter tiles for decode sizes (more programs without split-K), deeper pipelines
    (32, 32, 128, 4, 4), (64, 32, 128, 4, 4), (128, 32, 128, 4, 4), (256, 32, 64, 8, 3), (64, 32, 256, 4, 3),
    (128, 64, 128, 4, 3), (256, 64, 64, 8, 3), (128, 64, 64, 4, 5),
]  # fmt: skip


def _time(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3  # us


def _device_time(fn: Callable[[], object], calls: int = 20) -> float:
    """Kernel time per call (us): the sum of the device kernels' durations under torch.profiler, without the
    host's launch gaps, which dominate eager calls at decode sizes (what a CUDA graph removes)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def _triton_invariant(
    x: torch.Tensor, w: torch.Tensor, w8: torch.Tensor, s8: torch.Tensor, fp8: bool
) -> torch.Tensor:
    """The Triton kernels true_on_policy ran before cuBLAS was planned in, at their launch shapes for x's M."""
    from infir2_rl.models import invariant_ops as ops

    size = ops._size(x.shape[0])
    if fp8:
        return _prequantized(x, w8, s8, ops.FP8_CONFIGS[size])
    tile, warps, stages = ops.MM_TILES[size]
    return ops.mm_launch(x, w, None, tile, warps, stages)


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> '1-3 7 9-10'."""
    out: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return " ".join(out)


def _prequantized(x: torch.Tensor, w8: torch.Tensor, s8: torch.Tensor, cfg: object) -> torch.Tensor:
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8 import quant_triton

    assert isinstance(cfg, fp8_gemm.GemmConfig)
    q, s_t = quant_triton.quantize_rows(x)
    return fp8_gemm.w8a8_fused(q, w8, s8, None, cfg, False, s_t, x.shape[0], torch.bfloat16)


def _cublaslt_invariance(x: torch.Tensor, w: torch.Tensor, rows: list[int]) -> None:
    """Is cuBLASLt's blockwise FP8 GEMM (``F.scaled_mm``, the fast trainer's fprop) batch-invariant? Rows of a
    ``max(CHECK_ROWS) + 333``-row batch against the same rows computed in batches of every M in CHECK_ROWS,
    starting at each of CHECK_OFFSETS; BF16 and FP32 output. cuBLAS's BF16 ``F.linear`` is checked alike. The
    FP8 GEMM is ``invariant_ops._cublas``, the one true_on_policy's plan probes and runs, without padding."""
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.models import invariant_ops as ops

    w8, s8 = quant_triton.quantize_weight(w.float())
    for label, fn in (
        (
            "cuBLASLt FP8 -> BF16",
            functools.partial(ops._cublas, w=(w8, s8), bias=None, rows=16, out_dtype=torch.bfloat16),
        ),
        (
            "cuBLASLt FP8 -> FP32",
            functools.partial(ops._cublas, w=(w8, s8), bias=None, rows=16, out_dtype=torch.float32),
        ),
        ("cuBLAS BF16 F.linear", functools.partial(torch.nn.functional.linear, weight=w)),
    ):
        ref = fn(x)
        differ = [
            m
            for m in CHECK_ROWS
            if any(not torch.equal(fn(x[o : o + m]), ref[o : o + m]) for o in CHECK_OFFSETS)
        ]
        times = [_device_time(functools.partial(fn, x[:m])) for m in rows]
        verdict = "bit-equal at every M" if not differ else f"differs at M = {_ranges(differ)}"
        print(f"   {label:24s} " + " ".join(f"{t:9.1f}" for t in times) + f"   {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 4096])
    parser.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if not s.startswith("7b:")])
    parser.add_argument(
        "--cublaslt",
        action="store_true",
        help="only check whether cuBLASLt's FP8 (and cuBLAS BF16) GEMM is batch-invariant",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/invariant_gemm.py needs a CUDA GPU")
        return 2
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; times in us at M = {args.rows}")
    fp8_cfgs = [fp8_gemm.GemmConfig(64, 64, 1, 4, 3)] + [
        fp8_gemm.GemmConfig(bm, bn, 1, w, st)
        for bm, bn, w, st in ((16, 64, 4, 3), (64, 32, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                              (64, 32, 4, 6), (128, 32, 4, 4), (256, 32, 8, 3), (64, 64, 4, 5))
    ]  # fmt: skip
    for name in args.shapes:
        k, n = SHAPES[name]
        x = (torch.randn(max(args.rows), k, device="cuda", generator=gen) * 2).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16()
        if args.cublaslt:
            print(
                f"-- {name} (K {k}, N {n}); kernel us per call at M = {args.rows} (FP8: quantize_rows + GEMM)"
            )
            big = (
                torch.randn(max(CHECK_ROWS) + max(CHECK_OFFSETS), k, device="cuda", generator=gen) * 2
            ).bfloat16()
            _cublaslt_invariance(big, w, args.rows)
            w8, s8 = quant_triton.quantize_weight(w.float())
            for label, fp8 in (("invariant Triton FP8", True), ("invariant Triton BF16", False)):
                fn = functools.partial(_triton_invariant, w=w, w8=w8, s8=s8, fp8=fp8)
                times = [_device_time(functools.partial(fn, x[:m])) for m in args.rows]
                print(f"   {label:24s} " + " ".join(f"{t:9.1f}" for t in times))
            continue
        ref = ops.mm_launch(x, w, None, BF16_TILES[0][:3], *BF16_TILES[0][3:])
        print(f"-- {name} (K {k}, N {n}) BF16")
        for tile in BF16_TILES:
            same = all(
                torch.equal(ops.mm_launch(x[:m], w, None, tile[:3], *tile[3:]), ref[:m]) for m in args.rows
            )
            times = [
                _time(functools.partial(ops.mm_launch, x[:m], w, None, tile[:3], *tile[3:]))
                for m in args.rows
            ]
            print(f"   {str(tile):24s} bit-equal {same!s:5s} " + " ".join(f"{t:9.1f}" for t in times))
        cublas = [_time(functools.partial(torch.nn.functional.linear, x[:m], w)) for m in args.rows]
        print(f"   {'cuBLAS F.linear':24s} {'':15s} " + " ".join(f"{t:9.1f}" for t in cublas))
        if name == "lm_head":
            continue
        w8, s8 = quant_triton.quantize_weight(w.float())
        ref8 = fp8_gemm.w8a8_fused(x, w8, s8, None, fp8_cfgs[0])
        print(f"-- {name} FP8 W8A8 (in-kernel quantization | pre-quantized rows)")
        for cfg in fp8_cfgs:
            inside = [functools.partial(fp8_gemm.w8a8_fused, x[:m], w8, s8, None, cfg) for m in args.rows]
            before = [functools.partial(_prequantized, x[:m], w8, s8, cfg) for m in args.rows]
            same = all(torch.equal(f(), ref8[:m]) for f, m in zip(inside, args.rows))
            same_pre = all(torch.equal(f(), ref8[:m]) for f, m in zip(before, args.rows))
            times, times_pre = [_time(f) for f in inside], [_time(f) for f in before]
            print(
                f"   {str(cfg):24s} bit-equal {same!s:5s}|{same_pre!s:5s} "
                + " ".join(f"{a:7.1f}|{b:<7.1f}" for a, b in zip(times, times_pre))
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
