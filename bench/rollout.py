"""Decode throughput of the native rollout engine, BF16 vs FP8 W8A8, on a random Qwen2.5-1.5B-shape model.

    python bench/rollout.py [--batch-sizes 16 32 64 128 256] [--repeats 3] [--profile] [--peers] [--rl]
                            [--gemms] [--out PATH] [--tiny]

On CUDA the engine decodes through its model runner (CUDA graphs, continuous batching; see
``infir2_rl/engines/native/``). ``--peers`` adds transformers ``generate`` (eager dynamic cache at
--peer-batches, static cache + torch.compile at --compile-batches) on the same model in this process;
``--rl`` adds the RL-shaped workload (64 prompts x 16 samples, long-tailed lengths up to 2,048) and the
transformers estimate for it (``rollout_peers.py`` says how each is measured).

What is timed: ``NativeEngine.generate`` on B requests of --prompt-len random token ids each, sampled at
temperature 1.0 with no stop tokens, so all B rows decode exactly --new-tokens tokens in one batch.
Tokens/s is B * new_tokens / wall time of the whole call (prefill included), between
``torch.cuda.synchronize()`` calls; median, min and max of --repeats calls, the two engines alternating.
The decode step time is (wall of the call - wall of the same call with new_tokens=1, i.e. prefill and the
first sample) / (new_tokens - 1). Both engines live in this process: BF16 weights (``fp8=False``) and
FP8 W8A8 (``fp8=True``: decoder linears swapped for ``Fp8InferenceLinear``), the same random model, which
is the ``qwen2.5-1.5b-shape`` preset (``--preset qwen2.5-7b-shape`` for the 7B shape) with Qwen's 151,936-token
vocabulary, built and saved once under /tmp/infir2_bench by bench/train_step.py's helper.

``--profile`` runs torch.profiler at --profile-batch over a call with 1 + k new tokens and one with 1,
and subtracts the two (what remains is k decode steps): device kernels by category, the top kernels, and
the CPU/Python gap = unprofiled wall time of the k steps - their summed device kernel time (one stream,
so kernels do not overlap; a gap means the GPU waited for the host); GPU-busy fraction = kernel time / wall.
With PDL (the default on Hopper, ``engines/native/pdl.py``) kernels do overlap: a kernel launched early
counts its wait, so the sums exceed the wall; ``--pdl both`` also profiles the engines without PDL, whose
sums are valid.
``--gemms`` times each decoder GEMM of one layer at each batch size as the decode graph runs it: BF16 against
every FP8 launch candidate, with the FP8 weight-bandwidth floor (bytes / 3.35 TB/s, the H100's peak).
``--tiny`` runs the tiny preset on CPU (FP8 emulated; runner path without graphs) to check the script.
``--one-launch-per-sm N`` moves the switch between the fast decode attention's two forms (one launch from rows x KV
heads >= N x the SMs; 0 = always, 1000 = never), for measuring where it should be (docs/performance.md, "Rollout
decode", session 55).
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import rollout_peers as peers
import torch
from train_step import kernel_times, model_dir, print_kernels, summarize_kernels, sync, write_report

# (bench/ is on sys.path when this file runs as a script: the model and profile helpers are shared.)
GOAL = 1.3  # FP8 tokens/s over BF16 tokens/s, at least


def requests(batch: int, prompt_len: int, new_tokens: int, vocab: int) -> list[Any]:
    from infir2_rl.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=[])
    return [
        GenerateRequest(
            f"r{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), 1, params, seed=i
        )
        for i in range(batch)
    ]


class NoPdlEngine:
    """An engine whose ``generate`` calls (and the CUDA graphs they capture) launch without PDL."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, reqs: list[Any]) -> list[Any]:
        from infir2_rl.engines.native import pdl

        with pdl.forced(False):
            return self.engine.generate(reqs)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def timed_generate(engine: Any, reqs: list[Any]) -> float:
    sync(engine.device)
    start = time.perf_counter()
    samples = engine.generate(reqs)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    want = reqs[0].params.max_new_tokens
    assert all(len(s.response_ids) == want for s in samples), "a row stopped early"
    return elapsed


