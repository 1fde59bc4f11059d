"""Host time of the trainer's weight-sync export walk: FP8 export against the BF16 one, same trainer, one process.

    python bench/export_walk.py [--layers 28] [--reps 30] [--device cpu|cuda]

What a weight sync does first on the trainer: ``TorchTrainer.export_weights(fp8)`` lists the tensors to send
(FP8: each decoder linear's kept FP8 weight and scale grid, ``fp8_state_from_model``; BF16: ``state_dict()``).
Its cost is host time per module and per tensor, so it depends on the module count, not on the sizes: the
model here is the ``tiny`` preset (hidden 64) with ``--layers`` decoder layers (28: the Qwen2.5-1.5B count,
534 FP8 / 338 BF16 tensors), a BF16 model with FP32 masters and kept FP8 weights (``trainer.param_dtype:
bfloat16``, the GPU default), eager. Median of --reps after 3 warm-ups, each export listed in full; on a GPU
no kernel runs (the kept FP8 weights are fresh). Prints both medians and FP8 / BF16.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from infir2_rl.config.components import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.models.factory import init_model
from infir2_rl.trainers.torch.trainer import TorchTrainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    path = init_model(Path(tempfile.mkdtemp()) / "model", "tiny", num_hidden_layers=args.layers)
    trainer = TorchTrainer(
        ModelConfig(path=str(path), dtype="bfloat16"),
        TrainerConfig(param_dtype="bfloat16", cuda_graphs=False),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-3),
        fp8=True,
        total_steps=1,
        device=args.device,
    )
    medians = {}
    for fp8 in (True, False):
        for _ in range(3):
            named = list(trainer.export_weights(fp8))
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            named = list(trainer.export_weights(fp8))
            times.append(time.perf_counter() - start)
        medians[fp8] = statistics.median(times) * 1e3
        print(f"{'FP8' if fp8 else 'BF16'} export: {len(named)} tensors, {medians[fp8]:.2f} ms "
              f"[{min(times) * 1e3:.2f}, {max(times) * 1e3:.2f}]")  # fmt: skip
    print(f"FP8 / BF16: {medians[True] / medians[False]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
