"""Weight sync to an engine on its own GPU: object store vs NCCL broadcast, Qwen2.5-1.5B shape (two GPUs).

    python bench/weight_sync_nccl.py [--reps 7] [--warmup 2] [--baseline-reps N] [--bucket-mb 512] [--out PATH] [--tiny]

The disaggregated twin of bench/weight_sync.py (same model, same timing rules; read its docstring): a trainer
actor (``TrainerGroup``: FP32 masters, FP8 decoder linears) on GPU 0 and a native FP8 engine actor on GPU 1,
placed by ``plan_placement`` with ``placement.mode=disaggregate`` as the RL stage would. (a) cast: the FP8
export inside the trainer. (b) object store and (c) nccl: ``WeightSyncService.push_from(trainer, fp8=True,
version)`` with the self-check off, the FP8 weights as after an optimizer step before each push (read as the
flat AdamW keeps them, or quantized again with ``--requantize``: bench/weight_sync.py's ``_step_boundary``;
until session 43 always quantized again); "sync" is the whole call on the driver (export with the cast, transfer, the engine has loaded every bucket, buffers released), "push" is
``PushStats.seconds`` (first bucket sent until the engine has loaded the last). The nccl weight group is
formed at the first push (a warm-up push, untimed). (d) self-check: the same with ``self_check_layers=2``.
Goal: nccl push <= 100 ms. ``--baseline-reps N``: the object store's timed repeats (default ``--reps``; one
object-store push of the 1.5B shape takes tens of seconds, so a short run times it once after no warm-up). ``--tiny``: the tiny preset on CPU, where "nccl" runs over gloo (checks the
script, not the speed). Ran on two H200s: docs/performance.md, "Two GPUs".
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch
from train_step import model_dir, write_report  # bench/ is on sys.path when run as a script
from weight_sync import _step_boundary, _time_cast, summary

GOAL_MS = 100.0  # nccl push, engine on its own GPU, Qwen2.5-1.5B shape
TRANSPORTS = ("nccl", "object_store")  # nccl first: the object store is slow at this size


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from infir2_rl.actors.placement import reserve_for
    from infir2_rl.actors.rollout_engine import create_engines
    from infir2_rl.actors.trainer_group import TrainerGroup
    from infir2_rl.config.stage import RlStageConfig
    from infir2_rl.stages.rl_setup import resolve_transport
    from infir2_rl.weight_sync.service import WeightSyncService

    gpu = not args.tiny
    path = model_dir(args.tiny)
    ray.init(
        num_cpus=None if gpu else 2, num_gpus=2 if gpu else 0, include_dashboard=False, log_to_driver=False
    )

    def cfg(transport: str, check_layers: int) -> RlStageConfig:
        return RlStageConfig.model_validate(
            {
                "model": {"path": str(path)},
                "rollout": {"num_engines": 1},
                "placement": {"use_gpu": "yes" if gpu else "no", "mode": "disaggregate", "cpus_per_actor": 1},
                "weight_sync": {
                    "transport": transport,
                    "bucket_size_mb": args.bucket_mb,
                    "self_check_layers": check_layers,
                },
            }
        )

    base = cfg("object_store", 0)
    placement = reserve_for(base.placement, num_trainers=1, num_engines=1)
    assert not placement.plan.colocate
    start = time.perf_counter()
    trainer = TrainerGroup(base, placement, total_steps=1)
    engines = create_engines(base, placement)
    ray.get([e.health.remote() for e in engines])
    print(f"# actors ready in {time.perf_counter() - start:.0f} s")
    worker = trainer.workers[0]
    results: dict[str, Any] = {}
    try:
        casts = [
            ray.get(worker.__ray_call__.remote(_time_cast, True, args.requantize))
            for _ in range(args.warmup + args.reps)
        ]
        results["cast_ms"] = summary(casts[args.warmup :])
        print(f"# cast timed: {results['cast_ms']['median']:.1f} ms median", flush=True)
        versions = itertools.count(1)
        for transport in TRANSPORTS:
            row: dict[str, Any] = {}
            service = None
            for check_layers, key in ((0, "sync"), (2, "check")):
                c = cfg(transport, check_layers)
                resolve_transport(c, colocate=False)
                if service is None:
                    service = WeightSyncService(engines, c.weight_sync)
                service.cfg = c.weight_sync  # one service: one nccl group for both measurements
                walls, pushes, checks = [], [], []
                warmup, reps = (args.warmup, args.reps) if transport == "nccl" else args.baseline
                for i in range(warmup + reps):
                    ray.get(worker.__ray_call__.remote(_step_boundary, args.requantize))
                    t0 = time.perf_counter()
                    stats = service.push_from(trainer, fp8=True, version=next(versions))
                    wall = time.perf_counter() - t0
                    print(
                        f"#   {transport} {key} push {i + 1}/{warmup + reps}: {wall * 1e3:.1f} ms", flush=True
                    )
                    if i >= warmup:
                        walls.append(wall)
                        pushes.append(stats.seconds)
                        checks.append(stats.check_seconds)
                if key == "sync":
                    row |= {"sync_ms": summary(walls), "push_ms": summary(pushes), "bytes": stats.bytes}
                    row |= {"num_buckets": stats.num_buckets, "num_tensors": stats.num_tensors}
                else:
                    row |= {"check_ms": summary(checks), "num_checked": stats.num_checked}
            results[transport] = row
    finally:
        for e in engines:
            ray.kill(e)
        trainer.shutdown()
        placement.remove()
        ray.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repeats per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats before them")
    parser.add_argument(
        "--baseline-reps", type=int, help="object store: timed repeats, no warm-up (default: --warmup/--reps)"
    )
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight_sync.bucket_size_mb")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--requantize", action="store_true", help="quantize the FP8 weights again before every export"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny preset on CPU, nccl over gloo (checks the script)"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.warmup = min(args.reps, 3), min(args.warmup, 1)
    elif torch.cuda.device_count() < 2:
        print(
            "bench/weight_sync_nccl.py needs two CUDA GPUs (trainer on one, engine on the other); --tiny on CPU."
        )
        return 1
    args.baseline = (0, args.baseline_reps) if args.baseline_reps else (args.warmup, args.reps)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name = (
        f"2x {torch.cuda.get_device_name()}" if not args.tiny else "CPU (float32; FP8 emulated; nccl = gloo)"
    )
    print(f"# {name} | torch {torch.__version__} | {'tiny' if args.tiny else 'qwen2.5-1.5b-shape'} | "
          f"bucket {args.bucket_mb} MiB | median of {args.reps} after {args.warmup} warm-up"
          f" (object store: {args.baseline[1]} after {args.baseline[0]})")  # fmt: skip
    start = time.perf_counter()
    r = run(args)
    base = r["object_store"]
    print(
        f"one push: {base['bytes'] / 1e9:.3f} GB, {base['num_tensors']} tensors, {base['num_buckets']} bucket(s)"
    )
    print(f"\n{'step':<31} {'median ms':>10} {'min':>9} {'max':>9}   vs object_store")
    c = r["cast_ms"]
    print(f"{'(a) cast on the trainer':<31} {c['median']:10.1f} {c['min']:9.1f} {c['max']:9.1f}")
    ratios: dict[str, float] = {}
    for transport in TRANSPORTS:
        for key, label in (
            ("push_ms", "push"),
            ("sync_ms", "sync = cast + push"),
            ("check_ms", "self-check"),
        ):
            s = r[transport][key]
            ratios[f"{transport}/{key}"] = ratio = s["median"] / base[key]["median"]
            print(
                f"{transport + ' ' + label:<31} {s['median']:10.1f} {s['min']:9.1f} {s['max']:9.1f}   {ratio:6.3f}"
            )
    push = r["nccl"]["push_ms"]["median"]
    verdict = "n/a on CPU" if args.tiny else ("met" if push <= GOAL_MS else "MISSED")
    print(f"\ngoal: nccl push {push:.1f} ms (median) <= {GOAL_MS:.0f} ms: {verdict}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    if args.out:
        report = dict(
            device=name, torch=torch.__version__, tiny=args.tiny, bucket_mb=args.bucket_mb, reps=args.reps
        )
        report |= {"results": r, "ratios_vs_object_store": ratios, "goal_nccl_push_ms_max": GOAL_MS}
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
