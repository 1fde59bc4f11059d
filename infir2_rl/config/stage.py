"""Stage and pipeline configs, and the cross-component rules checked before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.config.components import (
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    RlDataConfig,
    RlTrainerConfig,
    RolloutConfig,
    SftDataConfig,
    SftTrainerConfig,
    TrainerConfig,
    WeightSyncConfig,
    _Config,
)
from infir2_rl.config.parallel_rules import check_model_dir

# Keys that moved, with where they went: a config that still sets one fails with this hint.
_PRECISION_HINT = (
    "the stage's top-level `precision` (SFT: fp8 | bf16; RL: unified_fp8 | bf16_train_fp8_rollout | bf16)"
)
RETIRED_KEYS = {
    ("trainer", "fp8"): _PRECISION_HINT,
    ("rollout", "fp8"): _PRECISION_HINT,
    ("weight_sync", "mode"): _PRECISION_HINT,
}
# Sections only one kind of stage has.
_RL_SECTIONS = ("rollout", "algorithm", "weight_sync")


# The largest seed a stage, `init-model` and `make-data` take (torch.manual_seed's int64).
MAX_SEED = 2**63 - 1


class _StageBase(_Config):
    # Stage name (used for the run directory and metric tags).
    name: str = "stage"
    # Directory for the resolved config, logs, metrics.jsonl, TensorBoard events and checkpoints.
    run_dir: str = "runs/stage"
    # Seed of data order, initialisation of anything random, and sampling.
    # torch.manual_seed takes a 64-bit integer: a larger seed failed inside a Ray actor.
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    model: ModelConfig = ModelConfig()
    default_kind: ClassVar[str] = "sft"  # the kind of a stage dict that names none
    # Each kind narrows these to its own sections (SftDataConfig / RlDataConfig, SftTrainerConfig / ...).
    data: DataConfig = DataConfig()
    trainer: TrainerConfig = TrainerConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """One sentence naming the new home of a key that moved, or the kind a misplaced key belongs to."""
        if not isinstance(data, dict):
            return data
        for (section, key), hint in RETIRED_KEYS.items():
            if isinstance(data.get(section), dict) and key in data[section]:
                value = data[section][key]
                raise ValueError(
                    f"{section}.{key}={value!r} was replaced by {hint}; remove it and set precision"
                )
        kind = data.get("kind", cls.default_kind)
        if kind == "sft":
            for section in _RL_SECTIONS:
                if section in data:
                    raise ValueError(
                        f"{section}: a section of RL stages only (kind: rl); remove it from this SFT stage"
                    )
        own = _KIND_SECTIONS.get(kind)
        if own is None:
            return data
        other_kind = "rl" if kind == "sft" else "sft"
        for section, mine in own.items():
            keys = data.get(section)
            if not isinstance(keys, dict):
                continue
            theirs = _KIND_SECTIONS[other_kind][section]
            for key in keys:
                if key not in mine.model_fields and key in theirs.model_fields:
                    raise ValueError(
                        f"{section}.{key}: a field of {other_kind.upper()} stages only (kind: {other_kind});"
                        f" remove it from this {kind.upper()} stage"
                    )
        return data

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step (RL derives its default from the rollout batch)."""
        raise NotImplementedError

    @property
    def train_fp8(self) -> bool:
        """Whether the trainer's decoder linears train in blockwise FP8 (from the stage's precision)."""
        raise NotImplementedError

    def _check_paths_not_empty(self) -> None:
        # An empty path resolves to the current directory: checkpoints would land wherever the command ran.
        for field, value in (
            ("run_dir", self.run_dir),
            ("model.path", self.model.path),
            ("data.train_path", self.data.train_path),
            ("data.test_path", self.data.test_path),
        ):
            if value is not None and not str(value).strip():
                fix = "null to disable evaluation" if field == "data.test_path" else "a path"
                raise ValueError(f"{field}='': empty (it would mean the current directory); set it to {fix}")

    @model_validator(mode="after")
    def _check_stage(self) -> _StageBase:
        self._check_kind()
        self._check_paths_not_empty()
        t = self.trainer
        model_parallel = t.tensor_parallel_size * t.context_parallel_size
        if t.num_workers % model_parallel:
            raise ValueError(
                f"trainer.num_workers={t.num_workers}: must be divisible by trainer.tensor_parallel_size x"
                f" trainer.context_parallel_size = {model_parallel}; use a multiple of {model_parallel}"
            )
        # Megatron: the TP sizes the model allows; what needs the runtime (megatron-core, the spec) is checked
        # by TrainerGroup before any actor starts.
        if t.backend == "megatron":
            check_model_dir(self.model.path, t.tensor_parallel_size, self.train_fp8)
        if t.cuda_graphs is True:
            graph_problems = []
            # FSDP for sure: one worker asking for one-rank FSDP2, or several sharding (megatron's ranks
            # always do). data_parallel=auto decides by model size at start: if it picks FSDP, the worker
            # refuses cuda_graphs=true then (TorchTrainer), before any step.
            if t.num_workers == 1:
                fsdp = t.fsdp_param_dtype == "bfloat16"
            else:
                fsdp = t.backend == "megatron" or t.data_parallel == "fsdp"
            if fsdp:
                graph_problems.append(
                    "no FSDP: one trainer worker (fsdp_param_dtype auto), or torch-backend replicas"
                    " (data_parallel replicate or auto)"
                )
            if self.model.gradient_checkpointing:
                graph_problems.append("model.gradient_checkpointing=false")
            if graph_problems:
                raise ValueError("trainer.cuda_graphs=true needs " + "; ".join(graph_problems))
        dp = t.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.max_tokens_per_gpu is None and self.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size}: must be divisible by trainer.micro_batch_size"
                f" x data-parallel size = {t.micro_batch_size} x {dp} = {per_step}; use a multiple of {per_step}"
            )
        if self.global_batch_size % dp:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size}: must be divisible by the data-parallel size"
                f" {dp} so every rank gets the same number of sequences"
            )
        return self

    def _check_kind(self) -> None:
        pass