def time_batch(engines: dict[str, Any], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s (median, min, max), decode step and prefill time of each engine at one batch size."""
    vocab = next(iter(engines.values())).vocab_size
    full_reqs = requests(batch, args.prompt_len, args.new_tokens, vocab)
    first_reqs = requests(batch, args.prompt_len, 1, vocab)
    full: dict[str, list[float]] = {m: [] for m in engines}
    first: dict[str, list[float]] = {m: [] for m in engines}
    for engine in engines.values():  # graph capture and FP8 GEMM choice of this batch size stay untimed
        timed_generate(engine, full_reqs)
    for _ in range(args.repeats):  # the engines alternate, so drifts (clocks, heat) hit both alike
        for mode, engine in engines.items():
            full[mode].append(timed_generate(engine, full_reqs))
            first[mode].append(timed_generate(engine, first_reqs))
    row: dict[str, Any] = {"batch": batch}
    for mode in engines:
        tps = [batch * args.new_tokens / t for t in full[mode]]
        prefill = statistics.median(first[mode])
        row[mode] = {
            "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "decode_step_ms": 1e3 * (statistics.median(full[mode]) - prefill) / (args.new_tokens - 1),
            "prefill_ms": 1e3 * prefill,
        }
    row["ratio_fp8_over_bf16"] = row["fp8"]["tokens_per_s"]["median"] / row["bf16"]["tokens_per_s"]["median"]
    if "fp8 no-pdl" in row:
        median = {m: row[m]["tokens_per_s"]["median"] for m in engines}
        row["no_pdl_ratio_fp8_over_bf16"] = median["fp8 no-pdl"] / median["bf16 no-pdl"]
        row["pdl_speedup"] = {m: median[m] / median[f"{m} no-pdl"] for m in ("bf16", "fp8")}
    return row


def profile_decode(
    engines: dict[str, Any], batch: int, steps: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Per engine: kernels of `steps` decode steps (a 1 + steps call minus a 1-token call) and the host gap."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for mode, engine in engines.items():
        vocab = engine.vocab_size
        short, long = (requests(batch, args.prompt_len, n, vocab) for n in (1, 1 + steps))
        walls = {}
        for name, reqs in (("short", short), ("long", long)):
            timed_generate(engine, reqs)  # warm
            walls[name] = statistics.median(timed_generate(engine, reqs) for _ in range(3))
        kernels = {}
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if engine.device.type == "cuda" else []
        )
        for name, reqs in (("short", short), ("long", long)):
            with profile(activities=activities) as prof:
                timed_generate(engine, reqs)
            kernels[name] = kernel_times(prof)
        # Subtract per kernel: the long call's kernels minus the short call's (the shared prefill).
        acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
        for sign, name in ((1, "long"), (-1, "short")):
            for kernel, op, us, calls in kernels[name]:
                acc[(kernel, op)][0] += sign * us
                acc[(kernel, op)][1] += sign * calls
        diff = [(k, op, max(us, 0.0), int(max(c, 0))) for (k, op), (us, c) in acc.items()]
        summary = summarize_kernels(diff)
        wall_ms = 1e3 * (walls["long"] - walls["short"])
        summary["decode_steps"] = steps
        summary["wall_ms"] = wall_ms
        summary["cpu_python_gap_ms"] = wall_ms - summary["total_ms"]
        summary["gpu_busy_fraction"] = summary["total_ms"] / wall_ms if wall_ms > 0 else float("nan")
        out[mode] = summary
    return out


def nominal_bandwidth(device_name: str) -> float:
    """HBM bytes/s the floors below divide by: an H200's 4.8 TB/s, else the H100 SXM's 3.35."""
    return 4.8e12 if "H200" in device_name else 3.35e12


def time_attention(contexts: list[int] | None = None, batches: list[int] | None = None) -> dict[str, float]:
    """Decode attention of one layer, 1.5B shape (12 heads, 2 KV heads, D 128), timed as CUDA-graph replays
    (20 calls per replay, median of 5): the engine's Triton split-K kernel against SDPA over a static cache
    (the whole cache length, masked, GQA in SDPA), in us. ``contexts``: every row at each of these lengths
    (cache 64 longer), at each of ``batches``, instead of the four default cases; the floor is the K/V bytes
    read at the GPU's nominal bandwidth (``nominal_bandwidth``)."""
    import torch.nn.functional as F

    from infir2_rl.engines.native import attention

    def graph_us(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / 20)
        return statistics.median(times)

    out = {}
    cases = [(64, 256, 256), (256, 256, 256), (64, 1024, 2304), (256, 1024, 2304)]
    if contexts:
        cases = [(b, ctx, ctx + 64) for b in batches or [64] for ctx in contexts]
    for batch, ctx, cache_len in cases:
        k = torch.randn(batch + 1, 2, cache_len, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, 12, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(batch, device="cuda")
        lengths = torch.full((batch,), ctx, device="cuda")
        mask = (torch.arange(cache_len, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
        arrivals = torch.zeros(batch * 2, dtype=torch.int32, device="cuda")  # allocated outside the graph
        triton_us = graph_us(
            functools.partial(attention.decode, q, k, v, slots, lengths, "triton", arrivals=arrivals)
        )
        sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=mask, enable_gqa=True)
        sdpa_us = graph_us(functools.partial(sdpa, q[:, :, None], k[:batch], v[:batch]))
        key = f"b{batch} ctx{ctx} cache{cache_len}"
        out[f"triton {key}"], out[f"sdpa_static {key}"] = triton_us, sdpa_us
        floor_us = 2 * batch * 2 * ctx * 128 * 2 / nominal_bandwidth(torch.cuda.get_device_name()) * 1e6
        print(
            f"attention {key}: triton {triton_us:.1f} us, SDPA static cache {sdpa_us:.1f} us (floor {floor_us:.1f} us)"
        )
    return out


def time_gemms(engines: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    """Each decoder GEMM of layer 0 at each decode batch, timed as the decode graph runs it (inside a CUDA
    graph, ``Fp8GemmChooser._time``): BF16 ``F.linear`` against every FP8 candidate on producer-quantized
    input (what the runner feeds q|k|v, o, gate|up and down), with the FP8 weight-bandwidth floor."""
    import torch.nn.functional as F

    from infir2_rl.engines.native.fused_ops import QuantizedRows
    from infir2_rl.engines.native.linears import Fp8GemmChooser
    from infir2_rl.fp8 import quant_triton

    bf16_layer = engines["bf16"]._scheduler.runner.layers[0]
    fp8_runner = engines["fp8"]._scheduler.runner
    fp8_layer = fp8_runner.layers[0]
    rows = []
    for batch in batches:
        for name in ("qkv", "o", "gate_up", "down"):
            dense, fp8 = getattr(bf16_layer, name), getattr(fp8_layer, name)
            x = torch.randn(batch, dense.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            bf16_us = 1e3 * Fp8GemmChooser._time(functools.partial(F.linear, x, dense.weight, dense.bias))
            q, s_t = quant_triton.quantize_rows(x, fp8_runner.pow2)
            chooser = Fp8GemmChooser(fp8_runner.pow2)
            qr = QuantizedRows(q, s_t, batch)
            choice = chooser.pick(qr, fp8.weight, fp8.scale, fp8.bias, torch.bfloat16)
            times = {k: 1e3 * v for k, v in next(iter(chooser.timings.values())).items()}
            floor_us = fp8.weight.numel() / nominal_bandwidth(torch.cuda.get_device_name()) * 1e6
            best = times[str(choice)]
            rows.append(
                dict(batch=batch, gemm=name, n=fp8.weight.shape[0], k=fp8.weight.shape[1], bf16_us=bf16_us,
                     fp8_us=best, choice=str(choice), floor_us=floor_us, candidates_us=times)
            )  # fmt: skip
            print(
                f"gemm b{batch:<4d} {name:8s} N {fp8.weight.shape[0]:6d} K {fp8.weight.shape[1]:5d}: BF16 "
                f"{bf16_us:6.1f} us, FP8 {best:6.1f} us ({choice}), x{bf16_us / best:4.2f}, FP8 floor "
                f"{floor_us:5.1f} us"
            )
    return rows


def release_resume(engine: Any) -> dict[str, float]:
    """Colocated memory: release + resume wall time, memory freed, and graph capture time of the last call."""
    decoder = getattr(engine._scheduler, "decoder", None)
    out = {"graph_capture_s_total": decoder.capture_s if decoder is not None else 0.0}
    del decoder  # a live reference would keep the KV cache and graphs from being freed
    if engine.device.type != "cuda":
        return out
    sync(engine.device)
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    engine.release_memory()
    engine.resume_memory()
    sync(engine.device)
    out["release_resume_ms"] = 1e3 * (time.perf_counter() - start)
    out["freed_gb"] = (before - torch.cuda.memory_allocated()) / 2**30
    print(
        f"  release+resume {out['release_resume_ms']:.1f} ms, freed {out['freed_gb']:.1f} GiB; graph captures "
        f"took {out['graph_capture_s_total']:.1f} s in all (re-done lazily after a release)"
    )
    return out


def run_rl(engines: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The RL-shaped workload on each engine (rollout_peers.rl_workload); prints one line per engine."""
    engine = next(iter(engines.values()))
    reqs = peers.rl_requests(
        engine.vocab_size,
        args.rl_prompts,
        16,
        args.prompt_len,
        args.rl_max_new,
        args.rl_mean_len,
        fixed_lengths=args.rl_lengths == "fixed",
    )
    out: dict[str, Any] = {
        "prompts": args.rl_prompts,
        "samples": 16,
        "max_new_tokens": args.rl_max_new,
        "lengths": args.rl_lengths,
    }
    for mode, eng in engines.items():
        if eng._scheduler is not None:  # cache of the workload's length, graphs of every batch size, untimed
            print(f"  {mode}: graphs captured in {eng._scheduler.prepare(reqs):.1f} s")
        res = peers.rl_workload(eng, reqs, args.rl_repeats)
        out[mode] = res
        res |= release_resume(eng)
        lens = res["response_len"]
        print(
            f"RL workload {mode}: {res['wall_s']['median']:.2f} s ({res['wall_s']['min']:.2f}-"
            f"{res['wall_s']['max']:.2f}), {res['tokens_per_s']:.0f} tok/s, {res['tokens']} tokens, "
            f"length mean {lens['mean']:.0f} median {lens['median']:.0f} max {lens['max']} ({lens['at_max']} at max)"
        )
        if res["work"]:
            print(f"  work of the last call: {res['work']}")
    return out


def run_peers(path: str, args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """transformers generate, eager and static+compile (rollout_peers.hf_step_ms), and the RL estimate."""
    out: dict[str, Any] = {}
    for name, static, batches in (
        ("hf_eager", False, args.peer_batches),
        ("hf_static_compile", True, args.compile_batches),
    ):
        try:
            res = peers.hf_step_ms(path, batches, args.prompt_len, args.new_tokens, args.repeats, static)
        except Exception as exc:  # a peer that fails is reported as such, loudly, not skipped
            print(f"PEER FAILED: {name}: {type(exc).__name__}: {exc}")
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = res
        for batch, r in res.items():
            print(
                f"{name} batch {batch}: {r['decode_step_ms']:.2f} ms/step ({r['step_ms_min']:.2f}-"
                f"{r['step_ms_max']:.2f}), {r['tokens_per_s']:.0f} tok/s, warm-up {r['warmup_s']:.0f} s"
            )
    static = out.get("hf_static_compile", {})
    if "rl" in report and 256 in static:
        step = static[256]["decode_step_ms"]
        for mode in ("bf16", "fp8"):
            rl = report["rl"][mode]
            est = peers.hf_rl_estimate_s(rl["lengths"], 256, step, 0.0)
            rl["hf_static_compile_estimate_s"] = est
            rl["speedup_vs_hf_static_compile"] = est / rl["wall_s"]["median"]
            print(
                f"RL workload {mode}: transformers static+compile estimate {est:.1f} s -> {est / rl['wall_s']['median']:.2f}x"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens every row decodes")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch size and engine")
    parser.add_argument("--profile", action="store_true", help="profile a few decode steps per engine")
    parser.add_argument("--profile-batch", type=int, default=128, help="batch size of --profile")
    parser.add_argument("--profile-steps", type=int, default=16, help="decode steps of --profile")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (checks the script)")
    parser.add_argument(
        "--preset",
        default="qwen2.5-1.5b-shape",
        choices=["qwen2.5-1.5b-shape", "qwen2.5-7b-shape"],
        help="the random model's shape (Qwen's 151,936-token vocabulary either way)",
    )
    parser.add_argument("--peers", action="store_true", help="transformers generate, eager and compiled")
    parser.add_argument("--peer-batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--compile-batches", type=int, nargs="*", default=[256])
    parser.add_argument(
        "--attention", action="store_true", help="time Triton split-K vs SDPA decode attention"
    )
    parser.add_argument(
        "--attention-contexts",
        type=int,
        nargs="*",
        help="with --attention: these context lengths at each --batch-sizes, instead of the default cases",
    )
    parser.add_argument("--gemms", action="store_true", help="each decoder GEMM: BF16 vs FP8 candidates")
    parser.add_argument("--rl", action="store_true", help="the RL-shaped workload")
    parser.add_argument("--rl-repeats", type=int, default=2)
    parser.add_argument("--rl-prompts", type=int, default=64)
    parser.add_argument("--rl-mean-len", type=int, default=450, help="~mean response length (stop set size)")
    parser.add_argument(
        "--rl-lengths",
        choices=("sampled", "fixed"),
        default="sampled",
        help="sampled: rows stop at a random stop set (lengths differ per engine); fixed: per-prompt lengths "
        "drawn up front, the same work for every engine",
    )
    parser.add_argument("--rl-max-new", type=int, default=2048)
    parser.add_argument(
        "--pdl",
        choices=("on", "both"),
        default="on",
        help="both: the batch sweep also times each engine with its kernels launched without programmatic "
        "dependent launch (engines/native/pdl.py), in the same process; INFIR2_PDL=0 turns it off everywhere",
    )
    parser.add_argument(
        "--one-launch-per-sm",
        type=int,
        help="the fast mode's decode attention takes its one-launch form where rows x KV heads >= this x the "
        "SMs (attention.ONE_LAUNCH_PROGRAMS_PER_SM; 0: always, 1000: never); default: the library's rule",
    )
    args = parser.parse_args(argv)
    if args.one_launch_per_sm is not None:
        from infir2_rl.engines.native import attention

        attention.ONE_LAUNCH_PROGRAMS_PER_SM = args.one_launch_per_sm  # read at each call (graph capture)
    if args.tiny:
        args.batch_sizes, args.prompt_len, args.new_tokens, args.repeats = [2, 4], 8, 8, 2
        args.profile_batch, args.profile_steps = 4, 4
        args.rl_prompts, args.rl_mean_len, args.rl_max_new = 4, 20, 40
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench/rollout.py needs a CUDA GPU (Hopper for the FP8 fast path); use --tiny on CPU.")
        return 1
    else:
        device = torch.device("cuda")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (the decode step time needs at least one decode step)")
    from transformers.utils import logging as hf_logging

    from infir2_rl.engines.native.engine import NativeEngine

    hf_logging.disable_progress_bar()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("infir2_rl.engines.native").setLevel(logging.INFO)  # FP8 GEMM choices, graph captures
    start = time.perf_counter()
    path = model_dir(args.tiny, args.preset)
    max_batch = max(args.batch_sizes + [args.profile_batch])
    engines = {
        mode: NativeEngine(
            str(path), fp8=mode == "fp8", device=device, max_batch_size=max_batch, decode_path="runner"
        )
        for mode in ("bf16", "fp8")
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (float32; FP8 emulated)"
    print(
        f"# {name} | torch {torch.__version__} | {path.name} | prompt {args.prompt_len} + {args.new_tokens} "
        f"new tokens | median of {args.repeats} | engines ready in {time.perf_counter() - start:.0f} s"
    )
    if args.one_launch_per_sm is not None:
        print(f"# decode attention in one launch from rows x KV heads >= {args.one_launch_per_sm} x SMs")
    for engine in engines.values():  # Triton compiles, cuBLAS handles, allocator blocks for the largest batch
        for b in (min(args.batch_sizes), max_batch):
            timed_generate(engine, requests(b, args.prompt_len, 4, engine.vocab_size))
    swept: dict[str, Any] = dict(engines)
    if args.pdl == "both" and device.type == "cuda":
        for mode in ("bf16", "fp8"):
            swept[f"{mode} no-pdl"] = NoPdlEngine(
                NativeEngine(
                    str(path),
                    fp8=mode == "fp8",
                    device=device,
                    max_batch_size=max_batch,
                    decode_path="runner",
                )
            )
            if mode == "fp8":  # the same FP8 GEMM choices, so that only the launches differ
                fp8_runner = swept[f"{mode} no-pdl"].engine._scheduler.runner
                fp8_runner.chooser.choice = engines["fp8"]._scheduler.runner.chooser.choice
            for b in (min(args.batch_sizes), max_batch):
                timed_generate(
                    swept[f"{mode} no-pdl"], requests(b, args.prompt_len, 4, swept[mode].vocab_size)
                )
    rows = []
    print(
        f"{'batch':>5} | {'bf16 tok/s':>10} {'min':>8} {'max':>8} | {'fp8 tok/s':>10} {'min':>8} {'max':>8} | "
        f"{'x':>5} | {'bf16 ms/step':>12} {'fp8 ms/step':>11} | {'bf16 prefill':>12} {'fp8':>7}"
    )
    for batch in args.batch_sizes:
        row = time_batch(swept, batch, args)
        rows.append(row)
        b, f = row["bf16"], row["fp8"]
        print(
            f"{batch:5d} | {b['tokens_per_s']['median']:10.0f} {b['tokens_per_s']['min']:8.0f} "
            f"{b['tokens_per_s']['max']:8.0f} | {f['tokens_per_s']['median']:10.0f} {f['tokens_per_s']['min']:8.0f} "
            f"{f['tokens_per_s']['max']:8.0f} | {row['ratio_fp8_over_bf16']:5.2f} | {b['decode_step_ms']:12.2f} "
            f"{f['decode_step_ms']:11.2f} | {b['prefill_ms']:10.1f}ms {f['prefill_ms']:5.1f}ms"
        )
        if "pdl_speedup" in row:
            nb, nf = row["bf16 no-pdl"], row["fp8 no-pdl"]
            print(
                f"{'':5} | no PDL: bf16 {nb['tokens_per_s']['median']:.0f} ({nb['decode_step_ms']:.2f} ms/step), fp8 "
                f"{nf['tokens_per_s']['median']:.0f} ({nf['decode_step_ms']:.2f} ms/step), x "
                f"{row['no_pdl_ratio_fp8_over_bf16']:.2f} | PDL speed-up bf16 {row['pdl_speedup']['bf16']:.3f}, "
                f"fp8 {row['pdl_speedup']['fp8']:.3f}"
            )
    met = [r["batch"] for r in rows if r["ratio_fp8_over_bf16"] >= GOAL]
    print(f"goal FP8 tokens/s >= {GOAL}x BF16: met at batch sizes {met or 'none'} of {args.batch_sizes}")
    report: dict[str, Any] = dict(device=name, torch=torch.__version__, prompt_len=args.prompt_len)
    report |= dict(new_tokens=args.new_tokens, repeats=args.repeats, rows=rows, goal_min=GOAL)
    if args.profile:
        # Under PDL a kernel launched early counts its wait in its duration, so kernel times overlap and their
        # sum exceeds the wall; with --pdl both the engines without PDL are profiled too (valid sums).
        prof = profile_decode(swept, args.profile_batch, args.profile_steps, args)
        report["profile"] = {"batch": args.profile_batch, **prof}
        for mode, summary in prof.items():
            steps = summary["decode_steps"]
            print_kernels(
                f"profile, {mode}, {steps} decode steps at batch {args.profile_batch} "
                f"(unprofiled wall {summary['wall_ms']:.2f} ms, {summary['wall_ms'] / steps:.2f} ms/step, "
                f"GPU busy {100 * summary['gpu_busy_fraction']:.0f}%)",
                summary,
                {"CPU/Python gap": summary["cpu_python_gap_ms"]},
            )
        write_report(args.out, report)
    if args.attention and device.type == "cuda":
        report["attention_us"] = time_attention(args.attention_contexts, args.batch_sizes)
    if args.gemms and device.type == "cuda":
        report["gemms"] = time_gemms(engines, sorted(set(args.batch_sizes)))
        write_report(args.out, report)
    if args.rl:
        report["rl"] = run_rl(engines, args)
        write_report(args.out, report)
    if args.peers and device.type == "cuda":
        report["peers"] = run_peers(str(path), args, report)
        write_report(args.out, report)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
