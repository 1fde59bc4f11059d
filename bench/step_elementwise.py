"""The large elementwise additions and multiplications of one eager trainer step, with their operands' strides.

    python bench/step_elementwise.py [--seq 8192] [--modes bf16 fp8] [--min-numel 100000] [--tiny]
    python bench/step_elementwise.py --all-ops --launches   # every large op, and the project's quantizer launches

Why: a kernel profile names torch's unvectorized elementwise kernel (``elementwise_kernel<128, 4,
gpu_kernel_impl_nocast<...>>``) but not the op that launched it, and under CUDA graphs not even the module. This
runs one step of ``TorchTrainer`` (the 1.5B-shape random model of ``bench/train_step.py``, one micro-batch, CUDA
graphs off so every op runs eagerly, padded rows as there unless ``--pack-sequences true``) under a ``TorchDispatchMode`` and counts each ``add``/``mul`` call on
tensors of at least --min-numel elements by (op, shapes, strides, dtypes, contiguity, the innermost project or
transformers frames of its Python call site; autograd's own accumulations show none on a GPU, where backward
runs in autograd's device thread, and the frame that called backward on CPU). An operand that is not
contiguous, or two operands of different layouts, is what sends torch to the strided kernel. This is how session
55 found transformers' rotary embedding on the transposed q and k views (docs/performance.md, "The step on an
H200 at session 55's code"); ``trainer.fused_kernels`` now runs that as one kernel (trainers/torch/fused_rope.py).
``--all-ops``: every aten op that is not a view, with a large tensor among its outputs or operands (copies,
cats, fills, reductions as well), and with both modes the (op, shapes) rows FP8 runs more often than BF16: the
FP8-only work outside the quantizers. ``--launches``: the project's Triton quantizer launches (``quant_triton``'s
row and token tiles, weight blocks and FP8 transposes; the fused SwiGLU's and RMSNorm's quantizing kernels) by
shape and call site, each timed with CUDA events around its launch, queued behind a ~0.1 ms device sleep so
that the events time the kernels and not the host's Python between them (eager, so no overlap either). Not
always enough: in session 56 the o_proj input's row tiles (8,192 x 1,536) read 115 us per call here against 8.9
us in ``bench/quantizers.py`` and ~30 us on average for the kernel in a profile; trust the calls, shapes and
sites, and take kernel times from ``bench/train_step.py --profile``.
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


def call_site() -> tuple[str, ...]:
    """The two innermost project or transformers frames of the caller's stack."""
    return tuple(
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()[:-2]
        if ("infir2_rl" in f.filename or "transformers" in f.filename)
        and "step_elementwise" not in f.filename
    )[-2:]


class ElementwiseLog(TorchDispatchMode):
    """Counts add/mul calls on large tensors (with ``all_ops``: every op that is not a view, large by an operand
    or an output) by signature and call site."""

    def __init__(self, min_numel: int, all_ops: bool = False) -> None:
        super().__init__()
        self.min_numel, self.all_ops = min_numel, all_ops
        self.calls: Counter[tuple[Any, ...]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if self.all_ops and func.is_view:
            return out
        if self.all_ops or name in ("add", "add_", "mul", "mul_"):
            flat = [*args, *(kwargs or {}).values()]
            flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            outs = [
                o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)
            ]
            big = max((t.numel() for t in (tensors + outs if self.all_ops else tensors[:1])), default=0)
            if big >= self.min_numel:
                key = (
                    str(func),
                    tuple(tuple(t.shape) for t in tensors),
                    tuple(t.stride() for t in tensors),
                    tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                    tuple(t.is_contiguous() for t in tensors),
                    call_site(),
                )
                self.calls[key] += 1
        return out


SLEEP_CYCLES = 200_000  # ~0.1 ms at 2 GHz: longer than the host takes to enqueue one launcher's kernels


