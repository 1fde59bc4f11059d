"""Prefill of the native engine, BF16 vs FP8: wall time against device kernel time, and where the host spends it.

    python bench/prefill.py [--prompts 2 4 16 64] [--prompt-len 128] [--repeats 5] [--cprofile] [--launch-costs]
                            [--eager-too] [--trace DIR] [--replays N] [--true-on-policy] [--out PATH]

Why: ``bench/rollout.py`` showed the FP8 engine's prefill of 16 prompts x 128 tokens at 33.5 ms against
BF16's 21.1 ms, while from 64 prompts on FP8 is the faster (H100, docs/performance.md), and the RL-shaped
workload, whose joining prompts come a few at a time, ran 2.5% slower in FP8. A fixed cost per prefill that
does not scale with tokens is host work (the prefill runs eagerly, outside the decode graphs). For each prompt
count this script times ``generate`` with one new token (prefill + the first sample; median of --repeats
after a warm-up call), then profiles one call: device kernel time, the host-bound gap (wall - kernels) and
the host ops with the most self time. ``--cprofile`` also prints the Python functions with the most own
time in one call per engine at the smallest prompt count (cProfile: host work the torch profiler does not
name, such as Triton's launcher). ``--launch-costs`` times eager loops of one q|k|v-shaped GEMM at M = 256
(BF16 ``F.linear``, FP8 cuBLASLt ``scaled_mm`` on quantized input, the quantize kernel alone): wall
microseconds per call, which for kernels this small is the host cost of a call. ``--trace DIR`` writes a
Chrome trace (torch profiler, CPU and CUDA) of one call per engine at the smallest prompt count, to read
where the host's wall goes between ops (chrome://tracing or Perfetto). Prefills of up to
``prefill_graphs.MAX_TOKENS`` tokens replay CUDA graphs (``engines/native/prefill_graphs.py``);
``--eager-too`` also times two more engines with them off, in the same process. ``--replays N`` times N
bare replays of each engine's prefill graph per prompt count: host microseconds inside ``graph.replay()``
(the launch), device time between events around it, and wall to a synchronize, to split a graphed prefill's
wall into the launch, the kernels and the rest of ``generate``. ``--true-on-policy`` builds the engines with
``true_on_policy`` (prefill by the trainer's batch-invariant walk).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rollout import requests, timed_generate
from train_step import kernel_times, model_dir


def profile_call(engine: Any, reqs: list[Any]) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed_generate(engine, reqs)
    kernels = kernel_times(prof)
    kernels_ms = sum(us for _, _, us, _ in kernels) / 1e3
    by_name: dict[str, list[float]] = {}
    for name, _, us, _ in kernels:
        acc = by_name.setdefault(name[:60], [0.0, 0])
        acc[0] += us / 1e3
        acc[1] += 1
    top_kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    host: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CPU:
            acc = host.setdefault(e.name, [0.0, 0])
            acc[0] += e.self_cpu_time_total / 1e3
            acc[1] += 1
    top = sorted(host.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "profiled_wall_ms": 1e3 * wall,
        "kernels_ms": kernels_ms,
        "top_host_ops": [{"op": k, "self_ms": v[0], "calls": v[1]} for k, v in top],
        "top_kernels": [{"kernel": k, "ms": v[0], "calls": v[1]} for k, v in top_kernels],
    }


def replay_costs(engine: Any, prompts: int, length: int, n: int) -> dict[str, float]:
    """Median host us inside ``replay()``, device us between events around it, wall us to a sync."""
    graphs = engine._scheduler.prefill_graphs
    bucket = graphs.buckets[graphs.bucket(prompts, length)]
    host, device, wall = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        bucket.graph.replay()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        t2 = time.perf_counter()
        host.append(1e6 * (t1 - t0))
        device.append(1e3 * start.elapsed_time(end))
        wall.append(1e6 * (t2 - t0))
    return {k: statistics.median(v) for k, v in (("host_us", host), ("device_us", device), ("wall_us", wall))}


def launch_costs(calls: int = 200) -> None:
    import torch.nn.functional as F

    from infir2_rl.fp8 import gemm as cublas_gemm
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.fp8.quant import quantize_weight_blockwise

    dev = torch.device("cuda")
    x = torch.randn(256, 1536, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 1536, device=dev, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight_blockwise(w)
    q, s_t = quant_triton.quantize_rows(x)
    cases = {
        "bf16 F.linear": lambda: F.linear(x, w),
        "fp8 scaled_mm (quantized input)": lambda: cublas_gemm.mm_1x128_128x128(
            q, s_t, wq, ws, torch.bfloat16
        ),
        "quantize_rows": lambda: quant_triton.quantize_rows(x),
    }
    print(f"\n# eager loops of {calls} calls, wall us per call (M 256, N 2048, K 1536)")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) / calls * 1e6)
        print(f"  {name:<34} {statistics.median(walls):7.1f} us (min {min(walls):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[2, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cprofile", action="store_true", help="Python profile of one call per engine")
    parser.add_argument("--launch-costs", action="store_true", help="host cost per GEMM call, eager")
    parser.add_argument("--kernels", action="store_true", help="print each engine's top device kernels")
    parser.add_argument("--eager-too", action="store_true", help="also engines without prefill graphs")
    parser.add_argument("--trace", type=Path, default=None, help="Chrome traces of one call per engine")
    parser.add_argument("--replays", type=int, default=0, help="time N bare replays of each prefill graph")
    parser.add_argument(
        "--true-on-policy", action="store_true", help="engines with true_on_policy (its walk)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/prefill.py: needs a CUDA GPU")
    from infir2_rl.engines.native.engine import NativeEngine

    path = model_dir(False)
    dev = torch.device("cuda")

    def make_engine(fp8: bool) -> Any:
        return NativeEngine(
            str(path),
            fp8=fp8,
            device=dev,
            max_batch_size=max(args.prompts),
            true_on_policy=args.true_on_policy,
        )

    engines = {mode: make_engine(mode == "fp8") for mode in ("bf16", "fp8")}
    if args.eager_too:  # the same engines' prefill without graphs (the path before prefill_graphs.py)
        for mode in ("bf16", "fp8"):
            eager = make_engine(mode == "fp8")
            eager._scheduler.prefill_graphs = None
            engines[f"{mode}_eager"] = eager
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | {path.name} | prompt {args.prompt_len}"
        f"{' | true_on_policy' if args.true_on_policy else ''}"
    )
    rows = []
    for p in args.prompts:
        row: dict[str, Any] = {"prompts": p}
        for mode, engine in engines.items():
            reqs = requests(p, args.prompt_len, 1, engine.vocab_size)
            timed_generate(engine, reqs)  # warm: compiles, GEMM choices, allocator
            wall = statistics.median(timed_generate(engine, reqs) for _ in range(args.repeats))
            row[mode] = {"wall_ms": 1e3 * wall, **profile_call(engine, reqs)}
        rows.append(row)
        for tag in ("", "_eager") if args.eager_too else ("",):
            b, f = row["bf16" + tag], row["fp8" + tag]
            graphs = engines["bf16" + tag]._scheduler.prefill_graphs is not None
            print(
                f"{p:4d} prompts {'graphs' if graphs else 'eager '} | wall BF16 {b['wall_ms']:7.2f} FP8 "
                f"{f['wall_ms']:7.2f} ms (x{b['wall_ms'] / f['wall_ms']:.2f}) | kernels BF16 "
                f"{b['kernels_ms']:7.2f} FP8 {f['kernels_ms']:7.2f} ms",
                flush=True,
            )
        for mode in ("bf16", "fp8"):
            ops = ", ".join(
                f"{o['op']} {o['self_ms']:.1f}/{o['calls']}" for o in row[mode]["top_host_ops"][:6]
            )
            print(f"       {mode} host self ms/calls (profiled): {ops}")
            if args.kernels:
                for kern in row[mode]["top_kernels"]:
                    print(f"         {mode} kernel {kern['ms']:6.3f} ms {kern['calls']:4d}x {kern['kernel']}")
            graphs = engines[mode]._scheduler.prefill_graphs
            if args.replays and graphs is not None and graphs.bucket(p, args.prompt_len) is not None:
                r = row[mode]["replay"] = replay_costs(engines[mode], p, args.prompt_len, args.replays)
                print(
                    f"       {mode} graph replay alone (median of {args.replays}): launch {r['host_us']:.0f} us "
                    f"on the host, {r['device_us']:.0f} us between events, {r['wall_us']:.0f} us to a sync"
                )
    if args.cprofile:
        import cProfile
        import pstats

        for mode, engine in engines.items():
            reqs = requests(min(args.prompts), args.prompt_len, 1, engine.vocab_size)
            prof = cProfile.Profile()
            prof.runcall(timed_generate, engine, reqs)
            print(f"\n# {mode}: Python functions by own time, one call at {min(args.prompts)} prompts")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        args.trace.mkdir(parents=True, exist_ok=True)
        for mode, engine in engines.items():
            reqs = requests(min(args.prompts), args.prompt_len, 1, engine.vocab_size)
            timed_generate(engine, reqs)
            with profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
            ) as prof:
                timed_generate(engine, reqs)
            prof.export_chrome_trace(str(args.trace / f"prefill_{mode}_{min(args.prompts)}.json"))
        print(f"# traces in {args.trace}")
    if args.launch_costs:
        launch_costs()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
