"""true_on_policy on one GPU: is the trainer's log-prob of every sampled token the engine's, and what does it cost?

For each precision (``bf16``, ``unified_fp8``) and mode (``fast``, ``true_on_policy``), in one process: a
TorchTrainer and a NativeEngine on the same GPU (the trainer's weights pushed to the engine as an RL step
pushes them), then

* rollout: P prompts x n samples, exactly ``--new-tokens`` new tokens (no stop token), temperature T;
  seconds per ``generate`` call, median of ``--repeats`` after one warm-up call (graph capture, GEMM choice);
* score: the trainer's ``forward_logprobs`` over that batch (the RL step's old log-probs);
* train: one GRPO ``train_step`` over it in micro-batches of ``--micro-batch`` sequences, then the new
  weights pushed to the engine (so every call samples from the trainer's current weights);
* mismatch of the warm-up batch and every timed one: max and mean |dlogp| and K3 (``algo.mismatch``); in
  FP8 also the K3 of the same samples scored by the trainer with its FP8 off (the mixed setup), so issue 20's
  fast-mode ratios (unified / BF16, mixed / unified) come out of one run.

Prints one line per (precision, mode), the time ratios true_on_policy / fast and FP8 / BF16 per mode (step =
rollout + score + train); ``--out`` writes JSON. For an A/B in one process, ``--modes`` may add
``true_on_policy_fp32`` (its trainer with FP32 parameters, ``trainer.param_dtype=float32``) and
``true_on_policy_eager`` (FP32 parameters and no CUDA graphs: the true_on_policy trainer before session 30).
Default shape: Qwen2.5-1.5B with its 151,936-token vocabulary, random weights (``bench/train_step.py``'s
model directory). ``--tiny`` runs the tiny preset (a GPU smoke run in seconds).

    python bench/true_on_policy.py --prompts 32 --samples 8 --prompt-len 64 --new-tokens 192
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sync() -> None:
    torch.cuda.synchronize()


def _profile(title: str, rows: int, fn: Callable[[], object]) -> None:
    """Run fn once under torch.profiler; print its device-kernel total and top ``rows`` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=rows)
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"--- {title}: device kernels {total:.1f} ms\n{table}")


