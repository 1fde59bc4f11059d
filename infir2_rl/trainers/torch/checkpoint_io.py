"""Save, load and greedy generation for `TrainerRank` (split out to keep each file one concern).

A trainer checkpoint directory:

    hf/                      rank 0: config.json, model.safetensors (FP32 master weights: the parameters, or
                             with a BF16 model, trainer.param_dtype, the masters the trainer keeps), tokenizer files
    train_state/rank_K.pt    every rank: optimizer, lr schedule, RNG states (torch, cuda, python, numpy), step

FP32 in `hf/` is what makes resume exact: reloading the masters gives back the very same numbers.
The stage's final export (`save_hf`) is written in the compute dtype instead (BF16 on GPUs), as an
ordinary HF checkpoint for the next stage or for inference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from infir2_rl.data.datasets import stop_token_ids
from infir2_rl.trainers.torch import distributed as D


class TrainerRank(Protocol):
    """What these functions read and restore of a trainer rank (``trainer.TorchTrainer`` implements it)."""

    model: Any
    tokenizer: Any
    optimizer: Any
    optimizer_cfg: Any
    scheduler: Any
    device: torch.device
    fsdp: bool
    rank: int
    world_size: int
    step: int
    num_skipped: int
    master_weights: Any  # master_weights.MasterWeights beside a BF16 model (trainer.param_dtype), else None

    def autocast(self) -> AbstractContextManager[Any]: ...

    def fp8_step_boundary(self) -> None: ...


HF_DIR = "hf"
TRAIN_STATE_DIR = "train_state"
# Prompts per generate() call in held-out evaluation.
GENERATE_BATCH_SIZE = 64


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def hf_name(name: str) -> str:
    """Drop wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`) that are not HF names."""
    for prefix in ("_orig_mod.", "module."):
        name = name.replace(prefix, "")
    return name


def full_state_dict(trainer: TrainerRank) -> dict[str, Tensor]:
    """HF-named full FP32 state dict on CPU (collective under FSDP; meaningful on rank 0)."""
    if trainer.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd: dict[str, Any] = get_model_state_dict(
            trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    elif trainer.master_weights is not None:  # a BF16 model: its FP32 masters are the weights
        sd = trainer.master_weights.state_dict(trainer.model)
    else:
        sd = trainer.model.state_dict()
    return {hf_name(k): v.detach().cpu() for k, v in sd.items()}


def save_hf(trainer: TrainerRank, directory: Path, dtype: torch.dtype) -> None:
    state = full_state_dict(trainer)
    if trainer.rank != 0:
        return
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    config = trainer.model.config
    saved = (config.dtype, config.use_cache)
    # The checkpoint is for inference and the next stage: its config names its dtype and enables the KV cache.
    config.use_cache = True
    try:
        trainer.model.save_pretrained(str(directory), state_dict=state)
        # save_pretrained writes the dtype of the model's parameters into config.json, the FP32 masters
        # (transformers 5.x, modeling_utils.save_pretrained), whatever the saved weights are: write it again.
        config.dtype = dtype
        config.save_pretrained(str(directory))
    finally:
        config.dtype, config.use_cache = saved
    trainer.tokenizer.save_pretrained(str(directory))


# The saved optimizer of an FSDP rank that has not stepped yet (every update so far skipped).
_UNSTEPPED = {"unstepped": True}


def _optimizer_state(trainer: TrainerRank) -> dict[str, Any]:
    if trainer.fsdp:
        if not trainer.optimizer.state:
            # torch's get_optimizer_state_dict fills an empty state by running a step with zero gradients and
            # lr 0: AdamW's step count became 1, and the first real update, bias-corrected as step 2, was ~26%
            # smaller than an unsaved run's.
            return dict(_UNSTEPPED)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(trainer.model, trainer.optimizer)
    return trainer.optimizer.state_dict()


def save_checkpoint(trainer: TrainerRank, directory: Path) -> None:
    save_hf(trainer, directory / HF_DIR, torch.float32)
    state_dir = directory / TRAIN_STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "world_size": trainer.world_size,
            "fsdp": bool(trainer.fsdp),
            "step": trainer.step,
            "num_skipped": trainer.num_skipped,
            "optimizer": _optimizer_state(trainer),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": rng_state(),
        },
        state_dir / f"rank_{trainer.rank}.pt",
    )


def read_hf_weights(hf_dir: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{hf_dir}: no *.safetensors weights; point at a directory written by save")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_checkpoint(trainer: TrainerRank, directory: Path) -> None:
    state_file = directory / TRAIN_STATE_DIR / f"rank_{trainer.rank}.pt"
    if not state_file.is_file():
        raise ValueError(f"{state_file}: missing; the checkpoint is incomplete or was written by fewer ranks")
    train_state = torch.load(state_file, map_location="cpu", weights_only=False)
    if train_state["world_size"] != trainer.world_size:
        raise ValueError(
            f"checkpoint {directory} was written by {train_state['world_size']} trainer ranks, this run has"
            f" {trainer.world_size}: resume with trainer.num_workers={train_state['world_size']}"
        )
    if train_state.get("fsdp", bool(trainer.fsdp)) != bool(trainer.fsdp):  # (older checkpoints do not say)
        # Its optimizer state is sharded (FSDP) or whole (replicas): loaded into the other, the first step
        # failed inside AdamW with "mixed torch.Tensor and DTensor".
        was, now = ("fsdp", "replicate") if train_state["fsdp"] else ("replicate", "fsdp")
        raise ValueError(
            f"checkpoint {directory} was written by {was} trainer ranks, this run has {now} ones: resume with "
            f"trainer.data_parallel={was}"
        )
    weights = read_hf_weights(directory / HF_DIR)
    if trainer.fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # FSDP2 keeps the parameters' names, so the keys are checked before anything is loaded, as
        # load_state_dict's result is below (strict=False: a tied lm_head is not saved).
        expected = set(trainer.model.state_dict())
        check_weights_match(trainer.model, expected - set(weights), set(weights) - expected, directory)
        set_model_state_dict(
            trainer.model,
            dict[str, Any](weights),
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        if not train_state["optimizer"].get("unstepped"):  # else the new optimizer is as it was: no state yet
            set_optimizer_state_dict(trainer.model, trainer.optimizer, train_state["optimizer"])
    else:
        missing, unexpected = trainer.model.load_state_dict(weights, strict=False)
        check_weights_match(trainer.model, set(missing), set(unexpected), directory)
        if trainer.master_weights is not None:  # the FP32 values, not the BF16 model's rounding of them
            trainer.master_weights.load_state_dict(trainer.model, weights)
        trainer.optimizer.load_state_dict(train_state["optimizer"])
    restore_schedule(
        trainer.optimizer,
        trainer.scheduler,
        trainer.optimizer_cfg,
        int(train_state["scheduler"]["last_epoch"]),
    )
    set_rng_state(train_state["rng"])
    trainer.step = int(train_state["step"])
    trainer.num_skipped = int(train_state["num_skipped"])


def check_weights_match(model: Any, missing: set[str], unexpected: set[str], directory: Path) -> None:
    """Refuse a checkpoint whose weights do not fit the model (a tied lm_head, never saved, may be missing)."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or missing - tied:
        raise ValueError(
            f"{directory / HF_DIR}: weights do not match the model (missing {sorted(missing - tied)[:5]},"
            f" unexpected {sorted(unexpected)[:5]}); resume with the model the checkpoint was written from"
        )


def restore_schedule(optimizer: Any, scheduler: Any, cfg: Any, last_epoch: int) -> None:
    """Put the lr schedule at the saved position, with this run's optimizer settings.

    A saved LambdaLR also holds the peak lr and the schedule's parameters of the run that wrote it, and the
    optimizer's saved param groups its betas, eps and weight decay: loading those kept the old values when a
    resume changed them (issue 16: resumed with lr=1e-2, the run went on at 3e-4). The schedule here is the
    one built from this run's config, moved to the saved step; the lr is computed with LambdaLR's own
    expression, so an unchanged config gives bit-identical learning rates. A changed config is refused
    before this point unless ``checkpoint.allow_config_change`` is set (stages/guards.py). ``optimizer``: a torch
    optimizer whose saved state was just loaded; ``scheduler``: its LambdaLR, built from ``cfg`` (an
    ``OptimizerConfig``). Both trainer backends call it (megatron's local spec: trainers/megatron/checkpoint.py).
    """
    scheduler.last_epoch = last_epoch
    for group, base_lr, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["betas"], group["eps"], group["weight_decay"] = tuple(cfg.betas), cfg.eps, cfg.weight_decay
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * factor(last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@torch.no_grad()
def generate_greedy(
    trainer: TrainerRank, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy completions, batched with left padding; under FSDP all ranks must call (synced_gpus)."""
    from transformers import GenerationConfig

    tok = trainer.tokenizer
    stops = stop_token_ids(tok)  # the chat template's turn end and the eos token, as the rollout stops
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )
    chunks = [list(prompts[i : i + GENERATE_BATCH_SIZE]) for i in range(0, len(prompts), GENERATE_BATCH_SIZE)]
    if trainer.fsdp:  # every rank runs as many generate() calls as the busiest one
        chunks += [[[tok.pad_token_id]]] * (D.all_reduce_max_int(len(chunks), trainer.device) - len(chunks))
    trainer.model.eval()
    trainer.fp8_step_boundary()
    results: list[list[int]] = []
    for chunk in chunks:
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        with trainer.autocast():
            out = trainer.model.generate(  # type: ignore[operator]
                input_ids=ids.to(trainer.device),
                attention_mask=mask.to(trainer.device),
                generation_config=gen_cfg,
                synced_gpus=trainer.fsdp,
            )
        for row in out[:, width:].tolist():
            cut = next((t + 1 for t, token in enumerate(row) if token in stops), len(row))
            results.append(row[:cut])
    trainer.model.train()
    return results[: len(prompts)]
