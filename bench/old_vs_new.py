"""Old log-probs (the scoring forward) against the training forward's log-probs, same weights, same micro-batches.

    python bench/old_vs_new.py [--seqs 32] [--budget 8192] [--modes bf16 fp8] [--layouts sorted packed]
                               [--cuda-graphs on|off] [--tiny]

At an RL step's first update the weights are those that scored the batch, so the PPO ratio exp(new - old) of
every trained token should be 1. It is 1 only where the two forwards compute the same bits; this prints, per
precision and layout, the max and mean |new - old| over trained tokens and the share of tokens that differ.
The training forward's log-probs are those ``train_step(keep_logprobs=True)`` hands back (what an RL step's
first update uses as its old log-probs, stages/rl.py); ``tests/test_old_logprobs_gpu.py`` checks the same on a
tiny model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from train_packed import rl_batch
from train_step import model_dir


def run(
    path: Path, fp8: bool, layout: str, graphs: str, batch: Any, args: argparse.Namespace
) -> dict[str, Any]:
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.microbatch import merge_rows, micro_batches, row_lengths, shard_rows, take_rows
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    packed = layout == "packed"
    trainer = TorchTrainer(
        ModelConfig(path=str(path)),
        TrainerConfig(pack_sequences=packed, max_tokens_per_gpu=args.budget, cuda_graphs=graphs),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0),
        fp8=fp8,
        total_steps=4,
    )
    if layout == "sorted":
        batch = take_rows(batch, shard_rows(row_lengths(batch), 1, sort_by_length=True)[0])
    parts = micro_batches(batch, 1, args.budget, packed=packed, bucketed=trainer.pads_to_buckets)
    old = merge_rows(trainer.forward_logprobs(parts), batch.input_ids.shape[1])
    stats = trainer.train_step(parts, SftLossFn(), num_target_tokens(batch), keep_logprobs=True)
    assert stats.logprobs is not None
    new = merge_rows([stats.logprobs], batch.input_ids.shape[1])
    trained = batch.loss_mask > 0
    trained[:, 0] = False
    d = (new[trained] - old[trained]).abs()
    worst, total, differ, count = float(d.max()), float(d.sum()), int((d > 0).sum()), d.numel()
    return {"max": worst, "mean": total / count, "differ": differ / count, "tokens": count}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument(
        "--layouts", nargs="+", default=["sorted", "packed"], choices=["sorted", "padded", "packed"]
    )
    p.add_argument("--cuda-graphs", nargs="+", default=["on"], choices=["on", "off"])
    p.add_argument("--tiny", action="store_true", help="the tiny CPU model (a smoke run)")
    args = p.parse_args()
    path = model_dir(args.tiny)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = rl_batch(args.seqs, vocab)
    for graphs in args.cuda_graphs:
        for mode in args.modes:
            for layout in args.layouts:
                r = run(path, mode == "fp8", layout, graphs, batch, args)
                print(
                    f"graphs {graphs:3s} {mode:4s} {layout:7s}: max |new - old| {r['max']:.3e}, mean "
                    f"{r['mean']:.3e}, tokens differing {100 * r['differ']:.2f}% of {r['tokens']}",
                    flush=True,
                )
                torch.cuda.empty_cache()

    return 0


if __name__ == "__main__":
    sys.exit(main())
