"""SASS instructions per element of the FP8 quantizer kernels, compiled for sm_90 (no GPU needed).

    python bench/kernel_sass.py [--kernel rows|cols|weight] [--warps N] [--block N] [--fp32-input]

Compiles ``quant_triton``'s kernel as its launcher would (16-divisibility hints, the default launch shape
unless overridden), disassembles it with the ``cuobjdump`` that ships with Triton, and prints the instructions
per element each thread issues, the registers, shared memory and the most frequent opcodes (static counts;
until session 58 they included both sides of ``_to_e4m3``'s tiny-scale branch, since removed). A memory-bound quantizer on an H100 has ~29 instructions per element to spend at the memory floor with
BF16 input (4 schedulers x ~1.75 GHz per SM against ~7.6 G elements/s per SM); above that it is issue-bound.
This is how session 25 found the token-tile kernel at ~34 per element (docs/performance.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.fp8 import quant_triton as qt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("rows", "cols", "weight"), default="cols")
    parser.add_argument("--warps", type=int, help="default: quant_triton.LAUNCH's")
    parser.add_argument("--block", type=int, help="rows: tokens per program (bm); cols: features (bk)")
    parser.add_argument("--fp32-input", action="store_true", help="FP32 input (default BF16)")
    args = parser.parse_args()
    launch = qt.LAUNCH[args.kernel]
    warps = args.warps or launch["warps"]
    x_type = "*fp32" if args.fp32_input else "*bf16"
    if args.kernel == "weight":
        kernel, shape = qt._weight_quant_kernel, (128, 128)
        types = {"w_ptr": x_type, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        constexprs = {"POW2": False, "B": 128}
    else:
        kernel = qt._act_quant_kernel
        cols = args.kernel == "cols"
        shape = (128, args.block or launch["bk"]) if cols else (args.block or launch["bm"], 128)
        types = {"x_ptr": x_type, "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv"}
        constexprs = {"POW2": False, "ROUND": 0, "COLS": cols}
        constexprs |= {"BM": shape[0], "BK": shape[1]}
    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    aligned = [i for i, n in enumerate(names) if n not in constexprs and n not in ("M", "N")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp") / f"infir2_{args.kernel}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+([A-Z0-9_]+)", sass, re.M)
    per_element = len(ops) * 32 * warps / (shape[0] * shape[1])
    regs = re.search(r"REG:(\d+)", usage)
    print(
        f"# {args.kernel}, {x_type[1:]} input, {shape[0]} x {shape[1]} per program, {warps} warps, triton "
        f"{triton.__version__}, sm_90"
    )
    print(
        f"{len(ops)} SASS instructions per thread = {per_element:.1f} per element; registers "
        f"{regs.group(1) if regs else '?'}, shared memory {compiled.metadata.shared} bytes, "
        f"local-memory spills {ops.count('STL')}"
    )
    print("top opcodes:", ", ".join(f"{op} {n}" for op, n in Counter(ops).most_common(12)))


if __name__ == "__main__":
    main()
