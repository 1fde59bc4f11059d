"""Weight sync with trainer and engine colocated on one GPU: object store vs CUDA IPC, Qwen2.5-1.5B shape.

    python bench/weight_sync.py [--reps 7] [--warmup 2] [--bucket-mb 512] [--precisions unified_fp8 bf16]
                                [--requantize] [--plans on off] [--phases] [--out PATH] [--tiny]

What is timed. A trainer actor (``TrainerGroup``: FP32 master weights, FP8 decoder linears) and a native
FP8 engine actor (``create_engines``: W8A8 linears, BF16 elsewhere) share one GPU bundle exactly as the RL
stage colocates them (GPU shares 0.6 / 0.4), on the ``qwen2.5-1.5b-shape`` preset with Qwen's
151,936-token vocabulary and random weights (written once under /tmp/infir2_bench, shared with
bench/train_step.py). (a) cast: inside the trainer actor, ``export_weights(fp8=True)`` with the FP8 weights
as after an optimizer step (``_step_boundary``: the flat AdamW, the GPU default, keeps each FP8 linear's
weight quantized as it updates it, so the export reads them; ``--requantize`` forgets them first, so the
export quantizes the 196 decoder linears, FP32 masters -> blockwise FP8 + ``weight_scale_inv``, which is what
this script timed until session 43), between ``torch.cuda.synchronize()`` calls. (b) object store and (c)
CUDA IPC: what ``rl_step`` runs, ``WeightSyncService.push_from(trainer, fp8=True, version)`` with the
self-check off and the FP8 weights as in (a) before each push, timed on the driver: "sync" is the whole call (export with the
cast, transfer, the engine has loaded every bucket, and for cuda_ipc the release of the trainer's buffers);
"push" is ``PushStats.seconds``, the transport alone (first bucket sent until the engine has loaded the
last). (d) self-check: the same pushes with ``self_check_layers=2`` (the default), its
``PushStats.check_seconds`` (health of every engine, and the digests of 2 decoder layers computed by the
engine and by the trainer on their GPUs and compared: ``weight_sync/digest.py``; until fdadb53 the layers
were read back through Ray and compared byte for byte). Median, min and max of --reps after --warmup untimed
pushes, both transports in one process on the same actors; ratios are against the object store. Goal:
cast + push with cuda_ipc, i.e. its whole sync, <= 100 ms. ``--tiny``: the tiny preset on CPU, object
store only (checks the script in a minute). ``--phases``: then --reps more pushes with the self-check on,
each phase's host time summed inside the driver, the trainer and the engine (``TRAINER_PHASES`` etc.: the
functions are wrapped with timers in each process), printed per push. ``--plans on off``: the cuda_ipc rows
twice, with the copy plans (``weight_sync/copy_plan.py``: one launch per side once the layout is known) and
without them (tensor by tensor, the code before session 45), in the same process.

``--precisions unified_fp8 bf16`` runs the whole measurement once per RL ``precision`` in one process, one after
the other (actors of one precision are shut down before the next start): ``bf16`` is a BF16 trainer pushing
BF16 tensors (``fp8=False``, as ``rl_step`` does) to a BF16 engine, whose "cast" is the export to the compute
dtype. Then FP8 / BF16 ratios are printed for each step: what weight sync costs FP8 over BF16, measured on one
machine (the RL runs of docs/performance.md, session 42, could not separate it from the machine).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from train_step import model_dir, write_report  # bench/ is on sys.path when run as a script

GOAL_MS = 100.0  # cast + push with cuda_ipc, colocated, Qwen2.5-1.5B shape


def _step_boundary(worker: Any, requantize: bool = False) -> bool:
    """Runs in the trainer actor: the FP8 weights as after an optimizer step. The trainer's own rule
    (``fp8_step_boundary``): forgotten unless the optimizer keeps them current (the flat AdamW, the GPU default,
    quantizes each FP8 linear as it updates it, so an RL step's export reads them as they are). ``requantize``:
    forgotten anyway, so the export quantizes all of them (what every push paid before session 27, and what
    this script measured until session 43). Returns whether the next export quantizes."""
    backend = worker.backend
    keeps = bool(getattr(getattr(backend, "optimizer", None), "keeps_fp8", False))
    if requantize:
        for module in backend.model.modules():
            if hasattr(module, "invalidate_fp8_cache"):
                module.invalidate_fp8_cache()
    elif hasattr(backend, "fp8_step_boundary"):
        backend.fp8_step_boundary()
    return requantize or not keeps


def _time_cast(worker: Any, fp8: bool = True, requantize: bool = False) -> float:
    """Runs in the trainer actor: seconds of one export (FP8: reading or quantizing the FP8 weights, see
    ``_step_boundary``), GPU work included."""
    _step_boundary(worker, requantize)
    sync = torch.cuda.synchronize if worker.backend.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    exported = list(worker.backend.export_weights(fp8))
    sync()
    del exported
    return time.perf_counter() - start


# --phases: functions timed inside each actor, (module, attribute) or (module, class.method); every call's host
# seconds are summed per name. IpcExporter.share and WeightReceiver.load end in a stream synchronize, so their
# totals include the GPU copies they queued.
TRAINER_PHASES = [
    ("infir2_rl.weight_sync.transport", "IpcExporter.share"),  # buffer, copies, IPC handle, sync
    ("infir2_rl.weight_sync.transport", "build_buckets"),  # (no plan yet) bucket the export
    ("infir2_rl.weight_sync.transport", "flatten"),  # (no plan yet) views + the copies into the buffer
    ("infir2_rl.weight_sync.copy_plan", "CopyPlan.matches"),  # the plan's check of the exported tensors
    ("infir2_rl.weight_sync.copy_plan", "CopyPlan.run"),  # the one launch (both sides)
    ("infir2_rl.actors.trainer_worker", "digests"),  # the self-check's sent side
]
ENGINE_PHASES = [
    ("infir2_rl.weight_sync.receiver", "WeightReceiver.load"),  # outer call: map + check + copy + sync
    ("infir2_rl.weight_sync.receiver", "map_ipc_buffer"),
    ("infir2_rl.weight_sync.receiver", "open_ipc_bucket"),  # (no plan yet) map + views
    ("infir2_rl.weight_sync.receiver", "WeightReceiver._load_one"),  # (no plan yet) checks per tensor
    ("infir2_rl.weight_sync.receiver", "copy_pairs"),  # (no plan yet)
    ("infir2_rl.weight_sync.copy_plan", "CopyPlan.matches"),
    ("infir2_rl.weight_sync.copy_plan", "CopyPlan.run"),
    ("infir2_rl.weight_sync.receiver", "digests"),  # the self-check's held side
]


DRIVER_PHASES = [
    ("infir2_rl.weight_sync.transport", "CudaIpcTransport.open"),  # the trainer's export_ipc_buckets call
    ("infir2_rl.weight_sync.transport", "_IpcPush.send"),  # update_weights on every engine
    ("infir2_rl.weight_sync.transport", "_IpcPush.close"),  # the trainer's release_export call
    ("infir2_rl.weight_sync.transport", "ObjectStoreTransport.open"),  # (--tiny: the object store)
    ("infir2_rl.weight_sync.transport", "_ObjectStorePush.send"),
    ("infir2_rl.weight_sync.service", "WeightSyncService._self_check"),
]


def _install_timers(actor: Any, phases: list[tuple[str, str]]) -> list[tuple[Any, str, Any]]:
    """Runs in an actor: wrap each phase so that its calls' seconds add up in ``infir2_rl._bench_timers``
    (nested calls of one phase, e.g. ``load`` of an IPC bucket calling ``load``, count once)."""
    import functools
    import importlib

    import infir2_rl

    totals: dict[str, list[float]] = {}
    infir2_rl._bench_timers = totals  # type: ignore[attr-defined]
    depth: dict[str, int] = {}
    undo: list[tuple[Any, str, Any]] = []
    for module_name, attr in phases:
        owner: Any = importlib.import_module(module_name)
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        inner = getattr(owner, leaf)

        def timed(*a: Any, _inner: Any = inner, _name: str = attr, **kw: Any) -> Any:
            depth[_name] = depth.get(_name, 0) + 1
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                depth[_name] -= 1
                if depth[_name] == 0:
                    totals.setdefault(_name, [0.0, 0])
                    totals[_name][0] += time.perf_counter() - start
                    totals[_name][1] += 1

        setattr(owner, leaf, functools.wraps(inner)(timed))
        undo.append((owner, leaf, inner))
    # In an actor nothing is returned: a wrapped original is no longer found under its name, so Ray would pickle
    # it by value, with its globals (a Triton kernel's lock among them).
    return undo if actor is None else []


def _read_timers(actor: Any) -> dict[str, list[float]]:
    """Runs in an actor: the sums so far, then zeroed."""
    import infir2_rl

    totals: dict[str, list[float]] = infir2_rl._bench_timers  # type: ignore[attr-defined]
    out = {k: list(v) for k, v in totals.items()}
    for v in totals.values():
        v[0], v[1] = 0.0, 0
    return out


def _phases(
    args: argparse.Namespace,
    engines: list[Any],
    trainer: Any,
    worker: Any,
    cfg: Any,
    fp8: bool,
    versions: Any,
) -> dict[str, dict[str, float]]:
    """--phases: host milliseconds per push of each phase in the driver, the trainer and the engine, summed over
    --reps cuda_ipc pushes (--tiny: object store) with the default self-check (2 layers), after --warmup
    untimed ones."""
    import ray

    from infir2_rl.stages.rl_setup import resolve_transport
    from infir2_rl.weight_sync.service import WeightSyncService

    gpu = not args.tiny
    c = cfg("cuda_ipc" if gpu else "object_store", 2, args.bucket_mb)
    resolve_transport(c, colocate=gpu)
    service = WeightSyncService(engines, c.weight_sync)
    ray.get([worker.__ray_call__.remote(_install_timers, TRAINER_PHASES)])
    ray.get([e.__ray_call__.remote(_install_timers, ENGINE_PHASES) for e in engines])
    undo = _install_timers(None, DRIVER_PHASES)
    try:
        wall = 0.0
        for i in range(args.warmup + args.reps):
            if i == args.warmup:  # forget the warm-ups
                _read_timers(None)
                ray.get(
                    [worker.__ray_call__.remote(_read_timers)]
                    + [e.__ray_call__.remote(_read_timers) for e in engines]
                )
            ray.get(worker.__ray_call__.remote(_step_boundary, args.requantize))
            t0 = time.perf_counter()
            service.push_from(trainer, fp8=fp8, version=next(versions))
            if i >= args.warmup:
                wall += time.perf_counter() - t0
        sides = {"driver": _read_timers(None), "trainer": ray.get(worker.__ray_call__.remote(_read_timers))}
        sides["engine"] = ray.get(engines[0].__ray_call__.remote(_read_timers))
    finally:
        for owner, leaf, inner in undo:
            setattr(owner, leaf, inner)
    out = {"driver": {"push_from": wall / args.reps * 1e3}}
    for side, totals in sides.items():
        for name, (seconds, _calls) in totals.items():
            out.setdefault(side, {})[name] = seconds / args.reps * 1e3
    return out


def _use_plans(actor: Any, enabled: bool) -> None:
    """Runs in the trainer or engine actor: copy plans on or off (``--plans``), forgetting the ones made."""
    from infir2_rl.weight_sync import copy_plan
    from infir2_rl.weight_sync.transport import IpcExporter

    copy_plan.ENABLED = enabled
    if hasattr(actor, "_ipc"):  # TrainerWorker
        actor._ipc = IpcExporter()
        actor._broadcast._plans = []
    receiver = getattr(getattr(actor, "backend", None), "_receiver", None)  # RolloutEngine of a native engine
    if receiver is not None:
        receiver._plans.clear()


def _profile_export(worker: Any, fp8: bool, requantize: bool, reps: int = 5) -> str:
    """Runs in the trainer actor: cProfile of ``reps`` exports as a cuda_ipc push makes them (the export walk,
    the buckets and the shared buffer), the top functions by their own time."""
    import cProfile
    import io
    import pstats

    from infir2_rl.weight_sync.transport import ONE_BUFFER, IpcExporter

    profile = cProfile.Profile()
    exporter = IpcExporter()
    exporter.share(list(worker.backend.export_weights(fp8)), ONE_BUFFER, 0)  # plans the pushes below
    for _ in range(reps):
        _step_boundary(worker, requantize)
        profile.enable()
        held = exporter.share(list(worker.backend.export_weights(fp8)), ONE_BUFFER, 0)
        profile.disable()
        del held
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def run(args: argparse.Namespace, precision: str = "unified_fp8") -> dict[str, Any]:
    import ray

    from infir2_rl.actors.placement import reserve_for
    from infir2_rl.actors.rollout_engine import create_engines
    from infir2_rl.actors.trainer_group import TrainerGroup
    from infir2_rl.config.stage import RlStageConfig
    from infir2_rl.stages.rl_setup import resolve_transport
    from infir2_rl.weight_sync.service import WeightSyncService

    gpu = not args.tiny
    # (result key, transport, bucket MiB): the object store, then cuda_ipc at each --ipc-bucket-mb
    ipc_sizes = args.ipc_bucket_mb or [args.bucket_mb]
    runs = [("object_store", "object_store", args.bucket_mb)] if "object_store" in args.transports else []
    if gpu and "cuda_ipc" in args.transports:
        for plans in args.plans:
            suffix = "" if plans == "on" else " no-plan"
            runs += [
                (("cuda_ipc" if i == 0 else f"cuda_ipc@{mb}") + suffix, "cuda_ipc", mb)
                for i, mb in enumerate(ipc_sizes)
            ]
    path = model_dir(args.tiny)
    ray.init(
        num_cpus=None if gpu else 2, num_gpus=1 if gpu else 0, include_dashboard=False, log_to_driver=False
    )

    def cfg(transport: str, check_layers: int, bucket_mb: int) -> RlStageConfig:
        return RlStageConfig.model_validate(
            {
                "precision": precision,
                "model": {"path": str(path)},
                "rollout": {"num_engines": 1},
                "placement": {"use_gpu": "yes" if gpu else "no", "mode": "colocate", "cpus_per_actor": 1},
                "weight_sync": {
                    "transport": transport,
                    "bucket_size_mb": bucket_mb,
                    "self_check_layers": check_layers,
                },
            }
        )

    base = cfg("object_store", 0, args.bucket_mb)
    # GPU: one bundle, trainer and engine colocated as in the RL stage. CPU: a bundle each.
    placement = reserve_for(base.placement, num_trainers=1, num_engines=1)
    start = time.perf_counter()
    trainer = TrainerGroup(base, placement, total_steps=1)
    engines = create_engines(base, placement)
    ray.get([e.health.remote() for e in engines])
    print(f"# actors ready in {time.perf_counter() - start:.0f} s")
    worker = trainer.workers[0]
    results: dict[str, Any] = {}
    try:
        fp8 = base.rollout_fp8
        quantizes = ray.get(worker.__ray_call__.remote(_step_boundary, args.requantize))
        print(f"# {precision}: each export {'quantizes' if quantizes and fp8 else 'reads'} the FP8 weights"
              if fp8 else f"# {precision}: exports in the compute dtype")  # fmt: skip
        casts = [
            ray.get(worker.__ray_call__.remote(_time_cast, fp8, args.requantize))
            for _ in range(args.warmup + args.reps)
        ]
        results["cast_ms"] = summary(casts[args.warmup :])
        versions = itertools.count(1)
        for result_key, transport, bucket_mb in runs:
            plans = not result_key.endswith("no-plan")
            ray.get([a.__ray_call__.remote(_use_plans, plans) for a in (worker, *engines)])
            row: dict[str, Any] = {}
            for check_layers, key in ((0, "sync"), (2, "check")):
                c = cfg(transport, check_layers, bucket_mb)
                resolve_transport(c, colocate=gpu)
                service = WeightSyncService(engines, c.weight_sync)
                walls, pushes, checks = [], [], []
                for i in range(args.warmup + args.reps):
                    ray.get(worker.__ray_call__.remote(_step_boundary, args.requantize))
                    t0 = time.perf_counter()
                    stats = service.push_from(trainer, fp8=fp8, version=next(versions))
                    wall = time.perf_counter() - t0
                    if i >= args.warmup:
                        walls.append(wall)
                        pushes.append(stats.seconds)
                        checks.append(stats.check_seconds)
                if key == "sync":
                    row |= {"sync_ms": summary(walls), "push_ms": summary(pushes)}
                    row |= {
                        "bytes": stats.bytes,
                        "num_buckets": stats.num_buckets,
                        "num_tensors": stats.num_tensors,
                    }
                else:
                    row |= {"check_ms": summary(checks), "num_checked": stats.num_checked}
            results[result_key] = row
        if args.profile_export and gpu:
            text = ray.get(worker.__ray_call__.remote(_profile_export, fp8, args.requantize))
            print(
                f"# {precision}: cProfile of 5 exports in the trainer (export walk, buckets, IPC buffer)\n{text}"
            )
        if args.phases:
            ray.get([a.__ray_call__.remote(_use_plans, True) for a in (worker, *engines)])
            results["phases_ms"] = _phases(args, engines, trainer, worker, cfg, fp8, versions)
    finally:
        for e in engines:
            ray.kill(e)
        trainer.shutdown()
        placement.remove()
        ray.shutdown()
    return results


def report_one(r: dict[str, Any]) -> dict[str, float]:
    """Print one precision's results; returns the ratios against the object store."""
    base = r.get("object_store")
    for key, row in r.items():
        if key not in ("cast_ms", "phases_ms"):
            print(
                f"{key}: one push {row['bytes'] / 1e9:.3f} GB, {row['num_tensors']} tensors, {row['num_buckets']} bucket(s)"
            )
    print(f"\n{'step':<31} {'median ms':>10} {'min':>9} {'max':>9}   vs object_store")
    print(
        f"{'(a) cast on the trainer':<31} {r['cast_ms']['median']:10.1f} {r['cast_ms']['min']:9.1f} {r['cast_ms']['max']:9.1f}"
    )
    ratios: dict[str, float] = {}
    for transport in [k for k in r if k not in ("cast_ms", "phases_ms")]:
        for key, label in (
            ("push_ms", "push"),
            ("sync_ms", "sync = cast + push"),
            ("check_ms", "self-check"),
        ):
            s = r[transport][key]
            ratio = s["median"] / base[key]["median"] if base else float("nan")
            ratios[f"{transport}/{key}"] = ratio
            print(
                f"{transport + ' ' + label:<31} {s['median']:10.1f} {s['min']:9.1f} {s['max']:9.1f}   {ratio:6.3f}"
            )
    if "cuda_ipc" not in r:
        print("cuda_ipc: skipped (--tiny runs on CPU; CUDA IPC needs a GPU)")
    if "cuda_ipc" in r:
        total = r["cuda_ipc"]["sync_ms"]["median"]
        verdict = "met" if total <= GOAL_MS else "MISSED"
        print(
            f"\ngoal: cast + push with cuda_ipc {total:.1f} ms (median sync) <= {GOAL_MS:.0f} ms: {verdict}"
        )
        print(f"      (cast {r['cast_ms']['median']:.1f} ms + cuda_ipc push {r['cuda_ipc']['push_ms']['median']:.1f} ms"
              " + export/release overhead)")  # fmt: skip
    else:
        print(f"\ngoal (cast + push with cuda_ipc <= {GOAL_MS:.0f} ms): n/a on CPU")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repeats per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats before them")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight_sync.bucket_size_mb")
    parser.add_argument(
        "--ipc-bucket-mb", type=int, nargs="+", help="cuda_ipc at these bucket sizes (default: --bucket-mb)"
    )
    parser.add_argument(
        "--transports", nargs="+", choices=("object_store", "cuda_ipc"), default=["object_store", "cuda_ipc"]
    )
    parser.add_argument(
        "--precisions", nargs="+", choices=("unified_fp8", "bf16"), default=["unified_fp8"],
        help="RL precisions to measure, one after the other in this process",
    )  # fmt: skip
    parser.add_argument(
        "--requantize", action="store_true",
        help="forget the FP8 weights before every export, so it quantizes them (the RL step's export reads the"
        " flat AdamW's kept ones: the default here)",
    )  # fmt: skip
    parser.add_argument(
        "--plans", nargs="+", choices=["on", "off"], default=["on"],
        help="cuda_ipc with the copy plans of weight_sync/copy_plan.py (on) and without (off: tensor by tensor)",
    )  # fmt: skip
    parser.add_argument(
        "--phases", action="store_true",
        help="also time each phase of a cuda_ipc push inside the driver, the trainer and the engine",
    )  # fmt: skip
    parser.add_argument(
        "--profile-export",
        action="store_true",
        help="also print a cProfile of the trainer's export per precision",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny preset on CPU, object store only (checks the script)"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.warmup = min(args.reps, 3), min(args.warmup, 1)
    elif not torch.cuda.is_available():
        print("bench/weight_sync.py needs a CUDA GPU (trainer and engine share it); use --tiny on CPU.")
        return 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name = torch.cuda.get_device_name() if not args.tiny else "CPU (float32; FP8 emulated)"
    print(f"# {name} | torch {torch.__version__} | {'tiny' if args.tiny else 'qwen2.5-1.5b-shape'} | "
          f"bucket {args.bucket_mb} MiB | median of {args.reps} after {args.warmup} warm-up")  # fmt: skip
    start = time.perf_counter()
    by_precision = {p: run(args, p) for p in args.precisions}
    ratios = {}
    for precision, r in by_precision.items():
        print(f"\n## precision {precision}")
        ratios[precision] = report_one(r)
    if len(by_precision) > 1 and "bf16" in by_precision:
        bf16 = by_precision["bf16"]
        print("\nratios against bf16 (median ms):")
        for precision, r in by_precision.items():
            if precision == "bf16":
                continue
            print(f"  {precision} cast {r['cast_ms']['median'] / bf16['cast_ms']['median']:.3f}")
            for transport in [k for k in r if k not in ("cast_ms", "phases_ms") and k in bf16]:
                for key in ("push_ms", "sync_ms", "check_ms"):
                    ratio = r[transport][key]["median"] / bf16[transport][key]["median"]
                    extra = r[transport][key]["median"] - bf16[transport][key]["median"]
                    print(f"  {precision} {transport} {key[:-3]:<5} {ratio:.3f} ({extra:+.1f} ms)")
    with_phases = {p: r["phases_ms"] for p, r in by_precision.items() if "phases_ms" in r}
    if with_phases:
        transport = "object_store" if args.tiny else "cuda_ipc"
        print(f"\nhost ms per {transport} push (self-check of 2 layers), mean of {args.reps}:")
        print(f"{'side':<8} {'phase':<34}" + "".join(f" {p:>12}" for p in with_phases))
        rows = {(side, name) for ph in with_phases.values() for side, d in ph.items() for name in d}
        for side, name in sorted(rows, key=lambda k: (("driver", "trainer", "engine").index(k[0]), k[1])):
            cells = "".join(
                f" {ph.get(side, {}).get(name, float('nan')):12.2f}" for ph in with_phases.values()
            )
            print(f"{side:<8} {name:<34}{cells}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    if args.out:
        report = dict(
            device=name, torch=torch.__version__, tiny=args.tiny, bucket_mb=args.bucket_mb, reps=args.reps
        )
        report |= {
            "results": by_precision,
            "ratios_vs_object_store": ratios,
            "goal_cast_plus_push_ms_max": GOAL_MS,
        }
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
