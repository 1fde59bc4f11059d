"""Packed vs padded micro-batches on an RL-shaped batch: one trainer step, 1.5B shape, BF16 and FP8.

    python bench/train_packed.py [--seqs 64] [--budget 8192] [--steps 2] [--modes bf16 fp8]
                                 [--layouts padded packed sorted] [--cuda-graphs auto|on|off|both]
                                 [--max-shapes N] [--score-steps 0] [--vary 0] [--profile] [--profile-top 12]
                                 [--out PATH]

The batch: --seqs sequences whose lengths are long-tailed between 200 and 8,192 tokens (log-normal, median
900, clipped; seeded), a 128-token prompt and the rest trained (SFT loss: the same per-token work as the
RL loss), in random order as a rollout returns them. Padded: micro-batches of consecutive rows with rows x
longest row <= --budget (``trainer.max_tokens_per_gpu``), each padded to its longest row; with graphs, rows x
the longest row's length bucket <= --budget (the trainer group's split where the trainer pads to buckets,
since session 38; ``padded-longest``, ``sorted-longest``: rows x longest row, the rule before). Packed
(``trainer.pack_sequences``): consecutive rows with summed length <= --budget, one row of real tokens each.
Sorted (``trainer.sort_by_length``, the default with a token budget): the padded grouping over the rows
ordered by length, longest first (rows of like length share a micro-batch, so little is padded, and
attention stays on SDPA's kernel instead of varlen flash); sorted-packed: packed over the sorted rows.
Tokens/s counts real tokens. Median of --steps steps after one warm-up step, synchronized wall time.
``--cuda-graphs`` sets ``trainer.cuda_graphs`` (auto, the trainer's default: graphs for both precisions on one
GPU; both: every mode and layout eager and graphed); ``--max-shapes`` caps the training shapes captured (the
trainer's default 64; micro-batches of later shapes run eagerly). With graphs, padded micro-batches are padded
to a length bucket and packed rows to the bucket of their real tokens; "computed" counts those pads. FP8/BF16
ratios are printed per layout against the fastest BF16 of that layout. ``--score-steps N`` then times N scoring passes
(``forward_logprobs``, the RL step's old log-probs) after one that captures, with how many micro-batches
replayed from forward-only graphs (at most 64 shapes; 16 before session 38). ``--vary N`` then runs N RL-shaped
steps on N new batches (seeds 1..N of the same distribution; each scored, then trained, as an RL step does),
as a run meets them: new lengths every step, so new graph shapes are captured along the way; it prints each
step's time, the tokens/s over all N (and without the capture time), and the share of micro-batches replayed from graphs. ``--profile`` runs one more step per
case under torch.profiler and prints its device kernels by category (bench/train_step.py's grouping), per
computed token, and the share of the step the GPU was busy: where a packed token costs more than a padded one.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from train_step import kernel_times, model_dir, print_kernels, summarize_kernels, sync, write_report


def rl_batch(num: int, vocab: int, seed: int = 0) -> Any:
    from infir2_rl.types import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(num, generator=gen) + torch.log(torch.tensor(900.0)))
    lengths = lengths.round().clamp(200, 8192).long()
    longest = int(lengths.max())
    ids = torch.randint(0, vocab, (num, longest), generator=gen)
    mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    loss_mask = mask.float()
    loss_mask[:, :128] = 0
    return TokenBatch(input_ids=ids * mask, attention_mask=mask, loss_mask=loss_mask)


def run(
    path: Path, fp8: bool, layout: str, graphs: bool | str, batch: Any, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.microbatch import bucket_length, micro_batches, row_lengths, shard_rows, take_rows
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    packed = layout.endswith("packed")  # packed or sorted-packed
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = TorchTrainer(
        ModelConfig(path=str(path), gradient_checkpointing=args.checkpointing),
        TrainerConfig(pack_sequences=packed, max_tokens_per_gpu=args.budget, cuda_graphs=graphs),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0),
        fp8=fp8,
        total_steps=args.steps + args.vary + 2,
    )
    pads_to_buckets = trainer.pads_to_buckets

    def split(b: Any) -> tuple[Any, list[Any]]:
        """The batch in the layout's row order, and its micro-batches as the trainer group makes them."""
        if layout.startswith("sorted"):  # the rows ordered by length, longest first (trainer.sort_by_length)
            b = take_rows(b, shard_rows(row_lengths(b), 1, sort_by_length=True)[0])
        bucketed = pads_to_buckets and not layout.endswith("-longest")
        return b, micro_batches(b, 1, args.budget, packed=packed, bucketed=bucketed)

    batch, parts = split(batch)
    graphed = trainer.layer_graphs is not None
    if graphed and args.max_shapes is not None:
        trainer.layer_graphs.max_shapes = args.max_shapes  # type: ignore[union-attr]
    packed_length = trainer.packed_length

    def computed_tokens(b: Any) -> int:
        if packed:
            real = int(b.attention_mask.sum())
            return packed_length(real) if packed_length else real
        rows, length = b.input_ids.shape
        return rows * (bucket_length(length) if graphed else length)

    computed = sum(computed_tokens(b) for b in parts)
    units, loss_fn = num_target_tokens(batch), SftLossFn()
    times = []
    for _ in range(args.steps + 1):
        sync(trainer.device)
        start = time.perf_counter()
        stats = trainer.train_step(parts, loss_fn, units)
        sync(trainer.device)
        times.append(time.perf_counter() - start)
    first, times = times[0], times[1:]  # the first step also captures the graphs of the shapes it meets
    captured_s = trainer.layer_graphs.capture_s if trainer.layer_graphs is not None else 0.0
    real = int(batch.attention_mask.sum())
    step_s = statistics.median(times)
    out: dict[str, Any] = {
        "fp8": fp8,
        "packed": packed,
        "layout": layout,
        "graphs": graphed,
        "graph_shapes": trainer.layer_graphs.num_shapes
        if graphed and trainer.layer_graphs is not None
        else 0,
        "micro_batches": len(parts),
        "real_tokens": real,
        "computed_tokens": computed,
        "step_s": dict(median=step_s, min=min(times), max=max(times), n=len(times)),
        "first_step_s": first,
        "first_step_capture_s": captured_s,
        "tokens_per_s": real / step_s,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
        "loss": stats.loss,
    }
    if args.score_steps:  # old log-probs over the same micro-batches, as an RL step scores its batch
        layer_graphs = trainer.layer_graphs
        trainer.forward_logprobs(parts)  # captures the forward-only shapes (at most 64)
        before = layer_graphs.replays if layer_graphs is not None else 0
        score_times = []
        for _ in range(args.score_steps):
            sync(trainer.device)
            start = time.perf_counter()
            trainer.forward_logprobs(parts)
            sync(trainer.device)
            score_times.append(time.perf_counter() - start)
        out["score_s"] = statistics.median(score_times)
        after = layer_graphs.replays if layer_graphs is not None else 0
        out["score_graphed"] = (after - before) / args.score_steps
        out["graph_shapes_after_scoring"] = layer_graphs.num_shapes if layer_graphs is not None else 0
    if args.vary:
        out["vary"] = run_varied(trainer, split, loss_fn, args, vocab)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(parts, loss_fn, units)
            sync(trainer.device)
        out["profile"] = summarize_kernels(kernel_times(prof), top=args.profile_top)
    print(
        f"  {'fp8' if fp8 else 'bf16'} {layout} graphs={graphed}: "
        f"step {step_s:.2f} s [{min(times):.2f}, {max(times):.2f}], {out['tokens_per_s']:.0f} tok/s "
        f"(first step {first:.2f} s, of which capturing {captured_s:.2f} s)"
        + (
            f"; scoring {out['score_s']:.2f} s ({out['score_graphed']:.0f} of {len(parts)} micro-batches graphed), "
            f"train + score {real / (step_s + float(out['score_s'])):.0f} tok/s"
            if "score_s" in out
            else ""
        ),
        flush=True,
    )
    if "vary" in out:
        v = out["vary"]
        print(
            f"    --vary {args.vary} new batches: score + train s per step "
            + " ".join(f"{a:.1f}+{b:.1f}" for a, b in zip(v["score_s"], v["train_s"], strict=True))
            + f"; {v['tokens_per_s']:.0f} tok/s over all; graphed {v['train_graphed']} of {v['micro_batches']} "
            f"training and {v['score_graphed']} of {v['micro_batches']} scoring micro-batches; "
            f"{v['graph_shapes']} shapes captured in all, capturing {v['capture_s']:.1f} s of the {args.vary} steps",
            flush=True,
        )
    del trainer
    gc.collect()
    return out


