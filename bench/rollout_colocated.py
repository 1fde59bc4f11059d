"""The rollout as a colocated RL step meets it: BF16 vs FP8 W8A8 ``generate`` right after the engine gave its GPU
memory to the trainer and took it back, on a random Qwen2.5-1.5B-shape model.

    python bench/rollout_colocated.py [--prompts 32] [--samples 8] [--prompt-len 17 64] [--new-tokens 256]
                                      [--repeats 4] [--keep-memory] [--ab] [--profile] [--tiny]

A colocated engine releases its KV cache, decode state and decode graphs before the trainer's phases
(``NativeEngine.release_memory``), so each RL step's ``generate`` allocates them again and captures its decode
graphs again. ``bench/rollout.py`` times decode with the graphs already captured; this times the whole call
after ``release_memory`` + ``resume_memory``, as ``bench/rl_1p5b.sh``'s rollout phase runs it (32 prompts x 8
samples, prompts of 17-64 random tokens, 256 new tokens, T = 1, no stop token), and the decode-graph capture
inside it (``NativeEngine.graph_capture_s``). Both engines live in this process and alternate (BF16, FP8,
BF16, ...), each warmed by one untimed call first. Prints per precision the median wall and capture of
--repeats calls, and FP8 / BF16 with and without the capture. ``--keep-memory``: the same calls without the
release and resume (cache, graphs and prefill graphs kept, as a dedicated engine runs), for comparison.

``--ab`` adds, in the same process and alternating with the others, engines as they were before session 41:
decode graphs warmed up (two eager steps) before every capture, prefill graphs dropped at the first release
(``Scheduler.warmed = None``, ``Scheduler.keep_prefill_graphs = False``); and prints the GPU memory the kept
prefill graphs hold while the engines are released (reserved before and after dropping them).
``--profile``: per engine, one more colocated call split into its phases (first admission = prefill and
first sample, decode-graph capture, the rest; the GPU synchronised around the admission), then one under
torch.profiler: device-kernel time by category against the wall (with PDL, kernels overlap: sums may exceed
the wall).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import torch
from rollout import timed_generate
from train_step import kernel_times, model_dir, print_kernels, summarize_kernels


def rl_requests(args: argparse.Namespace, vocab: int) -> list[Any]:
    from infir2_rl.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
    low, high = args.prompt_len
    return [
        GenerateRequest(
            f"p{i}",
            torch.randint(
                0, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g
            ).tolist(),
            args.samples,
            params,
            seed=i,
        )
        for i in range(args.prompts)
    ]


def colocated_call(engine: Any, reqs: list[Any], keep_memory: bool = False) -> tuple[float, float]:
    """(wall s, decode-graph capture s) of one ``generate`` after the engine released and resumed its memory
    (``keep_memory``: without that, so nothing is captured again)."""
    if not keep_memory:
        engine.release_memory()
        engine.resume_memory()
    engine.graph_capture_s()  # the count restarts here (the RL step's rollout/graph_capture_s)
    wall = timed_generate(engine, reqs)
    return wall, engine.graph_capture_s() or 0.0  # None on CPU: nothing captured


def phases(engine: Any, reqs: list[Any]) -> dict[str, float]:
    """One colocated call split into first admission (prefill + first sample; GPU synchronised around it),
    decode-graph capture and the rest, in ms."""
    sched = engine._scheduler
    admit, spent = sched._admit, []

    def timed_admit(*a: Any, **k: Any) -> Any:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = admit(*a, **k)
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - start)
        return out

    sched._admit = timed_admit
    try:
        wall, capture = colocated_call(engine, reqs)
    finally:
        del sched._admit  # the bound method again
    return {
        "wall": 1e3 * wall,
        "admit": 1e3 * sum(spent),
        "capture": 1e3 * capture,
        "rest": 1e3 * (wall - sum(spent) - capture),
        "warmups": float(sched.decoder.warmups if sched.decoder is not None else 0),
        "graph_prefills": float(sched.tally["graph_prefills"]),
    }


def profiled(engine: Any, reqs: list[Any]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = colocated_call(engine, reqs)
    summary: dict[str, Any] = summarize_kernels(kernel_times(prof))
    summary["wall_ms"] = 1e3 * wall
    return summary


def prefill_graph_memory(engines: dict[str, Any]) -> float:
    """GiB the kept prefill graphs hold while every engine is released."""
    for engine in engines.values():
        engine.release_memory()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for engine in engines.values():
        engine._scheduler.prefill_graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    return (before - torch.cuda.memory_reserved()) / 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[17, 64], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--keep-memory", action="store_true", help="no release/resume before each call")
    p.add_argument("--ab", action="store_true", help="also the engines as before session 41")
    p.add_argument("--profile", action="store_true", help="phases and kernels of one call per engine")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU model (a smoke run)")
    args = p.parse_args()
    from infir2_rl.engines.native.engine import NativeEngine

    device = torch.device("cpu" if args.tiny else "cuda")
    path = model_dir(args.tiny)
    batch = args.prompts * args.samples
    variants = ("", " old") if args.ab else ("",)
    engines = {
        f"{mode}{variant}": NativeEngine(str(path), fp8=mode == "fp8", device=device, max_batch_size=batch)
        for variant in variants
        for mode in ("bf16", "fp8")
    }
    for name, engine in engines.items():
        if name.endswith(" old") and engine._scheduler is not None:
            engine._scheduler.warmed = None
            engine._scheduler.keep_prefill_graphs = False
    reqs = rl_requests(args, next(iter(engines.values())).vocab_size)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    how = "engine memory kept" if args.keep_memory else "colocated (release + resume before each call)"
    print(f"{name}: {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, {how}")
    for engine in engines.values():
        colocated_call(engine, reqs)  # warm: GEMM choice, Triton compiles, first captures
    walls: dict[str, list[float]] = {m: [] for m in engines}
    captures: dict[str, list[float]] = {m: [] for m in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            wall, capture = colocated_call(engine, reqs, args.keep_memory)
            walls[mode].append(wall)
            captures[mode].append(capture)
    med = {m: (statistics.median(walls[m]), statistics.median(captures[m])) for m in engines}
    for mode in engines:
        print(
            f"{mode:8s}: generate {1e3 * med[mode][0]:7.1f} ms (range {1e3 * min(walls[mode]):.1f}-"
            f"{1e3 * max(walls[mode]):.1f}), decode-graph capture in it {1e3 * med[mode][1]:6.1f} ms "
            f"(range {1e3 * min(captures[mode]):.1f}-{1e3 * max(captures[mode]):.1f})"
        )
    for variant in variants:
        (bw, bc), (fw, fc) = med[f"bf16{variant}"], med[f"fp8{variant}"]
        print(f"FP8 / BF16{variant}: {fw / bw:.3f} with the capture, {(fw - fc) / (bw - bc):.3f} without it")
    if args.ab:
        for mode in ("bf16", "fp8"):
            print(f"{mode} new / old: {med[mode][0] / med[f'{mode} old'][0]:.3f}")
    if args.profile and device.type == "cuda":
        print("\nphases of one colocated call, ms (admit: prefill + first sample, synchronised around it)")
        for mode, engine in engines.items():
            ph = phases(engine, reqs)
            print(
                f"{mode:8s}: wall {ph['wall']:7.1f}  admit {ph['admit']:6.1f}  capture {ph['capture']:6.1f}"
                f"  rest {ph['rest']:7.1f}  (warm-ups {ph['warmups']:.0f}, graph prefills so far "
                f"{ph['graph_prefills']:.0f})"
            )
        for mode, engine in engines.items():
            summary = profiled(engine, reqs)
            print_kernels(
                f"{mode}: one colocated call under the profiler, wall {summary['wall_ms']:.1f} ms", summary
            )
    if args.ab and device.type == "cuda":
        print(f"\nkept prefill graphs hold {prefill_graph_memory(engines):.3f} GiB (all engines released)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
