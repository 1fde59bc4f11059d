"""Stage and pipeline configs, and the cross-component rules checked before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.config.components import (
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
    _Config,
)


class _StageBase(_Config):
    # Stage name (used for the run directory and metric tags).
    name: str = "stage"
    # Directory for the resolved config, logs, metrics.jsonl, TensorBoard events and checkpoints.
    run_dir: str = "runs/stage"
    # Seed of data order, initialisation of anything random, and sampling.
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    trainer: TrainerConfig = TrainerConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _check_stage(self) -> _StageBase:
        self._check_kind()  # kind-specific rules first: they may fill derived fields checked below
        t = self.trainer
        model_parallel = t.tensor_parallel_size * t.context_parallel_size
        if t.num_workers % model_parallel:
            raise ValueError(
                f"trainer.num_workers={t.num_workers}: must be divisible by trainer.tensor_parallel_size x"
                f" trainer.context_parallel_size = {model_parallel}; use a multiple of {model_parallel}"
            )
        if t.model_parallel_size > 1 and t.backend == "torch":
            raise ValueError(
                f"trainer.tensor_parallel_size x context_parallel_size = {model_parallel}: the torch backend is"
                " data-parallel only (FSDP2); set both to 1 or use trainer.backend=megatron"
            )
        dp = t.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.max_tokens_per_gpu is None and t.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={t.global_batch_size}: must be divisible by trainer.micro_batch_size"
                f" x data-parallel size = {t.micro_batch_size} x {dp} = {per_step}; use a multiple of {per_step}"
            )
        if t.global_batch_size % dp:
            raise ValueError(
                f"trainer.global_batch_size={t.global_batch_size}: must be divisible by the data-parallel size"
                f" {dp} so every rank gets the same number of sequences"
            )
        return self

    def _check_kind(self) -> None:
        pass


class SftStageConfig(_StageBase):
    # Supervised fine-tuning on chat `messages` (loss on assistant tokens only).
    kind: Literal["sft"] = "sft"


class RlStageConfig(_StageBase):
    # GRPO reinforcement learning with FP8 rollout engines.
    kind: Literal["rl"] = "rl"
    optimizer: OptimizerConfig = OptimizerConfig(
        lr=1e-6, min_lr=0.0, schedule="constant", warmup_ratio=0.0, weight_decay=0.1, betas=(0.9, 0.98)
    )
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per rollout batch: samples / trainer.global_batch_size (PPO-style mini-batches;
        the first is on-policy, later ones see the clipped, importance-weighted ratio to the old policy)."""
        return (
            self.rollout.prompts_per_step
            * self.rollout.n_samples_per_prompt
            // self.trainer.global_batch_size
        )

    def _check_kind(self) -> None:
        r = self.rollout
        if r.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt={r.n_samples_per_prompt}: must be >= 2 for GRPO"
                " (advantages are relative to the group)"
            )
        if r.over_sampling_prompts < r.prompts_per_step:
            raise ValueError(
                f"rollout.over_sampling_prompts={r.over_sampling_prompts}: must be >= rollout.prompts_per_step"
                f"={r.prompts_per_step}"
            )
        if r.top_p != 1.0 or r.top_k != -1:
            raise ValueError(
                f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: RL sampling needs top_p=1.0 and top_k=-1"
                " so engine log-probs are the plain tempered softmax the trainer recomputes"
            )
        samples = r.prompts_per_step * r.n_samples_per_prompt
        if "global_batch_size" not in self.trainer.model_fields_set:
            object.__setattr__(self.trainer, "global_batch_size", samples)  # one step per rollout batch
        if samples % self.trainer.global_batch_size:
            raise ValueError(
                f"trainer.global_batch_size={self.trainer.global_batch_size}: must divide rollout.prompts_per_step"
                f" x rollout.n_samples_per_prompt = {samples} (each rollout batch is split into optimizer steps)"
            )
        # weight_sync.mode is the one precision switch of an RL stage: trainer.fp8 and rollout.fp8 follow
        # it unless set explicitly, and an explicit contradiction is an error.
        want_train, want_rollout = self.weight_sync.mode == "unified_fp8", self.weight_sync.mode != "bf16"
        for section, want in ((self.trainer, want_train), (r, want_rollout)):
            name = "trainer" if section is self.trainer else "rollout"
            if "fp8" in section.model_fields_set and section.fp8 != want:
                raise ValueError(
                    f"{name}.fp8={section.fp8} contradicts weight_sync.mode={self.weight_sync.mode!r};"
                    f" drop {name}.fp8 (the mode sets it) or pick the matching mode"
                )
            object.__setattr__(section, "fp8", want)


StageConfig = Annotated[SftStageConfig | RlStageConfig, Field(discriminator="kind")]


class PipelineStage(_Config):
    # Stage name; its run directory is PIPELINE_RUN_DIR/NAME.
    name: str
    # "stage": an SFT/RL stage from a YAML file; "cast_fp8": cast the previous checkpoint to blockwise FP8.
    kind: Literal["stage", "cast_fp8"] = "stage"
    # Stage YAML, relative to the pipeline file (kind "stage" only).
    config: str | None = None
    # Dotted overrides applied to that stage (`rollout.temperature=1.1`).
    overrides: list[str] = []

    @model_validator(mode="after")
    def _check(self) -> PipelineStage:
        if self.kind == "stage" and not self.config:
            raise ValueError(f"stages[{self.name}].config is missing: name the stage YAML file")
        if self.kind == "cast_fp8" and self.config:
            raise ValueError(f"stages[{self.name}].config={self.config!r}: a cast_fp8 step takes no config")
        return self


class PipelineConfig(_Config):
    # Pipeline name.
    name: str = "pipeline"
    # Root run directory; each stage writes into RUN_DIR/STAGE_NAME.
    run_dir: str = "runs/pipeline"
    # Stages in order; each starts from the previous one's final checkpoint.
    stages: list[PipelineStage]

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.stages:
            raise ValueError("stages is empty: list at least one stage")
        names = [s.name for s in self.stages]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"stages: names {sorted(dup)} repeat; give every stage its own name")
        if self.stages[0].kind == "cast_fp8":
            raise ValueError("stages[0].kind='cast_fp8': a cast needs a previous stage's checkpoint")
        return self


def stage_paths_to_check(cfg: SftStageConfig | RlStageConfig, *, check_model: bool = True) -> dict[str, str]:
    """The input paths a stage reads, by field name (checked by `validate_paths` before actors start)."""
    paths = {"data.train_path": cfg.data.train_path}
    if cfg.data.test_path is not None:
        paths["data.test_path"] = cfg.data.test_path
    if check_model:
        paths["model.path"] = cfg.model.path
    if isinstance(cfg, RlStageConfig) and cfg.rollout.fp8_checkpoint is not None:
        paths["rollout.fp8_checkpoint"] = cfg.rollout.fp8_checkpoint
    return paths


def validate_paths(cfg: SftStageConfig | RlStageConfig, *, check_model: bool = True) -> None:
    """Fail with one sentence for the first input path that does not exist."""
    for field, value in stage_paths_to_check(cfg, check_model=check_model).items():
        if not Path(value).exists():
            hint = (
                "run `infir2-rl init-model --out DIR` or point it at an HF checkpoint"
                if field.startswith("model") or field.startswith("rollout")
                else "run `infir2-rl make-data --out DIR` or point it at your data file"
            )
            raise ValueError(f"{field}={value!r}: no such file or directory; {hint}")
