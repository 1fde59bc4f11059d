"""The decode step's producer kernels (add+RMSNorm, SiLU*up), BF16 output against FP8-quantizing, per launch shape.

    python bench/decode_elementwise.py [--batches 16 64 256] [--kernels norm silu] [--splits 0 4 8] [--out PATH]

Why: in a profile of the 1.5B decode step at batch 64 (docs/performance.md, "Rollout decode"), the quantizing
add+RMSNorm took 3.87 ms per 16 steps against 1.81 for the BF16 one, and the quantizing SiLU*up 1.49 against
0.93: ~0.15 ms of FP8's 2.1 ms step, paid before any GEMM saves anything. Each kernel runs one program per
row, so at decode batch sizes a launch has 16-256 programs and its time is latency, which the launch shape
(warps per row, tiles per program) sets. This script times every shape of both kernels, quantizing and not,
with programmatic dependent launch on and off, as a chain of 56 dependent calls in one CUDA graph (a decode
step's count at 1.5B: two norms per layer), and prints microseconds per call: the median of 7 replays.
``--splits S``: the norm's residual delta also as S unsummed split-K partials (``fused_ops.SplitPartials``,
FP32), as it gets them after o_proj (S = 4 at batch 64) and down_proj (8) in the decode step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native import fused_ops, pdl  # noqa: E402
from infir2_rl.engines.native.linears import Fp8GemmChooser  # noqa: E402

HIDDEN, INTER = 1536, 8960  # Qwen2.5-1.5B
CHAIN = 56


def time_us(fn) -> float:
    return 1e3 * Fp8GemmChooser._time([fn], calls=CHAIN, replays=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--kernels", nargs="+", choices=("norm", "silu"), default=["norm", "silu"])
    parser.add_argument(
        "--splits", type=int, nargs="+", default=[0], help="norm delta as S partials (0: BF16)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_elementwise.py: needs a CUDA GPU")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; us per call, chain of {CHAIN}")
    rows = []
    for m in args.batches:
        h = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
        deltas: dict[int, torch.Tensor | fused_ops.SplitPartials] = {
            s: fused_ops.SplitPartials(torch.randn(s, m, HIDDEN, device=dev) * 1e-3, torch.bfloat16)
            if s
            else torch.randn_like(h) * 1e-3
            for s in args.splits
        }
        weight = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16) + 0.5
        gate_up = torch.randn(m, 2 * INTER, device=dev, dtype=torch.bfloat16)
        shapes: dict[str, list[dict[str, int]]] = {
            **{
                f"norm+{s}" if s else "norm": [dict(num_warps=w, split=s) for w in (2, 4, 8, 16, 32)]
                for s in args.splits
                if "norm" in args.kernels
            },
            **(
                {"silu": [dict(tiles=t, num_warps=w) for t in (1, 2, 4, 8, 16) for w in (2, 4, 8, 16)]}
                if "silu" in args.kernels
                else {}
            ),
        }
        for kernel, launch_shapes in shapes.items():
            for quant in (False, True):
                for on in (True, False):
                    res: dict[str, float] = {}
                    with pdl.forced(on):
                        for shape in launch_shapes:
                            if kernel.startswith("norm"):
                                fn = functools.partial(
                                    fused_ops.add_rms_norm, h, deltas[shape["split"]], weight, 1e-6, quant,
                                    num_warps=shape["num_warps"],
                                )  # fmt: skip
                            else:
                                fn = functools.partial(
                                    fused_ops.silu_mul, gate_up, quant,
                                    tiles=shape["tiles"], num_warps=shape["num_warps"],
                                )  # fmt: skip
                            res[" ".join(f"{k}={v}" for k, v in shape.items() if k != "split")] = time_us(fn)
                    best = min(res, key=lambda name: res[name])
                    rows.append(dict(kernel=kernel, m=m, quant=quant, pdl=on, us=res, best=best))
                    listing = "  ".join(f"[{k}] {v:5.2f}" for k, v in res.items())
                    print(
                        f"b{m:<4d} {kernel} {'fp8 ' if quant else 'bf16'} pdl={int(on)} best [{best}] {res[best]:5.2f} | {listing}",
                        flush=True,
                    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
