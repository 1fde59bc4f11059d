"""Everything the RL loop needs before its first step: data, placement, actors, and their resume state.

Placement: one Ray placement group for the stage, planned by `actors.placement.plan_placement` (trainer and
engines colocated on GPUs, or in bundles of their own).

Weights reach the engines through `WeightSyncService.push_from` (the first push here, then every step) by the
transport `resolve_transport` picks: `auto` is CUDA IPC for native engines colocated on GPUs, NCCL for native
engines on GPUs of their own (51 ms against the object store's 7.8 s per 1.5B push on two H200s,
docs/performance.md), else the object store (CPU, and SGLang engines, whose NCCL join has not run on GPUs);
`cuda_ipc` is refused unless native engines are colocated on GPUs; `nccl` is refused for engines colocated on
the trainer's GPUs, where NCCL cannot pair two processes of one GPU.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infir2_rl.actors.placement import Placement, reserve_for
from infir2_rl.actors.remote import Call, call_all, stop_actors
from infir2_rl.actors.rollout_engine import create_engines
from infir2_rl.actors.trainer_group import TrainerGroup
from infir2_rl.checkpoint import Checkpoint, StageState
from infir2_rl.config import RlStageConfig
from infir2_rl.data.datasets import PromptExample, load_prompt_examples, stop_token_ids
from infir2_rl.metrics import names
from infir2_rl.reward.protocol import RewardFn
from infir2_rl.rollout.manager import RolloutManager
from infir2_rl.rollout.prompts import PromptSource
from infir2_rl.weight_sync.service import WeightSyncService, make_transport

log = logging.getLogger(__name__)

ROLLOUT_STATE_FILE = "rollout_state.json"


@dataclass
class RlData:
    tokenizer: PreTrainedTokenizerBase
    train: list[PromptExample]
    # Held-out prompts for greedy accuracy (empty when data.test_path is null).
    test: list[PromptExample]
    # Where a response ends: the chat template's turn end (<|im_end|> in ChatML) and the eos token.
    stop_ids: list[int]


def load_rl_data(cfg: RlStageConfig) -> RlData:
    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    try:
        stop_ids = stop_token_ids(tokenizer)
    except ValueError as exc:
        raise ValueError(f"model.path={cfg.model.path!r}: {exc}") from None
    kwargs: dict[str, Any] = dict(
        input_key=d.input_key, label_key=d.label_key, max_prompt_tokens=d.max_prompt_tokens, format=d.format
    )
    train, _ = load_prompt_examples(d.train_path, tokenizer, **kwargs)
    test: list[PromptExample] = []
    if d.test_path is not None:
        test, _ = load_prompt_examples(d.test_path, tokenizer, **kwargs)
        test = test[: d.num_eval_examples]
    return RlData(tokenizer=tokenizer, train=train, test=test, stop_ids=stop_ids)


@dataclass
class RlActors:
    trainer: TrainerGroup
    engines: list[Any]
    manager: RolloutManager
    prompts: PromptSource
    sync: WeightSyncService
    placement: Placement
    pad_id: int
    colocated_gpu: bool

    def evaluate(self, test: list[PromptExample]) -> dict[str, float]:
        """Greedy held-out accuracy of the engines' current (FP8) weights."""
        if not test:
            return {}
        result = self.manager.evaluate(test)
        return {
            names.EVAL_ACCURACY: result.accuracy,
            names.EVAL_RESPONSE_LEN_MEAN: result.response_len_mean,
            names.EVAL_TRUNCATED_FRAC: result.truncated_frac,
        }

    def engines_sleep(self) -> None:
        """Colocated on a GPU: engines free their memory for the trainer (no-op otherwise)."""
        if self.colocated_gpu:
            call_all([Call(e, "release_memory") for e in self.engines])

    def engines_wake(self) -> None:
        if self.colocated_gpu:
            call_all([Call(e, "resume_memory") for e in self.engines])

    def _engines_say(self, method: str) -> list[Any]:
        """Every engine's answer to ``method`` (no arguments), leaving out the None of engines that do not say."""
        return [v for v in call_all([Call(e, method) for e in self.engines]) if v is not None]

    def make_room_for_rollout(self) -> dict[str, float]:
        """Colocated on GPUs, before a rollout: where the engines' KV cache (as large as their last one wanted)
        would not fit in the free memory, each trainer rank returns its cached GPU blocks, then drops its layer
        graphs (``TorchTrainer.make_room``). Nothing before the first rollout, apart, or with engines that do not say
        what they want (SGLang)."""
        if not self.colocated_gpu:
            return {}
        wanted = self._engines_say("memory_wanted")
        if not wanted:
            return {}
        dropped = self.trainer.make_room(max(wanted))
        return {names.MEMORY_TRAINER_GRAPHS_DROPPED: float(any(dropped))}

    def memory(self, peak_key: str, reserved_key: str, engines: bool = False) -> dict[str, float]:
        """The trainer ranks' (or the engines') peak since the last call and reserved memory, largest process,
        under the given metric keys; their peak counters restart (names.MEMORY_*)."""
        if engines:
            values = self._engines_say("memory")
        else:
            values = self.trainer.memory()
        if not values:
            return {}
        return {peak_key: max(p for p, _ in values), reserved_key: max(r for _, r in values)}

    def kv_slots_short(self) -> dict[str, float]:
        """KV-cache slots the rollout wanted and did not get for memory, largest engine (``names.
        ROLLOUT_KV_SLOTS_SHORT``); nothing when no engine says (CPU decode path, SGLang)."""
        values = self._engines_say("kv_slots_short")
        return {names.ROLLOUT_KV_SLOTS_SHORT: float(max(values))} if values else {}

    def graph_capture_s(self) -> dict[str, float]:
        """The engines' decode-graph capture seconds since the last call (largest engine); nothing when no
        engine captures graphs (CPU, SGLang)."""
        values = self._engines_say("graph_capture_s")
        return {names.ROLLOUT_GRAPH_CAPTURE_S: max(values)} if values else {}

    def checkpointable(self) -> _RlCheckpointWriter:
        return _RlCheckpointWriter(self)

    def shutdown(self) -> None:
        # Engines first: with weight_sync.transport=nccl trainer rank 0 hosts the weight group's store, and an
        # engine's NCCL heartbeat thread that outlives it printed a c10d traceback at the end of every
        # disaggregated run (2 x H200, session 44).
        stop_actors(self.engines)
        self.trainer.shutdown()
        self.placement.remove()


