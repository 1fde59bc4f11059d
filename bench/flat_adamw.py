"""The flat AdamW's step over one decoder layer's masters (trainers/flat_adamw.py), FP8 linears included, on a GPU.

The step (the AdamW kernel, then the FP8 linears' masters quantized into their kept FP8 weights by one
``quant_triton.quantize_weight_blocks`` launch) beside its parts and beside what the quantization replaced:
``quantize_weight`` once per weight, which every micro-batch's forward ran before the FP8 weights were kept.
Cases interleaved in rounds; median ms per layer (min-max over rounds) and GB/s against the bytes each moves.

    python bench/flat_adamw.py [--model 1.5b|7b] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from fp8_linear import cuda_time_ms
from torch import nn

SHAPES = {  # hidden, kv rows, intermediate
    "1.5b": (1536, 256, 8960),
    "7b": (3584, 512, 18944),
}


def _layer(hidden: int, kv: int, inter: int) -> nn.Module:
    from infir2_rl.fp8.linear import Fp8Linear

    layer = nn.Module()
    layer.input_layernorm = nn.LayerNorm(hidden)
    for name, (n, k, bias) in {
        "q_proj": (hidden, hidden, True),
        "k_proj": (kv, hidden, True),
        "v_proj": (kv, hidden, True),
        "o_proj": (hidden, hidden, False),
        "gate_proj": (inter, hidden, False),
        "up_proj": (inter, hidden, False),
        "down_proj": (hidden, inter, False),
    }.items():
        setattr(layer, name, Fp8Linear(k, n, bias=bias))
    return layer.cuda()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/flat_adamw.py needs a CUDA GPU (the kernels are Triton)")
    from infir2_rl.config import OptimizerConfig
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.fp8.linear import Fp8Linear
    from infir2_rl.trainers import flat_adamw
    from infir2_rl.trainers.optim import build_optimizer
    from infir2_rl.trainers.torch.master_weights import MasterWeights

    torch.manual_seed(0)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    layer = _layer(*SHAPES[args.model])
    masters = MasterWeights(layer)
    opt = build_optimizer(masters.optimizer_params, cfg, masters)  # type: ignore[arg-type]
    assert isinstance(opt, flat_adamw.FlatAdamW) and opt.keeps_fp8
    seg = masters.segments[0]
    seg.ensure_grads().normal_()
    linears = [m for m in layer.modules() if isinstance(m, Fp8Linear)]
    n = seg.flat.numel()
    n_fp8 = sum(m.weight.numel() for m in linears)
    no_fp8 = type(seg)(
        flat=seg.flat, copy=seg.copy, slots=seg.slots, grads=seg.grads
    )  # the same, no Fp8Region
    plain = flat_adamw.FlatAdamW(
        masters.optimizer_params, [no_fp8], lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1
    )

    def per_weight() -> None:  # what each micro-batch's forward did before the FP8 weights were kept
        for m in linears:
            quant_triton.quantize_weight(m.weight.detach(), m.pow2_scales)

    fp8 = seg.fp8
    assert fp8 is not None

    def blocks() -> None:  # what the flat AdamW now does once per step, after the update
        quant_triton.quantize_weight_blocks(
            seg.flat, fp8.codes, fp8.scales, fp8.blocks, fp8.start, fp8.pow2, fp8.aligned
        )

    cases: dict[str, tuple[Callable[[], object], float]] = {
        # bytes: AdamW 28 per parameter (+2 for a BF16 copy); quantizing an FP32 weight 5
        "AdamW alone": (plain.step, 28.0 * n + 2.0 * (n - n_fp8)),
        "quantize_weight, one launch per weight": (per_weight, 5.0 * n_fp8),
        "quantize_weight_blocks, one launch": (blocks, 5.0 * n_fp8),
        "FlatAdamW.step (AdamW + blocks)": (opt.step, 33.0 * n_fp8 + 30.0 * (n - n_fp8)),
    }
    for fn, _ in cases.values():  # compile and warm up
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(5):  # rounds: each case in turn, so that clock drift hits all alike
        for name, (fn, _) in cases.items():
            results[name].append(cuda_time_ms(fn, args.reps, warmup=0))
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; one {args.model} decoder layer, "
        f"{n / 1e6:.2f}M parameters ({n_fp8 / 1e6:.2f}M in FP8 linears); median of 5 rounds x {args.reps}"
    )
    for name, (_, nbytes) in cases.items():
        ms = statistics.median(results[name])
        spread = f"{min(results[name]):.3f}-{max(results[name]):.3f}"
        print(f"{name:<40} {ms:8.3f} ms ({spread})  {nbytes / ms / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