class LaunchLog:
    """Wraps the project's quantizer launchers for one step: calls by (launcher, shapes, call site) and the
    CUDA-event time of each (eager launches, one after another on the stream)."""

    TARGETS = (
        ("infir2_rl.fp8.quant_triton", "_launch_act"),
        ("infir2_rl.fp8.quant_triton", "transpose_fp8"),
        ("infir2_rl.fp8.quant_triton", "quantize_weight"),
        ("infir2_rl.fp8.quant_triton", "quantize_weight_blocks"),
        ("infir2_rl.trainers.torch.fused_layers", "_rows_quantized"),
        ("infir2_rl.trainers.torch.fused_layers", "_token_tiles"),
    )

    def __init__(self, timed: bool) -> None:
        self.timed = timed
        self.events: list[tuple[tuple[Any, ...], Any, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, label: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            shapes = tuple(
                (tuple(a.shape), str(a.dtype).removeprefix("torch."))
                for a in args
                if isinstance(a, torch.Tensor)
            )[:3]
            flags: tuple[Any, ...] = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, bool)))
            flags += tuple(a for a in args if isinstance(a, bool))
            key = (label, shapes, flags, call_site())
            if not self.timed:
                self.events.append((key, None, None))
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the host enqueues the launch, so the events time the kernels, not the
            # host's Python between them (an eager step leaves the GPU idle there).
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.append((key, start, end))
            return out

        return wrapped

    def __enter__(self) -> LaunchLog:
        import importlib

        for module_name, attr in self.TARGETS:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)
            self._saved.append((module, attr, fn))
            setattr(module, attr, self._wrap(f"{module_name.rsplit('.', 1)[1]}.{attr}", fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, fn in self._saved:
            setattr(module, attr, fn)

    def summary(self) -> list[tuple[tuple[Any, ...], int, float]]:
        """(key, calls, ms) rows, most time first (ms 0 without timing)."""
        totals: dict[tuple[Any, ...], list[float]] = {}
        for key, start, end in self.events:
            row = totals.setdefault(key, [0, 0.0])
            row[0] += 1
            row[1] += start.elapsed_time(end) if start is not None else 0.0
        return sorted(((k, int(n), ms) for k, (n, ms) in totals.items()), key=lambda r: (-r[2], -r[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--modes", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--min-numel", type=int, default=100_000)
    parser.add_argument(
        "--pack-sequences",
        choices=("false", "true"),
        default="false",
        help="trainer.pack_sequences (default false: padded rows and SDPA, as bench/train_step.py runs)",
    )
    parser.add_argument("--all-ops", action="store_true", help="every large op that is not a view")
    parser.add_argument("--launches", action="store_true", help="the project's quantizer launches, timed")
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
    logs: dict[str, Counter[tuple[Any, ...]]] = {}
    for mode in args.modes:
        trainer = TorchTrainer(
            ModelConfig(path=str(path)),
            TrainerConfig(cuda_graphs=False, pack_sequences=args.pack_sequences == "true"),
            optim,
            fp8=mode == "fp8", total_steps=3, device=device,
        )  # fmt: skip
        units = num_target_tokens(batch)
        trainer.train_step([batch], SftLossFn(), units)  # warm-up: compiles, allocator
        if device.type == "cuda":
            torch.cuda.synchronize()
        log = ElementwiseLog(args.min_numel, args.all_ops)
        with log:
            trainer.train_step([batch], SftLossFn(), units)
        if device.type == "cuda":
            torch.cuda.synchronize()
        logs[mode] = log.calls
        print(
            f"# {mode}, 1 x {args.seq} tokens, eager: calls | op | shapes | strides | dtypes | contiguous | site"
        )
        for (op, shapes, strides, dtypes, contiguous, site), n in log.calls.most_common():
            flag = "" if all(contiguous) else "  <- strided"
            print(
                f"{n:5d} | {op} | {shapes} | {strides} | {dtypes} | {contiguous} | {' < '.join(site)}{flag}"
            )
        if args.launches:
            launches = LaunchLog(timed=device.type == "cuda")
            with launches:
                trainer.train_step([batch], SftLossFn(), units)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows = launches.summary()
            print(f"\n# {mode}: quantizer launches of one step ({sum(r[2] for r in rows):.3f} ms in all):")
            print("#    ms | calls | launcher | tensors (shape, dtype) | flags | site")
            for (label, shapes, flags, site), n, ms in rows:
                print(f"{ms:7.3f} | {n:5d} | {label} | {shapes} | {flags} | {' < '.join(site)}")
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.all_ops and {"bf16", "fp8"} <= logs.keys():
        # Rows by (op, shapes, dtypes) without the site: FP8's count minus BF16's, where FP8 runs more.
        def by_signature(calls: Counter[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
            out: Counter[tuple[Any, ...]] = Counter()
            for (op, shapes, _strides, dtypes, _contiguous, _site), n in calls.items():
                out[(op, shapes, dtypes)] += n
            return out

        extra = by_signature(logs["fp8"]) - by_signature(logs["bf16"])
        print("\n# FP8 runs these more often than BF16 (calls more | op | shapes | dtypes):")
        for (op, shapes, dtypes), n in extra.most_common():
            print(f"{n:5d} | {op} | {shapes} | {dtypes}")


if __name__ == "__main__":
    main()
