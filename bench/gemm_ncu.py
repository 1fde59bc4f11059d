"""One decode GEMM of the 1.5B shape under Nsight Compute: the engine's FP8 W8A8 Triton kernel in the launch
shape the chooser picks, and BF16 cuBLAS, once each (cold weights), to read stall reasons and DRAM throughput.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats python bench/gemm_ncu.py --gemm down --m 64

Without ncu it prints the chosen shape and the CUDA-graph timings of both (us per call, cold weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native import fp8_gemm  # noqa: E402
from infir2_rl.engines.native.fused_ops import QuantizedRows  # noqa: E402
from infir2_rl.engines.native.linears import Choice, Fp8GemmChooser, run_fp8  # noqa: E402
from infir2_rl.fp8 import quant_triton  # noqa: E402
from infir2_rl.fp8.quant import quantize_weight_blockwise  # noqa: E402

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemm", choices=sorted(SHAPES), default="down")
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--config", default=None, help="bm,bn,split_k,warps,stages instead of the chooser's")
    args = parser.parse_args()
    n, k = SHAPES[args.gemm]
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight_blockwise(w)
    x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
    q, s_t = quant_triton.quantize_rows(x)
    pad = -(-args.m // 16) * 16
    qp = torch.zeros(pad, k, dtype=q.dtype, device=dev)
    qp[: args.m] = q
    sp = torch.ones(s_t.shape[0], pad, dtype=s_t.dtype, device=dev)
    sp[:, : args.m] = s_t
    rows = QuantizedRows(qp, sp, args.m)
    if args.config:
        choice: Choice = fp8_gemm.GemmConfig(*map(int, args.config.split(",")))
    else:
        choice = Fp8GemmChooser(False).pick(rows, wq, ws, None, torch.bfloat16)
    print(f"{args.gemm} M {args.m} N {n} K {k}: {choice}")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    for name, fn in (
        ("fp8", lambda: run_fp8(choice, rows, wq, ws, None, False, torch.bfloat16)),
        ("bf16", lambda: F.linear(x, w)),
    ):
        fn()
        flush.zero_()  # evict the weights from L2: the profiled call reads them from memory
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range(name):
            fn()
        torch.cuda.synchronize()
    err = (run_fp8(choice, rows, wq, ws, None, False, torch.bfloat16).float() - F.linear(x, w).float()).norm()
    print(f"relative error vs BF16: {float(err / F.linear(x, w).float().norm()):.3g}")


if __name__ == "__main__":
    main()
