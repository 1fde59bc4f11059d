"""What a fixed launch shape costs varlen flash attention: the price of capturing packed micro-batches in CUDA graphs.

    python bench/varlen_grid.py [--tokens 8192] [--heads 12] [--kv-heads 2] [--head-dim 128] [--caps 16 32 64]
                                [--reps 20] [--out PATH]

A CUDA graph fixes a kernel's grid. Flash attention's varlen grid is (ceil(max_len / block), sequences, heads),
and ``cu_seq`` (sequences + 1 offsets) is its input. To replay one graph for packed rows of different
compositions, the graph is captured with a fixed number of sequences (``cap``: offsets padded by repeating
the last one, i.e. empty sequences) and ``max_len`` = the row's padded length; the programs past a sequence's
end return at once. This bench times, for micro-batches of the RL-shaped batch of bench/train_packed.py
(lengths 200..8,192, long-tailed, grouped as ``trainer.pack_sequences`` groups them under ``--tokens``),
varlen attention forward + backward (replayed from a CUDA graph, so no host time) with

* exact: the row's own sequence count and longest sequence (what eager packing launches),
* capped: ``cap`` sequences and ``max_len`` = ``--tokens`` (one graph for every row of the budget),
* trainer: what the trainer launches: the row padded to its length bucket (``bucket_length`` of its real
  tokens), at least 16 sequence slots, ``graph_max_len`` (``varlen_kwargs(padded_to=)``),

reports whether the capped launches give bit-equal outputs and gradients on the real tokens (they do not:
flash's dQ atomics, docs/performance.md), and prints the per-call difference and what it adds to a
micro-batch of 28 layers (the 1.5B shape). The last column times
what the padded layout runs for the same sequences instead: SDPA's causal kernel (no mask, as the trainer's
padded rows run since session 36) over the rows padded to the length bucket of the longest
(``microbatch.bucket_length``), also forward + backward from a CUDA graph.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from decoder_layer import graphed
from train_packed import rl_batch
from train_step import write_report

from infir2_rl.trainers.torch.varlen_attention import varlen_causal, varlen_kwargs


def graph_times(fn: Any, reps: int) -> tuple[list[float], Any]:
    """``fn`` replayed from one CUDA graph (``decoder_layer.graphed``): the ms of each of ``reps`` replays, and
    what ``fn`` returned in the capture (its tensors hold the last replay's values)."""
    held: list[Any] = [None]

    def call() -> None:
        held[0] = fn()

    replay = graphed(call)
    replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, held[0]


def timed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    reps: int,
    backend: str = "flash",
    eager: bool = False,
) -> dict[str, Any]:
    """Forward + backward in one CUDA graph (``eager``: launched from Python each time, host included):
    median ms per replay, and the outputs and gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn(
        q.shape, generator=torch.Generator(q.device).manual_seed(1), device=q.device, dtype=q.dtype
    )

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        attend = cudnn_varlen_causal if backend == "cudnn" else varlen_causal
        out = attend(q, k, v, cu, max_len)
        return out, torch.autograd.grad(out, (q, k, v), grad)

    kernel_ms = None
    if eager:
        times, ((out, grads), kernel_ms) = eager_times(step, reps)
    else:
        times, (out, grads) = graph_times(step, reps)
    return {
        "kernel_ms": kernel_ms,
        "ms": statistics.median(times),
        "spread": [min(times), max(times)],
        "out": out.detach(),
        "grads": grads,
    }


def cudnn_varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int
) -> Any:
    """``varlen_causal`` on torch's cuDNN attention over ragged sequences (``_cudnn_attention_forward`` given
    offsets; autograd runs ``_cudnn_attention_backward``): timed against flash by ``--cudnn``, not used by the
    trainer (torch 2.11 on an H100, session 37: outputs and gradients up to 15 away from flash's with these
    GQA shapes, through this call of torch's private op, not debugged further; 100-140 ms per eager call,
    a cuDNN graph built each time; and its CUDA graph capture failed; docs/performance.md, "Packed
    micro-batches", session 37)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    args = (q.contiguous(), k.contiguous(), v.contiguous(), None, cu, cu, max_len, max_len, needs_grad)
    return torch.ops.aten._cudnn_attention_forward(*args, 0.0, True, False)[0]


def eager_times(fn: Any, reps: int) -> tuple[list[float], Any]:
    """``fn`` called from Python ``reps`` times after a warm-up: wall ms of each call, synchronized (the host's
    launch work included), and the last call's result."""
    import time

    from torch.profiler import ProfilerActivity, profile
    from train_step import kernel_times

    held = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        held = fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(us for _, _, us, _ in kernel_times(prof)) / 1e3
    return times, (held, kernels)


def max_diff(got: dict[str, Any], ref: dict[str, Any], real: int) -> float:
    """Largest |difference| of outputs and gradients on the first ``real`` tokens."""
    pairs = [(got["out"], ref["out"]), *zip(got["grads"], ref["grads"], strict=True)]
    return max(float((a[:real].float() - b[:real].float()).abs().max()) for a, b in pairs)


def timed_padded(
    heads: int, kv_heads: int, head_dim: int, lengths: list[int], reps: int
) -> tuple[float, int]:
    """SDPA causal forward + backward over the sequences as right-padded rows (B, H, L, D) of random values,
    L the length bucket of the longest, from one CUDA graph: (median ms, L)."""
    from infir2_rl.trainers.microbatch import bucket_length

    length = bucket_length(max(lengths))
    gen = torch.Generator("cuda").manual_seed(2)
    qs, ks, vs = (
        torch.randn(
            len(lengths), h, length, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn_like(qs)

    def step() -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out, (qs, ks, vs), grad)

    times, _ = graph_times(step, reps)
    return statistics.median(times), length


def same_on_real(got: dict[str, Any], exact: dict[str, Any], real: int) -> bool:
    """Outputs and gradients of two ``timed`` runs bit-equal on the first ``real`` (non-pad) tokens."""
    return torch.equal(got["out"][:real], exact["out"][:real]) and all(
        torch.equal(a[:real], b[:real]) for a, b in zip(got["grads"], exact["grads"], strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    from infir2_rl.trainers.microbatch import bucket_length, packed_token_budget, row_lengths

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, default=8192, help="token budget per packed row (max_tokens_per_gpu)"
    )
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--caps", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=6, help="micro-batches timed (spread over the batch)")
    parser.add_argument(
        "--cudnn",
        action="store_true",
        help="also time the trainer's launch on cuDNN's ragged attention (graphed and eager, flash eager too)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("varlen_grid: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    lengths = row_lengths(rl_batch(args.seqs, 1000))
    groups = packed_token_budget(lengths, args.tokens)
    pick = sorted({round(i * (len(groups) - 1) / max(args.rows - 1, 1)) for i in range(args.rows)})
    gen = torch.Generator(dev).manual_seed(0)
    N, D = args.tokens, args.head_dim
    q = torch.randn(N, args.heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(N, args.kv_heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(N, args.kv_heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {N} tokens, {args.heads}/{args.kv_heads} heads x {D}"
    )
    print(
        f"{'row':>4} {'seqs':>4} {'real':>5} {'longest':>7} {'exact ms':>9} "
        + " ".join(f"{'cap ' + str(c) + ' ms':>10}" for c in args.caps)
        + "  trainer ms (slots, max_len)  padded SDPA ms (rows x length)"
    )
    rows = []
    for g in pick:
        ls = [lengths[i] for i in groups[g]]
        real = sum(ls)
        # The packed row padded to N tokens: the pads are one more sequence, after the real ones.
        seq = ls + ([N - real] if real < N else [])
        cu = torch.tensor([0, *torch.tensor(seq).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        exact = timed(q, k, v, cu, max(seq), args.reps)
        row: dict[str, Any] = {
            "group": g,
            "seqs": len(ls),
            "real": real,
            "longest": max(ls),
            "exact_ms": exact["ms"],
            "exact_spread": exact["spread"],
        }
        cells = []
        for cap in args.caps:
            if cap < len(seq):
                cells.append(f"{'-':>10}")
                continue
            padded = torch.cat([cu, cu[-1:].expand(cap - len(seq))])
            got = timed(q, k, v, padded, N, args.reps)
            equal = same_on_real(got, exact, real)
            row[f"cap{cap}_ms"], row[f"cap{cap}_equal"] = got["ms"], equal
            cells.append(f"{got['ms']:>8.3f}{'' if equal else ' !='}")
        # What the trainer launches (varlen_kwargs(padded_to=)): the row padded to its length bucket
        # (TorchTrainer.packed_length), its slot count and graph_max_len bound.
        bucket = bucket_length(real)
        launch = varlen_kwargs(torch.tensor(ls), padded_to=bucket)
        cu_t = launch["cu_seq_lens_q"].to(dev)
        got = timed(q[:bucket], k[:bucket], v[:bucket], cu_t, launch["max_length_q"], args.reps)
        equal = same_on_real(got, exact, real)
        row["trainer_ms"], row["trainer_equal"] = got["ms"], equal
        row["trainer_launch"] = [launch["cu_seq_lens_q"].numel() - 1, launch["max_length_q"]]
        cells.append(
            f"{got['ms']:>8.3f}{'' if equal else ' !='} ({row['trainer_launch'][0]}, {row['trainer_launch'][1]})"
        )
        if args.cudnn:  # eager only: torch 2.11's ragged cuDNN attention cannot be captured (below)
            qb, kb, vb, mlen = q[:bucket], k[:bucket], v[:bucket], launch["max_length_q"]
            fl = timed(qb, kb, vb, cu_t, mlen, args.reps, eager=True)
            cud = timed(qb, kb, vb, cu_t, mlen, args.reps, backend="cudnn", eager=True)
            row["flash_eager_ms"], row["cudnn_eager_ms"] = fl["ms"], cud["ms"]
            row["cudnn_diff"] = max_diff(cud, fl, real)
            cells.append(f" eager flash {fl['ms']:.3f} / cudnn {cud['ms']:.3f} (|d| {row['cudnn_diff']:.1e})")
        row["padded_ms"], row["padded_length"] = timed_padded(args.heads, args.kv_heads, D, ls, args.reps)
        cells.append(f"  {row['padded_ms']:>8.3f} ({len(ls)} x {row['padded_length']})")
        rows.append(row)
        print(f"{g:>4} {len(ls):>4} {real:>5} {max(ls):>7} {exact['ms']:>9.3f} " + " ".join(cells))
    for cap in args.caps:
        deltas = [r[f"cap{cap}_ms"] - r["exact_ms"] for r in rows if f"cap{cap}_ms" in r]
        if deltas:
            mean = statistics.mean(deltas)
            print(
                f"cap {cap}: +{mean:.3f} ms per attention fwd+bwd on average, x {args.layers} layers = "
                f"+{mean * args.layers:.1f} ms per micro-batch; bit-equal: {all(r.get(f'cap{cap}_equal', True) for r in rows)}"
            )
    deltas = [r["trainer_ms"] - r["exact_ms"] for r in rows]
    print(
        f"trainer launch against exact (exact pads the row to --tokens, the trainer to its bucket): "
        f"{statistics.mean(deltas):+.3f} ms per attention fwd+bwd on average, x {args.layers} layers = "
        f"{statistics.mean(deltas) * args.layers:+.1f} ms per micro-batch; bit-equal: "
        f"{all(r['trainer_equal'] for r in rows)}"
    )
    packed, padded = sum(r["trainer_ms"] for r in rows), sum(r["padded_ms"] for r in rows)
    print(
        f"these rows' attention, forward + backward: packed (trainer launch) {packed:.3f} ms, padded SDPA "
        f"{padded:.3f} ms: packed / padded time {packed / padded:.2f}"
    )
    if args.cudnn:
        cud, fl = sum(r["cudnn_eager_ms"] for r in rows), sum(r["flash_eager_ms"] for r in rows)
        kc, kf = sum(r["cudnn_kernel_ms"] for r in rows), sum(r["flash_kernel_ms"] for r in rows)
        print(
            f"eager, host included: cuDNN ragged {cud:.3f} ms against flash {fl:.3f} (cudnn / flash "
            f"{cud / fl:.2f}); device kernels {kc:.3f} against {kf:.3f} ({kc / kf:.2f}); largest "
            f"|difference| from flash {max(r['cudnn_diff'] for r in rows):.2e}"
        )
        try:  # last: a failed capture may leave the device unusable for this process
            timed(q, k, v, cu, max(seq), 1, backend="cudnn")
            print("cuDNN ragged attention: captured in a CUDA graph")
        except Exception as exc:
            print(f"cuDNN ragged attention: CUDA graph capture failed: {str(exc).splitlines()[0]}")
    write_report(
        args.out,
        {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "args": vars(args) | {"out": str(args.out)},
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