def run_varied(
    trainer: Any, split: Any, loss_fn: Any, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    """--vary: N RL-shaped steps (score, then train) on N new batches; times, tokens/s, graphed shares."""
    from infir2_rl.stages.sft_eval import num_target_tokens

    graphs = trainer.layer_graphs
    replays = (lambda: graphs.replays) if graphs is not None else (lambda: 0)
    captured_before = graphs.capture_s if graphs is not None else 0.0
    score_s, train_s = [], []
    real = micro = score_graphed = train_graphed = 0
    for seed in range(1, args.vary + 1):
        batch, parts = split(rl_batch(args.seqs, vocab, seed=seed))
        real += int(batch.attention_mask.sum())
        micro += len(parts)
        sync(trainer.device)
        start, before = time.perf_counter(), replays()
        trainer.forward_logprobs(parts)
        sync(trainer.device)
        middle, scored = time.perf_counter(), replays()
        trainer.train_step(parts, loss_fn, num_target_tokens(batch))
        sync(trainer.device)
        score_s.append(middle - start)
        train_s.append(time.perf_counter() - middle)
        score_graphed += scored - before
        train_graphed += replays() - scored
    capture_s = (graphs.capture_s - captured_before) if graphs is not None else 0.0
    total_s = sum(score_s) + sum(train_s)
    return {
        "score_s": score_s,
        "train_s": train_s,
        "tokens_per_s": real / total_s,
        "tokens_per_s_ex_capture": real / (total_s - capture_s),  # the steady state the captures delay
        "real_tokens": real,
        "micro_batches": micro,
        "score_graphed": score_graphed,
        "train_graphed": train_graphed,
        "graph_shapes": graphs.num_shapes if graphs is not None else 0,
        "capture_s": capture_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64, help="sequences in the batch")
    parser.add_argument("--budget", type=int, default=8192, help="trainer.max_tokens_per_gpu")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case (median)")
    parser.add_argument("--modes", nargs="*", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=["padded", "packed"],
        choices=["padded", "padded-longest", "packed", "sorted", "sorted-longest", "sorted-packed"],
    )
    parser.add_argument(
        "--max-shapes",
        type=int,
        help="LayerGraphs.max_shapes, training shapes (the trainer's default unless told)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing")
    parser.add_argument(
        "--cuda-graphs", default="auto", choices=["auto", "on", "off", "both"], help="trainer.cuda_graphs"
    )
    parser.add_argument(
        "--score-steps",
        type=int,
        default=0,
        help="then time this many scoring passes (forward_logprobs, after one that captures) per case",
    )
    parser.add_argument(
        "--vary", type=int, default=0, help="then run this many RL-shaped steps on new batches per case"
    )
    parser.add_argument("--profile", action="store_true", help="profile one more step per case (kernels)")
    parser.add_argument("--profile-top", type=int, default=12, help="--profile: top kernels printed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("infir2_rl.trainers.layer_graphs").setLevel(logging.INFO)  # each capture's growth
    if not torch.cuda.is_available():
        print("bench/train_packed.py needs a CUDA GPU.")
        return 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = model_dir(tiny=False)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = rl_batch(args.seqs, vocab)
    lengths = batch.attention_mask.sum(1)
    print(
        f"# {torch.cuda.get_device_name()} | {args.seqs} sequences, lengths {int(lengths.min())}..{int(lengths.max())} "
        f"(median {int(lengths.median())}, mean {float(lengths.float().mean()):.0f}) | budget {args.budget} tokens"
    )
    graph_choices: dict[str, list[bool | str]] = {
        "auto": ["auto"],
        "on": [True],
        "off": [False],
        "both": [False, True],
    }
    graph_settings = graph_choices[args.cuda_graphs]
    results = [
        run(path, mode == "fp8", layout, graphs, batch, args, vocab)
        for mode in args.modes
        for graphs in graph_settings
        for layout in args.layouts
    ]
    print(
        f"\n{'mode':<5} {'layout':<14} {'graphs':<6} | {'micro':>5} | {'computed':>9} | {'step s':>7} | {'tok/s':>8} | {'peak GiB':>8}"
    )
    for r in results:
        print(
            f"{'fp8' if r['fp8'] else 'bf16':<5} {r['layout']:<14} "
            f"{('on/' + str(r['graph_shapes'])) if r['graphs'] else 'off':<6} | {r['micro_batches']:5d} | "
            f"{r['computed_tokens']:9d} | {r['step_s']['median']:7.2f} | {r['tokens_per_s']:8.0f} | {r['peak_memory_gb']:8.2f}"
        )

    def best(fp8: bool, layout: str) -> dict[str, Any] | None:
        rows = [r for r in results if r["fp8"] == fp8 and r["layout"] == layout]
        return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None

    def ratio(label: str, num: dict[str, Any] | None, den: dict[str, Any] | None, goal: str = "") -> None:
        if num and den:
            print(f"{label}: {num['tokens_per_s'] / den['tokens_per_s']:.2f}{goal}")

    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        ratio(
            f"packed/padded tokens/s ({name}, fastest of each)",
            best(fp8, "packed"),
            best(fp8, "padded"),
            " (goal >= 1.5)",
        )
        ratio(f"sorted/padded tokens/s ({name}, fastest of each)", best(fp8, "sorted"), best(fp8, "padded"))
        ratio(
            f"sorted/padded-longest tokens/s ({name}, fastest of each)",
            best(fp8, "sorted"),
            best(fp8, "padded-longest"),
        )
        ratio(
            f"sorted/sorted-longest tokens/s ({name}, fastest of each)",
            best(fp8, "sorted"),
            best(fp8, "sorted-longest"),
        )
        ratio(f"sorted/packed tokens/s ({name}, fastest of each)", best(fp8, "sorted"), best(fp8, "packed"))
        ratio(
            f"sorted/sorted-packed tokens/s ({name}, fastest of each)",
            best(fp8, "sorted"),
            best(fp8, "sorted-packed"),
        )
    for r in results:
        if "profile" in r:
            prof = r["profile"]
            name = f"{'fp8' if r['fp8'] else 'bf16'} {r['layout']}"
            per_token = {c: 1e6 * ms / r["computed_tokens"] for c, ms in prof["categories_ms"].items()}
            print_kernels(f"profile of one {name} step ({r['micro_batches']} micro-batches)", prof)
            print(
                f"  busy {prof['total_ms'] / 1e3 / r['step_s']['median']:.0%} of the step; ns per computed token: "
                + ", ".join(f"{c} {v:.0f}" for c, v in per_token.items())
            )
    for layout in args.layouts:
        ratio(f"FP8/BF16 tokens/s ({layout}, fastest of each)", best(True, layout), best(False, layout))
    varied = [r for r in results if "vary" in r]
    for r in varied:  # --vary: score + train tokens/s over the new batches, against the first layout's
        base = next(b for b in varied if b["fp8"] == r["fp8"])
        v, b = r["vary"], base["vary"]
        print(
            f"--vary {'fp8' if r['fp8'] else 'bf16'} {r['layout']}: {v['tokens_per_s']:.0f} tok/s "
            f"(score + train), {v['tokens_per_s'] / b['tokens_per_s']:.3f}x {base['layout']}; without the "
            f"capture time {v['tokens_per_s_ex_capture']:.0f}, "
            f"{v['tokens_per_s_ex_capture'] / b['tokens_per_s_ex_capture']:.3f}x"
        )
    write_report(
        args.out,
        {
            "device": torch.cuda.get_device_name(),
            "args": vars(args) | {"out": str(args.out)},
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