def run(path: Path, fp8: bool, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from infir2_rl.algo.advantages import grpo_advantages
    from infir2_rl.algo.loss_fns import GrpoLoss
    from infir2_rl.algo.mismatch import mismatch_metrics
    from infir2_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.rollout.batch import RolloutBatch, to_token_batches
    from infir2_rl.trainers.torch.trainer import TorchTrainer
    from infir2_rl.types import GenerateRequest, SamplingParams
    from infir2_rl.weight_sync.buckets import build_buckets

    true_on_policy = mode.startswith("true_on_policy")
    graphs: bool | str = False if mode == "true_on_policy_eager" else "auto"
    param_dtype = "float32" if mode in ("true_on_policy_eager", "true_on_policy_fp32") else "auto"
    trainer = TorchTrainer(
        ModelConfig(path=str(path)),
        TrainerConfig(micro_batch_size=args.micro_batch, cuda_graphs=graphs, param_dtype=param_dtype),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-7, min_lr=0.0),
        fp8=fp8,
        total_steps=10,
        true_on_policy=true_on_policy,
    )
    if true_on_policy:  # which GEMM runs each shape (cuBLAS where batch-invariant), as both sides plan it
        from infir2_rl.models import invariant

        for line in invariant.plan_gemms(trainer.model, trainer.device):
            print(f"  plan ({'fp8' if fp8 else 'bf16'}): {line}")
    engine = NativeEngine(
        str(path), fp8=fp8, max_batch_size=args.prompts * args.samples, true_on_policy=true_on_policy
    )
    for bucket in build_buckets(trainer.export_weights(fp8=fp8), 1 << 30, version=1):
        engine.update_weights(bucket)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
    out: dict[str, Any] = {
        "rollout_s": [],
        "score_s": [],
        "train_s": [],
        "mismatch": [],
        "k3_dense_trainer": [],
    }
    loss_fn = GrpoLoss(AlgorithmConfig(), args.temperature)
    for call in range(args.repeats + 1):
        gen = torch.Generator().manual_seed(call)
        requests = [
            GenerateRequest(
                f"r{i}",
                torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist(),
                n=args.samples,
                params=params,
                seed=1000 * call + i,
            )  # fmt: skip
            for i in range(args.prompts)
        ]
        _sync()
        start = time.perf_counter()
        samples = sorted(engine.generate(requests), key=lambda s: (s.request_id, s.index))
        _sync()
        rollout_s = time.perf_counter() - start
        num = len(samples)
        batch = RolloutBatch(samples=samples, rewards=[float(i % 2) for i in range(num)], group_size=args.samples,
                             labels=["0"] * args.prompts)  # fmt: skip
        adv = grpo_advantages(batch.rewards_tensor(), args.samples, True)
        micro = to_token_batches(batch, adv, pad_id=0, micro_batch_size=args.micro_batch)
        _sync()
        start = time.perf_counter()
        logps = trainer.forward_logprobs(micro, temperature=args.temperature)
        _sync()
        score_s = time.perf_counter() - start
        train_lp = torch.cat([lp[:, 1:].flatten() for lp in logps])
        engine_lp = torch.cat([mb.rollout_logprobs[:, 1:].flatten() for mb in micro])  # type: ignore[index]
        mask = torch.cat([mb.loss_mask[:, 1:].flatten() for mb in micro]) > 0
        stats = mismatch_metrics(train_lp[None], engine_lp[None], mask[None])
        out["mismatch"].append(
            {"max_abs": stats.abs_logp_diff_max, "mean_abs": stats.abs_logp_diff_mean, "k3": stats.k3,
             "tokens": stats.num_tokens}
        )  # fmt: skip
        if fp8:  # the same FP8 samples scored with the trainer's FP8 off: the mixed (BF16-train) setup's K3
            dense = torch.cat(
                [lp[:, 1:].flatten() for lp in trainer.forward_logprobs(micro, args.temperature, fp8=False)]
            )
            out["k3_dense_trainer"].append(mismatch_metrics(dense[None], engine_lp[None], mask[None]).k3)
        # The rest of an RL step: one GRPO update, then the new weights pushed to the engine.
        for mb, lp in zip(micro, logps):
            mb.old_logprobs = lp
        units = sum(mb.num_targets for mb in micro)
        _sync()
        start = time.perf_counter()
        trainer.train_step(micro, loss_fn, units)
        _sync()
        train_s = time.perf_counter() - start
        for bucket in build_buckets(trainer.export_weights(fp8=fp8), 1 << 30, version=call + 2):
            engine.update_weights(bucket)
        if call == 0:  # the warm-up call (graph capture, GEMM choice, kernel compiles): not timed
            continue
        out["rollout_s"].append(rollout_s)
        out["score_s"].append(score_s)
        out["train_s"].append(train_s)
    out["tokens_per_call"] = args.prompts * args.samples * args.new_tokens
    name = f"{'FP8' if fp8 else 'BF16'}, {mode}"
    if args.profile_rollout:  # one more generate call (the last call's requests)
        _profile(
            f"rollout profile ({name})", args.profile_rollout, functools.partial(engine.generate, requests)
        )
    if args.profile_score:  # one more scoring call (the last call's micro-batches)
        _profile(
            f"score profile ({name})",
            args.profile_score,
            functools.partial(trainer.forward_logprobs, micro, args.temperature),
        )
    del trainer, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny preset instead of the 1.5B shape")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="timed generate calls after the warm-up one")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per trainer forward")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "unified_fp8"])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["fast", "true_on_policy"],
        choices=["fast", "true_on_policy", "true_on_policy_fp32", "true_on_policy_eager"],
        help="true_on_policy_fp32: its trainer with FP32 parameters (trainer.param_dtype=float32); "
        "true_on_policy_eager: FP32 parameters and no CUDA graphs (trainer.cuda_graphs=false), the "
        "true_on_policy trainer before session 30",
    )
    parser.add_argument(
        "--profile-rollout",
        type=int,
        default=0,
        metavar="ROWS",
        help="profile one more generate call per run and print its top ROWS kernels by device time",
    )
    parser.add_argument(
        "--profile-score",
        type=int,
        default=0,
        metavar="ROWS",
        help="profile one more scoring call (old log-probs) per run and print its top ROWS kernels by device time",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/true_on_policy.py: needs a CUDA GPU (the true_on_policy kernels are CUDA-only)")
        return 2
    from train_step import model_dir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = model_dir(args.tiny)
    print(f"model {path.name}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results: dict[str, dict[str, Any]] = {}
    for precision in args.precisions:
        for mode in args.modes:
            r = run(path, precision == "unified_fp8", mode, args)
            results[f"{precision}/{mode}"] = r
            mm = r["mismatch"]
            print(
                f"{precision:12s} {mode:15s} rollout {statistics.median(r['rollout_s']):7.2f} s"
                f" ({r['tokens_per_call'] / statistics.median(r['rollout_s']):8.0f} tok/s)"
                f"  score {statistics.median(r['score_s']):6.2f} s  train {statistics.median(r['train_s']):6.2f} s"
                f"  max|dlogp| {max(m['max_abs'] for m in mm):.3e}"
                f"  mean|dlogp| {statistics.mean(m['mean_abs'] for m in mm):.3e}"
                f"  K3 {statistics.mean(m['k3'] for m in mm):.3e}  ({sum(m['tokens'] for m in mm)} tokens)"
                + (
                    f"  dense-trainer K3 {statistics.mean(r['k3_dense_trainer']):.3e}"
                    if r["k3_dense_trainer"]
                    else ""
                ),
                flush=True,
            )
    bf16, fp8 = results.get("bf16/fast"), results.get("unified_fp8/fast")
    if bf16 and fp8:  # issue 20's fast-mode goals: unified <= 3x BF16, and >= 10x below mixed
        k3 = {
            name: statistics.mean(m["k3"] for m in r["mismatch"])
            for name, r in (("bf16", bf16), ("fp8", fp8))
        }
        mixed = statistics.mean(fp8["k3_dense_trainer"])
        print(
            f"fast mode: K3 unified FP8 / BF16 {k3['fp8'] / k3['bf16']:.1f}x, mixed / unified FP8 {mixed / k3['fp8']:.1f}x"
        )
    keys = ("rollout_s", "score_s", "train_s")

    def medians(r: dict[str, Any]) -> dict[str, float]:
        out = {k: statistics.median(r[k]) for k in keys}
        return out | {"step_s": sum(out.values())}

    for precision in args.precisions:
        fast = results.get(f"{precision}/fast")
        for mode in ("true_on_policy", "true_on_policy_fp32", "true_on_policy_eager"):
            tp = results.get(f"{precision}/{mode}")
            if fast and tp:
                a, b = medians(tp), medians(fast)
                print(f"{precision}: {mode} / fast time: " + ", ".join(f"{k} {a[k] / b[k]:.2f}x" for k in a))
    for mode in args.modes:  # FP8 against BF16 in each mode (> 1: FP8 takes longer)
        bf16_r, fp8_r = results.get(f"bf16/{mode}"), results.get(f"unified_fp8/{mode}")
        if bf16_r and fp8_r:
            a, b = medians(fp8_r), medians(bf16_r)
            print(f"{mode}: unified FP8 / BF16 time: " + ", ".join(f"{k} {a[k] / b[k]:.2f}x" for k in a))
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
