"""The embedded trainer backend: a transformers causal LM, AdamW, optional blockwise FP8, data parallel.

Precision. Parameters are loaded in FP32: they are the master weights, and AdamW's moments are FP32 too.
`trainer.param_dtype` (default `auto`) says what the model computes with. "bfloat16" (auto on GPUs computing
in BF16, without FSDP): the model's parameters become BF16 and the trainer keeps the FP32
masters and FP32 gradient accumulation beside them (master_weights.py; the FP8 linears' weights stay FP32, their
own masters), so activations, the residual stream and the norms are BF16 as in the rollout engine, and no
forward casts a weight; on CUDA AdamW is one Triton kernel per layer that also writes the BF16 copy
(trainers/flat_adamw.py). At 1.5B x 8K on an H100 that made the BF16 step 13% and the FP8 step 10% shorter
(docs/performance.md). "float32" (auto on CPU, the demo): FP32 parameters under `torch.autocast(bfloat16)`
when the compute dtype is bfloat16, with no second copy. With
`fp8=True` (the stage's precision: SFT `fp8`, RL `unified_fp8`) the decoder linears are swapped for
`fp8.Fp8Linear`, which quantizes the FP32 master weight into 128x128 FP8 blocks each forward (cached until the
weight changes) and runs fprop, dgrad and wgrad in FP8; embeddings, norms and lm_head stay in the compute dtype.

A step. `train_step(batches, loss_fn, total_units)` runs forward/backward over this rank's
micro-batches, scaling each micro-batch's mean loss by num_units / total_units (units summed over the
global batch, all ranks) so the accumulated gradient is that of the global-batch mean, whatever the
split. Gradients are then reduced over ranks (see distributed.py), the global norm is measured, and
a non-finite norm skips the update: gradients are dropped, neither the optimizer nor the lr
schedule advances, and `TrainStats.skipped` is True. Otherwise the norm is clipped to
`optimizer.grad_clip` (0 = off) and AdamW and the schedule step. On CUDA AdamW is fused and the skip
is decided on the device (optim.step_unless_nonfinite): the host waits once, after the update is queued.

Loss functions never see logits: the model's lm_head is run chunk by chunk into per-token log-probs (and
entropies when asked) at the positions the loss needs (scoring.py, trainers/token_scores.py).

`trainer.cuda_graphs` ("auto", the default: on for a trainer on one CUDA GPU without FSDP or gradient
checkpointing, BF16 and FP8, true_on_policy too; off elsewhere): the decoder layers' forward and backward of
training micro-batches, and their forward in scoring and evaluation, are replayed from CUDA graphs
(trainers/layer_graphs.py); micro-batches (packed rows too) are padded to a length bucket and run largest first,
gradients are zeroed in place (the graphs add into `.grad`) and autocast keeps no weight-cast cache. An eager
step on a GPU is host-bound at small micro-batches: at 1.5B x 2,048 tokens eager BF16 took 2.0x and eager FP8
3.6x the graphed BF16 step (docs/performance.md).

`trainer.fused_kernels` ("auto": on for CUDA with Triton, not under true_on_policy): the model's RMSNorm and
SwiGLU MLP modules run one Triton kernel each way (fused_layers.py), and the token scores' softmax work one
Triton pass per chunk each way (token_scores_fused.py), in both precisions; the CPU keeps torch's.

FP8 on CUDA (not under true_on_policy): each attention's q, k and v projections run as one FP8 linear
(fp8/grouped.py; 2-3% of a 1.5B step, docs/performance.md); the CPU demo keeps three.

`true_on_policy=True` (RL stages with the setting of that name; one CUDA GPU, BF16 compute, no FSDP):
every forward is the batch-invariant walk the rollout engine decodes with (models/invariant.py), so the
trainer's log-probs of the engine's samples equal the engine's bit for bit; backward is plain torch math.
Under the CUDA graphs its decoder layers replay the walk's layers (invariant_scoring.layer_forwards).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import get_total_norm
from transformers import PreTrainedModel

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.fp8 import grouped
from infir2_rl.fp8.linear import Fp8Linear, fp8_disabled, mark_kept_inputs, swap_to_fp8_training
from infir2_rl.metrics.logger import peak_memory_gb
from infir2_rl.trainers.flat_adamw import FlatAdamW
from infir2_rl.trainers.layer_graphs import LayerGraphs, drop_for_room
from infir2_rl.trainers.microbatch import MetricMeans, bucket_length, merge_on_host, pad_length
from infir2_rl.trainers.optim import build_optimizer, build_scheduler, step_unless_nonfinite
from infir2_rl.trainers.torch import checkpoint_io as io
from infir2_rl.trainers.torch import distributed as D
from infir2_rl.trainers.torch import fused_layers, varlen_attention
from infir2_rl.trainers.torch.export_listing import UNLISTABLE, ExportListing, ExportRecorder
from infir2_rl.trainers.torch.master_weights import MasterWeights
from infir2_rl.trainers.torch.reference import load_reference_model
from infir2_rl.trainers.torch.scoring import score_tokens
from infir2_rl.types import LossFn, TokenBatch, TokenScores, TrainStats

os.environ.setdefault("HF_HUB_OFFLINE", "1")
log = logging.getLogger(__name__)


def dropout_in(model: torch.nn.Module) -> list[str]:
    """Where ``model`` drops activations in training mode: ``nn.Dropout`` modules with p > 0, and config rates
    named ``*dropout``/``*pdrop`` above 0 (transformers' attention reads its rate from the config)."""
    found = [f"{n}.p={m.p}" for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    for key, value in sorted(vars(config).items() if config is not None else []):
        if key.endswith(("dropout", "pdrop")) and isinstance(value, (int, float)) and value > 0:
            found.append(f"config.{key}={value}")
    return found


def resolve_param_dtype(setting: str, compute_dtype: torch.dtype, fsdp: bool) -> torch.dtype:
    """The model parameters' dtype (trainer.param_dtype): bfloat16 means a BF16 model with FP32 masters."""
    blockers = [
        name
        for name, present in {
            f"compute dtype {compute_dtype} (model.dtype)": compute_dtype != torch.bfloat16,
            "FSDP (trainer.fsdp_param_dtype sets what it gathers)": fsdp,
        }.items()
        if present
    ]
    if setting == "bfloat16" and blockers:
        raise ValueError(
            "trainer.param_dtype=bfloat16 needs bfloat16 compute without FSDP; here: " + ", ".join(blockers)
        )
    if setting == "bfloat16" or (setting == "auto" and not blockers):
        return torch.bfloat16
    return torch.float32


def resolve_compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on CPU; explicit settings are honoured."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


def profile_step_from_env() -> int | None:
    """``INFIR2_PROFILE_TRAIN_STEP``: the optimizer step (1, 2, ...) to profile, None when unset; another value
    is refused in one line (it would never match a step, and nothing would say so)."""
    raw = os.environ.get("INFIR2_PROFILE_TRAIN_STEP", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"INFIR2_PROFILE_TRAIN_STEP={raw!r}: give the optimizer step to profile, 1 or more")
    return int(raw)


def resolve_pack_sequences(
    setting: bool | str,
    device: torch.device,
    compute_dtype: torch.dtype,
    true_on_policy: bool,
    sorted_rows: bool = False,
    eager_attention: bool = False,
) -> bool:
    """``trainer.pack_sequences``: "auto" packs where varlen flash attention runs (a CUDA device, BF16/FP16
    compute, not true_on_policy, whose walk scores padded rows; not where ``model.attn_implementation`` asks
    for eager attention, which packed rows would replace by varlen flash) and the rows are not sorted by length
    (``sorted_rows``: trainer.sort_by_length with a token budget), and pads elsewhere. Sorted padded
    micro-batches compute little padding and keep SDPA's attention kernel, ~2x faster per FLOP on an H100
    than varlen flash: 1.06-1.07x the tokens/s of packing on an RL-shaped batch at 1.5B (docs/performance.md,
    "Packed micro-batches", session 37)."""
    if setting != "auto":
        return bool(setting)
    return (
        not true_on_policy
        and not sorted_rows
        and not eager_attention
        and compute_dtype in (torch.bfloat16, torch.float16)
        and varlen_attention.varlen_available(device, warn=False)
    )


class TorchTrainer:
    """One data-parallel rank of the torch trainer (implements `TrainerBackend`).

    Call after the process group is initialized (when there is more than one rank). `fsdp=None`
    shards with FSDP2 on GPUs when there are several ranks, or on one GPU when `fsdp_param_dtype` is set
    to bfloat16 (a one-rank group is made if none exists), and replicates (gradient all-reduce) otherwise;
    True/False force it (FSDP2 also runs on CPU over gloo, which is how it is tested).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        optimizer_cfg: OptimizerConfig,
        *,
        fp8: bool,
        total_steps: int,
        seed: int = 0,
        device: str | torch.device | None = None,
        fsdp: bool | None = None,
        reference: bool = False,
        true_on_policy: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank, self.world_size = D.rank_and_world()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.compute_dtype = resolve_compute_dtype(model_cfg.dtype, self.device)
        self.optimizer_cfg = optimizer_cfg
        torch.manual_seed(seed)
        path = model_cfg.path
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float32,
            attn_implementation=model_cfg.attn_implementation,
            local_files_only=True,
        )
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model.config.use_cache = False
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Packed micro-batches (trainer.pack_sequences): see scoring.py. The trainer group asks for the
        # resolved setting (TrainerWorker.packs_sequences), since it splits batches into micro-batches.
        sorted_rows = trainer_cfg.sorts_rows
        eager_attention = model_cfg.attn_implementation == "eager"
        self.pack_sequences = resolve_pack_sequences(
            trainer_cfg.pack_sequences, self.device, self.compute_dtype, true_on_policy, sorted_rows,
            eager_attention,
        )  # fmt: skip
        if trainer_cfg.pack_sequences == "auto" and self.device.type == "cuda":
            why = " (rows sorted by length: trainer.sort_by_length)" if sorted_rows else ""
            why = " (model.attn_implementation=eager)" if eager_attention else why
            log.info("trainer.pack_sequences=auto: %s%s", "packed" if self.pack_sequences else "padded", why)
        elif self.pack_sequences and eager_attention and self.device.type == "cuda":
            log.warning(
                "trainer.pack_sequences=true: packed micro-batches run varlen flash attention, not the eager"
                " attention model.attn_implementation asks for"
            )
        self.fp8_linears: list[str] = []
        self.pow2_scales = trainer_cfg.fp8_pow2_scales
        if fp8:
            self.fp8_linears = swap_to_fp8_training(model, pow2_scales=trainer_cfg.fp8_pow2_scales)
            if not self.fp8_linears:
                log.warning(
                    "FP8 precision but the model has no decoder linears to swap: training in BF16/FP32"
                )
            elif self.device.type == "cuda" and not true_on_policy:
                # q, k and v as one FP8 linear (fp8/grouped.py); the CPU demo and the true_on_policy walk
                # keep three.
                groups = grouped.group_projections(model)
                log.info("FP8 q|k|v projections run as one linear in %d attention layers", groups)
                mark_kept_inputs(model)  # o_proj keeps no FP8 copy of the output SDPA keeps (fp8/linear.py)
        # trainer.fused_kernels: RMSNorm, SwiGLU and the rotary embedding as one Triton kernel each way.
        fused_ok = fused_layers.available(self.device) and not true_on_policy
        if trainer_cfg.fused_kernels is True and not fused_ok:
            raise ValueError(
                "trainer.fused_kernels=true needs a CUDA device with Triton and true_on_policy off; here: "
                f"device {self.device}, true_on_policy={true_on_policy}"
            )
        self.fused_layers: dict[str, int] = {}
        if trainer_cfg.fused_kernels is True or (trainer_cfg.fused_kernels == "auto" and fused_ok):
            self.fused_layers = fused_layers.apply_fused_layers(model)
            if fp8:  # the norms quantize their outputs for the FP8 linears that read them
                self.fused_layers["rms_norm_fp8"] = fused_layers.link_norms_to_fp8_linears(model)
            log.info("trainer.fused_kernels: %s", self.fused_layers)
        model.to(self.device)  # type: ignore[arg-type]  # transformers' stub of .to is too narrow
        # What FSDP2 gathers for the forward (trainer.fsdp_param_dtype; distributed.py says what changes).
        self.fsdp_param_dtype = D.resolve_fsdp_param_dtype(
            trainer_cfg.fsdp_param_dtype, self.device, self.compute_dtype
        )
        if fsdp is None:
            # One GPU runs FSDP2 (on a group of its own) only when fsdp_param_dtype is set to bfloat16: the
            # forward then sees BF16 copies of the masters, as the rollout engine holds them. At 1.5B that
            # lowered the train/rollout K3 by only 7% (FP8) / 16% (BF16) and cost 38% / 17% step time
            # (docs/mismatch.md, source 1), so "auto" keeps the plain path there.
            fsdp = self.device.type == "cuda" and (
                self.world_size > 1 or trainer_cfg.fsdp_param_dtype == "bfloat16"
            )
        if fsdp and self.world_size == 1:
            D.ensure_one_rank_group()
        if fsdp:
            D.apply_fsdp2(model, self.fsdp_param_dtype)
        self.model: PreTrainedModel = model
        self.fsdp = D.is_fsdp(model)
        # export_weights' listing per fp8 flag (export_listing.py): an ExportListing, or UNLISTABLE
        self._export_listings: dict[bool, object] = {}
        self.true_on_policy = true_on_policy
        if true_on_policy:
            self._check_true_on_policy()
        # trainer.param_dtype: a BF16 model whose FP32 masters the trainer keeps (master_weights.py). The FP8
        # decoder linears' weights are only ever quantized: they stay FP32, their own masters.
        self.master_weights: MasterWeights | None = None
        if resolve_param_dtype(trainer_cfg.param_dtype, self.compute_dtype, self.fsdp) == torch.bfloat16:
            self.master_weights = MasterWeights(model)
        # trainer.cuda_graphs: the decoder layers' forward and backward replayed from CUDA graphs (trainers/layer_graphs.py).
        self.layer_graphs: LayerGraphs | None = None
        blockers = [
            name
            for name, present in {
                f"device {self.device}": self.device.type != "cuda",
                "FSDP": self.fsdp,
                "gradient checkpointing": model_cfg.gradient_checkpointing,
            }.items()
            if present
        ]
        if trainer_cfg.cuda_graphs is True and blockers:
            raise ValueError(
                "trainer.cuda_graphs=true needs one CUDA device without FSDP or gradient checkpointing; "
                f"here: {', '.join(blockers)}"
            )
        # "auto" graphs both precisions (session 26): eager steps are host-bound at small micro-batches (BF16
        # 2.0x its graphed step at 1.5B x 2K, 1.4x at 4K; FP8 more), and the colocated 1.5B RL run with BF16
        # graphs reserved less than eager BF16 (51.8 against 60.7 GiB). Until then BF16 stayed eager: its
        # graphs' pool had left a colocated engine without memory, before the BF16 model and fused kernels.
        # Under true_on_policy the graphs capture the invariant walk's layers (invariant_scoring.py), which the
        # eager walk runs host-bound: replays run the same kernels, so the log-probs stay the engine's.
        if trainer_cfg.cuda_graphs is True or (trainer_cfg.cuda_graphs == "auto" and not blockers):
            forwards = None
            if true_on_policy:
                from infir2_rl.trainers.torch import invariant_scoring

                forwards = invariant_scoring.layer_forwards(self.model)
            self.layer_graphs = LayerGraphs(
                self.model, check_memory=trainer_cfg.cuda_graphs == "auto", forwards=forwards
            )
        if trainer_cfg.cuda_graphs == "auto" and self.device.type == "cuda":
            log.info(
                "trainer.cuda_graphs=auto: %s",
                "decoder layers replayed from CUDA graphs"
                if self.layer_graphs
                else f"eager ({', '.join(blockers)})",
            )
        # Packed rows under the layer graphs are padded to a few lengths (scoring.score_tokens).
        self.packed_length: Callable[[int], int] | None = (
            bucket_length if self.layer_graphs is not None and self.pack_sequences else None
        )
        self.model.train()
        # Where the model drops activations in training: its training forward's log-probs are then not the policy's
        # (train_step(keep_logprobs=True) refuses).
        self.dropout = dropout_in(self.model)
        # What the optimizer steps, in the model's parameter order whatever param_dtype is (so that optimizer
        # states in checkpoints line up): each parameter, or its FP32 master.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.master_weights is not None:
            self.params = self.master_weights.optimizer_params  # type: ignore[assignment]
        self.optimizer = build_optimizer(self.params, optimizer_cfg, self.master_weights)
        self.scheduler = build_scheduler(self.optimizer, optimizer_cfg, total_steps)
        self.step = 0
        self.num_skipped = 0
        # algorithm.kl_coef > 0: the frozen starting model the KL is measured against (None otherwise).
        self.reference: PreTrainedModel | None = None
        if reference:
            self.reference = load_reference_model(
                model_cfg,
                fp8=bool(self.fp8_linears),
                pow2_scales=self.pow2_scales,
                device=self.device,
                fsdp=self.fsdp,
                param_dtype=self.fsdp_param_dtype,
                bf16_model=self.master_weights is not None,
            )

    def _check_true_on_policy(self) -> None:
        from infir2_rl.models import invariant, invariant_ops

        invariant.check_model(self.model)
        problems = []
        if not invariant_ops.kernels_available(self.device):
            problems.append(f"a CUDA device with Triton (device {self.device})")
        if self.compute_dtype != invariant.DTYPE:
            problems.append(f"compute dtype {invariant.DTYPE} (model.dtype gives {self.compute_dtype})")
        if self.fsdp or self.world_size > 1:
            problems.append("one trainer worker without FSDP (the invariant walk bypasses FSDP's hooks)")
        if problems:
            raise ValueError("true_on_policy needs " + "; ".join(problems))
        for line in invariant.plan_gemms(self.model, self.device):
            log.info("true_on_policy trainer: %s", line)

    # ------------------------------------------------------------------ forward helpers
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        # The CUDA graphs cannot hold autocast's cache of weight casts (trainers/layer_graphs.py); it saves nothing here
        # anyway, since each weight is cast once per forward.
        return torch.autocast(
            device_type=self.device.type, dtype=self.compute_dtype, cache_enabled=self.layer_graphs is None
        )

    def _scores(
        self,
        batch: TokenBatch,
        select_BL: Tensor,
        temperature: float = 1.0,
        need_entropy: bool = False,
        model: PreTrainedModel | None = None,
        num_selected: int | None = None,
    ) -> TokenScores:
        """Per-token log-probs (and entropies) at the selected positions, never the full logits.
        ``num_selected``: the count of ``select_BL & attention_mask`` at t >= 1 when the host knows it."""
        if self.true_on_policy:
            from infir2_rl.trainers.torch import invariant_scoring

            logp, entropy = invariant_scoring.score_tokens(
                self.model if model is None else model,
                batch.input_ids,
                select_BL & (batch.attention_mask > 0),
                temperature=temperature,
                need_entropy=need_entropy,
                # the policy's layers are graphed (under trainer.cuda_graphs); the reference model's are not
                layers=self.layer_graphs.call if self.layer_graphs is not None and model is None else None,
            )
            return TokenScores(logprobs_BL=logp, entropy_BL=entropy)
        return score_tokens(
            self.model if model is None else model,
            batch.input_ids,
            batch.attention_mask,
            select_BL,
            temperature=temperature,
            need_entropy=need_entropy,
            compute_dtype=self.compute_dtype,
            packed=self.pack_sequences,
            autocast=self.autocast,
            packed_length=self.packed_length if model is None else None,  # the policy's layers are graphed
            fused=bool(self.fused_layers),  # trainer.fused_kernels: the token scores' Triton passes too
            # Counted on the host (TokenBatch.to): no wait for the device in the micro-batch.
            lengths=batch.counts.lengths if batch.counts is not None else None,
            num_selected=num_selected,
        )

    def _loss_scores(self, batch: TokenBatch, loss_fn: LossFn) -> TokenScores:
        num = batch.counts.num_targets if batch.counts is not None else None
        return self._scores(
            batch, batch.loss_mask > 0, loss_fn.temperature, loss_fn.needs_entropy, num_selected=num
        )

    def _token_scores(
        self, batch: TokenBatch, temperature: float = 1.0, model: PreTrainedModel | None = None
    ) -> Tensor:
        """Log-probs of every real token after the first of its row (old and reference log-probs)."""
        num = sum(max(n - 1, 0) for n in batch.counts.lengths) if batch.counts is not None else None
        return self._scores(
            batch, batch.attention_mask > 0, temperature, model=model, num_selected=num
        ).logprobs_BL

    def _dummy_scores(self, model: PreTrainedModel | None = None) -> Tensor:
        """A one-token forward (FSDP: ranks with fewer micro-batches still join every collective)."""
        return self._token_scores(self._dummy_batch(), model=model)

    def _padded(self, batches: Sequence[TokenBatch]) -> list[TokenBatch | None]:
        """Under FSDP every rank must run as many forwards as the busiest one: pad with None (dummy)."""
        items: list[TokenBatch | None] = [b.to(self.device) for b in batches]
        if self.fsdp:
            items += [None] * (D.all_reduce_max_int(len(items), self.device) - len(items))
        return items

    def _graph_order(self, items: list[TokenBatch | None]) -> list[int]:
        """The order micro-batches run in: as given, or largest first under the layer graphs. The first capture
        sizes the graphs' shared memory pool and smaller shapes' captures then fit in it (bench/train_packed.py,
        1.5B, H100: +24.9-28.4 GiB for the largest shape, then 0.0-0.35 GiB for each of 11-15 smaller ones; in
        rollout order a padded batch grew it by 14.8, 8.8 and 3.6 GiB for its first three shapes)."""
        order = list(range(len(items)))
        if self.layer_graphs is None:
            return order

        def tokens(batch: TokenBatch | None) -> int:
            if batch is None:
                return 0
            if self.pack_sequences:  # the length scoring pads the packed row to
                real = (
                    sum(batch.counts.lengths) if batch.counts is not None else int(batch.attention_mask.sum())
                )
                return self.packed_length(real) if self.packed_length is not None else real
            rows, length = batch.input_ids.shape
            return rows * bucket_length(length)

        sizes = [tokens(b) for b in items]
        return sorted(order, key=lambda i: -sizes[i])

    @property
    def pads_to_buckets(self) -> bool:
        """Whether padded micro-batches run right-padded to their length bucket (the layer graphs, not packed:
        scoring pads the packed row instead); the trainer group then counts the bucket against the token
        budget (``microbatch.micro_batches(bucketed=)``)."""
        return self.layer_graphs is not None and not self.pack_sequences

    def _bucketed(self, batch: TokenBatch) -> TokenBatch:
        """With the layer graphs: ``batch`` right-padded to its length bucket, so that few shapes occur."""
        if not self.pads_to_buckets:
            return batch
        return pad_length(batch, bucket_length(batch.input_ids.shape[1]))

    def _dummy_batch(self) -> TokenBatch:
        ids = torch.zeros(1, 2, dtype=torch.long)
        return TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.zeros(1, 2)).to(
            self.device
        )

    def invalidate_fp8_cache(self) -> None:
        for m in self.model.modules():
            if isinstance(m, Fp8Linear):
                m.invalidate_fp8_cache()

    def fp8_step_boundary(self) -> None:
        """Forget the FP8 weights at a step boundary, unless the optimizer keeps them current. FSDP may refill
        unsharded parameters in place without a version bump, and torch's fused AdamW updates the weights
        without one; the flat AdamW quantizes each FP8 linear's master into its kept FP8 weight as it updates
        it (trainers/flat_adamw.py), so they stay valid and no forward quantizes them again."""
        if not (isinstance(self.optimizer, FlatAdamW) and self.optimizer.keeps_fp8):
            self.invalidate_fp8_cache()

    # ------------------------------------------------------------------ TrainerBackend
    def train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool = False
    ) -> TrainStats:
        if keep_logprobs and self.dropout:
            raise ValueError(
                f"train_step(keep_logprobs=True): the model drops activations in training ({', '.join(self.dropout)}),"
                " so its training forward's log-probs are not the policy's; set the dropout to 0 for RL"
            )
        # INFIR2_PROFILE_TRAIN_STEP=N: torch.profiler over optimizer step N, tables to INFIR2_PROFILE_DIR
        # (docs/monitoring.md). A debugging aid for GPU runs; off by default.
        if profile_step_from_env() == self.step + 1:
            return self._profiled_train_step(batches, loss_fn, total_units, keep_logprobs)
        return self._train_step(batches, loss_fn, total_units, keep_logprobs)

    def _profiled_train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool
    ) -> TrainStats:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            stats = self._train_step(batches, loss_fn, total_units, keep_logprobs)
        out_dir = Path(os.environ.get("INFIR2_PROFILE_DIR", "."))
        out_dir.mkdir(parents=True, exist_ok=True)
        # Never over another trainer's profile of the same step (a bench runs several trainers in one process)
        out = out_dir / f"train_step{self.step}_rank{self.rank}.txt"
        copy = 2
        while out.exists():
            out, copy = out_dir / f"train_step{self.step}_rank{self.rank}.{copy}.txt", copy + 1
        averages = prof.key_averages()
        sort = "device_time_total" if self.device.type == "cuda" else "cpu_time_total"
        out.write_text(
            f"step {self.step}, wall {stats.step_time_s * 1e3:.1f} ms\n"
            + averages.table(sort_by=sort, row_limit=60)
            + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=30)
        )
        log.info("profile of train step %d written to %s", self.step, out)
        return stats

    def _train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool
    ) -> TrainStats:
        if total_units < 1:
            raise ValueError(
                f"total_units={total_units}: the global batch has no loss units (empty loss mask?)"
            )
        start = time.perf_counter()
        self.model.train()
        self.fp8_step_boundary()
        if self.master_weights is not None and self.layer_graphs is not None:
            self.master_weights.ensure_grads()  # the graphs add into it (eager: allocated by the first gradient)
        # Loss weight of FSDP2's averaging reduce-scatter: undo its division by world size.
        grad_scale = float(self.world_size) if self.fsdp else 1.0
        # Loss and token sums stay on the device until the step is queued (no per-micro-batch host sync).
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        num_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        metrics = MetricMeans()
        num_sequences = 0
        items = self._padded(batches)
        kept: list[Tensor | None] = [None] * len(items)  # keep_logprobs: per micro-batch, in the order given
        for i in self._graph_order(items):
            batch = items[i]
            if batch is None:
                (self._dummy_scores().sum() * 0.0).backward()
                continue
            length = batch.input_ids.shape[1]
            batch = self._bucketed(batch)  # a few lengths, so that a few captured graphs serve them all
            scores = self._loss_scores(batch, loss_fn)
            if keep_logprobs:
                kept[i] = scores.logprobs_BL[:, :length].detach()
            out = loss_fn(scores, batch)
            weight = out.num_units / total_units
            (out.loss * (weight * grad_scale)).backward()
            loss_sum += out.loss.detach().double() * weight
            metrics.add(out)
            num_tokens += batch.attention_mask.sum()
            num_sequences += batch.num_sequences
        if self.world_size > 1 and not self.fsdp:  # replicas: sum the gradients of every rank
            if self.master_weights is not None:
                self.master_weights.all_reduce_grads()  # in place, per segment
            else:
                D.all_reduce_grads_(self.params)
        grad_norm = self._grad_norm()
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = step_unless_nonfinite(self.optimizer, self.params, grad_norm, self.optimizer_cfg.grad_clip)
        if self.master_weights is not None and not isinstance(self.optimizer, FlatAdamW):
            self.master_weights.copy_to_model()  # (FlatAdamW writes the BF16 copy as it updates)
        # Torch's fused AdamW (CUDA) updates the weights without bumping their version counters, so the FP8
        # weight caches cannot see the update: without this the next export sent the pre-update FP8 bytes.
        self.fp8_step_boundary()
        if skipped:
            self.num_skipped += 1
            log.warning("step %d: gradient norm is %s: update skipped", self.step + 1, grad_norm.item())
        else:
            self.scheduler.step()
        self._zero_grads()
        self.step += 1
        names = self._metric_names(metrics.weights)
        totals = self._sum_over_ranks(
            [loss_sum.item(), num_tokens.item(), num_sequences, *metrics.totals(names)]
        )
        return TrainStats(
            step=self.step,
            loss=totals[0],
            grad_norm=float(grad_norm.item()),
            lr=lr,
            num_tokens=int(round(totals[1])),
            num_sequences=int(round(totals[2])),
            skipped=skipped,
            step_time_s=time.perf_counter() - start,
            metrics=MetricMeans.means(names, totals[3:]),
            logprobs=merge_on_host(kept) if keep_logprobs else None,
        )

    def _zero_grads(self) -> None:
        # The backward graphs add into the gradient tensors they were captured with: keep those (zeroed). Eager,
        # the masters' per-layer gradient buffers are freed, as set_to_none frees .grad.
        if self.master_weights is None:
            self.optimizer.zero_grad(set_to_none=self.layer_graphs is None)
            return
        if self.layer_graphs is None:
            self.master_weights.release_grads()
        else:
            self.master_weights.zero_grad()

    def _grad_norm(self) -> Tensor:
        if self.master_weights is not None:
            return self.master_weights.grad_norm()
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the full value is the global norm
            norm = norm.full_tensor()
        return norm.float()

    def make_room(self, wanted_bytes: int) -> bool:
        """Before a colocated rollout short of memory: cached blocks back, then the layer graphs dropped
        (``layer_graphs.drop_for_room``). True when the graphs went."""
        return drop_for_room(self.device, wanted_bytes, self.layer_graphs)

    def _metric_names(self, local: dict[str, float]) -> list[str]:
        """Loss metric names over all ranks (a rank without micro-batches has none), in one order."""
        if self.world_size == 1:
            return sorted(local)
        gathered: list[list[str] | None] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, sorted(local))
        return sorted({n for names in gathered for n in names or []})

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        D.all_reduce_sum_([t])
        return t.cpu().tolist()

    @torch.no_grad()
    def forward_logprobs(
        self, batches: Sequence[TokenBatch], temperature: float = 1.0, fp8: bool = True
    ) -> list[Tensor]:
        self.model.eval()
        self.fp8_step_boundary()
        with contextlib.nullcontext() if fp8 else fp8_disabled(self.model):
            out = self._forward_logprobs(batches, temperature)
        self.model.train()
        return out

    @torch.no_grad()
    def forward_ref_logprobs(self, batches: Sequence[TokenBatch], temperature: float = 1.0) -> list[Tensor]:
        """Per-token log-probs under the frozen reference model (see reference.py), like forward_logprobs."""
        if self.reference is None:
            raise RuntimeError(
                "forward_ref_logprobs: this trainer holds no reference model (built only when"
                " algorithm.kl_coef > 0)"
            )
        return self._forward_logprobs(batches, temperature, self.reference)

    def _forward_logprobs(
        self, batches: Sequence[TokenBatch], temperature: float, model: PreTrainedModel | None = None
    ) -> list[Tensor]:
        items = self._padded(batches)
        out: list[Tensor | None] = [None] * len(items)
        for i in self._graph_order(items):
            batch = items[i]
            if batch is None:
                self._dummy_scores(model)
                continue
            length = batch.input_ids.shape[1]
            if model is None:  # the policy model's layers are graphed; the reference model's are not
                batch = self._bucketed(batch)
            out[i] = self._token_scores(batch, temperature, model)[:, :length]
        # To the host after the last micro-batch is queued: a copy per micro-batch waited for each in turn.
        return [t.cpu() for t in out if t is not None]  # in the order given (dummies have none)

    @torch.no_grad()
    def evaluate_loss(self, batches: Sequence[TokenBatch], loss_fn: LossFn) -> tuple[float, int]:
        """(sum over micro-batches of loss x units, units) on this rank, without gradients."""
        self.model.eval()
        self.fp8_step_boundary()
        # The sum stays on the device (FP64: the same arithmetic as summing Python floats) and comes to the host
        # once, after the last micro-batch: a read per micro-batch made the host wait for each in turn.
        total: Tensor | float = 0.0
        units = 0
        items = self._padded(batches)
        for batch in (items[i] for i in self._graph_order(items)):
            if batch is None:
                self._dummy_scores()
                continue
            batch = self._bucketed(batch)
            out = loss_fn(self._loss_scores(batch, loss_fn), batch)
            total = total + out.loss.detach().double() * out.num_units
            units += out.num_units
        self.model.train()
        return float(total), units

    def export_weights(self, fp8: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors for the engines; with ``fp8`` the decoder linears as (weight fp8, weight_scale_inv),
        dense tensors in the compute dtype, a tied lm_head left out (``trainers.engine_export``). Collective
        under FSDP."""
        from infir2_rl.trainers.engine_export import for_engines

        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        yield from for_engines(self._export_as_held(fp8), self.compute_dtype, tied)

    def _export_as_held(self, fp8: bool) -> Iterator[tuple[str, Tensor]]:
        """Without FSDP, the tensors of the first walk again while the model holds them (export_listing.py);
        a walk whose tensors the model does not all hold (quantized on the fly) runs every push."""
        if self.fsdp:
            yield from self._walk_export(fp8)  # collective: every rank gathers every push
            return
        listing = self._export_listings.get(fp8)
        if isinstance(listing, ExportListing) and listing.current():
            yield from listing
            return
        if listing is UNLISTABLE:
            yield from self._walk_export(fp8)
            return
        recorder = ExportRecorder(self.model)
        for name, tensor in self._walk_export(fp8):
            recorder.add(name, tensor)
            yield name, tensor
        self._export_listings[fp8] = recorder.listing() or UNLISTABLE

    def _walk_export(self, fp8: bool) -> Iterator[tuple[str, Tensor]]:
        from infir2_rl.fp8.checkpoint import fp8_state_from_model

        if not self.fsdp and fp8:
            for name, tensor in fp8_state_from_model(self.model, pow2_scales=self.pow2_scales):
                yield io.hf_name(name), tensor  # detached there
            return
        # FSDP2: modules hold shards. Gather one tensor at a time (all ranks in the same order) and quantize
        # decoder linears with the quantizer Fp8Linear's forward uses: the same bytes it trains with.
        from torch.distributed.tensor import DTensor

        from infir2_rl.fp8.linear import DECODER_LINEAR_NAMES
        from infir2_rl.fp8.quant import quantize_weight_blockwise

        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                # state_dict() detached it already
                full = value.full_tensor() if isinstance(value, DTensor) else value
                prefix, _, leaf = io.hf_name(name).rpartition(".")
                if fp8 and leaf == "weight" and prefix.rsplit(".", 1)[-1] in DECODER_LINEAR_NAMES:
                    as_trained = D.gathered_like_forward(full, self.fsdp_param_dtype)
                    w_fp8, scale_inv = quantize_weight_blockwise(as_trained, pow2_scales=self.pow2_scales)
                    yield f"{prefix}.weight", w_fp8
                    yield f"{prefix}.weight_scale_inv", scale_inv
                else:
                    yield f"{prefix}.{leaf}", full

    def save(self, directory: Path) -> None:
        """directory/hf (rank 0, FP32 masters + tokenizer) and directory/train_state/rank_K.pt (every rank)."""
        io.save_checkpoint(self, Path(directory))

    def load(self, directory: Path) -> None:
        """Restore weights, optimizer, schedule, RNG states and step from a `save` directory."""
        io.load_checkpoint(self, Path(directory))
        self._export_listings.clear()  # the next export walks (a listing would find any replaced tensor)
        profile_step = profile_step_from_env()
        if profile_step is not None and profile_step <= self.step:
            log.warning(
                "INFIR2_PROFILE_TRAIN_STEP=%d: this run resumes after step %d, so no step is profiled",
                profile_step, self.step,
            )  # fmt: skip

    def save_hf(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        """An HF directory transformers loads (weights in `dtype`, default the compute dtype) + tokenizer."""
        io.save_hf(self, Path(directory), dtype or self.compute_dtype)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions (new tokens, up to and including eos) of this rank's prompts."""
        return io.generate_greedy(self, prompts, max_new_tokens)

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()
