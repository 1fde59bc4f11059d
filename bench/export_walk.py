"""Host time of the trainer's weight-sync export: an FP8 trainer's FP8 export against a BF16 trainer's BF16 one.

    python bench/export_walk.py [--layers 28] [--reps 30] [--device cpu|cuda]

What a weight sync does first on the trainer: ``TorchTrainer.export_weights(fp8)`` lists the tensors to send
(FP8: each decoder linear's kept FP8 weight and scale grid, ``fp8_state_from_model``; BF16: ``state_dict()``),
as ``rl_step`` calls it: an FP8 trainer exports FP8 (unified FP8), a BF16 trainer BF16. Its cost is host time per
module and per tensor, so it depends on the module count, not on the sizes: the model here is the ``tiny``
preset (hidden 64) with ``--layers`` decoder layers (28: the Qwen2.5-1.5B count, 534 FP8 / 338 BF16 tensors), a
BF16 model with FP32 masters (``trainer.param_dtype: bfloat16``, the GPU default; FP8 with kept FP8 weights),
eager. Each export is timed twice per rep in one process: as shipped (the first walk's listing given again,
``trainers/torch/export_listing.py``) and walking the model every push (as before the listing). Medians of
--reps after 3 warm-ups, each export listed in full; no kernel runs (the kept FP8 weights are fresh).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from infir2_rl.config.components import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.models.factory import init_model
from infir2_rl.trainers.torch.export_listing import UNLISTABLE
from infir2_rl.trainers.torch.trainer import TorchTrainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    path = init_model(Path(tempfile.mkdtemp()) / "model", "tiny", num_hidden_layers=args.layers)
    medians: dict[tuple[bool, bool], float] = {}
    for fp8 in (True, False):
        trainer = TorchTrainer(
            ModelConfig(path=str(path), dtype="bfloat16"),
            TrainerConfig(param_dtype="bfloat16", cuda_graphs=False),  # type: ignore[arg-type]
            OptimizerConfig(lr=1e-3),
            fp8=fp8,
            total_steps=1,
            device=args.device,
        )
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(3 + args.reps):
            for listed in (True, False):
                kept = trainer._export_listings.get(fp8)
                if not listed:
                    trainer._export_listings[fp8] = UNLISTABLE  # walk, as every push did before the listing
                start = time.perf_counter()
                named = list(trainer.export_weights(fp8))
                elapsed = time.perf_counter() - start
                if not listed:
                    trainer._export_listings[fp8] = kept
                if rep >= 3:
                    times[listed].append(elapsed)
        listing = trainer._export_listings.get(fp8)
        print(
            f"{'FP8' if fp8 else 'BF16'} trainer, {len(named)} tensors, listed: {listing is not UNLISTABLE}"
        )
        for listed in (True, False):
            medians[fp8, listed] = statistics.median(times[listed]) * 1e3
            print(f"  {'listing' if listed else 'walk every push'}: {medians[fp8, listed]:.2f} ms "
                  f"[{min(times[listed]) * 1e3:.2f}, {max(times[listed]) * 1e3:.2f}]")  # fmt: skip
    for listed in (True, False):
        ratio = medians[True, listed] / medians[False, listed]
        print(f"FP8 / BF16 export, {'listing' if listed else 'walk every push'}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
