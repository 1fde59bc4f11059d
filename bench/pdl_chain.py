"""Does programmatic dependent launch shorten a chain of small kernels in a CUDA graph? (engines/native/pdl.py)

    python bench/pdl_chain.py [--kernels 300] [--programs 64 1024] [--replays 20]

A chain of --kernels tiny Triton kernels, each reading the previous kernel's output and writing its own
(so each depends on the one before), captured in one CUDA graph, launched with and without PDL (the
kernels call ``griddepcontrol.wait`` then ``launch_dependents`` first, as the decode kernels do). Prints
microseconds per kernel (graph replay time / kernels, median of --replays) and the ratio. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native.pdl import wait_then_release

    @triton.jit
    def _step(src, dst, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
        if PDL:
            wait_then_release()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n) + 1.0, mask=offs < n)

except ImportError:  # CPU-only install: main() says so
    pass


def chain(kernels: int, programs: int, bufs: list[torch.Tensor], pdl: bool) -> None:
    n = bufs[0].numel()
    for i in range(kernels):
        _step[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], n, PDL=pdl, BLOCK=128, num_warps=4, launch_pdl=pdl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=300)
    parser.add_argument("--programs", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/pdl_chain.py needs a CUDA GPU")
        return 1
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    for programs in args.programs:
        n = programs * 128
        bufs = [torch.zeros(n, device="cuda") for _ in range(2)]
        res = {}
        for pdl in (False, True):
            chain(args.kernels, programs, bufs, pdl)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(args.kernels, programs, bufs, pdl)
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(1e3 * start.elapsed_time(end) / args.kernels)
            res[pdl] = statistics.median(times)
        print(
            f"{programs:5d} programs: {res[False]:.2f} us/kernel without PDL, {res[True]:.2f} with, "
            f"ratio {res[False] / res[True]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
