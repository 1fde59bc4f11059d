"""BF16 vs blockwise-FP8 linear layers at Qwen2.5-1.5B / 7B shapes (M tokens, default 8192).

    python bench/fp8_linear.py [--m 8192] [--reps 30] [--sweep] [--profile]

All times come from CUDA events, median of --reps after warm-up, BF16 and FP8 measured in the same process;
the cases compared with each other run interleaved in rounds (``time_interleaved``), after a 2 s warm-up, so
that the GPU's clocks, which fall as it heats, weigh on every case alike.
* ``--sweep`` first times the quantizer launch alternatives (each checked bit for bit against the eager
  reference) and keeps the fastest for the rest of the run.
* Per shape: forward (grad enabled) and forward+backward (dX and dW via autograd.grad) of ``nn.Linear``
  in BF16 and of ``Fp8Linear`` with a BF16 master weight. "fp8 f+b" re-quantizes the weight every
  iteration (one micro-batch per optimizer step); "W cached" reuses it (gradient accumulation: the cost
  per micro-batch). Also: the three FP8 GEMMs alone on pre-quantized operands (the cuBLASLt ceiling of
  this recipe) and each quantizer alone (weight with its transpose, X rows+tokens, dY rows+tokens).
* Per decoder layer: the seven linears run as in the model (q, k, v read the same input, so do gate and
  up), forward then one backward through all of them: launch overheads overlap GPU work as in training.
  Also with q, k and v as one linear: FP8 as the trainer groups them on a GPU (``fp8/grouped.py``), and
  BF16 as one ``nn.Linear`` of N = q + k + v (what a BF16 trainer would fuse); "best" ratios divide the
  faster BF16 layer by the FP8 one.
* ``--profile``: after the tables, one forward+backward of each model's layer (BF16 with q|k|v as one
  linear; FP8 grouped, weights re-quantized) under torch.profiler: device time per kernel category and the
  top kernels, so that each FP8 GEMM (fprop, dgrad, wgrad by cuBLASLt's kernel name) and each quantizer
  can be set against the BF16 GEMMs it replaces.
* ``--as-trained``: only the decoder layer as the trainer holds it on a GPU (FP32 masters, kept FP8 weights,
  q|k|v grouped, every weight gradient added into its master's FP32 gradient by its GEMM: fp8/ops.py
  ``WGRAD_INTO``, ``MainGradLinear``), BF16 with three q, k, v linears and with one, forward + backward.
TFLOP/s counts 2MNK per GEMM (forward 1 GEMM, forward+backward 3).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

# hidden, intermediate, kv width (num_key_value_heads * head_dim)
MODELS = {"Qwen2.5-1.5B": (1536, 8960, 256), "Qwen2.5-7B": (3584, 18944, 512)}
# (name, N, K, input): a linear of a decoder layer and the name of the tensor it reads
Spec = tuple[str, int, int, str]


def layer_specs(hidden: int, inter: int, kv: int) -> list[Spec]:
    """(name, N, K, input) for the seven decoder linears; the input names which tensor each one reads."""
    return [
        ("q_proj", hidden, hidden, "x"),
        ("k_proj", kv, hidden, "x"),
        ("v_proj", kv, hidden, "x"),
        ("o_proj", hidden, hidden, "attn"),
        ("gate_proj", inter, hidden, "h"),
        ("up_proj", inter, hidden, "h"),
        ("down_proj", hidden, inter, "act"),
    ]


def cuda_time_ms(fn: Callable[[], object], reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_interleaved(cases: dict[str, Callable[[], object]], reps: int, rounds: int = 5) -> dict[str, float]:
    """Median ms per call of each case, timed in ``rounds`` rounds that take the cases in turn (A B C A B C ...),
    ``reps // rounds`` calls each, after a warm-up that runs every case for ~2 s: the GPU's clocks fall as it
    heats (docs/performance.md, "FP8 linear"), so timing one case after another would favour the first."""
    for fn in cases.values():
        cuda_time_ms(fn, 1, warmup=3)
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        for fn in cases.values():
            fn()
        torch.cuda.synchronize()
    per_round = max(1, reps // rounds)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(per_round)
            ]
            for begin, end in events:
                begin.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            samples[name] += [b.elapsed_time(e) for b, e in events]
    return {name: statistics.median(times) for name, times in samples.items()}


def _layers(specs: list[Spec], fp8: bool) -> list[torch.nn.Linear]:
    from infir2_rl.fp8.linear import Fp8Linear

    cls = Fp8Linear if fp8 else torch.nn.Linear
    torch.manual_seed(0)
    return [cls(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _, n, k, _ in specs]


def _runner(
    layers: list[torch.nn.Linear], inputs: list[torch.Tensor], dys: list[torch.Tensor] | None, fresh_w: bool
):
    from infir2_rl.fp8.linear import Fp8Linear

    leaves = list(dict.fromkeys(inputs)) + [layer.weight for layer in layers]

    def run() -> object:
        if fresh_w:  # as after an optimizer step: the weight quantization is part of the timed work
            for layer in layers:
                if isinstance(layer, Fp8Linear):
                    layer.invalidate_fp8_cache()
        outs = [layer(x) for layer, x in zip(layers, inputs)]
        return outs if dys is None else torch.autograd.grad(outs, leaves, dys)

    return run


def _layer_data(specs: list[Spec], m: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Inputs by source name (shared by the linears that read them) and one output gradient per linear."""
    bf16 = torch.bfloat16
    srcs = {src: torch.randn(m, k, device="cuda", dtype=bf16, requires_grad=True) for _, _, k, src in specs}
    return srcs, [torch.randn(m, n, device="cuda", dtype=bf16) for _, n, _, _ in specs]


