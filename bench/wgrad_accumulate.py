"""A weight gradient added into an FP32 master gradient (``main_grad``): the GEMM's own beta = 1 against a GEMM and an add.

Per linear of the model (tokens x out features x in features), four ways, interleaved in rounds:

* FP8, old: ``gemm.mm_1x128_1x128`` to a new FP32 dW, then ``main_grad += dW`` (what the layer graphs did);
* FP8, new: ``cublaslt.add_mm_1x128_1x128``: cuBLASLt blockwise FP8 with C = D = main_grad, beta = 1;
* BF16, old: ``dY^T @ X`` in BF16, then ``main_grad += dW`` (autograd's dW, added by the layer graphs);
* BF16, new: ``torch.addmm(main_grad, dY^T, X, out_dtype=float32, out=main_grad)``.

Prints ms per call (median of the interleaved rounds), the whole model's sum per micro-batch, and whether the
FP8 ways give the same FP32 bits. Operands are pre-quantized (the quantizers are not what differs).

    python bench/wgrad_accumulate.py [--model 1.5b|7b] [--tokens 8192] [--reps 30]
"""

from __future__ import annotations

import argparse

import torch
from fp8_linear import MODELS as FP8_LINEAR_MODELS
from fp8_linear import layer_specs, time_interleaved

MODELS = {"1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B"}  # fp8_linear.MODELS' shapes; both have 28 layers
LAYERS = 28


def _linears(model: str) -> list[tuple[str, int, int, int]]:
    """(names, out features, in features, how many per layer) for each distinct linear shape of a layer."""
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, n, k, _ in layer_specs(*FP8_LINEAR_MODELS[MODELS[model]]):
        by_shape.setdefault((n, k), []).append(name.removesuffix("_proj"))
    return [("/".join(names), n, k, len(names)) for (n, k), names in by_shape.items()]


def _one_linear(t: int, n: int, k: int, reps: int) -> tuple[dict[str, float], str]:
    from infir2_rl.fp8 import cublaslt, gemm, quant_triton

    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dytq, dyts = quant_triton.quantize_cols(dy)
    xtq, xts = quant_triton.quantize_cols(x)
    main_grad = torch.randn(n, k, device="cuda", dtype=torch.float32)

    # Same bits? One call each on copies of one main_grad.
    old = main_grad.clone()
    old.add_(gemm.mm_1x128_1x128(dytq, dyts, xtq, xts, torch.float32))
    new = main_grad.clone()
    cublaslt.add_mm_1x128_1x128(new, dytq, dyts, xtq, xts)
    fp8 = "equal" if torch.equal(old, new) else f"max diff {(old - new).abs().max().item():.3g}"
    ref16 = main_grad.clone()
    ref16.add_(dy.t() @ x)
    new16 = main_grad.clone()
    torch.addmm(new16, dy.t(), x, out_dtype=torch.float32, out=new16)
    rel16 = ((new16 - ref16).norm() / (ref16 - main_grad).norm()).item()
    bits = f"{fp8} (bf16 new vs old: rel {rel16:.2e})"

    times = time_interleaved(
        {
            "fp8 old": lambda: main_grad.add_(gemm.mm_1x128_1x128(dytq, dyts, xtq, xts, torch.float32)),
            "fp8 new": lambda: cublaslt.add_mm_1x128_1x128(main_grad, dytq, dyts, xtq, xts),
            "bf16 old": lambda: main_grad.add_(dy.t() @ x),
            "bf16 new": lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad),
        },
        reps,
    )
    return times, bits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/wgrad_accumulate.py needs a CUDA GPU (cuBLASLt blockwise FP8)")
    torch.manual_seed(0)
    linears, n_layers = _linears(args.model), LAYERS
    totals = dict.fromkeys(("fp8 old", "fp8 new", "bf16 old", "bf16 new"), 0.0)
    print(f"{args.model}, {args.tokens} tokens, ms per call (median of interleaved rounds)")
    print(
        "linear          N x K     |  fp8 old  fp8 new     x | bf16 old bf16 new     x | bf16 new/fp8 new | bits"
    )
    for name, n, k, count in linears:
        times, bits = _one_linear(args.tokens, n, k, args.reps)
        for key, ms in times.items():
            totals[key] += ms * count * n_layers
        print(
            f"{name:8} {n:>5} x {k:<5} | {times['fp8 old']:8.4f} {times['fp8 new']:8.4f} "
            f"{times['fp8 old'] / times['fp8 new']:5.2f} | {times['bf16 old']:8.4f} {times['bf16 new']:8.4f} "
            f"{times['bf16 old'] / times['bf16 new']:5.2f} | {times['bf16 new'] / times['fp8 new']:16.2f} | {bits}"
        )
        torch.cuda.empty_cache()
    print(
        f"whole model ({n_layers} layers), ms per micro-batch: "
        + ", ".join(f"{k} {v:.2f}" for k, v in totals.items())
    )
    print(
        f"  FP8 saves {totals['fp8 old'] - totals['fp8 new']:.2f} ms, "
        f"BF16 saves {totals['bf16 old'] - totals['bf16 new']:.2f} ms"
    )


if __name__ == "__main__":
    main()
