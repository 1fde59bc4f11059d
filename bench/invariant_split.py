"""A batch-invariant FP8 GEMM with a fixed split of K: can decode split down_proj and the trainer agree? (CUDA)

Under true_on_policy every FP8 GEMM runs on both sides with one per-element arithmetic: K blocks chained in
order from 0, ``acc = fma(p, s_x * s_w, acc)`` (cuBLASLt's, which the engine's Triton kernel reproduces:
``bench/cublaslt_bits.py``). Without split-K, down_proj (K 8,960, N 1,536) at decode M = 256 has 24 output
tiles for 132 SMs and takes ~30 us on cuBLASLt, where the engine's split-K Triton launch takes ~20 us in fast
mode. A split is batch-invariant too if it is fixed by K alone: chunk c chains its K blocks from 0, and the
chunks' FP32 results are summed in chunk order, then rounded once (``fused_ops._sum_partials``). The engine
would run the split-K Triton launch; the trainer (thousands of rows) can run either the same launch, or one
cuBLASLt call per K chunk with FP32 output, summed by torch in the same order, or added into one FP32 output
by cuBLASLt's epilogue (beta = 1, ``cublaslt.mm_1x128_128x128_into``: "acc").

This checks that the three give the same bits at every M (rows of the largest batch as the reference), and
times them with cold weights inside a CUDA graph (``bench/decode_gemm.py``'s timer) against cuBLASLt on the
whole K, at decode and trainer M. On an H100 (docs/mismatch.md, "The decode step's small launches") all give
the same bits; the split saves ~10 us per down_proj at M = 256 but costs the trainer's cuBLASLt-per-chunk form
+53 us per 4,096 rows, so it was not built.

    python bench/invariant_split.py [--shapes down 7b:down] [--splits 2 4]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name: (K, N); q|k|v and o at --splits 1: the Triton kernel unsplit (any tile shape) against cuBLASLt
SHAPES = {
    "down": (8960, 1536),
    "7b:down": (18944, 3584),
    "gate|up": (1536, 17920),
    "q|k|v": (1536, 2048),
    "o": (1536, 1536),
}
BITS_ROWS = [1, 16, 17, 64, 80, 96, 255, 256, 512, 1000, 4096]
DECODE_ROWS = [64, 256]
TRAIN_ROWS = [4096, 16384]
COLD_BYTES = 256 * 2**20


def cublaslt_chunks(
    q: torch.Tensor, s_t: torch.Tensor, m: int, w: torch.Tensor, s: torch.Tensor, split: int
) -> torch.Tensor:
    """One cuBLASLt call per K chunk (FP32 out), summed in chunk order, rounded once to BF16."""
    from infir2_rl.fp8 import gemm as cublas_gemm
    from infir2_rl.models.invariant_ops import split_chunks

    acc: torch.Tensor | None = None
    for b0, b1 in split_chunks(s.shape[1], split):
        part = cublas_gemm.mm_1x128_128x128(
            q[:, b0 * 128 : b1 * 128], s_t[b0:b1], w[:, b0 * 128 : b1 * 128], s[:, b0:b1], torch.float32
        )
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    return acc[:m].to(torch.bfloat16)


def cublaslt_accumulated(
    q: torch.Tensor, s_t: torch.Tensor, m: int, w: torch.Tensor, s: torch.Tensor, split: int
) -> torch.Tensor:
    """The same sum with the chunks added by cuBLASLt's epilogue (beta = 1) into one FP32 output: no FP32
    partial per chunk, no separate add (``invariant_ops.accumulate_chunks``, the trainer's form); then BF16."""
    from infir2_rl.models.invariant_ops import accumulate_chunks

    return accumulate_chunks(q, s_t, w, s, split)[:m].to(torch.bfloat16)


def whole_k(q: torch.Tensor, s_t: torch.Tensor, m: int, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """cuBLASLt on the whole K (BF16 out): what true_on_policy runs today."""
    from infir2_rl.fp8 import gemm as cublas_gemm

    return cublas_gemm.mm_1x128_128x128(q, s_t, w, s, torch.bfloat16)[:m]


def cold_us(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, s_t: torch.Tensor, m: int, copies: list
) -> float:
    """us per call of ``fn(q, s_t, m, w, s)`` rotating over the weight ``copies`` [(w, s), ...] (together
    larger than the L2) inside a CUDA graph: ``bench/decode_gemm.py``'s timer."""
    from decode_gemm import time_graph

    return time_graph([functools.partial(fn, q, s_t, m, wc, sc) for wc, sc in copies])


def triton_split(
    cfg: object, q: torch.Tensor, s_t: torch.Tensor, m: int, w: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    from infir2_rl.engines.native import fp8_gemm

    assert isinstance(cfg, fp8_gemm.GemmConfig)
    return fp8_gemm.w8a8_fused(q, w, s, None, cfg, False, s_t, m, torch.bfloat16)


def _check(name: str, args: argparse.Namespace, gen: torch.Generator) -> None:
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.models.invariant_ops import split_chunks

    GemmConfig = fp8_gemm.GemmConfig
    k, n = SHAPES[name]
    big = max(BITS_ROWS)
    x = (torch.randn(max(big, *TRAIN_ROWS) + 333, k, device="cuda", generator=gen) * 2).bfloat16()
    w8, s8 = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    q_all, s_all = quant_triton.quantize_rows(x)  # a row's codes do not depend on the batch
    print(f"-- {name} (K {k}, N {n}, {s8.shape[1]} K blocks)")
    for split in args.splits:
        ref = cublaslt_chunks(q_all, s_all, q_all.shape[0], w8, s8, split)
        small = [GemmConfig(64, bn, split, warps, stages) for bn, warps, stages in ((64, 4, 3), (32, 4, 5))]
        large = [GemmConfig(128, 128, split, 8, 3), GemmConfig(64, 128, split, 4, 3)]
        print(
            f"   split {split} ({split_chunks(s8.shape[1], split)}): elements differing from cuBLASLt per chunk"
        )

        def at(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], ref: torch.Tensor = ref) -> str:
            bad: list[str] = []
            for m in BITS_ROWS:
                for off in (0, 333):
                    q, st = quant_triton.quantize_rows(x[off : off + m].contiguous())
                    d = int((fn(q, st, m) != ref[off : off + m]).sum())
                    if d:
                        bad.append(f"M{m}@{off}:{d}")
            return "none" if not bad else " ".join(bad)

        print(
            f"     cuBLASLt chunks at each M       {at(functools.partial(cublaslt_chunks, w=w8, s=s8, split=split))}"
        )
        print(
            f"     cuBLASLt beta=1 accumulation    "
            f"{at(functools.partial(cublaslt_accumulated, w=w8, s=s8, split=split))}"
        )
        for cfg in small + large:
            print(f"     {cfg!s:33s} {at(functools.partial(triton_split, cfg, w=w8, s=s8))}")
    copies = max(1, COLD_BYTES // (n * k))
    ws = [(w8.clone(), s8.clone()) for _ in range(copies)]
    print(
        "   us per call (cold weights, CUDA graph): cuBLASLt whole K | per split: cuBLASLt chunks summed by torch,"
        " cuBLASLt chunks accumulated (acc), Triton shapes"
    )
    for m in DECODE_ROWS + TRAIN_ROWS:
        q, st = quant_triton.quantize_rows(x[:m].contiguous())
        cold = functools.partial(cold_us, q=q, s_t=st, m=m, copies=ws)
        line = f"     M {m:5d}: {cold(whole_k):7.1f} |"
        shapes = (
            [(64, 64, 4, 3), (64, 32, 4, 5), (64, 64, 8, 4)]
            if m in DECODE_ROWS
            else [(128, 128, 8, 3), (64, 128, 4, 3)]
        )
        for split in args.splits:
            t_lt = cold(functools.partial(cublaslt_chunks, split=split))
            t_acc = cold(functools.partial(cublaslt_accumulated, split=split))
            ts = [
                cold(functools.partial(triton_split, GemmConfig(bm, bn, split, wa, sg)))
                for bm, bn, wa, sg in shapes
            ]
            line += f" s{split}: {t_lt:7.1f} acc {t_acc:7.1f} " + " ".join(f"{t:7.1f}" for t in ts) + " |"
        print(line + f"  (Triton shapes {shapes})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["down", "7b:down"], choices=list(SHAPES))
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/invariant_split.py needs a CUDA GPU")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        _check(name, args, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
