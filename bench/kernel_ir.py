"""Which loads of the engine's FP8 decode GEMM Triton pipelines, read from its TTGIR (no GPU needed).

    python bench/kernel_ir.py [--bm 64] [--bn 64] [--warps 4] [--stages 3] [--bf16-input] [--no-hints]

Compiles ``fp8_gemm._w8a8_kernel`` for sm_90 (Triton's own ptxas; a CPU machine with Triton installed will
do) and prints, for the K loop, each load and whether it became an asynchronous copy into shared memory
(pipelined ``stages`` deep) or a plain load into registers, which Triton does not pipeline (the kernel
issues its scale loads one K block ahead by hand), plus the waits. The integer
arguments get the 16-divisibility hints Triton's launcher gives them at model shapes (K, N, the row stride,
the scale rows); ``--no-hints`` drops them, which turns every tile load synchronous. This is how the
unpipelined scale loads were found (docs/performance.md, session 19).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native import fp8_gemm  # noqa: E402

_CONSTEXPR = ("HAS_BIAS", "SPLIT", "PREQUANT", "POW2", "BM", "BN", "PDL")
_ALIGNED = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "bias_ptr", "y_ptr", "N", "K", "stride_xm", "xs_rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bm", type=int, default=64)
    parser.add_argument("--bn", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--bf16-input", action="store_true", help="the kernel quantizes x itself")
    parser.add_argument("--no-hints", action="store_true", help="no 16-divisibility hints")
    args = parser.parse_args()
    kernel = fp8_gemm._w8a8_kernel
    names = kernel.arg_names
    ptrs = {"x_ptr": "*bf16" if args.bf16_input else "*fp8e4nv", "w_ptr": "*fp8e4nv", "bias_ptr": "*bf16"}
    sig = {
        n: "constexpr" if n in _CONSTEXPR else ptrs.get(n, "*fp32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    constexprs = {"HAS_BIAS": 0, "SPLIT": 1, "PREQUANT": not args.bf16_input, "POW2": False}
    constexprs |= {"BM": args.bm, "BN": args.bn, "PDL": False}
    attrs = {} if args.no_hints else {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": args.warps, "num_stages": args.stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ttgir = compiled.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for") :]
    print(f"# triton {triton.__version__}, sm_90, {options}, shared memory {compiled.metadata.shared} bytes")
    for line in loop.splitlines():
        op = re.search(
            r"(ttg\.async_copy_global_to_local|tt\.load|ttng\.warp_group_dot_wait|ttg\.async_wait)", line
        )
        name = re.search(r"%([A-Za-z_]+)", line)
        if op and name:
            kind = {"tt.load": "tt.load (registers; not pipelined)"}.get(op.group(1), op.group(1))
            print(f"  {name.group(1):12s} {kind}")
        if line.strip().startswith("scf.yield"):
            break


if __name__ == "__main__":
    main()