class SftStageConfig(_StageBase):
    # Supervised fine-tuning on chat `messages` (loss on assistant tokens only).
    kind: Literal["sft"] = "sft"
    default_kind: ClassVar[str] = "sft"
    # "fp8": blockwise FP8 training (128x128 weights, 1x128 activations/gradients, e4m3) of the decoder
    # linears; "bf16": no FP8 (the compute dtype of model.dtype, FP32 on CPU).
    precision: Literal["fp8", "bf16"] = "fp8"
    data: SftDataConfig = SftDataConfig()
    trainer: SftTrainerConfig = SftTrainerConfig()

    @property
    def global_batch_size(self) -> int:
        return self.trainer.global_batch_size

    @property
    def train_fp8(self) -> bool:
        return self.precision == "fp8"


class RlStageConfig(_StageBase):
    # GRPO reinforcement learning with FP8 rollout engines.
    kind: Literal["rl"] = "rl"
    default_kind: ClassVar[str] = "rl"
    # The one precision switch of an RL stage. "unified_fp8": the trainer trains in FP8 and engines get the
    # exact FP8 bytes it trains with. "bf16_train_fp8_rollout": trainer in BF16, weights cast to FP8 at sync
    # (the setup Jet-RL shows diverging). "bf16": no FP8 anywhere (baseline).
    precision: Literal["unified_fp8", "bf16_train_fp8_rollout", "bf16"] = "unified_fp8"
    # The trainer's log-prob of every sampled token equals the engine's bit for bit (bf16 and unified_fp8):
    # both run one batch-invariant forward (models/invariant.py). Needs CUDA, the native engine, the torch
    # trainer with one worker; costs throughput (docs/performance.md, "true on-policy").
    true_on_policy: bool = False
    data: RlDataConfig = RlDataConfig()
    trainer: RlTrainerConfig = RlTrainerConfig()
    optimizer: OptimizerConfig = OptimizerConfig(
        lr=1e-6, min_lr=0.0, schedule="constant", warmup_ratio=0.0, weight_decay=0.1, betas=(0.9, 0.98)
    )
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()

    @property
    def train_fp8(self) -> bool:
        return self.precision == "unified_fp8"

    @property
    def rollout_fp8(self) -> bool:
        """Whether engines generate with blockwise FP8 W8A8 decoder linears (pushed by the trainer each step)."""
        return self.precision != "bf16"

    def longest_row(self) -> int:
        """The most tokens one RL row can have: a prompt kept by the data scan plus a whole response."""
        return self.data.max_prompt_tokens + self.rollout.max_response_len

    @property
    def samples_per_step(self) -> int:
        """Samples of one rollout batch: rollout.prompts_per_step x rollout.n_samples_per_prompt."""
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def global_batch_size(self) -> int:
        """trainer.global_batch_size, or the whole rollout batch when it is unset (one step per rollout)."""
        return self.trainer.global_batch_size or self.samples_per_step

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per rollout batch: samples / global batch (PPO-style mini-batches; the first is
        on-policy, later ones see the clipped, importance-weighted ratio to the old policy)."""
        return self.samples_per_step // self.global_batch_size

    def _check_kind(self) -> None:
        r = self.rollout
        budget = self.trainer.max_tokens_per_gpu
        if budget is not None and self.longest_row() > budget:
            # Responses routinely run to max_response_len; a row over the budget fits no micro-batch, and the
            # trainer would say so only at its first update, after the first rollout (minutes at 16K).
            raise ValueError(
                f"trainer.max_tokens_per_gpu={budget}: below the longest row this stage can make"
                f" (data.max_prompt_tokens {self.data.max_prompt_tokens} + rollout.max_response_len"
                f" {r.max_response_len} = {self.longest_row()} tokens), which no micro-batch could hold;"
                f" set it to >= {self.longest_row()} or lower data.max_prompt_tokens"
            )
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
        ws = self.weight_sync
        if r.backend == "sglang" and ws.self_check_layers:
            raise ValueError(
                f"weight_sync.self_check_layers={ws.self_check_layers}: SGLang engines cannot read back the"
                " tensors the trainer sent (they check each push with SGLang's /weights_checker); set it to 0"
            )
        if r.backend != "native" and ws.transport == "cuda_ipc":
            raise ValueError(
                f"weight_sync.transport=cuda_ipc needs rollout.backend=native (got {r.backend}); set"
                " weight_sync.transport=auto or object_store"
            )
        if self.true_on_policy:
            problems = []
            if self.precision == "bf16_train_fp8_rollout":
                problems.append(
                    "precision bf16 or unified_fp8 (a BF16 trainer cannot reproduce FP8 rollout bits)"
                )
            if r.backend != "native":
                problems.append("rollout.backend=native")
            if self.trainer.backend != "torch" or self.trainer.num_workers != 1:
                problems.append("trainer.backend=torch with trainer.num_workers=1 (no FSDP)")
            if self.trainer.fsdp_param_dtype == "bfloat16":
                problems.append("trainer.fsdp_param_dtype auto or float32 (the walk bypasses FSDP)")
            if self.trainer.pack_sequences is True:  # auto pads under true_on_policy
                problems.append("trainer.pack_sequences auto or false (the walk scores padded rows)")
            if self.model.gradient_checkpointing:
                problems.append("model.gradient_checkpointing=false (the walk does not checkpoint)")
            if problems:
                raise ValueError("true_on_policy=true needs " + "; ".join(problems))
        if self.trainer.backend == "megatron" and self.algorithm.kl_coef > 0:
            raise ValueError(
                f"algorithm.kl_coef={self.algorithm.kl_coef} needs a reference model, which trainer.backend=megatron"
                " does not hold yet; set algorithm.kl_coef=0 or use trainer.backend=torch"
            )
        samples = self.samples_per_step
        if samples % self.global_batch_size:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size}: must divide rollout.prompts_per_step"
                f" x rollout.n_samples_per_prompt = {samples} (each rollout batch is split into optimizer steps)"
            )


StageConfig = Annotated[SftStageConfig | RlStageConfig, Field(discriminator="kind")]
# Each kind's own data and trainer sections (a field of the other kind's is refused by name).
_KIND_SECTIONS: dict[str, dict[str, type[_Config]]] = {
    "sft": {"data": SftDataConfig, "trainer": SftTrainerConfig},
    "rl": {"data": RlDataConfig, "trainer": RlTrainerConfig},
}


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
        # The name is a directory under the pipeline's run_dir: one plain path component.
        name = self.name.strip()
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(
                f"stages[].name={self.name!r}: a stage name is its directory under run_dir; use a plain name"
                " such as sft_stage1 (no '/', not empty, not '.' or '..')"
            )
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
        if not self.run_dir.strip():
            raise ValueError(
                "run_dir='': empty (stages would write into the current directory); set it to a path"
            )
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


def validate_paths(
    cfg: SftStageConfig | RlStageConfig, *, check_model: bool = True, cast_before: bool = False
) -> None:
    """Fail with one sentence for the first input path that does not exist or cannot serve (``cast_before``: a
    pipeline's cast_fp8 step right before this stage will set rollout.fp8_checkpoint)."""
    if isinstance(cfg, RlStageConfig):
        _check_engine_start(cfg, cast_before)
    for field, value in stage_paths_to_check(cfg, check_model=check_model).items():
        if not Path(value).exists():
            if value.startswith("/path/to/"):  # the recipe configs' placeholders (configs/*_7b*.yaml)
                hint = (
                    "a placeholder of the shipped config: set it to your own (as an override or in the YAML)"
                )
            elif field == "rollout.fp8_checkpoint":
                hint = (
                    "run `infir2-rl cast-fp8 --input MODEL_DIR --output DIR` or point it at an FP8 checkpoint"
                )
            elif field.startswith("model"):
                hint = "run `infir2-rl init-model --out DIR` or point it at an HF checkpoint"
            else:
                hint = "run `infir2-rl make-data --out DIR` or point it at your data file"
            raise ValueError(f"{field}={value!r}: no such file or directory; {hint}")
        path = Path(value)
        if field in ("model.path", "rollout.fp8_checkpoint"):
            # An HF directory: its config and weights (what every trainer and engine reads first).
            if not path.is_dir():
                raise ValueError(
                    f"{field}={value!r}: a file, not a directory; point it at an HF checkpoint directory"
                )
            missing = [w for w, ok in (
                ("config.json", (path / "config.json").is_file()),
                ("weights (*.safetensors)", any(path.glob("*.safetensors")) or any(path.glob("*.bin"))),
            ) if not ok]  # fmt: skip
            if field == "model.path" and not any((path / f).is_file() for f in _TOKENIZER_FILES):
                missing.append(f"tokenizer ({' or '.join(_TOKENIZER_FILES)})")
            if missing:
                raise ValueError(
                    f"{field}={value!r}: no {' and no '.join(missing)} in it; point it at an HF checkpoint"
                    " directory (a stage's final/, or `infir2-rl init-model --out DIR`)"
                )
            config = _check_checkpoint_files(field, path)
            if field == "model.path" and isinstance(cfg, RlStageConfig):
                _check_context(cfg, path, config)
        elif path.is_dir():
            raise ValueError(f"{field}={value!r}: a directory; point it at a jsonl or parquet file")


# What AutoTokenizer reads a tokenizer from (fast, SentencePiece, or BPE vocabulary files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_engine_start(cfg: RlStageConfig, cast_before: bool) -> None:
    """SGLang servers with FP8 rollout start from an FP8 checkpoint (one with a blockwise quantization_config).
    From a BF16 one SGLang builds BF16 linears with no weight_scale_inv, and each push's FP8 bytes were cast
    into them without their scales (it only logs the scales it cannot place): wrong weights, nothing failed.
    The native engine quantizes a BF16 checkpoint itself."""
    if cfg.rollout.backend != "sglang" or not cfg.rollout_fp8:
        return
    start = cfg.rollout.fp8_checkpoint
    if start is None:
        if cast_before:
            return
        raise ValueError(
            f"rollout.backend=sglang with precision={cfg.precision} starts its servers from an FP8 checkpoint and "
            "rollout.fp8_checkpoint is not set: run `infir2-rl cast-fp8 --input MODEL_DIR --output DIR` on "
            "model.path and set it, or in a pipeline put a cast_fp8 step right before this stage"
        )
    if not (Path(start) / "config.json").is_file():
        return  # the path check that follows says what is missing
    from infir2_rl.fp8.cast_checks import config_of, is_blockwise_fp8

    if not is_blockwise_fp8(config_of(Path(start))):
        raise ValueError(
            f"rollout.fp8_checkpoint={start!r}: its config.json has no blockwise FP8 quantization_config "
            "(quant_method fp8, weight_block_size [128, 128]), so SGLang would load it in BF16; point it at an "
            "`infir2-rl cast-fp8` output"
        )


def _check_context(cfg: RlStageConfig, path: Path, config: dict[str, Any]) -> None:
    """The longest row an RL stage makes fits the model's positions. Before, the GPU engine refused the whole
    rollout at its first long prompt, and the CPU one decoded past the positions the model was trained for."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int):
        return
    if cfg.rollout.backend == "sglang":
        from infir2_rl.engines.sglang.protocol import INPUT_MARGIN, max_new_tokens_within

        wanted = cfg.rollout.max_response_len
        if max_new_tokens_within(cfg.data.max_prompt_tokens, wanted, limit) != wanted:
            raise ValueError(
                f"data.max_prompt_tokens {cfg.data.max_prompt_tokens} + rollout.max_response_len {wanted} does not "
                f"fit SGLang's limits for the max_position_embeddings {limit} of model.path={str(path)!r} (a prompt "
                f"below {limit - 1 - INPUT_MARGIN} tokens, prompt + response at most {limit - 2}): lower one of them"
            )
    if cfg.longest_row() > limit:
        raise ValueError(
            f"data.max_prompt_tokens {cfg.data.max_prompt_tokens} + rollout.max_response_len "
            f"{cfg.rollout.max_response_len} = {cfg.longest_row()} exceeds the max_position_embeddings {limit} of "
            f"model.path={str(path)!r}: lower one of them"
        )


def _check_checkpoint_files(field: str, path: Path) -> dict[str, Any]:
    """An HF directory's config.json is a JSON object and each safetensors shard's header reads (headers only,
    milliseconds even at 7B): a broken file fails here in one line naming it, not later inside a Ray actor.
    Returns the config."""
    from infir2_rl.fp8.cast_checks import config_of, shard_keys

    try:
        config = config_of(path)
    except ValueError as exc:
        raise ValueError(
            f"{field}: {path / 'config.json'} is {exc}; restore the checkpoint's config"
        ) from exc
    for shard in sorted(path.glob("*.safetensors")):
        try:
            shard_keys(shard)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from exc
    return config
