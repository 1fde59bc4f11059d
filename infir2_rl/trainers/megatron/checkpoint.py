"""Save, load, HF export and greedy generation of the megatron trainer (torch backend's on-disk layout).

    hf/                      rank 0: config.json, model.safetensors (FP32 masters, HF names), tokenizer
    train_state/rank_K.pt    every rank: optimizer (this rank's shards), lr schedule, RNG states, step

The ``hf/`` directory is an ordinary HF checkpoint, so a stage trained with either backend hands off to
the next stage (of either backend) exactly; resume needs the same number of ranks and the same TP size.
Greedy generation (held-out evaluation) runs an HF replica built from the current weights, with the same
FP8 linears (`fp8.Fp8Linear`, whose 128x128 grid is the one `layers.ParallelLinear` quantizes on).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from infir2_rl.trainers.torch import checkpoint_io as io

if TYPE_CHECKING:
    from infir2_rl.trainers.megatron.trainer import MegatronTrainer


def read_weights(hf_dir: Path) -> dict[str, Tensor]:
    """An HF directory's tensors in FP32 (the masters), whatever dtype the checkpoint was saved in."""
    return {k: v.float() if v.is_floating_point() else v for k, v in io.read_hf_weights(hf_dir).items()}


def save_hf(trainer: MegatronTrainer, directory: Path, dtype: torch.dtype) -> None:
    """An HF directory transformers loads: config.json (dtype, use_cache on), safetensors, tokenizer.

    Collective over the TP group (the weights are gathered); rank 0 writes.
    """
    from safetensors.torch import save_file

    state = trainer.hf_state()
    if trainer.rank != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu().clone() for k, v in state.items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = trainer.hf_config
    saved = (config.dtype, config.use_cache)
    config.dtype, config.use_cache = dtype, True
    try:
        config.save_pretrained(str(directory))
    finally:
        config.dtype, config.use_cache = saved
    generation = Path(trainer.path) / "generation_config.json"
    if generation.is_file():
        shutil.copyfile(generation, directory / "generation_config.json")
    trainer.tokenizer.save_pretrained(str(directory))


def save_checkpoint(trainer: MegatronTrainer, directory: Path) -> None:
    save_hf(trainer, directory / io.HF_DIR, torch.float32)
    state_dir = directory / io.TRAIN_STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "world_size": trainer.world_size,
            "tensor_parallel_size": trainer.tp,
            "step": trainer.step,
            "num_skipped": trainer.num_skipped,
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": io.rng_state(),
        },
        state_dir / f"rank_{trainer.rank}.pt",
    )


def load_checkpoint(trainer: MegatronTrainer, directory: Path) -> None:
    state_file = directory / io.TRAIN_STATE_DIR / f"rank_{trainer.rank}.pt"
    if not state_file.is_file():
        raise ValueError(f"{state_file}: missing; the checkpoint is incomplete or was written by fewer ranks")
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    written = (state["world_size"], state.get("tensor_parallel_size", 1))
    if written != (trainer.world_size, trainer.tp):
        raise ValueError(
            f"checkpoint {directory} was written by {written[0]} ranks at tensor_parallel_size {written[1]}, this"
            f" run has {trainer.world_size} at {trainer.tp}: resume with trainer.num_workers={written[0]} and"
            f" trainer.tensor_parallel_size={written[1]}"
        )
    trainer.load_hf_weights(read_weights(directory / io.HF_DIR))
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.te is None:  # a torch AdamW and LambdaLR: this run's lr, schedule and AdamW settings, as the
        # torch backend restores them (a saved LambdaLR and param groups hold the old run's)
        io.restore_schedule(
            trainer.optimizer, trainer.scheduler, trainer.optimizer_cfg, int(state["scheduler"]["last_epoch"])
        )
    else:  # te: LrSchedule keeps only the step and sets this run's lr every step (megatron's optimizer
        # keeps its saved AdamW settings: not handled, the te spec has never run here)
        trainer.scheduler.load_state_dict(state["scheduler"])
    io.set_rng_state(state["rng"])
    trainer.step = int(state["step"])
    trainer.num_skipped = int(state["num_skipped"])


class _HfReplica:
    """What `checkpoint_io.generate_greedy` reads of a trainer, over an HF copy of the megatron weights."""

    fsdp = False

    def __init__(self, trainer: MegatronTrainer) -> None:
        from transformers import AutoModelForCausalLM

        from infir2_rl.fp8.linear import swap_to_fp8_training

        state = trainer.hf_state()  # collective over the TP group
        model = AutoModelForCausalLM.from_config(trainer.hf_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if trainer.arch.tied_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"HF replica: missing {sorted(set(missing) - tied)[:4]}, unexpected {unexpected[:4]}"
            )
        if trainer.fp8:
            swap_to_fp8_training(model, pow2_scales=trainer.pow2_scales)
        self.model: Any = model.to(trainer.device)
        self.tokenizer, self.device = trainer.tokenizer, trainer.device
        self._autocast = trainer.autocast

    def autocast(self) -> AbstractContextManager[Any]:
        return self._autocast()

    def fp8_step_boundary(self) -> None:
        pass


def generate_greedy(
    trainer: MegatronTrainer, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy completions of this rank's prompts through an HF replica (built per call; all TP ranks call)."""
    replica = _HfReplica(trainer)
    try:
        return io.generate_greedy(replica, prompts, max_new_tokens)  # type: ignore[arg-type]  # reads a subset
    finally:
        del replica
