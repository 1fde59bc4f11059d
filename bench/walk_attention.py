"""The true_on_policy walk's attention over whole sequences: tokens per program, bits and time (CUDA).

    python bench/walk_attention.py [--shapes 16x256 4x2048 1x8192] [--tokens 1 2 4 8] [--reps 20]

Why: session 59's profiles put the walk's attention forward at 46 ms per 1.5B scoring pass against the fast
mode's 19 (docs/mismatch.md): ``invariant_ops._attention_kernel`` runs one program per token and KV head, so
every token loads all of its keys and values again. ``invariant_ops.causal_rows`` gives a program T consecutive
tokens of a sequence, which share each K/V block's load (``_causal_attention_kernel``); it must keep the bits
of the one-token kernel, which the engine's decode runs. For each shape (sequences x length; 1.5B heads: 12
query / 2 KV of 128) it prints, per T (their query heads stacked into the rows of the products, padded
to a power of two, at least 16) and warp count, whether the output equals T = 1's bit for bit and ms per
call (``graph_capture.time_in_graph``); then SDPA's causal kernel over the same tensors (``enable_gqa``) for
scale, and the walk's backward (SDPA recomputed) with K/V repeated per query head against ``enable_gqa``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.graph_capture import time_in_graph  # noqa: E402
from infir2_rl.models import invariant_ops as inv  # noqa: E402


def _backward(q, k, v, grad, gqa: bool):  # type: ignore[no-untyped-def]
    """The walk's attention backward (``invariant_ops._CausalAttention.backward``), K/V repeated or not."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[1]
    with torch.enable_grad():
        if gqa:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
        else:
            kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=True)
        return torch.autograd.grad(out.transpose(1, 2).reshape(grad.shape), (q, k, v), grad)


def _one_shape(batch: int, length: int, args: argparse.Namespace, gen: torch.Generator) -> None:
    dev = gen.device
    q = torch.randn(batch, length, args.heads, args.dim, device=dev, generator=gen).bfloat16()
    k, v = (
        torch.randn(batch, args.kv_heads, length, args.dim, device=dev, generator=gen).bfloat16()
        for _ in "kv"
    )
    q_rows = q.reshape(batch * length, args.heads, args.dim)
    ref = inv.causal_rows(q_rows, k, v, tokens=1)
    print(f"--- {batch} x {length} tokens")
    for tokens in args.tokens:
        for warps in (4, 8) if tokens > 1 else (4,):
            out = inv.causal_rows(q_rows, k, v, tokens=tokens, warps=warps)
            differ = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
            ms = time_in_graph(functools.partial(inv.causal_rows, q_rows, k, v, tokens, warps), args.reps, 7)
            print(f"tokens {tokens} warps {warps:2d}: {ms:7.3f} ms, elements differing from T=1: {differ}")
    qt = q.transpose(1, 2)
    sdpa = time_in_graph(
        lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True), args.reps, 7
    )
    print(f"SDPA causal (enable_gqa) forward: {sdpa:7.3f} ms")
    grad = torch.randn(batch, length, args.heads * args.dim, device=dev, generator=gen).bfloat16()
    for gqa in (False, True):
        ms = time_in_graph(functools.partial(_backward, q, k, v, grad, gqa), args.reps, 7)
        print(f"backward (SDPA recomputed), K/V {'enable_gqa' if gqa else 'repeated'}: {ms:7.3f} ms")
    a, b = _backward(q, k, v, grad, False), _backward(q, k, v, grad, True)
    diffs = [f"{(x.float() - y.float()).abs().max().item():.2e}" for x, y in zip(a, b, strict=True)]
    print("  max |gradient difference|, repeated against enable_gqa, q / k / v:", " / ".join(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["16x256", "4x2048", "1x8192"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10, help="calls per graph replay")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        _one_shape(batch, length, args, gen)


if __name__ == "__main__":
    main()