def _qkv_as_one(
    specs: list[Spec], srcs: dict[str, torch.Tensor], dys: list[torch.Tensor], fp8: list[torch.nn.Linear]
) -> tuple[list[torch.nn.Linear], list[torch.Tensor], list[torch.Tensor]]:
    """Group the FP8 q, k, v linears (fp8/grouped.py, as the trainer does on a GPU) and build the BF16 layer
    with q|k|v as one nn.Linear: its (layers, inputs, output gradients)."""
    from infir2_rl.fp8.grouped import ProjectionGroup

    group = ProjectionGroup(fp8[:3])  # type: ignore[arg-type]
    for layer in fp8[:3]:
        layer._group = group  # type: ignore[assignment]
    fused_specs = _qkv_specs(specs)
    return _layers(fused_specs, False), [srcs[s] for *_, s in fused_specs], _qkv_grads(dys)


def _qkv_specs(specs: list[Spec]) -> list[Spec]:
    """The layer's specs with q, k and v as one linear of N = q + k + v."""
    (_, q, k, src), (_, kv, _, _) = specs[0], specs[1]
    return [("qkv_proj", q + 2 * kv, k, src), *specs[3:]]


def _qkv_grads(dys: list[torch.Tensor]) -> list[torch.Tensor]:
    """The output gradients for ``_qkv_specs``: q's, k's and v's side by side."""
    return [torch.cat(dys[:3], dim=-1), *dys[3:]]


def time_linears(specs: list[Spec], m: int, reps: int) -> dict[str, float]:
    """Forward and forward+backward of the given linears, BF16 vs FP8; inputs shared as named."""
    srcs, dys = _layer_data(specs, m)
    inputs = [srcs[src] for *_, src in specs]
    plain, fp8 = _layers(specs, False), _layers(specs, True)
    out = time_interleaved(
        {
            "bf16_fwd": _runner(plain, inputs, None, False),
            "fp8_fwd": _runner(fp8, inputs, None, True),
            "bf16_fb": _runner(plain, inputs, dys, False),
            "fp8_fb": _runner(fp8, inputs, dys, True),
            "fp8_fb_cached": _runner(fp8, inputs, dys, False),
        },
        reps,
    )
    names = [name for name, *_ in specs]
    if names[:3] != ["q_proj", "k_proj", "v_proj"]:
        return out
    fused_bf16, fused_inputs, fused_dys = _qkv_as_one(specs, srcs, dys, fp8)
    # BF16 with three q, k, v linears again, in the same rounds, so that "best" compares like with like.
    out |= time_interleaved(
        {
            "bf16_unfused_fwd": _runner(plain, inputs, None, False),
            "bf16_fused_fwd": _runner(fused_bf16, fused_inputs, None, False),
            "fp8_grouped_fwd": _runner(fp8, inputs, None, True),
            "bf16_unfused_fb": _runner(plain, inputs, dys, False),
            "bf16_fused_fb": _runner(fused_bf16, fused_inputs, fused_dys, False),
            "fp8_grouped_fb": _runner(fp8, inputs, dys, True),
        },
        reps,
    )
    return out


