"""How many CUDA-graph shapes the trainer's micro-batches meet over many RL-shaped batches, per layout (CPU only).

    python bench/graph_shapes.py [--batches 50] [--seqs 256] [--budget 8192] [--report 1 10 50] [--cap 64]

``trainer.cuda_graphs`` captures each decoder layer once per micro-batch shape, at most 64 training and 64
forward-only shapes (16 forward-only before session 38) (trainers/layer_graphs.py); micro-batches of later shapes run eagerly. A benchmark
that repeats one batch (bench/train_packed.py) meets only that batch's shapes; an RL run meets new lengths
every step. This counts, for ``--batches`` batches of bench/train_packed.py's length distribution (seeds 0, 1,
...), the distinct keys each layout's micro-batches would have, as the trainer builds them:

* padded: consecutive rows with rows x bucket(longest) <= budget (``micro_batches(bucketed=True)``: what the
  trainer group does where the trainer pads to length buckets, since session 38; ``--rule longest``: rows x
  longest <= budget, the rule before, which gave one bucket several row counts), padded to the length
  bucket: (rows, bucket);
* sorted (``trainer.sort_by_length``): the same over the rows ordered by length;
* packed: one row of the group's real tokens padded to its bucket, with the offsets and longest length that
  ``varlen_attention.varlen_kwargs(padded_to=)`` makes for it: (bucket, offsets, max length).

It also counts the micro-batches whose shape is not among the first ``--cap`` met (the captured ones), which
run eagerly. Nothing runs on a GPU; the counts say when a run passes the caps, not what that costs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from train_packed import rl_batch


def shape_keys(lengths: list[int], budget: int, layout: str, rule: str = "bucket") -> list[tuple[Any, ...]]:
    """The graph key of each micro-batch of a batch with these row lengths (``rule``: module docstring)."""
    import torch

    from infir2_rl.data.batching import batch_by_token_budget
    from infir2_rl.trainers.microbatch import bucket_length, packed_token_budget
    from infir2_rl.trainers.torch.varlen_attention import varlen_kwargs

    if layout == "sorted":
        lengths = sorted(lengths, reverse=True)
    if layout in ("padded", "sorted"):
        pad = bucket_length if rule == "bucket" else None
        groups = batch_by_token_budget(lengths, budget, padded_length=pad)
        return [(len(g), bucket_length(max(lengths[i] for i in g))) for g in groups]
    keys = []
    for g in packed_token_budget(lengths, budget):
        seqs = [lengths[i] for i in g]
        padded_to = bucket_length(sum(seqs))  # TorchTrainer.packed_length under graphs
        launch = varlen_kwargs(seqs, padded_to, torch.device("cpu"))
        keys.append((padded_to, launch["cu_seq_lens_q"].numel(), launch["max_length_q"]))
    return keys


def main(argv: list[str] | None = None) -> int:
    from infir2_rl.trainers.microbatch import row_lengths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8192, help="trainer.max_tokens_per_gpu")
    parser.add_argument(
        "--report", type=int, nargs="+", default=[1, 10, 50], help="batches after which to print"
    )
    parser.add_argument(
        "--cap",
        type=int,
        default=64,
        help="shapes captured (LayerGraphs.max_shapes, max_forward_only_shapes)",
    )
    parser.add_argument(
        "--rule", choices=("bucket", "longest"), default="bucket", help="padded rows: budget rule (docstring)"
    )
    args = parser.parse_args(argv)
    layouts = ("padded", "sorted", "packed")
    seen: dict[str, set[tuple[Any, ...]]] = {name: set() for name in layouts}
    # The first --cap shapes met are the captured ones (layer_graphs captures on first use, up to its cap).
    captured: dict[str, set[tuple[Any, ...]]] = {name: set() for name in layouts}
    eager = dict.fromkeys(layouts, 0)
    total = dict.fromkeys(layouts, 0)
    print(
        f"distinct micro-batch shapes (graphs cap at 64 training and 64 forward-only); budget {args.budget}, "
        f"padded rows x {'bucket(longest)' if args.rule == 'bucket' else 'longest'} <= budget"
    )
    print(f"{'batches':>7} " + " ".join(f"{name:>7}" for name in layouts))
    for b in range(args.batches):
        lengths = row_lengths(rl_batch(args.seqs, 1000, seed=b))
        for name in layouts:
            for key in shape_keys(lengths, args.budget, name, args.rule):
                seen[name].add(key)
                if len(captured[name]) < args.cap:
                    captured[name].add(key)
                total[name] += 1
                eager[name] += key not in captured[name]
        if b + 1 in args.report or b + 1 == args.batches:
            print(f"{b + 1:>7} " + " ".join(f"{len(seen[name]):>7}" for name in layouts))
    print(
        f"micro-batches of shapes past the first {args.cap} met (eager under that cap), over all batches: "
        + ", ".join(
            f"{name} {eager[name]} of {total[name]} ({eager[name] / total[name]:.1%})" for name in layouts
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
