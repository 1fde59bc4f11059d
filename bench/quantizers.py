"""The FP8 quantizer kernels alone (``fp8/quant_triton.py``) at the trainer's shapes, in GB/s of their traffic.

    python bench/quantizers.py [--reps 50] [--calls 20]

Each case is replayed from a CUDA graph of --calls back-to-back launches (so launch time does not count), median
of --reps replays; the inputs (>= 25 MB) do not stay in the 50 MB L2 between calls of a large case. Traffic =
bytes read + bytes written (codes and scales), which is the memory floor. "floor %" is the GB/s against torch.neg
over 1 GiB of BF16 timed the same way in the same process (read + write; printed in the header), or against
``--peak-tbs`` where given (sessions 21-55 printed % of a fixed 3.35 TB/s, the H100's nominal bandwidth, so
their H200 rows read above 100). Cases: activation rows (1x128 along K: fprop X, dgrad dY), token tiles
(1x128 along M, written transposed: wgrad), both (the trainer's X and dY), and 128x128 weight blocks with
W^T, from BF16 and FP32 (the trainer's masters; FP32 activations are rounded to BF16 as they are read).
The weight rows count one read of W and the writes of W and W^T (FP32 W^T takes a second, byte-moving kernel,
``transpose_fp8``, whose 2 bytes per weight are not counted; "weight, transpose_fp8" times that way for BF16). "rows + cols" counts two reads (two kernels).
Used for the A/B of one division per tile (bench/ab_patch.sh with BENCH=..., docs/performance.md, session 22).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def graph_ms(fn: Callable[[], Any], calls: int, reps: int) -> float:
    """Median ms per call over ``reps`` replays of a CUDA graph holding ``calls`` calls of fn: the engine's
    GEMM-chooser timer (``Fp8GemmChooser._time``)."""
    from infir2_rl.engines.native.linears import Fp8GemmChooser

    return Fp8GemmChooser._time(fn, calls=calls, replays=reps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=50, help="graph replays per case (median reported)")
    parser.add_argument("--calls", type=int, default=20, help="launches per graph replay")
    parser.add_argument("--m", type=int, default=8192, help="tokens")
    parser.add_argument(
        "--peak-tbs", type=float, help="the floor in TB/s (default: torch.neg over 1 GiB, measured here)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/quantizers.py needs a CUDA GPU (the kernels are Triton)")
    from infir2_rl.fp8 import quant_triton as qt

    m = args.m
    if args.peak_tbs is None:
        # torch's vectorized elementwise kernel streaming 1 GiB in and out (a copy_ in a graph is a memcpy
        # node, which ran at 2.8 TB/s on an H200, below the quantizers themselves)
        src = torch.zeros(1 << 29, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        ms = graph_ms(partial(torch.neg, src, out=dst), 4, args.reps)
        peak, what = 2 * src.nbytes / ms / 1e9, "torch.neg over 1 GiB of BF16 (read + write) measured here"
        del src, dst
    else:
        peak, what = args.peak_tbs, "--peak-tbs"
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call, GB/s, "
        f"floor % = % of {peak:.2f} TB/s ({what})"
    )
    print(f"{'case':<34} {'shape':>14} {'ms':>8} {'GB/s':>7} {'floor %':>7}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k in (1536, 8960, 3584, 18944):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            r = torch.bfloat16 if dtype == torch.float32 else None
            size = m * k
            read = size * x.element_size()
            cases: list[tuple[str, Callable[[], Any], int]] = [
                ("rows", partial(qt.quantize_rows, x, round_to=r), read + size + size // 32),
                ("cols", partial(qt.quantize_cols, x, round_to=r), read + size + size // 32),
                (
                    "rows + cols",
                    partial(qt.quantize_rows_and_cols, x, round_to=r),
                    2 * read + 2 * size + size // 16,
                ),
            ]
            for name, fn, traffic in cases:
                ms = graph_ms(fn, args.calls, args.reps)
                gbs = traffic / ms / 1e6
                label = f"{name}, {str(dtype).removeprefix('torch.')}"
                print(f"{label:<34} {f'{m}x{k}':>14} {ms:8.4f} {gbs:7.0f} {100 * gbs / (peak * 1e3):7.1f}")
    for n, k in ((1536, 1536), (8960, 1536), (1536, 8960), (3584, 3584), (18944, 3584), (3584, 18944)):
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(n, k, device="cuda", generator=gen).to(dtype) * 0.02
            traffic = n * k * (w.element_size() + 2) + 4 * (n * k // 16384)
            dt = str(dtype).removeprefix("torch.")
            wcases: list[tuple[str, Callable[[], Any]]] = [
                (f"weight + W^T, {dt}", partial(qt.quantize_weight_with_transpose, w))
            ]
            if dtype == torch.bfloat16:  # FP32 always takes the second way
                wcases.append((f"weight, transpose_fp8, {dt}", partial(_weight_then_transpose, qt, w)))
            for label, fn in wcases:
                ms = graph_ms(fn, args.calls, args.reps)
                gbs = traffic / ms / 1e6
                print(f"{label:<34} {f'{n}x{k}':>14} {ms:8.4f} {gbs:7.0f} {100 * gbs / (peak * 1e3):7.1f}")


def _weight_then_transpose(qt: Any, w: torch.Tensor) -> None:
    """W^T by the byte-moving kernel after quantizing W (FP32 weights' way), not by the weight kernel's
    transposed store."""
    q, _ = qt.quantize_weight(w)
    qt.transpose_fp8(q)


if __name__ == "__main__":
    main()
