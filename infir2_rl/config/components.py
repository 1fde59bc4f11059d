"""One config class per component. Every field is documented; defaults suit the embedded demo run.

The classes are pydantic models with `extra="forbid"`: an unknown key is an error, not a silent no-op.
Cross-field rules that need more than one component (e.g. batch divisibility) live in `stage.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from infir2_rl.strict_model import StrictModel

# Largest finite float32: a learning rate above it overflows the first optimizer step.
FLOAT32_MAX = 3.4028234663852886e38


class _Config(StrictModel):
    """StrictModel (strict_model.py): unknown keys are errors, every float setting is finite (inf passed the
    range checks, nan did not), and no number is read from a boolean (`lr: true` is not 1.0)."""


class ModelConfig(_Config):
    # HF directory (config.json + safetensors + tokenizer) the stage starts from; in a pipeline,
    # every stage after the first starts from the previous stage's final checkpoint instead.
    path: str = "runs/demo/assets/tiny-model"
    # Compute dtype of the trainer and engines: "auto" = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Attention kernel passed to transformers (`sdpa` uses flash attention on GPUs).
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # Recompute activations in backward to save memory (long sequences on GPU).
    gradient_checkpointing: bool = False


class DataConfig(_Config):
    # Training file (jsonl or parquet). SFT: rows with a chat `messages` list. RL: `prompt` + `label`.
    train_path: str = "runs/demo/assets/data/sft_train.jsonl"
    # Held-out file with the same shape, for held-out loss / accuracy; None disables evaluation.
    test_path: str | None = "runs/demo/assets/data/sft_test.jsonl"
    # File format; "auto" picks by extension (.jsonl/.json -> jsonl, .parquet -> parquet).
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    # Held-out examples used per evaluation (None = the whole test file).
    num_eval_examples: int | None = Field(default=200, ge=1)
    # Shuffle the training data each epoch (seeded by the stage seed).
    shuffle: bool = True


class SftDataConfig(DataConfig):
    # Key of the chat message list in SFT rows.
    messages_key: str = "messages"
    # Longest SFT sequence kept (prompt + answer), in tokens; longer rows are skipped and counted.
    max_seq_len: int = Field(default=512, ge=2)


class RlDataConfig(DataConfig):
    # Key of the prompt (chat message list or plain string) in RL rows.
    input_key: str = "prompt"
    # Key of the reference answer in RL rows.
    label_key: str = "label"
    # Longest prompt kept, in tokens; longer rows are skipped and counted.
    max_prompt_tokens: int = Field(default=256, ge=1)


class OptimizerConfig(_Config):
    # Peak learning rate (AdamW).
    lr: float = Field(default=2e-3, gt=0)
    # Final learning rate of the cosine schedule (ignored by "constant").
    min_lr: float = Field(default=2e-4, ge=0)
    # Learning-rate schedule after warmup.
    schedule: Literal["cosine", "constant"] = "cosine"
    # Fraction of the total optimizer steps spent in linear warmup.
    warmup_ratio: float = Field(default=0.05, ge=0, lt=1)
    # Decoupled weight decay (AdamW).
    weight_decay: float = Field(default=0.0, ge=0)
    # Adam betas.
    betas: tuple[float, float] = (0.9, 0.95)
    # Adam epsilon.
    eps: float = Field(default=1e-8, gt=0)
    # Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if not self.lr <= FLOAT32_MAX:  # also false for NaN
            raise ValueError(
                f"optimizer.lr={self.lr:g}: not a float32 number (largest 3.4e38), the precision the optimizer"
                " steps in; use a learning rate such as 1e-5"
            )
        for i, b in enumerate(self.betas):
            if not 0 <= b < 1:
                raise ValueError(f"optimizer.betas[{i}]={b}: must be in [0, 1), e.g. 0.9")
        if self.schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(
                f"optimizer.min_lr={self.min_lr}: must not exceed optimizer.lr={self.lr} for the cosine schedule"
            )
        return self


class TrainerConfig(_Config):
    # Trainer backend: "torch" (transformers + FSDP2, runs anywhere) or "megatron" (megatron-core GPTModel,
    # tensor parallel; pip install -e '.[megatron]'; runs on CPU too with megatron_spec local).
    backend: Literal["torch", "megatron"] = "torch"
    # Round FP8 scales up to powers of two (TE's default); False keeps plain amax/448 (InfiR2's RL setting).
    fp8_pow2_scales: bool = False
    # Trainer actors (data-parallel ranks); one per GPU on GPU machines.
    num_workers: int = Field(default=1, ge=1)
    # torch backend, FSDP2 (several GPU workers): the dtype the forward all-gathers from the FP32 master shards.
    # "auto": bfloat16 on GPUs computing in bfloat16 (half the gather traffic), float32 on CPU. The masters,
    # optimizer state and gradient reduction stay FP32 either way (trainers/torch/distributed.py).
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Torch backend, several workers: how the ranks share the model. "fsdp": FSDP2 shards parameters, gradients
    # and optimizer state over the ranks (any model size; each rank runs eagerly on FP32 parameters gathered
    # per layer). "replicate": each rank holds the whole model and runs the one-GPU fast path (a BF16 model with
    # FP32 masters, the flat AdamW, CUDA layer graphs, per trainer.param_dtype and trainer.cuda_graphs), and the
    # ranks SUM-all-reduce their FP32 gradients once per step (one message per decoder layer); ~19 bytes per
    # parameter on every GPU (1.5B: ~27 GiB). At 1.5B on 2 x H200 the RL step's training took 0.78 s as
    # replicas, 1.87 s under fsdp, 1.50 s on one GPU (docs/performance.md, "Two GPUs", session 44). "auto":
    # replicate on GPUs when that state is <= 40 GiB (up to ~2.2B parameters, counted from config.json),
    # fsdp above; replicas on CPU (gloo). One worker ignores it (trainer.fsdp_param_dtype asks for one-rank FSDP2).
    data_parallel: Literal["auto", "fsdp", "replicate"] = "auto"
    # Torch backend without FSDP: the dtype of the model's own parameters, what forwards compute with.
    # "bfloat16": a BF16 model (BF16 residual stream and norms, as the rollout engine) with FP32 master weights
    # and FP32 gradient accumulation in the trainer (trainers/torch/master_weights.py; FP8 decoder weights stay
    # FP32, their own masters); at 1.5B x 8K on an H100 13% (BF16) and 10% (FP8) shorter steps than "float32"
    # and a lower peak memory in both (docs/performance.md). "float32": FP32 parameters under BF16 autocast. "auto": bfloat16 where the compute
    # dtype is bfloat16 (GPUs), without FSDP (true_on_policy too: its walk then reads the BF16 parameters and
    # kept FP8 weights the engine receives); float32 elsewhere (the CPU demo).
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Sequences per forward/backward on one worker; gradients accumulate to the global batch. Not used when
    # max_tokens_per_gpu is set: the token budget alone then decides how many rows a micro-batch holds.
    micro_batch_size: int = Field(default=8, ge=1)
    # Token budget of one micro-batch on one worker (padded tokens, or real tokens when packed); None =
    # fixed micro_batch_size. Must hold the longest row: an RL stage checks data.max_prompt_tokens +
    # rollout.max_response_len when the config loads; an SFT row over it fails at the first step.
    max_tokens_per_gpu: int | None = Field(default=None, ge=1)
    # With max_tokens_per_gpu: order the batch's rows by length, longest first, before they are split among
    # the ranks (dealt in turn: each gets as many long rows) and grouped into micro-batches, so rows of like
    # length share a micro-batch and little padding is computed; under cuda_graphs a micro-batch then holds
    # budget // bucket(longest row) rows (the bucket is the length it runs at), so each length bucket is one
    # graph shape. Results come back in batch order; the loss does not depend on the order. At 1.5B on one
    # H100, an RL-shaped batch (256 sequences of 200..8,192 tokens) trained 1.31x (BF16) / 1.33x (FP8) the
    # tokens/s of the unsorted padded layout and 1.05-1.07x that of packed micro-batches, training and
    # scoring 1.06x (FP8); over the first 6 new batches of a run, whose new shapes are captured, 1.006-1.010x
    # packed on an H200 (docs/performance.md, "Packed micro-batches", sessions 37-39).
    sort_by_length: bool = True
    # Torch backend: run each micro-batch as one packed row of its real tokens (no padding computed; attention
    # stays within each sequence: varlen flash attention on CUDA, a block-diagonal mask elsewhere). Same loss
    # and gradients as padded up to rounding; pays when lengths differ a lot (RL responses: 1.23x BF16 and
    # 1.24x FP8 tokens/s over unsorted padded rows on a 256-sequence batch at 1.5B, where padding computed
    # 1.44x the real tokens, docs/performance.md). "auto": packed where varlen
    # flash attention runs (torch backend on a CUDA GPU, BF16/FP16 compute, not true_on_policy, not with
    # model.attn_implementation=eager, which packed rows would replace by varlen flash) and the rows
    # are not sorted by length (sort_by_length with a token budget: sorted padded micro-batches were 1.06x /
    # 1.07x faster than packed ones on that batch, since SDPA's attention kernel beats varlen flash per
    # FLOP), padded elsewhere (CPU: the block-diagonal mask costs more than the padding it saves); true:
    # packed everywhere (the mask on CPU); false: padded.
    pack_sequences: bool | Literal["auto"] = "auto"
    # On a CUDA GPU per rank, without FSDP (one worker, or trainer.data_parallel replicas; megatron: the local
    # spec at TP = 1, trainers/megatron/graphs.py): replay each decoder layer's forward and backward from CUDA
    # graphs when training, and its forward when scoring or evaluating (trainers/layer_graphs.py), one capture per
    # micro-batch shape (at most 64 training and 64 forward-only; others run eagerly); micro-batches, and
    # packed rows, are right-padded to a length bucket (64, 72, 80, ..., 128, 144, ...: eight per doubling,
    # at most 12.5% padding) so that few shapes occur, and run largest first. Takes the host out of the step
    # (Python autograd, cuBLASLt setup, launches: at 1.5B x 2,048 tokens the eager step took 2.0x (BF16) and
    # 3.6x (FP8) the graphed BF16 one; at 8K tokens BF16 gains little); the graphs' memory stays reserved
    # between steps: the largest shape's working memory, two activations per layer for training and three
    # for forward-only graphs, all shared by every shape. Under true_on_policy the graphs replay its
    # invariant walk's layers (log-probs stay bit-equal to the engine's). Not with FSDP or gradient checkpointing (megatron: nor TP > 1 or the te spec). "auto": on where it
    # applies (a CUDA GPU per rank, none of those), BF16 and FP8, and a new shape after the first is captured only if the free memory
    # looks enough; true: required (an error where it cannot be); false: eager.
    cuda_graphs: bool | Literal["auto"] = "auto"
    # Torch backend: RMSNorm and the SwiGLU MLP activation run as one Triton kernel each way
    # (trainers/torch/fused_layers.py) instead of ~5 + ~10 and 2 + 3 torch kernels, saving less for backward;
    # the same numbers up to the order of the norm's FP32 sum; and the attention's rotary embedding of q and k
    # as one kernel each way (trainers/torch/fused_rope.py, torch's bits). "auto": on where it can run (CUDA with
    # Triton, not true_on_policy, which has its own kernels); true: required; false: torch's modules.
    fused_kernels: bool | Literal["auto"] = "auto"
    # Stop after this many optimizer steps (None = as many as the epochs / rollout steps give). The lr schedule
    # then spans these steps (warmup and decay of a shorter run), not the steps the epochs would give.
    max_steps: int | None = Field(default=None, ge=1)
    # Stop the stage, publishing nothing, after this many steps in a row skipped for a non-finite gradient
    # norm (a diverged run); 0 never stops. An RL step counts when all of its optimizer updates were skipped.
    max_consecutive_skips: int = Field(default=3, ge=0)
    # Megatron only: layer spec. "local": megatron's local modules with the project's FP8 linears and SDPA
    # attention (CPU and any GPU); "te": Transformer Engine's spec with TE's blockwise FP8, megatron DDP and the
    # distributed optimizer (GPU with TE; written and contract-tested, never run); "auto": te where TE imports,
    # else local.
    megatron_spec: Literal["auto", "local", "te"] = "auto"
    # Megatron only: tensor-parallel size (allowed sizes depend on the model: config/parallel_rules.py).
    tensor_parallel_size: int = Field(default=1, ge=1)
    # Megatron only: context-parallel size (long RL sequences). Not built: only 1 is accepted (neither megatron
    # layer spec splits sequences across ranks yet).
    context_parallel_size: int = Field(default=1, ge=1)

    @property
    def sorts_rows(self) -> bool:
        """Whether batches are split by length order (``sort_by_length`` applies with a token budget only)."""
        return self.sort_by_length and self.max_tokens_per_gpu is not None

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.num_workers // self.model_parallel_size

    @model_validator(mode="after")
    def _check_buildable(self) -> TrainerConfig:
        # The one place that refuses trainer setups not built yet.
        if self.backend == "megatron" and self.data_parallel != "auto":
            raise ValueError(
                f"trainer.data_parallel={self.data_parallel} is the torch backend's; megatron shards by"
                " tensor_parallel_size and its own data parallelism: leave it at auto"
            )
        if self.backend == "megatron" and self.pack_sequences is True:
            raise ValueError(
                "trainer.pack_sequences=true is implemented by the torch backend only; set it to false with"
                " trainer.backend=megatron"
            )
        if (
            self.cuda_graphs is True
            and self.backend == "megatron"
            and (self.tensor_parallel_size > 1 or self.megatron_spec == "te")
        ):
            raise ValueError(
                "trainer.cuda_graphs=true with trainer.backend=megatron needs tensor_parallel_size=1 and the local"
                " spec (trainers/megatron/graphs.py): leave it at auto, or set it to false"
            )
        if self.param_dtype == "bfloat16" and self.backend != "torch":
            raise ValueError(
                "trainer.param_dtype=bfloat16 is the torch backend's (trainers/torch/master_weights.py): leave it"
                " at auto for megatron, which keeps its own FP32 main parameters"
            )
        if self.fused_kernels is True and self.backend != "torch":
            raise ValueError(
                "trainer.fused_kernels=true is the torch backend's (fused_layers.py); megatron has its own"
                " kernels: leave it at auto or false with trainer.backend=megatron"
            )
        if self.backend == "megatron" and self.context_parallel_size > 1:
            raise ValueError(
                f"trainer.context_parallel_size={self.context_parallel_size}: the megatron trainer feeds whole"
                " sequences to every rank (context parallelism is not built); set it to 1 and use"
                " tensor_parallel_size and gradient checkpointing for long sequences"
            )
        if self.backend == "torch" and self.model_parallel_size > 1:
            raise ValueError(
                f"trainer.tensor_parallel_size={self.tensor_parallel_size}, trainer.context_parallel_size="
                f"{self.context_parallel_size}: the torch backend is data-parallel only (FSDP2); set both to 1"
            )
        return self


class SftTrainerConfig(TrainerConfig):
    # Conversations per optimizer step, summed over all workers.
    global_batch_size: int = Field(default=32, ge=1)
    # Passes over the training data.
    epochs: int = Field(default=1, ge=1)
    # Evaluate (held-out loss and accuracy) every N optimizer steps; 0 = only at the end.
    eval_every: int = Field(default=0, ge=0)
    # Also evaluate the starting model (step 0). Off where that measures nothing new: an untrained model,
    # or a checkpoint the previous stage of a pipeline evaluated at its end (the report then takes that
    # stage's last accuracy as this one's first).
    eval_at_start: bool = True


class RlTrainerConfig(TrainerConfig):
    # Samples per optimizer step, summed over all workers: a divisor of the rollout batch. None (default):
    # the whole batch, one on-policy step per rollout; a smaller one gives PPO-style mini-batches.
    global_batch_size: int | None = Field(default=None, ge=1)


class RolloutConfig(_Config):
    # Engine backend: "native" (transformers + our FP8 W8A8 linears) or "sglang" (SGLang servers).
    backend: Literal["native", "sglang"] = "native"
    # Rollout engine actors.
    num_engines: int = Field(default=1, ge=1)
    # Prompts per optimizer step (the global batch is prompts_per_step x n_samples_per_prompt).
    prompts_per_step: int = Field(default=8, ge=1)
    # Samples per prompt (the GRPO group size).
    n_samples_per_prompt: int = Field(default=8, ge=1)
    # Prompts drawn per sampling round when dynamic sampling refills the batch (>= prompts_per_step).
    over_sampling_prompts: int = Field(default=16, ge=1)
    # Drop groups whose rewards are all equal (no learning signal) and sample more prompts to refill.
    dynamic_sampling: bool = True
    # Sampling rounds allowed per step before training on what was kept.
    max_sampling_rounds: int = Field(default=4, ge=1)
    # Longest response, in tokens (8,192 then 16,384 in the InfiR2 curriculum).
    max_response_len: int = Field(default=64, ge=1)
    # Sampling temperature (1.0 then 1.1 in the InfiR2 curriculum); the trainer scores at the same one.
    temperature: float = Field(default=1.0, gt=0)
    # Nucleus sampling; RL keeps 1.0 so the engine's log-probs are the plain tempered softmax.
    top_p: float = Field(default=1.0, gt=0, le=1)
    # Top-k sampling; -1 disables it (required for exact RL log-probs).
    top_k: int = -1
    # Most sequences decoded together in one engine batch (native: the KV cache holds a call's rows up to this
    # many, fewer where 80% of the free GPU memory does not hold them; the rest wait for free slots).
    max_batch_size: int = Field(default=256, ge=1)
    # Rollout steps (optimizer steps) of the stage.
    num_steps: int = Field(default=10, ge=1)
    # Held-out accuracy every N steps (greedy decoding); 0 = only at start and end.
    eval_every: int = Field(default=0, ge=0)
    # Reward function: "math" (math-verify) or a dotted path "package.module:function".
    reward: str = "math"
    # SGLang only: tensor-parallel size of each engine.
    tensor_parallel_size: int = Field(default=1, ge=1)
    # FP8 checkpoint engines load at start (set by the pipeline from the cast stage); None = use model.path.
    fp8_checkpoint: str | None = None


class WeightSyncConfig(_Config):
    # How tensors travel: Ray's object store (CPU and GPU), CUDA IPC (colocated GPU), NCCL broadcast from trainer
    # rank 0 (engines on GPUs of their own, placement.mode=disaggregate; on CPU the same code runs over gloo).
    # "auto": cuda_ipc when native engines share the trainer's GPUs (placement.mode=colocate), nccl when native
    # engines have GPUs of their own (placement.mode=disaggregate), else object_store (CPU, SGLang engines).
    transport: Literal["auto", "object_store", "cuda_ipc", "nccl"] = "auto"
    # Upper bound of one bucket of tensors, in MiB (object_store and nccl: it bounds the object-store and
    # receive-buffer memory; cuda_ipc sends one buffer per push, see weight_sync.transport.CudaIpcTransport).
    bucket_size_mb: int = Field(default=512, ge=1)
    # Decoder layers of one engine checked after every push against what was sent, by digest (0 = off); the
    # window moves on each round of engines, and the embedding and final norm ride with layer 0's.
    self_check_layers: int = Field(default=2, ge=0)
    # Seconds a push may take before it is reported as hung (nccl: also each collective's limit inside the
    # trainer and engine processes, so a dead engine fails the push instead of hanging the trainer).
    timeout_s: float = Field(default=600.0, gt=0)


class PlacementConfig(_Config):
    # "colocate": a trainer and an engine share each GPU (memory released/resumed between phases);
    # "disaggregate": engines get GPUs of their own.
    mode: Literal["colocate", "disaggregate"] = "colocate"
    # Use GPUs: "auto" when Ray sees any, else CPU bundles.
    use_gpu: Literal["auto", "yes", "no"] = "auto"

    @field_validator("use_gpu", mode="before")
    @classmethod
    def _yes_no_as_typed(cls, value: Any) -> Any:
        # YAML reads an unquoted yes/no as a boolean: give back the word the user typed.
        return {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool) else value

    # CPUs reserved per actor in CPU bundles.
    cpus_per_actor: float = Field(default=1.0, gt=0)
    # torch CPU threads of each trainer worker (0: Ray's default, the CPUs the actor reserves). On a CPU
    # machine an RL stage's trainer and engines take turns (generate, then train), so the trainer may use
    # every core while reserving one: the demo's RL stages set 2 on its 2 cores (train step 3.7 -> 2.2 s).
    # Engines keep one thread: the demo's tiny decode batches sampled slower on two (1.8 -> 2.3 s a step).
    trainer_threads: int = Field(default=0, ge=0)


class CheckpointConfig(_Config):
    # Save every N optimizer steps (0 = only at the end of the stage).
    save_every: int = Field(default=0, ge=0)
    # Checkpoints kept; older ones are deleted after a successful save.
    keep_last: int = Field(default=2, ge=1)
    # Resume from the newest checkpoint in the run directory when one exists.
    resume: bool = True
    # Let a resume continue with a config that differs from the checkpoints' in fields that change training
    # (stages/guards.py lists the others); False refuses it, naming the fields. Each run's config is kept
    # in RUN_DIR/config_segments/.
    allow_config_change: bool = False


class MetricsConfig(_Config):
    # Write TensorBoard event files under RUN_DIR/tensorboard.
    tensorboard: bool = True
    # Export metrics through ray.util.metrics (Ray dashboard / Prometheus).
    ray_metrics: bool = True
    # Show a progress bar on local runs.
    progress_bar: bool = True
    # RL with an FP8 trainer: also score every rollout batch with the trainer's FP8 linears off (BF16 on a
    # GPU, FP32 on CPU) and log the mismatch a bf16_train_fp8_rollout trainer would have against the same
    # engine and samples (names.MISMATCH_DENSE_*). Costs one extra forward pass per step.
    dense_trainer_mismatch: bool = False