@dataclass
class _RlCheckpointWriter:
    """Saves the trainer state plus the rollout side (prompt order position, request counter)."""

    actors: RlActors

    def save(self, directory: Path) -> None:
        self.actors.trainer.save(directory)
        state = {"prompts": self.actors.prompts.state_dict(), "manager": self.actors.manager.state_dict()}
        (Path(directory) / ROLLOUT_STATE_FILE).write_text(json.dumps(state))


def resolve_transport(cfg: RlStageConfig, colocate: bool, on_gpu: bool = False) -> str:
    """The weight-sync transport for this placement (``colocate``: engines share the trainer's GPUs; ``on_gpu``:
    the placement uses GPUs); ``cuda_ipc`` needs native engines (the stage config's rule) colocated on GPUs."""
    native = cfg.rollout.backend == "native"
    chosen = cfg.weight_sync.transport
    if chosen == "auto":
        if colocate and native:
            return "cuda_ipc"
        return "nccl" if native and on_gpu and not colocate else "object_store"
    if chosen == "cuda_ipc" and not colocate:
        raise ValueError(
            f"weight_sync.transport=cuda_ipc needs the engines colocated with the trainer on GPUs (placement.mode="
            f"{cfg.placement.mode}, not colocated on GPUs): set weight_sync.transport=object_store or auto"
        )
    if chosen == "nccl" and colocate:
        raise ValueError(
            "weight_sync.transport=nccl with engines colocated on the trainer's GPUs: NCCL cannot connect two"
            " processes on one GPU; set placement.mode=disaggregate, or weight_sync.transport=auto (CUDA IPC)"
        )
    return chosen


def _weight_sync(cfg: RlStageConfig, engines: list[Any], transport: str) -> WeightSyncService:
    sync_cfg = cfg.weight_sync.model_copy(update={"transport": transport})
    # nccl: an SGLang engine has one rank in the weight group per TP rank.
    ranks = cfg.rollout.tensor_parallel_size if cfg.rollout.backend == "sglang" else 1
    return WeightSyncService(engines, sync_cfg, make_transport(sync_cfg, ranks_per_engine=ranks))


def start_rl_actors(
    cfg: RlStageConfig,
    data: RlData,
    reward_fn: RewardFn,
    *,
    total_steps: int,
    resume_from: Checkpoint | None,
    state: StageState,
) -> RlActors:
    """Place the trainer and engines, restore a checkpoint if given, and push the first weights (version = step)."""
    placement = reserve_for(
        cfg.placement,
        num_trainers=cfg.trainer.num_workers,
        num_engines=cfg.rollout.num_engines,
        engine_gpus=cfg.rollout.tensor_parallel_size,
    )
    colocate = placement.plan.colocate
    try:
        transport = resolve_transport(cfg, colocate, on_gpu=placement.plan.use_gpu)
        trainer = TrainerGroup(cfg, placement, total_steps=total_steps)
        engines = create_engines(cfg, placement)
    except Exception:
        placement.remove()
        raise
    tok = data.tokenizer
    manager = RolloutManager(engines, cfg.rollout, reward_fn, tok, data.stop_ids, cfg.seed)
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
        sync=_weight_sync(cfg, engines, transport),
        placement=placement,
        pad_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
        colocated_gpu=colocate,
    )
    # The engines load their models while the trainer group starts; wait for them here, so that the first
    # push's time is the push's (it had included up to ~18 s of engine start-up at 1.5B).
    from ray.exceptions import GetTimeoutError

    started = time.perf_counter()
    try:
        call_all([Call(e, "health") for e in engines], cfg.weight_sync.timeout_s)
    except GetTimeoutError as exc:
        raise TimeoutError(
            f"the rollout engines did not start within weight_sync.timeout_s={cfg.weight_sync.timeout_s} s"
        ) from exc
    ready_s = time.perf_counter() - started
    push = actors.sync.push_from(trainer, cfg.rollout_fp8, version=state.step)
    log.info(
        "placed %d trainer worker(s) and %d engine(s) (%s, %s); engines ready %.2f s after the trainer;"
        " first push (%s): %.1f MB in %.2f s",
        cfg.trainer.num_workers, cfg.rollout.num_engines, "GPU" if placement.plan.use_gpu else "CPU",
        "colocated" if colocate else "separate bundles", ready_s, transport, push.bytes / 1e6, push.seconds,
    )  # fmt: skip
    return actors
