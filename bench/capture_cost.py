"""Where the trainer's layer-graph capture time goes: warm-up runs, recording, instantiation, per kind.

    python bench/capture_cost.py [--seqs 64] [--budget 8192] [--mode fp8] [--batches 2]

Scores then trains --batches new RL-shaped batches (bench/train_packed.py's, sorted rows), as an RL run meets
them, and splits ``LayerGraphs.capture_s`` into: warm-up (the eager runs before a capture, to the synchronize
after them), the capture blocks (recording the captured Python and launches, with instantiation inside them,
``capture_end``: cudaGraphInstantiate and the upload, also shown apart), the shared buffers and static tables,
the other synchronizes, and the rest. ``--warm-every-shape``: every layer warms up for every shape (the rule
before session 39). Run it twice on a fresh machine: the first process also compiles the Triton kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from train_packed import rl_batch
from train_step import model_dir


def _unique_path(key_fn: Any) -> Any:
    """``LayerGraphs._key`` with the sizes in the code path too: every shape a path of its own."""

    def key(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = key_fn(self, *args, **kwargs)
        return None if out is None else ((out[0], out[1]), out[1])

    return key


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--mode", default="fp8", choices=["bf16", "fp8"])
    p.add_argument("--batches", type=int, default=2)
    p.add_argument(
        "--warm-every-shape",
        action="store_true",
        help="warm up every layer for every shape (the rule before session 39) instead of layer 0 after a "
        "code path's first shape",
    )
    args = p.parse_args()

    from transformers import AutoConfig

    import infir2_rl.trainers.layer_graphs as lg
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.microbatch import micro_batches, row_lengths, shard_rows, take_rows
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    plain_capture = lg.capture
    plain_end = torch.cuda.CUDAGraph.capture_end

    def timed_end(graph: torch.cuda.CUDAGraph) -> None:
        start = time.perf_counter()
        plain_end(graph)
        seconds["instantiate"] += time.perf_counter() - start

    @contextlib.contextmanager
    def timed_capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
        kind = "fwd-only" if not torch.is_grad_enabled() else "train"
        start = time.perf_counter()
        with plain_capture(graph, pool):
            yield
        seconds[f"capture {kind}"] += time.perf_counter() - start
        counts[kind] += 1

    lg.capture = timed_capture  # type: ignore[assignment]
    # Warm-up: from the warm-up stream's lookup to the end of the synchronize that follows the eager runs.
    plain_stream, plain_sync = lg.warmup_stream, torch.cuda.synchronize
    warm_start: list[float] = []

    def timed_stream(device: torch.device) -> torch.cuda.Stream:
        warm_start.append(time.perf_counter())
        return plain_stream(device)

    # While a capture runs (LayerGraphs._capture_or_none); its first synchronize waits for earlier work, before
    # capture_s starts counting, so it is not counted here either.
    inside: list[str] = []

    def timed_sync(device: Any = None) -> None:
        start = time.perf_counter()
        plain_sync(device)
        if not inside:
            return
        if inside[-1] == "entered":
            inside[-1] = "capturing"
            return
        if warm_start:
            seconds["warm-up"] += time.perf_counter() - warm_start.pop()
        else:
            seconds["synchronize"] += time.perf_counter() - start

    plain_capture_or_none = lg.LayerGraphs._capture_or_none

    def flagged(self: Any, *a: Any, **k: Any) -> Any:
        inside.append("entered")
        try:
            return plain_capture_or_none(self, *a, **k)
        finally:
            inside.pop()

    lg.LayerGraphs._capture_or_none = flagged  # type: ignore[method-assign]
    for name in ("_boundaries", "_static"):
        raw = lg.LayerGraphs.__dict__[name]
        static = isinstance(raw, staticmethod)
        method = raw.__func__ if static else raw

        def timed(*a: Any, _m: Any = method, _n: str = name, **k: Any) -> Any:
            start = time.perf_counter()
            out = _m(*a, **k)
            seconds[_n] += time.perf_counter() - start
            return out

        setattr(lg.LayerGraphs, name, staticmethod(timed) if static else timed)
    lg.warmup_stream = timed_stream  # type: ignore[assignment]
    torch.cuda.synchronize = timed_sync  # type: ignore[assignment]
    if args.warm_every_shape:  # every shape its own code path: all layers warm up
        lg.LayerGraphs._key = _unique_path(lg.LayerGraphs._key)  # type: ignore[method-assign]
    torch.cuda.CUDAGraph.capture_end = timed_end  # type: ignore[method-assign,assignment]

    path = model_dir(False)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    trainer = TorchTrainer(
        ModelConfig(path=str(path)),
        TrainerConfig(max_tokens_per_gpu=args.budget),
        OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0),
        fp8=args.mode == "fp8",
        total_steps=args.batches + 2,
    )
    graphs = trainer.layer_graphs
    assert graphs is not None, "needs the layer graphs (a CUDA GPU)"
    for seed in range(args.batches):
        batch = rl_batch(args.seqs, vocab, seed=seed)
        batch = take_rows(batch, shard_rows(row_lengths(batch), 1, sort_by_length=True)[0])
        parts = micro_batches(batch, 1, args.budget, bucketed=trainer.pads_to_buckets)
        before = graphs.capture_s
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.forward_logprobs(parts)
        torch.cuda.synchronize()
        mid = time.perf_counter()
        scoring_capture = graphs.capture_s - before
        trainer.train_step(parts, SftLossFn(), num_target_tokens(batch))
        torch.cuda.synchronize()
        end = time.perf_counter()
        print(
            f"batch {seed}: {len(parts)} micro-batches, shapes now {graphs.num_shapes}; scoring {mid - start:.2f} s "
            f"({scoring_capture:.2f} capturing), training {end - mid:.2f} s "
            f"({graphs.capture_s - before - scoring_capture:.2f} capturing)",
            flush=True,
        )
    total = graphs.capture_s
    recorded = sum(v for k, v in seconds.items() if k != "instantiate")
    print(f"{args.mode}: {graphs.captures} shapes captured in {total:.2f} s; graphs recorded: {dict(counts)}")
    for name, s in sorted(seconds.items()):
        print(f"  {name:18s} {s:7.2f} s  ({100 * s / total:.0f}%)")
    print(f"  {'other':18s} {total - recorded:7.2f} s  ({100 * (total - recorded) / total:.0f}%)")
    print("  (capture blocks include instantiation; recording = capture - instantiate)")

    return 0


if __name__ == "__main__":
    sys.exit(main())