def _trained_layer(specs: list[Spec], fp8: bool, qkv_as_one: bool) -> tuple[torch.nn.ModuleList, list[str]]:
    """The layer's linears as the trainer holds them on a GPU: FP32 masters (``MasterWeights``: BF16
    ``MainGradLinear`` modules, or ``Fp8Linear`` with kept FP8 weights), each weight gradient added into its
    master's FP32 gradient by its GEMM; q|k|v grouped (FP8) or one nn.Linear (BF16) when ``qkv_as_one``.
    Returns the modules (in a ModuleList) and the input name each reads."""
    from infir2_rl.fp8.grouped import group_projections
    from infir2_rl.fp8.linear import Fp8Linear
    from infir2_rl.trainers.torch.master_weights import MasterWeights

    if qkv_as_one and not fp8:
        specs = _qkv_specs(specs)
    cls = Fp8Linear if fp8 else torch.nn.Linear
    torch.manual_seed(0)
    attn = torch.nn.Module()  # the parent that group_projections looks for q_proj, k_proj, v_proj in
    layers = []
    for name, n, k, _ in specs:
        layer = cls(k, n, bias=False, device="cuda")
        setattr(attn, name, layer)
        layers.append(layer)
    if fp8 and qkv_as_one:
        assert group_projections(attn) == 1
    out = torch.nn.ModuleList(layers)
    out.masters = MasterWeights(torch.nn.ModuleList([attn]))  # type: ignore[assignment]  # kept alive with out
    return out, [src for *_, src in specs]


def _backward_as_trained(
    layers: torch.nn.ModuleList, inputs: list[torch.Tensor], dys: list[torch.Tensor]
) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
    torch.autograd.backward(outs, dys)


def time_as_trained(specs: list[Spec], m: int, reps: int) -> dict[str, float]:
    """Forward + backward of the layer as the trainer runs it (``_trained_layer``, BF16 autocast, the
    gradients into the masters' and the inputs'), BF16 (three q, k, v linears or one) against FP8 grouped."""
    srcs, dys = _layer_data(specs, m)
    fused_dys = _qkv_grads(dys)
    cases: dict[str, Callable[[], object]] = {}
    for key, fp8, as_one in (("bf16_3", False, False), ("bf16_1", False, True), ("fp8", True, True)):
        layers, names = _trained_layer(specs, fp8, as_one)
        inputs = [srcs[name] for name in names]
        cases[key] = functools.partial(
            _backward_as_trained, layers, inputs, fused_dys if as_one and not fp8 else dys
        )
    return time_interleaved(cases, reps)


def profile_layer(specs: list[Spec], m: int, top: int) -> None:
    """Kernel-time profile of one forward+backward of the layer, BF16 (q|k|v fused) and FP8 (grouped)."""
    from torch.profiler import ProfilerActivity, profile
    from train_step import kernel_times, print_kernels, summarize_kernels

    srcs, dys = _layer_data(specs, m)
    fp8 = _layers(specs, True)
    fused_bf16, fused_inputs, fused_dys = _qkv_as_one(specs, srcs, dys, fp8)
    runs = {
        "BF16, q|k|v as one linear": _runner(fused_bf16, fused_inputs, fused_dys, False),
        "FP8, q|k|v grouped, weights re-quantized": _runner(fp8, [srcs[s] for *_, s in specs], dys, True),
    }
    for title, run in runs.items():
        cuda_time_ms(run, 3)  # warm: Triton compiles, cuBLASLt heuristics, allocator
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print_kernels(
            f"one forward+backward of the layer's linears, {title}",
            summarize_kernels(kernel_times(prof), top),
        )


