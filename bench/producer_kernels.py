"""The decode step's producer kernels, BF16 output against FP8-quantizing, one case per kernel and mode.

    python bench/producer_kernels.py [--batch 256] [--context 192] [--cache-len 320] [--kernels norm silu attn]
        [--splits 1 2 4 8] [--stages 0 2 3] [--pdl 0]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats python bench/producer_kernels.py --ncu

Why: session 52's kernel account of the 1.5B true_on_policy rollout (docs/mismatch.md) found FP8's three
quantizing producers 40 ms per generate call slower than their BF16 forms (attention +16.1, SiLU*up +14.3,
add+RMSNorm +10.0: ~1.4-2.3 us more per launch), more than the FP8 GEMMs gain over BF16's. This script puts
each pair side by side at one decode batch (1.5B shape: hidden 1,536, 12 query / 2 KV heads of 128,
intermediate 8,960; every row at ``--context`` keys): add+RMSNorm (the fast mode's default warps and
true_on_policy's 8), SiLU*up, the fast mode's split-K attention (its merge quantizes) and
true_on_policy's attention (``models/invariant_ops``: its epilogue quantizes), the first at other split counts
(``--splits``; its chunk follows ``--cache-len``, the decode graphs' cache length, and is at least
``attention.MIN_CHUNK`` keys in the one-launch form) and launch forms (``--launch``: one kernel, or the split
and merge kernels; ``auto`` is the rule by batch size), the second at other pipeline
depths (``--stages``; 0 is the launch's own rule), whose bits it checks are the same. Each is timed as a chain of calls in one CUDA graph (``graph_capture.time_in_graph``,
median of 7 replays), PDL off by default so that no time includes a wait for the kernel before.
``--ncu``: after a warm-up, one launch of each case between ``cudaProfilerStart`` / ``Stop`` for Nsight Compute.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native import attention, fused_ops, pdl  # noqa: E402
from infir2_rl.graph_capture import time_in_graph  # noqa: E402
from infir2_rl.models import invariant_ops as inv  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, DIM = 1536, 8960, 12, 2, 128  # Qwen2.5-1.5B


def invariant_attention(q, k, v, seq, lens, quant: bool, stages: int | None) -> Any:
    """``invariant_ops.attention`` / ``attention_quantized`` at a pipeline depth (None: the launch's rule)."""
    out = torch.empty(q.shape[0], HEADS, DIM, dtype=q.dtype, device=q.device)
    codes = fused_ops.quant_buffers(q.shape[0], HEADS * DIM, q.device) if quant else None
    inv._launch_attention(q, k, v, seq, lens, q if quant else out, codes, False, stages)
    return codes if codes is not None else out


def bits(result: Any) -> list[Tensor]:
    """A case's output as tensors to compare (FP8: the codes' bytes and the scales)."""
    return (
        [result.q.view(torch.uint8), result.s_t] if isinstance(result, fused_ops.QuantizedRows) else [result]
    )


def cases(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    batch, context = args.batch, args.context
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
    delta = torch.randn_like(h) * 1e-3
    weight = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(batch, 2 * INTER, device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(batch, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    cache_len = max(args.cache_len, context)
    k = torch.randn(batch + 1, KV_HEADS, cache_len, DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    arrivals = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device=dev)  # allocated outside the graphs
    out: dict[str, Callable[[], Any]] = {}
    for fp8 in (False, True):
        tag = "fp8 " if fp8 else "bf16"
        if "norm" in args.kernels:
            norm = functools.partial(fused_ops.add_rms_norm, h, delta, weight, 1e-6, fp8)
            out[f"norm  fast {tag}"] = norm
            out[f"norm  top  {tag}"] = functools.partial(norm, num_warps=fused_ops.NORM_WARPS)
        if "silu" in args.kernels:
            out[f"silu  both {tag}"] = functools.partial(fused_ops.silu_mul, gate_up, fp8)
        if "attn" not in args.kernels:
            continue
        for sp in args.splits:
            for form in args.launch:
                one = {"auto": None, "one": True, "two": False}[form]
                out[f"attn  fast {tag} s{sp} {form}"] = functools.partial(
                    attention.decode_triton, q, k, v, slots, lens, arrivals, sp, quant=fp8, one_launch=one
                )
        for st in args.stages:
            out[f"attn  top  {tag} st{st}"] = functools.partial(
                invariant_attention, q, k, v, slots, lens, fp8, st or None
            )
    return out


def same_bits(fns: dict[str, Callable[[], Any]]) -> None:
    """The true_on_policy attention's pipeline depth must not change its bits: say whether it does."""
    for tag in ("bf16", "fp8 "):
        names = [n for n in fns if n.startswith(f"attn  top  {tag}")]
        for name in names[1:]:
            ref, got = bits(fns[names[0]]()), bits(fns[name]())
            equal = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            print(f"{name}: {'same bits as' if equal else 'DIFFERS from'} {names[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=192, help="keys every row attends to")
    parser.add_argument(
        "--kernels", nargs="+", choices=("norm", "silu", "attn"), default=["norm", "silu", "attn"]
    )
    parser.add_argument("--cache-len", type=int, default=0, help="KV cache length (default: the context)")
    parser.add_argument("--splits", type=int, nargs="+", default=[8], help="fast attention's splits")
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[0], help="true_on_policy attention's depths (0: its rule)"
    )
    parser.add_argument(
        "--launch", nargs="+", choices=("auto", "one", "two"), default=["auto"],
        help="fast attention: one launch (splits merged by their last), two (split and merge kernels), "
        "or the rule (auto)",
    )  # fmt: skip
    parser.add_argument("--pdl", type=int, choices=(0, 1), default=0)
    parser.add_argument("--chain", type=int, default=28, help="calls per graph replay")
    parser.add_argument("--ncu", action="store_true", help="one launch of each case for Nsight Compute")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/producer_kernels.py: needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch}, "
          f"context {args.context}, PDL {args.pdl}; us per call, chain of {args.chain}")  # fmt: skip
    with pdl.forced(bool(args.pdl)):
        fns = cases(args)
        same_bits(fns)
        if args.ncu:
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for name, fn in fns.items():
                with torch.cuda.nvtx.range(name):
                    fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print("cases in launch order:", ", ".join(fns))
            return
        times = {name: 1e3 * time_in_graph(fn, calls=args.chain, replays=7) for name, fn in fns.items()}
    for name, us in times.items():
        pair = name.replace("fp8 ", "bf16")
        extra = f"  fp8 - bf16 {us - times[pair]:+6.2f}" if "fp8" in name else ""
        print(f"{name:24s} {us:7.2f}{extra}", flush=True)


if __name__ == "__main__":
    main()
