"""cuBLASLt's blockwise FP8 forward GEMM with torch's 1 MiB workspace against none (``fp8/cublaslt.py``). (CUDA)

    python bench/cublaslt_workspace.py [--shapes qkv o gate_up down] [--rows 64 256 4096 16384]

Why: in a profile of the 1.5B decode step at batch 256 every gate|up GEMM (cuBLASLt) came with a memset, and
with ``CUBLASLT_WORKSPACE_SIZE=0`` for the whole process cuBLASLt chose another kernel without it (``ssched``
in its name) and the FP8 step ran 3.40 against 3.52 ms. This script compares the two per GEMM shape of the
1.5B decoder: bits (the no-workspace GEMM against ``F.scaled_mm``, and each against its own rows of a larger
batch, which is what ``true_on_policy`` needs) at M from 1 to 4,096, and us per call with cold weights inside
a CUDA graph (``bench/decode_gemm.py``'s timer), at decode and trainer M.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (N, K): the engine's decode GEMMs; the trainer's own (gate and up apart) and its dgrad GEMMs (dX = dY W: N, K
# swapped), which run the same blockwise kernel
SHAPES = {
    "qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
    "gate": (8960, 1536), "qkv_dgrad": (1536, 2048), "down_dgrad": (8960, 1536), "gate_dgrad": (1536, 8960),
}  # fmt: skip
DEFAULT_SHAPES = ["qkv", "o", "gate_up", "down"]
BITS_ROWS = [1, 16, 17, 64, 80, 96, 255, 256, 1000, 4096]
COLD_BYTES = 256 * 2**20


def torch_ws(q: torch.Tensor, s_t: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from infir2_rl.fp8 import gemm

    return gemm.mm_1x128_128x128(q, s_t, w, s, torch.bfloat16)


def no_ws(q: torch.Tensor, s_t: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from infir2_rl.fp8 import cublaslt, gemm

    return cublaslt.mm_1x128_128x128_no_workspace(q, s_t, w, gemm.padded_grid(s), torch.bfloat16)


WGRAD_SHAPES = {  # (out features, in features) of a decoder linear
    "1.5B q|k|v": (2048, 1536), "1.5B o": (1536, 1536), "1.5B gate": (8960, 1536), "1.5B down": (1536, 8960),
    "7B q|k|v": (4608, 3584), "7B o": (3584, 3584), "7B gate": (18944, 3584), "7B down": (3584, 18944),
}  # fmt: skip


def wgrad(rows: list[int], gen: torch.Generator, time_graph: Callable[[list], float]) -> int:
    """us per weight-gradient GEMM added into an FP32 gradient, torch's workspace against none, and whether the
    two give the same bits."""
    from infir2_rl.fp8 import cublaslt, quant_triton

    for name, (n, k) in WGRAD_SHAPES.items():
        for tokens in rows:
            if tokens < 1024:
                continue
            dy = torch.randn(tokens, n, device="cuda", generator=gen, dtype=torch.bfloat16)
            x = torch.randn(tokens, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            ops = (*quant_triton.quantize_cols(dy), *quant_triton.quantize_cols(x))
            targets = [torch.zeros(n, k, device="cuda"), torch.zeros(n, k, device="cuda")]
            cublaslt.add_mm_1x128_1x128(targets[0], *ops)
            cublaslt.add_mm_1x128_1x128(targets[1], *ops, use_workspace=False)
            same = torch.equal(*targets)
            t = [
                time_graph(
                    [functools.partial(cublaslt.add_mm_1x128_1x128, targets[i], *ops, use_workspace=i == 0)]
                )
                for i in (0, 1)
            ]
            print(f"   wgrad {name:11s} tokens {tokens:5d}: us with workspace {t[0]:7.1f}  without {t[1]:7.1f}"
                  f"  ({t[0] / t[1]:.2f}x)  bits {'equal' if same else 'DIFFER'}", flush=True)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 4096, 16384])
    parser.add_argument(
        "--wgrad",
        action="store_true",
        help="instead: the weight-gradient GEMM adding into FP32 (fp8/cublaslt.add_mm_1x128_1x128) at the 1.5B and "
        "7B shapes, --rows tokens, with torch's workspace and without",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/cublaslt_workspace.py: needs a CUDA GPU")
        return 2
    from decode_gemm import time_graph

    from infir2_rl.fp8 import gemm, quant_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    if args.wgrad:
        return wgrad(args.rows, gen, time_graph)
    for name in args.shapes:
        n, k = SHAPES[name]
        big = max(BITS_ROWS + args.rows)
        x = (torch.randn(big, k, device="cuda", generator=gen) * 2).bfloat16()
        w8, s_plain = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
        s8 = gemm.scale_grid(s_plain.shape[0], s_plain.shape[1], "cuda").copy_(
            s_plain
        )  # as the engine stores it: no pad per call
        q_all, s_all = quant_triton.quantize_rows(x)
        ref_ws, ref_no = torch_ws(q_all, s_all, w8, s8), no_ws(q_all, s_all, w8, s8)
        bad: dict[str, list[str]] = {"no-ws vs scaled_mm": [], "scaled_mm vs its big batch": [],
                                     "no-ws vs its big batch": []}  # fmt: skip
        for m in BITS_ROWS:
            q, st = quant_triton.quantize_rows(x[:m].contiguous())
            a, b = torch_ws(q, st, w8, s8)[:m], no_ws(q, st, w8, s8)[:m]
            for key, d in (
                ("no-ws vs scaled_mm", int((a != b).sum())),
                ("scaled_mm vs its big batch", int((a != ref_ws[:m]).sum())),
                ("no-ws vs its big batch", int((b != ref_no[:m]).sum())),
            ):
                if d:
                    bad[key].append(f"M{m}:{d}")
        print(f"-- {name} (N {n}, K {k}): elements differing")
        for key, where in bad.items():
            print(f"   {key:28s} {'none' if not where else ' '.join(where)}")
        copies = max(1, COLD_BYTES // (n * k))
        ws = [
            (w8.clone(), gemm.scale_grid(s8.shape[0], s8.shape[1], "cuda").copy_(s8)) for _ in range(copies)
        ]
        for m in args.rows:
            q, st = quant_triton.quantize_rows(x[:m].contiguous())
            t = {
                label: time_graph([functools.partial(fn, q, st, wc, sc) for wc, sc in ws])
                for label, fn in (("scaled_mm", torch_ws), ("no-ws", no_ws))
            }
            print(f"   M {m:5d}: us per call, scaled_mm {t['scaled_mm']:7.1f}  no workspace {t['no-ws']:7.1f}"
                  f"  ({t['scaled_mm'] / t['no-ws']:.2f}x)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
