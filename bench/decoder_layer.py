"""One whole decoder layer as the torch trainer builds it, BF16 vs blockwise FP8, forward + backward.

    python bench/decoder_layer.py [--models Qwen2.5-7B Qwen2.5-1.5B] [--shapes 1x8192 4x2048] [--reps 30]
                                  [--profile]

``bench/fp8_linear.py --as-trained`` times a layer's seven linears, each quantizing its own input. The
trainer's FP8 linears do not: on a GPU its fused RMSNorm and SwiGLU kernels write the quantized rows the
linears read (forward) and SwiGLU's backward those of dgate and dup (``trainers/torch/fused_layers.py``). What
a decoder layer costs in each precision therefore depends on its producers too, and this script times the
layer itself: ``TorchTrainer`` (the GPU defaults: a BF16 model with FP32 masters, fused kernels, q|k|v as one
FP8 linear, kept FP8 weights, every weight gradient added into its master's FP32 gradient) loads a one-layer
model of the shape (the tokenizer's small vocabulary: the embedding and lm_head are not timed), and
``model.model.layers[0]`` runs forward under BF16 autocast and backward for a random output gradient, eagerly
(the trainer's CUDA graphs replay the same kernels; at 7B the layer is GPU-bound). Two attentions:

* ``sdpa``: causal SDPA (flash) over each row of the shape, as a padded micro-batch runs it;
* ``none``: the attention replaced by the identity on the rotated queries (k and v are computed and get zero
  gradients): the linears with their producers, norms, rotary and residual adds, without attention's time,
  which FP8 does not change (the recipe keeps attention in BF16).

Both precisions run interleaved in one process (``fp8_linear.time_interleaved``); x = BF16 ms / FP8 ms.
``--profile`` adds one profiled forward+backward per case: device time by kernel category.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRESETS = {"Qwen2.5-1.5B": "qwen2.5-1.5b-shape", "Qwen2.5-7B": "qwen2.5-7b-shape"}
ATTENTIONS = ("sdpa", "none")


def _identity_attention(module: Any, query: torch.Tensor, key: Any, value: Any, mask: Any, **_: Any) -> Any:
    """An attention function (transformers' interface) that returns the queries: (B, S, heads, dim), no weights."""
    return query.transpose(1, 2), None


def one_layer_dir(preset: str) -> Path:
    """A random one-layer model of ``preset``'s shape with the project's small tokenizer, written once."""
    from transformers import Qwen2ForCausalLM

    from infir2_rl.models.factory import preset_config
    from infir2_rl.models.tokenizer import build_tokenizer

    path = Path(tempfile.gettempdir()) / "infir2_bench" / f"{preset}-1layer"
    if (path / "config.json").is_file():
        return path
    tokenizer = build_tokenizer()
    config = preset_config(preset, tokenizer, num_hidden_layers=1)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(previous)
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    partial.rename(path)
    del model
    torch.cuda.empty_cache()
    return path


def build(path: Path, fp8: bool) -> Any:
    """The trainer's model (GPU defaults, no CUDA graphs: the layer is called directly)."""
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    return TorchTrainer(
        ModelConfig(path=str(path)),
        TrainerConfig(cuda_graphs=False, pack_sequences=False),
        OptimizerConfig(),
        fp8=fp8,
        total_steps=1,
    )


def layer_step(model: Any, hidden: torch.Tensor, dy: torch.Tensor, attention: str) -> None:
    """Forward of decoder layer 0 on ``hidden`` (B, S, E) under BF16 autocast, then backward of ``dy``."""
    layer = model.model.layers[0]
    config = layer.self_attn.config
    saved, config._attn_implementation = config._attn_implementation, attention
    try:
        b, s, _ = hidden.shape
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cos, sin = model.model.rotary_emb(hidden, positions)
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        torch.autograd.backward(out, dy)
    finally:
        config._attn_implementation = saved


def graphed(fn: Any) -> Any:
    """fn captured once in a CUDA graph (after three warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph.replay


def profile_kernels(fn: Any, top: int) -> dict[str, Any]:
    """Device ms by category (train_step.py's categories) and the top kernels of one call of fn."""
    from torch.profiler import ProfilerActivity, profile
    from train_step import kernel_times, summarize_kernels

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return summarize_kernels(kernel_times(prof), top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["Qwen2.5-7B"], choices=list(PRESETS))
    parser.add_argument(
        "--shapes", nargs="+", default=["1x8192"], help="rows x tokens per row of the micro-batch"
    )
    parser.add_argument("--attention", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    parser.add_argument("--reps", type=int, default=30, help="timed calls per case (median reported)")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="replay each case from a CUDA graph (as the trainer does on a GPU)",
    )
    parser.add_argument("--profile", action="store_true", help="also profile one call per case")
    parser.add_argument("--top", type=int, default=0, help="--profile: also list the top N kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decoder_layer.py: needs a CUDA GPU (the trainer's fused and FP8 kernels)")
        return 2
    shapes = []
    for text in args.shapes:
        rows, _, tokens = text.partition("x")
        if not (rows.isdigit() and tokens.isdigit()):
            parser.error(f"--shapes {text!r}: expected ROWSxTOKENS, such as 1x8192")
        shapes.append((int(rows), int(tokens)))
    from fp8_linear import time_interleaved
    from transformers import AttentionInterface
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    AttentionInterface.register("none", _identity_attention)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | ms per forward+backward, median")
    print(f"{'model':<13} {'shape':>8} {'attention':>9} | {'bf16':>8} {'fp8':>8} | {'x':>5}")
    for name in args.models:
        path = one_layer_dir(PRESETS[name])
        trainers = {"bf16": build(path, False), "fp8": build(path, True)}
        hidden_size = trainers["bf16"].model.config.hidden_size
        for rows, tokens in shapes:
            gen = torch.Generator(device="cuda").manual_seed(0)
            hidden = torch.randn(
                rows, tokens, hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16
            )
            hidden.requires_grad_(True)
            dy = torch.randn(hidden.shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 1e-3
            for attention in args.attention:
                cases: dict[str, Callable[[], object]] = {
                    mode: functools.partial(layer_step, t.model, hidden, dy, attention)
                    for mode, t in trainers.items()
                }
                if args.graphs:
                    cases = {mode: graphed(fn) for mode, fn in cases.items()}
                ms = time_interleaved(cases, args.reps)
                print(
                    f"{name:<13} {rows:>3}x{tokens:<4} {attention:>9}{' graphed' if args.graphs else ''} |"
                    f" {ms['bf16']:8.3f} {ms['fp8']:8.3f} |"
                    f" {ms['bf16'] / ms['fp8']:5.2f}",
                    flush=True,
                )
                if args.profile:
                    for mode, fn in cases.items():
                        summary = profile_kernels(fn, args.top)
                        cats = {"total": summary["total_ms"], **summary["categories_ms"]}
                        print(
                            f"  profile {mode}: "
                            + ", ".join(f"{k} {v:.2f}" for k, v in cats.items() if v or k == "total")
                        )
                        for row in summary["top"]:
                            print(f"    {row['ms']:7.3f} ms {row['calls']:4d}x {row['kernel'][:100]}")
            hidden.grad = None
        del trainers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
