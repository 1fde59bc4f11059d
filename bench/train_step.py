"""One optimizer step of the torch trainer, BF16 vs blockwise FP8, on a random Qwen2.5-1.5B-shape model.

    python bench/train_step.py [--batch 1 --seq 8192] [--steps 10] [--profile] [--out PATH] [--tiny]
                               [--backend torch|megatron] [--cuda-graphs off|on|both]
                               [--fused-kernels auto|off|both] [--saved N]
                               [--preset qwen2.5-7b-shape --layers N] [--gradient-checkpointing]
                               [--memory-peak N]

What is timed: ``TorchTrainer.train_step`` (FP32 master weights, BF16 autocast, AdamW, grad-norm clipping)
on one micro-batch of batch x seq random tokens (8192 by default) with the SFT loss (cross-entropy on the
last 75% of each row, as an answer after a prompt). Wall time between ``torch.cuda.synchronize()`` calls,
median (and min/max) of --steps steps after --warmup steps; the first mode is BF16 (``fp8=False``),
the second FP8 (decoder linears swapped for ``Fp8Linear``), one after the other in this process. Peak
memory is ``torch.cuda.max_memory_allocated`` from trainer construction through the timed steps: the first
trainer is deleted and the peak reset before the second is built (the allocated memory left over is printed).

Model TFLOP/s counts 6 * N * tokens + 6 * batch * seq^2 * layers * hidden (N: weights of every matmul,
decoder linears and lm_head; hidden = heads x head_dim; the second term is causal attention, QK^T and PV, forward and backward).
The model is the ``qwen2.5-1.5b-shape`` preset with Qwen's 151,936-token vocabulary, built on the GPU
and saved once (BF16 safetensors) under /tmp/infir2_bench, since the trainer loads from a directory.
``--profile`` runs torch.profiler over one more step per mode and groups the CUDA kernels by category.
``--sync-sites`` runs one more step per mode under torch's sync debug mode and lists each place the host waited
for the device (``.item()``, ``nonzero``, ...), counted: each wait drains the GPU's queue, which then idles
while the host launches the next work (docs/performance.md, "The GPU waiting for the host").
``--cuda-graphs both`` (GPU; either backend) adds BF16 and FP8 with ``trainer.cuda_graphs`` (the decoder layers'
forward and backward replayed from CUDA graphs; the capture happens in the first warm-up step), so the
table has four rows and the ratio is FP8 over the fastest BF16 (the trainer's own default, ``auto``, is the
graphs on one GPU). After the training steps each mode times ``--score-steps`` no-gradient scoring forwards of
the same batch (``forward_logprobs``: an RL step's old log-probs; from forward-only graphs with graphs on). ``--tiny`` runs the tiny preset on CPU (FP8
emulated) to check the script. ``--backend megatron`` times
``MegatronTrainer`` (megatron-core GPTModel, local spec: the project's FP8 linears, SDPA attention, TP=1)
on the same model, batch and loss (with ``--cuda-graphs on/both``, megatron's layers replayed from graphs:
trainers/megatron/graphs.py). ``--fused-kernels both`` runs every mode twice, with ``trainer.fused_kernels``
off and on (RMSNorm and SwiGLU as one Triton kernel each way; ``auto``, the default, is on for CUDA), so the
fused and unfused steps are measured in one process; ``off`` runs torch's modules only. ``--memory-peak N``
(GPU) runs one more step per mode under the CUDA allocator's history and prints what the step starts with and,
at its peak, the N largest groups of what it allocated, by the Python line that allocated them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

QWEN_VOCAB = 151936
CATEGORIES = ("quantization (Triton)", "FP8 GEMM", "BF16 GEMM", "attention", "optimizer", "other")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear"}
GOALS = {"step_time": 0.80, "peak_memory": 0.90, "peak_reserved": 0.90}  # issue 13 (stretch: 0.75, 0.85)
GOALS_NONE = {"scoring_time": 1.0}  # no issue goal: FP8 scoring should at least not be slower


def model_dir(tiny: bool, preset: str = "qwen2.5-1.5b-shape", layers: int = 0) -> Path:
    """A random model directory (written once, reused by bench/rollout.py and bench/weight_sync.py): ``preset``
    (the 1.5B shape unless told) with Qwen's vocabulary, or tiny on CPU; ``layers`` > 0 keeps that many decoder
    layers of the preset's shape (a 7B-shaped step on one GPU)."""
    from transformers import Qwen2ForCausalLM

    from infir2_rl.models.factory import preset_config
    from infir2_rl.models.tokenizer import build_tokenizer

    preset = "tiny" if tiny else preset
    name = (preset if tiny else f"{preset}-v{QWEN_VOCAB}") + (f"-l{layers}" if layers else "")
    path = Path(tempfile.gettempdir()) / "infir2_bench" / name
    if (path / "config.json").is_file():
        return path
    tokenizer = build_tokenizer()
    overrides: dict[str, Any] = {} if tiny else {"vocab_size": QWEN_VOCAB}
    if layers:
        overrides["num_hidden_layers"] = layers
    config = preset_config(preset, tokenizer, **overrides)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built directly in its dtype, on the GPU: seconds, not a minute of CPU
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(previous)
    partial = path.with_name(name + ".partial")
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    partial.rename(path)  # a crashed write leaves only the .partial directory
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to what is benchmarked (bench/weight_sync.py's actors)
    return path


def kernel_times(prof: Any) -> list[tuple[str, str, float, int]]:
    """(kernel name, name of the op that launched it, microseconds, calls) of every device kernel.

    On CPU (no device kernels) each op's self time stands in for a kernel, so --tiny exercises this path.
    """
    from torch.autograd import DeviceType

    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    ops = {e.id: e.name for e in cpu}
    # Older torch has no linked_correlation_id on events: then name the op from its list of kernels.
    op_of_kernel = {k.name: e.name for e in cpu for k in e.kernels}
    out = []
    for e in events:
        # Kernels, memcpy and memset; not the GPU-side spans of record_function ranges (such as
        # "Optimizer.step#AdamW.step"), which would count the kernels inside them twice.
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            op = ops.get(getattr(e, "linked_correlation_id", -1)) or op_of_kernel.get(e.name, "")
            out.append((e.name, op, e.time_range.elapsed_us(), 1))
    if not out:
        out = [(e.key, e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    return out


def host_ops(prof: Any, top: int = 12) -> list[tuple[str, float, int]]:
    """(op name, self CPU ms, calls) of the ops that cost the host most in the profiled step."""
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def category(kernel: str, op: str) -> str:
    """Category of a kernel from its name and the op that launched it (the top-kernel list shows the result)."""
    k, o = kernel.lower(), op.lower()
    # our Triton kernels: _act_quant_kernel, _weight_quant_kernel, _weight_blocks_kernel (in the optimizer step)
    if ("quant" in k and "dequant" not in k) or "_weight_blocks" in k:
        return "quantization (Triton)"
    # cuBLASLt's FP8 kernels: "..._qqtst_..." (1x128 x 128x128) and "..._qqsss_..." (1x128 x 1x128) on sm90.
    # Inside CUDA graphs kernels are named from their own names only (the launching op is the graph).
    if "scaled_mm" in o or any(s in k for s in ("e4m3", "e5m2", "fp8", "f8f8", "qgmma", "sm90_qq")):
        return "FP8 GEMM"
    if any(s in k for s in ("flash", "fmha", "attention", "attn")) or "attention" in o:
        return "attention"
    if any(s in k for s in ("gemm", "nvjet", "cutlass", "xmma", "gmma", "cublas")) or o in GEMM_OPS:
        return "BF16 GEMM"
    if any(s in k for s in ("adam", "multi_tensor_apply")) or "adam" in o or "foreach" in o:
        return "optimizer"  # AdamW, and the foreach grad-norm and clipping kernels
    return "other"


def summarize_kernels(times: list[tuple[str, str, float, int]], top: int = 15) -> dict[str, Any]:
    """Milliseconds per category and the top kernels (name, category, ms, calls)."""
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    ops: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for name, op, us, calls in times:
        key = (name, category(name, op))
        acc = per_kernel[key]
        acc[0] += us / 1e3
        acc[1] += calls
        ops[key][op] += calls
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for (_, cat), (ms, _) in per_kernel.items():
        cats[cat] += ms
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "total_ms": sum(cats.values()),
        "categories_ms": cats,
        "top": [
            {
                "kernel": n,
                "category": c,
                "ms": ms,
                "calls": int(calls),
                # the ops that launched it (none inside CUDA graphs: profile eager steps to see them)
                "ops": [op for op, _ in ops[(n, c)].most_common(2) if op],
            }
            for (n, c), (ms, calls) in ranked
        ],
    }


def print_kernels(title: str, summary: dict[str, Any], extra: dict[str, float] | None = None) -> None:
    """Categories (and `extra` rows) in ms and as a share of kernel time plus the extra rows, then top kernels."""
    total = summary["total_ms"] + sum((extra or {}).values())
    print(f"\n# {title}: device kernels {summary['total_ms']:.2f} ms")
    for cat, ms in {**summary["categories_ms"], **(extra or {})}.items():
        print(f"  {cat:<24} {ms:9.3f} ms {100 * ms / max(total, 1e-9):6.1f}%")
    print(f"  top {len(summary['top'])} kernels:")
    for row in summary["top"]:
        launched_by = f"  [{', '.join(row['ops'])}]" if row.get("ops") else ""
        print(
            f"  {row['ms']:9.3f} ms {row['calls']:6d}x  {row['category']:<22} {row['kernel'][:90]}{launched_by}"
        )


def sft_batch(batch: int, seq: int, vocab: int) -> Any:
    from infir2_rl.types import TokenBatch

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(batch, seq)
    loss_mask[:, seq // 4 :] = 1.0  # prompt (first quarter) untrained, answer trained
    return TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask)


def write_report(out: Path | None, report: dict[str, Any]) -> None:
    """Write a bench's results as JSON to `out` (the --out option), if given."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def sync_sites(trainer: Any, batches: Any, loss_fn: Any, units: Any) -> list[tuple[int, str]]:
    """(count, call chain) of each place one more train step makes the host wait for the device (torch's
    sync debug mode: ``.item()``, ``nonzero``, copies between the device and pageable host memory, boolean
    indexing). The chain lists the innermost frames of this project and of transformers, innermost first."""
    import traceback
    import warnings

    sites: dict[str, int] = defaultdict(int)
    keep = ("infir2_rl", "transformers")

    def record(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: Any = None,
    ) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in keep)]
        chain = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        sites[chain or f"{Path(filename).name}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters after
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(batches, loss_fn, units)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sorted(((n, site) for site, n in sites.items()), reverse=True)


def _site(frames: list[dict[str, Any]]) -> str:
    """Where an allocation was made: its innermost Python frame in the project or megatron-core, else the
    innermost outside torch, else the innermost (frames run innermost first)."""
    tests = (lambda n: "infir2_rl/" in n or "/megatron/" in n, lambda n: "/torch/" not in n, lambda n: True)
    for test in tests:
        for f in frames:
            name = f.get("filename", "")
            if test(name):
                return f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def memory_peak(trainer: Any, batches: Any, loss_fn: Any, units: Any, top: int) -> dict[str, Any]:
    """One more train step under the CUDA allocator's history (``torch.cuda.memory._record_memory_history``):
    what the step starts with (weights, masters, optimizer state, kept FP8 weights: allocated before it), and
    at its peak of allocated memory the blocks the step itself allocated and still holds, grouped by the
    Python line that allocated them (``_site``), the largest ``top`` groups. Blocks allocated before the step and
    freed in it are not subtracted: start + step peak bounds the true peak from above (equal when none is)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        trainer.train_step(batches, loss_fn, units)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snap["device_traces"][torch.cuda.current_device()]:
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = (event["size"], _site(event.get("frames", [])))
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            now -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[site][0] += 1
        groups[site][1] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return {
        "start_gib": base / 2**30,
        "step_peak_gib": peak / 2**30,
        "top": [{"site": k, "count": c, "gib": b / 2**30} for k, (c, b) in ranked[:top]],
    }


def saved_activations(trainer: Any, batch: Any, loss_fn: Any, units: Any, top: int) -> dict[str, Any]:
    """What one more train step's forward keeps for its backward: each storage that autograd saves, once
    (``saved_tensors_hooks``), parameters and their masters left out, grouped by dtype and shape. Eager
    modes only (a CUDA graph capture would record the hooks' work)."""
    own = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    masters = getattr(trainer, "master_weights", None)
    for seg in getattr(masters, "segments", ()):
        own |= {seg.flat.untyped_storage().data_ptr(), seg.copy.untyped_storage().data_ptr()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own and ptr not in seen:
            seen[ptr] = (f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step([batch], loss_fn, units)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, nbytes in seen.values():
        groups[key][0] += 1
        groups[key][1] += nbytes
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    total = sum(n for _, n in seen.values())
    return {
        "total_gib": total / 2**30,
        "top": [{"tensor": k, "count": c, "gib": b / 2**30} for k, (c, b) in ranked[:top]],
    }


def run_mode(
    path: Path,
    fp8: bool,
    graphs: bool,
    args: argparse.Namespace,
    device: torch.device,
    fused: bool | str = "auto",
    qkv_group: bool = True,
    label: str = "mode",
) -> dict[str, Any]:
    from transformers import AutoConfig

    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.megatron.layers import ParallelLinear
    from infir2_rl.trainers.megatron.trainer import MegatronTrainer
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    leftover_gb = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    # A small constant lr keeps random weights finite over the run (a skipped update would be cheaper).
    optim = OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0)
    trainer: Any
    if args.backend == "megatron":
        trainer = MegatronTrainer(
            ModelConfig(path=str(path), gradient_checkpointing=args.gradient_checkpointing),
            TrainerConfig(backend="megatron", megatron_spec="local", cuda_graphs=graphs),
            optim,
            total_steps=args.warmup + args.steps + 1,
            device=device,
            fp8=fp8,
        )
        fp8_linears = sum(m.fp8 for m in trainer.model.modules() if isinstance(m, ParallelLinear))
    else:
        trainer = TorchTrainer(
            ModelConfig(path=str(path), gradient_checkpointing=args.gradient_checkpointing),
            TrainerConfig(
                fsdp_param_dtype=args.fsdp_param_dtype,
                param_dtype=args.param_dtype,
                cuda_graphs=graphs,
                fused_kernels=fused,
                pack_sequences={"false": False, "true": True, "auto": "auto"}[args.pack_sequences],
            ),
            optim,
            fp8=fp8,
            total_steps=args.warmup + args.steps + 1,
            device=device,
        )
        fp8_linears = len(trainer.fp8_linears)
        if not qkv_group:  # the FP8 trainer on a GPU runs q|k|v as one linear by default (fp8/grouped.py)
            from infir2_rl.fp8 import grouped

            grouped.ungroup_projections(trainer.model)
    cfg = AutoConfig.from_pretrained(path)
    batch = sft_batch(args.batch, args.seq, cfg.vocab_size)
    # --micro-batches N: one optimizer step over N micro-batches (the batch N times), as gradient accumulation.
    units, loss_fn = num_target_tokens(batch) * args.micro_batches, SftLossFn()
    batches = [batch] * args.micro_batches
    times, skipped, losses = [], 0, []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        stats = trainer.train_step(batches, loss_fn, units)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        skipped += stats.skipped
        losses.append(stats.loss)
    # Scoring (an RL step's old log-probs: the same batch, no gradients), after the training steps.
    score_times = []
    for i in range(2 + args.score_steps if args.score_steps else 0):
        sync(device)
        start = time.perf_counter()
        trainer.forward_logprobs([batch])
        sync(device)
        if i >= 2:
            score_times.append(time.perf_counter() - start)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    # What the process holds: CUDA graphs keep their memory pool reserved between replays.
    reserved_gb = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None
    tokens = args.batch * args.seq * args.micro_batches
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_width = cfg.num_attention_heads * head_dim
    # Weights of every matmul (q, k, v, o, gate, up, down per layer, and the lm_head), from the config so
    # that both backends count the same work.
    kv_width = cfg.num_key_value_heads * head_dim
    per_layer = (
        cfg.hidden_size * (2 * attn_width + 2 * kv_width) + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    n_matmul = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    flops = (
        6 * n_matmul * tokens
        + 6 * args.batch * args.micro_batches * args.seq**2 * cfg.num_hidden_layers * attn_width
    )
    step_s = statistics.median(times)
    out: dict[str, Any] = {
        "fp8": fp8,
        "cuda_graphs": graphs,
        "fused_kernels": getattr(trainer, "fused_layers", {}),
        "graph_captures": getattr(getattr(trainer, "layer_graphs", None), "captures", 0),
        "backend": args.backend,
        "fp8_linears": fp8_linears,
        "step_ms": dict(median=1e3 * step_s, min=1e3 * min(times), max=1e3 * max(times), n=len(times)),
        "score_ms": dict(
            median=1e3 * statistics.median(score_times),
            min=1e3 * min(score_times),
            max=1e3 * max(score_times),
            n=len(score_times),
        )
        if score_times
        else None,
        "peak_memory_gb": peak_gb,
        "peak_reserved_gb": reserved_gb,
        "leftover_before_build_gb": leftover_gb,
        "tflops": flops / step_s / 1e12,
        "flops_per_step": flops,
        "matmul_params": n_matmul,
        "skipped_steps": skipped,
        "loss_first_last": [losses[0], losses[-1]],
    }
    if args.saved and not graphs:
        out["saved"] = saved_activations(trainer, batch, loss_fn, num_target_tokens(batch), args.saved)
    if args.memory_peak and device.type == "cuda":
        out["memory_peak"] = memory_peak(trainer, batches, loss_fn, units, args.memory_peak)
    if args.sync_sites and device.type == "cuda":
        out["sync_sites"] = sync_sites(trainer, batches, loss_fn, units)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync(device)
        with profile(activities=activities) as prof:
            trainer.train_step(batches, loss_fn, units)
            sync(device)
        out["profile"] = summarize_kernels(kernel_times(prof), top=args.profile_top)
        out["profile"]["host_top"] = host_ops(prof)
        if args.trace is not None:  # a Chrome trace of the profiled step (chrome://tracing, Perfetto)
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{label}.json"))
    del trainer
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per optimizer step (the batch repeated)"
    )
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode (median reported)")
    parser.add_argument("--profile", action="store_true", help="profile one more step per mode")
    parser.add_argument(
        "--profile-top", type=int, default=15, help="--profile: how many top kernels to print"
    )
    parser.add_argument(
        "--trace", type=Path, help="--profile: also write each mode's profiled step as a Chrome trace here"
    )
    parser.add_argument(
        "--score-steps",
        type=int,
        default=5,
        help="then time this many no-gradient scoring forwards of the batch (old log-probs; 0: none), after 2",
    )
    parser.add_argument(
        "--saved",
        type=int,
        default=0,
        help="eager modes: after the timed steps, list the N largest groups of tensors the forward keeps for "
        "backward (dtype and shape; parameters left out) and their total",
    )
    parser.add_argument(
        "--sync-sites",
        action="store_true",
        help="GPU: after the timed steps, one more step under torch's sync debug mode; list where it waits",
    )
    parser.add_argument(
        "--memory-peak",
        type=int,
        default=0,
        help="GPU: after the timed steps, one more step under the allocator's history; print what it starts "
        "with and the N largest groups (by allocating line) of what it holds at its peak",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (checks the script)")
    parser.add_argument(
        "--preset",
        choices=("qwen2.5-1.5b-shape", "qwen2.5-7b-shape"),
        default="qwen2.5-1.5b-shape",
        help="model shape (Qwen's vocabulary either way)",
    )
    parser.add_argument(
        "--layers", type=int, default=0, help="keep this many decoder layers (0: the preset's)"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="model.gradient_checkpointing (the recipe's configs turn it on; CUDA graphs are off with it)",
    )
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch", help="trainer backend")
    parser.add_argument(
        "--fsdp-param-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="torch backend: trainer.fsdp_param_dtype (auto and float32 = plain autocast over the FP32 "
        "masters on one GPU; bfloat16 = one-rank FSDP2 with BF16 forward copies)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="torch backend: trainer.param_dtype (auto = bfloat16 on one GPU: a BF16 model with FP32 masters in "
        "the trainer; float32 = FP32 parameters under BF16 autocast)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("off", "on", "both"),
        default="off",
        help="on a GPU: trainer.cuda_graphs off, on, or both (four modes in one process)",
    )
    parser.add_argument(
        "--fused-kernels",
        choices=("auto", "off", "both"),
        default="auto",
        help="torch backend: trainer.fused_kernels as the trainer's default (auto), off, or both (each mode twice)",
    )
    parser.add_argument(
        "--qkv-group",
        choices=("on", "off", "both"),
        default="on",
        help="torch backend, FP8 on a GPU: q|k|v as one FP8 linear (on: the trainer's default), three, or both",
    )
    parser.add_argument(
        "--pack-sequences",
        choices=("false", "true", "auto"),
        default="false",
        help="torch backend: trainer.pack_sequences (default false: padded rows, as every number in "
        "docs/performance.md's trainer-step tables; a 1 x 8,192 batch has no padding to save)",
    )
    args = parser.parse_args(argv)
    if args.fused_kernels == "both" and (args.tiny or args.backend != "torch"):
        parser.error("--fused-kernels both needs the torch backend on a GPU (not --tiny)")
    if args.cuda_graphs != "off" and args.tiny:
        parser.error("--cuda-graphs on/both needs a GPU (not --tiny)")
    if args.cuda_graphs != "off" and args.gradient_checkpointing:
        parser.error("--cuda-graphs on/both: the trainers run no layer graphs with gradient checkpointing")
    if args.tiny:
        args.batch, args.seq, args.warmup, args.steps = 2, 64, 1, 3
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench/train_step.py needs a CUDA GPU (Hopper for the FP8 fast path); use --tiny on CPU.")
        return 1
    else:
        device = torch.device("cuda")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    path = model_dir(args.tiny, args.preset, args.layers)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (float32; FP8 emulated)"
    print(
        f"# {name} | torch {torch.__version__} | {args.backend} backend | fsdp_param_dtype {args.fsdp_param_dtype} | param_dtype {args.param_dtype} | pack_sequences {args.pack_sequences} | {path.name}{' | gradient checkpointing' if args.gradient_checkpointing else ''} | {args.batch} x {args.seq} tokens | "
        f"median of {args.steps} steps after {args.warmup} | model ready in {time.perf_counter() - start:.0f} s"
    )
    graph_settings = {"off": (False,), "on": (True,), "both": (False, True)}[args.cuda_graphs]
    fused_choices: dict[str, tuple[bool | str, ...]] = {
        "auto": ("auto",),
        "off": (False,),
        "both": (False, True),
    }
    fused_settings = fused_choices[args.fused_kernels]
    group_settings = {"on": (True,), "off": (False,), "both": (True, False)}[args.qkv_group]
    results = {
        label: run_mode(path, precision == "fp8", graphs, args, device, fused, group, label)
        for fused in fused_settings
        for graphs in graph_settings
        for precision in ("bf16", "fp8")
        for group in (group_settings if precision == "fp8" else (True,))
        for label in (
            f"{precision}{'+graphs' if graphs else ''}{'+fused' if fused is True else ''}"
            f"{'' if group or precision == 'bf16' else '+ungrouped'}",
        )
    }

    def fastest(precision: str) -> dict[str, Any]:
        runs = [r for r in results.values() if r["fp8"] == (precision == "fp8")]
        return min(runs, key=lambda r: r["step_ms"]["median"])

    def lowest(key: str, precision: str, eager: bool = False) -> float:
        runs = [r for r in results.values() if r["fp8"] == (precision == "fp8")]
        if eager and any(not r["cuda_graphs"] for r in runs):
            runs = [r for r in runs if not r["cuda_graphs"]]
        return float(min(r[key] for r in runs))

    bf16, fp8 = fastest("bf16"), fastest("fp8")
    ratios = {
        "step_time": fp8["step_ms"]["median"] / bf16["step_ms"]["median"],
        "scoring_time": min(r["score_ms"]["median"] for r in results.values() if r["fp8"])
        / min(r["score_ms"]["median"] for r in results.values() if not r["fp8"])
        if args.score_steps
        else None,
        # Memory: the lowest of each precision. Allocated peaks only over eager runs where there are any (after
        # a capture, graph replays allocate nothing, so a graphed run's allocated peak under-counts); reserved
        # memory over all runs.
        "peak_memory": lowest("peak_memory_gb", "fp8", eager=True)
        / lowest("peak_memory_gb", "bf16", eager=True)
        if device.type == "cuda"
        else None,
        "peak_reserved": lowest("peak_reserved_gb", "fp8") / lowest("peak_reserved_gb", "bf16")
        if device.type == "cuda"
        else None,
    }
    print(
        f"\n{'mode':<18} | {'step ms':>8} {'min':>8} {'max':>8} | {'TFLOP/s':>7} | {'peak GiB':>8} {'reserved':>8} | "
        f"{'left GiB':>8} | {'loss first -> last':>18} | skipped | {'score ms':>8} {'min':>7} {'max':>7}"
    )
    for mode, r in results.items():
        s = r["step_ms"]
        print(
            f"{mode:<18} | {s['median']:8.1f} {s['min']:8.1f} {s['max']:8.1f} | {r['tflops']:7.1f} | "
            f"{r['peak_memory_gb'] or float('nan'):8.2f} {r['peak_reserved_gb'] or float('nan'):8.2f} | {r['leftover_before_build_gb']:8.2f} | "
            f"{r['loss_first_last'][0]:8.4f} -> {r['loss_first_last'][1]:7.4f} | {r['skipped_steps']:7d} | "
            + (
                f"{r['score_ms']['median']:8.1f} {r['score_ms']['min']:7.1f} {r['score_ms']['max']:7.1f}"
                if r["score_ms"]
                else "-"
            )
        )
    print(
        f"TFLOP/s counts {bf16['flops_per_step'] / 1e12:.1f} TFLOP per step: 6 * {bf16['matmul_params'] / 1e9:.3f}B "
        f"matmul weights * {args.batch * args.seq} tokens + 6 * batch * seq^2 * layers * hidden (causal attention)"
    )
    if len(results) > 2:
        print(
            "FP8 and BF16 below: the fastest run of each (graphs or not); memory: the lowest of each (allocated: eager runs)"
        )
    for key, ratio in ratios.items():
        goal = GOALS.get(key, GOALS_NONE.get(key))
        verdict = "n/a" if ratio is None else "met" if ratio <= goal else "MISSED"
        print(f"FP8/BF16 {key:<12} {ratio or float('nan'):5.3f}  (goal <= {goal}: {verdict})")
    for mode, r in results.items():
        if "saved" in r:
            print(
                f"\nsaved for backward, {mode}: {r['saved']['total_gib']:.2f} GiB (largest groups: count, GiB)"
            )
            for row in r["saved"]["top"]:
                print(f"  {row['gib']:7.3f} GiB {row['count']:5d}x  {row['tensor']}")
        if "profile" in r:
            print_kernels(f"profile of one {mode} step", r["profile"])
            busy = r["profile"]["total_ms"] / r["step_ms"]["median"]
            print(f"  device kernels / median step time: {busy:.2f} (below 1: the GPU waits for the host)")
            print("  top host ops by self CPU time (profiled step, ms, calls):")
            for name, ms, calls in r["profile"]["host_top"]:
                print(f"  {ms:9.3f} ms {calls:6d}x  {name[:90]}")
            print("  where the GPU idles: bench/trace_gaps.py on this step's --trace")
        if "memory_peak" in r:
            mp = r["memory_peak"]
            print(
                f"\nmemory, one more {mode} step: {mp['start_gib']:.2f} GiB allocated before it, at its peak "
                f"{mp['step_peak_gib']:.2f} GiB more (largest groups by allocating line: GiB, count)"
            )
            for row in mp["top"]:
                print(f"  {row['gib']:7.3f} GiB {row['count']:5d}x  {row['site']}")
        if "sync_sites" in r:
            waits = sum(n for n, _ in r["sync_sites"])
            print(f"\nhost waits for the device in one {mode} step: {waits} (count, where)")
            for n, site in r["sync_sites"]:
                print(f"  {n:5d}x  {site}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    if args.out:
        report = dict(
            device=name,
            torch=torch.__version__,
            backend=args.backend,
            fsdp_param_dtype=args.fsdp_param_dtype,
            param_dtype=args.param_dtype,
            batch=args.batch,
            seq=args.seq,
        )
        report["results"] = results
        report |= {"ratios_fp8_over_bf16": ratios, "goals_max": GOALS}
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
