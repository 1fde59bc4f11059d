"""Everything the RL loop needs before its first step: data, placement, actors, and their resume state.

Placement (one Ray placement group for the stage):
  * GPU, `colocate`: one GPU bundle per trainer worker; engine i shares bundle i with worker i (the
    trainer takes 0.6 of the GPU, the engine 0.4) and frees its memory while the trainer works.
  * otherwise (CPU, or `disaggregate`): trainer bundles first, then one bundle per engine.

Weights reach the engines through `WeightSyncService.push_from` (the first push here, then every step);
`weight_sync.transport=cuda_ipc` is refused unless native engines are colocated on GPUs (`check_transport`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infir2_rl.actors.placement import PlacementPlan, create_placement, remove_placement, resolve_use_gpu
from infir2_rl.actors.remote import Call, call_all
from infir2_rl.actors.rollout_engine import create_engines
from infir2_rl.actors.trainer_group import TrainerGroup
from infir2_rl.checkpoint import Checkpoint, StageState
from infir2_rl.config import RlStageConfig
from infir2_rl.data.datasets import PromptExample, load_prompt_examples
from infir2_rl.metrics import names
from infir2_rl.reward.protocol import load_reward_fn
from infir2_rl.rollout.manager import RolloutManager
from infir2_rl.rollout.prompts import PromptSource
from infir2_rl.weight_sync.service import WeightSyncService

log = logging.getLogger(__name__)

ROLLOUT_STATE_FILE = "rollout_state.json"
TRAINER_GPU_SHARE_COLOCATED = 0.6


@dataclass
class RlData:
    tokenizer: PreTrainedTokenizerBase
    train: list[PromptExample]
    # Held-out prompts for greedy accuracy (empty when data.test_path is null).
    test: list[PromptExample]


def load_rl_data(cfg: RlStageConfig) -> RlData:
    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    kwargs: dict[str, Any] = dict(
        input_key=d.input_key, label_key=d.label_key, max_prompt_tokens=d.max_prompt_tokens, format=d.format
    )
    train, _ = load_prompt_examples(d.train_path, tokenizer, **kwargs)
    test: list[PromptExample] = []
    if d.test_path is not None:
        test, _ = load_prompt_examples(d.test_path, tokenizer, **kwargs)
        test = test[: d.num_eval_examples]
    return RlData(tokenizer=tokenizer, train=train, test=test)


@dataclass
class RlActors:
    trainer: TrainerGroup
    engines: list[Any]
    manager: RolloutManager
    prompts: PromptSource
    sync: WeightSyncService
    plan: PlacementPlan
    pad_id: int
    colocated_gpu: bool

    def evaluate(self, test: list[PromptExample]) -> dict[str, float]:
        """Greedy held-out accuracy of the engines' current (FP8) weights."""
        if not test:
            return {}
        result = self.manager.evaluate(test)
        return {names.EVAL_ACCURACY: result.accuracy, names.EVAL_RESPONSE_LEN_MEAN: result.response_len_mean}

    def engines_sleep(self) -> None:
        """Colocated on a GPU: engines free their memory for the trainer (no-op otherwise)."""
        if self.colocated_gpu:
            call_all([Call(e, "release_memory") for e in self.engines])

    def engines_wake(self) -> None:
        if self.colocated_gpu:
            call_all([Call(e, "resume_memory") for e in self.engines])

    def checkpointable(self) -> _RlCheckpointWriter:
        return _RlCheckpointWriter(self)

    def shutdown(self) -> None:
        import ray

        self.trainer.shutdown()
        for e in self.engines:
            ray.kill(e)
        remove_placement(self.plan)


@dataclass
class _RlCheckpointWriter:
    """Saves the trainer state plus the rollout side (prompt order position, request counter)."""

    actors: RlActors

    def save(self, directory: Path) -> None:
        self.actors.trainer.save(directory)
        state = {"prompts": self.actors.prompts.state_dict(), "manager": self.actors.manager.state_dict()}
        (Path(directory) / ROLLOUT_STATE_FILE).write_text(json.dumps(state))


def check_transport(cfg: RlStageConfig, colocate: bool) -> None:
    """weight_sync.transport=cuda_ipc shares the trainer's GPU memory: native engines colocated on GPUs."""
    if cfg.weight_sync.transport == "cuda_ipc" and not (colocate and cfg.rollout.backend == "native"):
        here = f"placement.mode={cfg.placement.mode}, rollout.backend={cfg.rollout.backend}"
        raise ValueError(
            f"weight_sync.transport=cuda_ipc needs native engines colocated with the trainer on GPUs ({here}"
            f"{'' if colocate else ', not colocated on GPUs'}): set weight_sync.transport=object_store"
        )


def start_rl_actors(
    cfg: RlStageConfig, data: RlData, *, total_steps: int, resume_from: Checkpoint | None, state: StageState
) -> RlActors:
    """Place the trainer and engines, restore a checkpoint if given, and push the first weights (version = step)."""
    use_gpu = resolve_use_gpu(cfg.placement.use_gpu)
    num_workers, num_engines = cfg.trainer.num_workers, cfg.rollout.num_engines
    colocate = use_gpu and cfg.placement.mode == "colocate"
    if colocate and num_engines > num_workers:
        raise ValueError(
            f"rollout.num_engines={num_engines}: colocate places one engine per trainer GPU, so at most"
            f" trainer.num_workers={num_workers}; lower it or use placement.mode=disaggregate"
        )
    check_transport(cfg, colocate)
    num_bundles = num_workers if colocate else num_workers + num_engines
    plan = create_placement(num_bundles, use_gpu=use_gpu, cpus_per_bundle=cfg.placement.cpus_per_actor)
    try:
        trainer = TrainerGroup(
            cfg,
            total_steps=total_steps,
            plan=plan,
            bundle_indices=list(range(num_workers)),
            share=TRAINER_GPU_SHARE_COLOCATED if colocate else 1.0,
        )
        engine_bundles = list(range(num_engines)) if colocate else list(range(num_workers, num_bundles))
        engines = create_engines(cfg, plan.placement_group, engine_bundles)
    except Exception:
        remove_placement(plan)
        raise
    tok = data.tokenizer
    if tok.eos_token_id is None:
        raise ValueError(
            f"model.path={cfg.model.path!r}: the tokenizer has no eos token to stop generation at"
        )
    stop_ids = [int(tok.eos_token_id)]  # the end of the assistant turn (<|im_end|> in ChatML templates)
    manager = RolloutManager(
        engines, cfg.rollout, load_reward_fn(cfg.rollout.reward), tok, stop_ids, cfg.seed
    )
    prompts = PromptSource(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
    if resume_from is not None:
        trainer.load(resume_from.path)
        saved = json.loads((resume_from.path / ROLLOUT_STATE_FILE).read_text())
        prompts.load_state_dict(saved["prompts"])
        manager.load_state_dict(saved["manager"])
    actors = RlActors(
        trainer=trainer,
        engines=engines,
        manager=manager,
        prompts=prompts,
        sync=WeightSyncService(engines, cfg.weight_sync),
        plan=plan,
        pad_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
        colocated_gpu=colocate,
    )
    push = actors.sync.push_from(trainer, cfg.rollout.fp8, version=state.step)
    log.info(
        "placed %d trainer worker(s) and %d engine(s) (%s, %s); first push: %.1f MB in %.2f s",
        num_workers, num_engines, "GPU" if use_gpu else "CPU", "colocated" if colocate else "separate bundles",
        push.bytes / 1e6, push.seconds,
    )  # fmt: skip
    return actors