def _gemm_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """BF16 x (M, K), dy (M, N), w (N, K) and their FP8 operands as ops.py hands them to the three GEMMs:
    (x, dy, w, wq, ws, wqt, wst, xq, xs, xtq, xts, dq, ds, dtq, dts)."""
    from infir2_rl.fp8 import quant_triton

    bf16 = torch.bfloat16
    x, dy = torch.randn(m, k, device="cuda", dtype=bf16), torch.randn(m, n, device="cuda", dtype=bf16)
    w = torch.randn(n, k, device="cuda", dtype=bf16) * 0.02
    wq, ws, wqt = quant_triton.quantize_weight_with_transpose(w)
    return (
        x, dy, w, wq, ws, wqt, ws.t().contiguous(),
        *quant_triton.quantize_rows_and_cols(x), *quant_triton.quantize_rows_and_cols(dy),
    )  # fmt: skip


def time_gemms(m: int, n: int, k: int, reps: int) -> dict[str, float]:
    """Each of the three GEMMs alone, BF16 (torch.mm) and FP8 on pre-quantized operands, ms; also wgrad
    computed transposed (dW^T = X^T dY, the same product with cuBLASLt's operands swapped)."""
    from infir2_rl.fp8 import gemm

    bf16 = torch.bfloat16
    x, dy, w, wq, ws, wqt, wst, xq, xs, xtq, xts, dq, ds, dtq, dts = _gemm_operands(m, n, k)
    return time_interleaved(
        {
            "bf16 fprop": lambda: x @ w.t(),
            "bf16 dgrad": lambda: dy @ w,
            "bf16 wgrad": lambda: dy.t() @ x,
            "fp8 fprop": lambda: gemm.mm_1x128_128x128(xq, xs, wq, ws, bf16),
            "fp8 dgrad": lambda: gemm.mm_1x128_128x128(dq, ds, wqt, wst, bf16),
            "fp8 wgrad": lambda: gemm.mm_1x128_1x128(dtq, dts, xtq, xts, bf16),
            "fp8 wgrad^T": lambda: gemm.mm_1x128_1x128(xtq, xts, dtq, dts, bf16),
        },
        reps,
    )


def time_parts(m: int, n: int, k: int, reps: int) -> dict[str, float]:
    """The FP8 GEMMs on pre-quantized operands, and each quantizer alone."""
    from infir2_rl.fp8 import gemm, quant_triton

    bf16 = torch.bfloat16
    x, dy, w, wq, ws, wqt, wst, xq, xs, xtq, xts, dq, ds, dtq, dts = _gemm_operands(m, n, k)
    return {
        "gemm": cuda_time_ms(lambda: gemm.mm_1x128_128x128(xq, xs, wq, ws, bf16), reps)
        + cuda_time_ms(lambda: gemm.mm_1x128_128x128(dq, ds, wqt, wst, bf16), reps)
        + cuda_time_ms(lambda: gemm.mm_1x128_1x128(dtq, dts, xtq, xts, bf16), reps),
        "q_w": cuda_time_ms(lambda: quant_triton.quantize_weight_with_transpose(w), reps),
        "q_x": cuda_time_ms(lambda: quant_triton.quantize_rows_and_cols(x), reps),
        "q_dy": cuda_time_ms(lambda: quant_triton.quantize_rows_and_cols(dy), reps),
    }


