"""The large elementwise additions and multiplications of one eager trainer step, with their operands' strides.

    python bench/step_elementwise.py [--seq 8192] [--modes bf16 fp8] [--min-numel 100000] [--tiny]

Why: a kernel profile names torch's unvectorized elementwise kernel (``elementwise_kernel<128, 4,
gpu_kernel_impl_nocast<...>>``) but not the op that launched it, and under CUDA graphs not even the module. This
runs one step of ``TorchTrainer`` (the 1.5B-shape random model of ``bench/train_step.py``, one micro-batch, CUDA
graphs off so every op runs eagerly) under a ``TorchDispatchMode`` and counts each ``add``/``mul`` call on
tensors of at least --min-numel elements by (op, shapes, strides, dtypes, contiguity, the innermost project or
transformers frames of its Python call site; autograd's own accumulations show none on a GPU, where backward
runs in autograd's device thread, and the frame that called backward on CPU). An operand that is not
contiguous, or two operands of different layouts, is what sends torch to the strided kernel. This is how session
55 found transformers' rotary embedding on the transposed q and k views (docs/performance.md, "The step on an
H200 at session 55's code"); ``trainer.fused_kernels`` now runs that as one kernel (trainers/torch/fused_rope.py).
``--tiny``: the tiny preset on CPU (FP8 emulated), to check the script.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_step import model_dir, sft_batch  # noqa: E402


class ElementwiseLog(TorchDispatchMode):
    """Counts add/mul calls on large tensors by signature and call site."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.calls: Counter[tuple[Any, ...]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in ("add", "add_", "mul", "mul_"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and tensors[0].numel() >= self.min_numel:
                site = tuple(
                    f"{Path(f.filename).name}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack()[:-1]
                    if "infir2_rl" in f.filename or "transformers" in f.filename
                )[-2:]
                key = (
                    str(func),
                    tuple(tuple(t.shape) for t in tensors),
                    tuple(t.stride() for t in tensors),
                    tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                    tuple(t.is_contiguous() for t in tensors),
                    site,
                )
                self.calls[key] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--modes", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--min-numel", type=int, default=100_000)
    parser.add_argument("--tiny", action="store_true", help="tiny preset on CPU (checks the script)")
    args = parser.parse_args()
    if args.tiny:
        args.seq, args.min_numel = 64, 1_000
    elif not torch.cuda.is_available():
        sys.exit("bench/step_elementwise.py: needs a CUDA GPU (--tiny runs on CPU)")
    from transformers import AutoConfig

    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    device, path = torch.device("cpu" if args.tiny else "cuda"), model_dir(args.tiny)
    batch = sft_batch(1, args.seq, AutoConfig.from_pretrained(path).vocab_size)
    optim = OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0)
    for mode in args.modes:
        trainer = TorchTrainer(
            ModelConfig(path=str(path)), TrainerConfig(cuda_graphs=False), optim,
            fp8=mode == "fp8", total_steps=3, device=device,
        )  # fmt: skip
        units = num_target_tokens(batch)
        trainer.train_step([batch], SftLossFn(), units)  # warm-up: compiles, allocator
        if device.type == "cuda":
            torch.cuda.synchronize()
        log = ElementwiseLog(args.min_numel)
        with log:
            trainer.train_step([batch], SftLossFn(), units)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(
            f"# {mode}, 1 x {args.seq} tokens, eager: calls | op | shapes | strides | dtypes | contiguous | site"
        )
        for (op, shapes, strides, dtypes, contiguous, site), n in log.calls.most_common():
            flag = "" if all(contiguous) else "  <- strided"
            print(
                f"{n:5d} | {op} | {shapes} | {strides} | {dtypes} | {contiguous} | {' < '.join(site)}{flag}"
            )
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