def sweep(m: int, reps: int) -> None:
    """Time each quantizer launch alternative at M x 3584 and M x 18944; keep the fastest correct one."""
    from infir2_rl.fp8 import quant_triton as qt
    from infir2_rl.fp8.quant import quantize_activation_eager, quantize_weight_blockwise_eager

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in (3584, 18944)]
    refs = [quantize_activation_eager(x) for x in xs]
    trefs = [quantize_activation_eager(x.t().contiguous()) for x in xs]
    wrefs = [quantize_weight_blockwise_eager(x) for x in xs]

    def check(kind: str, i: int) -> bool:
        x, (q, s), (qt_, st_), (wq, ws) = xs[i], refs[i], trefs[i], wrefs[i]
        if kind == "rows":
            q2, s2 = qt.quantize_rows(x)
            return same(q2, q) and torch.equal(s2.t(), s)
        if kind == "cols":
            qt2, st2 = qt.quantize_cols(x)
            return same(qt2, qt_) and torch.equal(st2.t(), st_)
        if kind == "weight":
            wq2, ws2, wqt2 = qt.quantize_weight_with_transpose(x)
            return same(wq2, wq) and torch.equal(ws2, ws) and same(wqt2, wq.t().contiguous())
        return True

    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "rows": qt.quantize_rows,
        "cols": qt.quantize_cols,
        "weight": qt.quantize_weight_with_transpose,
    }
    print(f"# sweep: quantizer launch alternatives, ms at K=3584 / K=18944 (M={m}); * = kept")
    for kind in ("rows", "cols", "weight"):
        results = []
        for cand in qt.LAUNCH_CANDIDATES[kind]:
            qt.LAUNCH[kind] = dict(cand)
            try:
                if not all(check(kind, i) for i in range(len(xs))):
                    print(f"  {kind:<6} {cand}: WRONG RESULT, excluded")
                    continue
                op = ops[kind]
                times = [cuda_time_ms(functools.partial(op, x), reps) for x in xs]
            except Exception as exc:  # a variant that does not compile is reported and skipped
                print(f"  {kind:<6} {cand}: failed ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            results.append((sum(times), cand, times))
        best = min(results, key=lambda r: r[0])
        qt.LAUNCH[kind] = dict(best[1])
        for _total, cand, times in results:
            mark = "*" if cand == best[1] else " "
            print(f" {mark}{kind:<6} {str(cand):<48} {times[0]:7.3f} {times[1]:7.3f}")
    print(f"# launch config used below: {qt.LAUNCH}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192, help="tokens per GEMM")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per case (median reported)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", action="store_true", help="first pick the fastest quantizer launch shapes")
    parser.add_argument("--profile", action="store_true", help="also profile one layer forward+backward")
    parser.add_argument("--profile-top", type=int, default=25, help="--profile: top kernels to print")
    parser.add_argument(
        "--as-trained",
        action="store_true",
        help="only the layers as the trainer runs them: FP32 masters, weight gradients added into them",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_linear.py needs a CUDA GPU (Hopper, sm90, for the FP8 fast path); none found.")
        return 1
    from infir2_rl.fp8 import gemm

    if not gemm.fast_path_ok(torch.empty(1, device="cuda"), 128, 128):
        print(
            "FP8 fast path unavailable on this GPU (see the warning above); timings would show emulation only."
        )
        return 1
    m = args.m
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | M={m} | ms, median of {args.reps}")
    if args.sweep:
        sweep(m, args.reps)
    if args.as_trained:
        print("# one decoder layer's linears as trained: FP32 masters (BF16 copies / kept FP8 weights), BF16")
        print(
            "# autocast, each dW added into its master's FP32 gradient by its GEMM; best = faster BF16 / FP8"
        )
        print(f"{'model':<13} | {'bf16 3 q,k,v':>12} {'bf16 q|k|v':>10} {'fp8 grouped':>11} | {'best x':>6}")
        for model in args.models:
            t = time_as_trained(layer_specs(*MODELS[model]), m, args.reps)
            best = min(t["bf16_3"], t["bf16_1"])
            print(
                f"{model:<13} | {t['bf16_3']:12.3f} {t['bf16_1']:10.3f} {t['fp8']:11.3f} | {best / t['fp8']:6.2f}"
            )
        return 0
    print(
        f"{'model':<13} {'layer':<9} {'N':>6} {'K':>6} | {'bf16 fwd':>8} {'fp8 fwd':>8} {'x':>5} | "
        f"{'bf16 f+b':>8} {'fp8 f+b':>8} {'x':>5} | {'W cached':>8} {'x':>5} | {'TF/s bf16':>9} {'fp8':>5} | "
        f"{'gemm f+b':>8} {'x':>5} | {'q W+WT':>6} {'q X':>6} {'q dY':>6}"
    )
    layer_rows = []
    for model in args.models:
        specs = layer_specs(*MODELS[model])
        for name, n, k, _ in specs:
            if name in ("v_proj", "o_proj", "up_proj"):
                continue  # same shapes as k_proj, q_proj, gate_proj
            r = time_linears([(name, n, k, "x")], m, args.reps) | time_parts(m, n, k, args.reps)
            flops = 6 * m * n * k
            print(
                f"{model:<13} {name:<9} {n:>6} {k:>6} | {r['bf16_fwd']:8.3f} {r['fp8_fwd']:8.3f} "
                f"{r['bf16_fwd'] / r['fp8_fwd']:5.2f} | {r['bf16_fb']:8.3f} {r['fp8_fb']:8.3f} "
                f"{r['bf16_fb'] / r['fp8_fb']:5.2f} | {r['fp8_fb_cached']:8.3f} {r['bf16_fb'] / r['fp8_fb_cached']:5.2f} | "
                f"{flops / r['bf16_fb'] / 1e9:9.0f} {flops / r['fp8_fb'] / 1e9:5.0f} | "
                f"{r['gemm']:8.3f} {r['bf16_fb'] / r['gemm']:5.2f} | {r['q_w']:6.3f} {r['q_x']:6.3f} {r['q_dy']:6.3f}"
            )
        layer_rows.append((model, time_linears(specs, m, args.reps)))
    print("\n# one decoder layer's seven linears, run as in the model (ms; x = BF16 time / FP8 time)")
    print(
        f"{'model':<13} | {'bf16 fwd':>8} {'fp8 fwd':>8} {'x':>5} | {'bf16 f+b':>8} {'fp8 f+b':>8} {'x':>5} | "
        f"{'W cached':>8} {'x':>5}"
    )
    for model, t in layer_rows:
        print(
            f"{model:<13} | {t['bf16_fwd']:8.3f} {t['fp8_fwd']:8.3f} {t['bf16_fwd'] / t['fp8_fwd']:5.2f} | "
            f"{t['bf16_fb']:8.3f} {t['fp8_fb']:8.3f} {t['bf16_fb'] / t['fp8_fb']:5.2f} | "
            f"{t['fp8_fb_cached']:8.3f} {t['bf16_fb'] / t['fp8_fb_cached']:5.2f}"
        )
    print(
        "\n# the same with q, k and v as one linear (BF16: one nn.Linear; FP8: fp8/grouped.py), in rounds with"
    )
    print("# BF16's three q, k, v linears; best = the faster BF16 layer / FP8 grouped")
    print(
        f"{'model':<13} | {'bf16 3 / 1 q|k|v fwd':>20} {'fp8 fwd':>8} {'best x':>6} | "
        f"{'bf16 3 / 1 q|k|v f+b':>20} {'fp8 f+b':>8} {'best x':>6}"
    )
    for model, t in layer_rows:
        best_fwd = min(t["bf16_unfused_fwd"], t["bf16_fused_fwd"])
        best_fb = min(t["bf16_unfused_fb"], t["bf16_fused_fb"])
        print(
            f"{model:<13} | {t['bf16_unfused_fwd']:9.3f} / {t['bf16_fused_fwd']:8.3f} {t['fp8_grouped_fwd']:8.3f} "
            f"{best_fwd / t['fp8_grouped_fwd']:6.2f} | {t['bf16_unfused_fb']:9.3f} / {t['bf16_fused_fb']:8.3f} "
            f"{t['fp8_grouped_fb']:8.3f} {best_fb / t['fp8_grouped_fb']:6.2f}"
        )
    if args.profile:
        print("\n# each GEMM alone, ms (x = BF16 / FP8); wgrad^T: dW^T = X^T dY, operands swapped")
        for model in args.models:
            for name, n, k, _ in layer_specs(*MODELS[model]):
                if name in ("v_proj", "o_proj", "up_proj"):
                    continue
                g = time_gemms(m, n, k, args.reps)
                cells = " | ".join(
                    f"{op} {g['bf16 ' + op]:.3f} / {g['fp8 ' + op]:.3f} = {g['bf16 ' + op] / g['fp8 ' + op]:.2f}"
                    for op in ("fprop", "dgrad", "wgrad")
                )
                print(f"{model:<13} {name:<9} {n:>6} {k:>6} | {cells} | wgrad^T {g['fp8 wgrad^T']:.3f}")
        for model in args.models:
            print(f"\n## {model}")
            profile_layer(layer_specs(*MODELS[model]), m, args.profile_top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
