"""The megatron trainer backend: a megatron-core GPTModel behind the same contract as the torch backend.

One instance is one rank of a ``tp x cp x dp`` grid (megatron's order: TP fastest, so ranks
``[k*tp, (k+1)*tp)`` hold one model replica and take the same micro-batches). Everything the stages see
is the torch backend's contract (`infir2_rl.types.TrainerBackend`): HF-named weights in and out, full-vocab
log-probs, `TrainStats`, save/load of an ``hf/`` directory plus ``train_state/rank_K.pt``.

Precision and the step follow the torch backend (see ``trainers/torch/trainer.py``): FP32 master
parameters, BF16 compute under autocast on GPUs, AdamW from ``trainers/optim.py``, the loss of each
micro-batch weighted by its share of the global batch's units, a non-finite gradient norm skipping the
update. Differences: gradients are SUM-all-reduced over the data-parallel group only (TP ranks hold
different shards of one replica), and the gradient norm adds the TP-sharded parameters' squares over the
TP group to the replicated ones (norms, row-parallel biases) counted once.

The ``te`` layer spec (te.py: written and contract-tested, never run) keeps this contract with megatron's own
machinery instead: DDP and the distributed optimizer (`te.TeRuntime`) replace the gradient all-reduce, the norm
and AdamW; the FP32 masters are the optimizer's shards (`hf_state` gathers them); the FP8 export sends TE's
bytes. Everything else (scores, losses, stats, checkpoint layout) is the code below, shared by both specs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.metrics.logger import peak_memory_gb
from infir2_rl.trainers import token_scores_fused
from infir2_rl.trainers.engine_export import for_engines
from infir2_rl.trainers.layer_graphs import LayerGraphs, drop_for_room
from infir2_rl.trainers.megatron import checkpoint as ckpt
from infir2_rl.trainers.megatron import graphs as megatron_graphs
from infir2_rl.trainers.megatron import hf_mapping as hfm
from infir2_rl.trainers.megatron import te
from infir2_rl.trainers.megatron.layers import HF_PARTS, ParallelLinear, part_rows
from infir2_rl.trainers.megatron.model import (
    autocast_in_recompute,
    build_gpt_model,
    init_parallel_state,
    resolve_spec,
)
from infir2_rl.trainers.megatron.vocab_parallel_scores import vocab_parallel_token_scores
from infir2_rl.trainers.microbatch import MetricMeans, bucket_length, merge_on_host, pad_length
from infir2_rl.trainers.optim import build_optimizer, build_scheduler, step_unless_nonfinite
from infir2_rl.trainers.token_scores import chunked_token_scores
from infir2_rl.trainers.torch import distributed as D
from infir2_rl.trainers.torch.scoring import nonzero_counted
from infir2_rl.trainers.torch.trainer import resolve_compute_dtype
from infir2_rl.types import LossFn, TokenBatch, TokenScores, TrainStats

log = logging.getLogger(__name__)


def _ensure_process_group(device: torch.device) -> None:
    """megatron's parallel state needs torch.distributed even for one rank: a private one-rank group."""
    if not dist.is_initialized():
        D.init_process_group("127.0.0.1", D.free_port(), 0, 1)


class MegatronTrainer:
    """One rank of the megatron trainer (implements `TrainerBackend`, as `TorchTrainer` does)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        optimizer_cfg: OptimizerConfig,
        *,
        total_steps: int,
        seed: int = 0,
        device: str | torch.device | None = None,
        reference: bool = False,
        fp8: bool = True,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from infir2_rl.config.parallel_rules import check_tensor_parallel

        # The config refuses kl_coef > 0 and pack_sequences with this backend (config/stage.py, components.py).
        assert not reference and trainer_cfg.pack_sequences is not True, "refused by the stage config"
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model_cfg.gradient_checkpointing and self.device.type != "cuda":
            raise ValueError(
                "model.gradient_checkpointing=true with trainer.backend=megatron needs a GPU (megatron's recompute"
                " saves CUDA RNG states); set it to false on CPU"
            )
        _ensure_process_group(self.device)
        self.rank, self.world_size = D.rank_and_world()
        self.compute_dtype = resolve_compute_dtype(model_cfg.dtype, self.device)
        self.optimizer_cfg = optimizer_cfg
        self.fp8, self.pow2_scales = fp8, trainer_cfg.fp8_pow2_scales
        # trainer.fused_kernels: here only the token scores' Triton passes (megatron has its own layers);
        # "true" is the torch backend's and refused by the config
        self.fused_token_scores = trainer_cfg.fused_kernels is not False
        self.tp, cp = trainer_cfg.tensor_parallel_size, trainer_cfg.context_parallel_size
        self.path = model_cfg.path
        self.hf_config: Any = AutoConfig.from_pretrained(self.path, local_files_only=True)
        self.spec = resolve_spec(
            trainer_cfg.megatron_spec,
            fp8,
            cp,
            pow2_scales=self.pow2_scales,
            hf_config=self.hf_config.to_dict(),
        )
        if self.spec == "te":
            problem = te.runtime_problem(fp8)
            if problem is not None:
                raise ValueError(problem)
        check_tensor_parallel(self.hf_config.to_dict(), self.tp, self.fp8)
        self.arch = hfm.Arch.from_hf_config(self.hf_config)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        torch.manual_seed(seed)
        init_parallel_state(self.tp, cp, seed)
        from megatron.core import parallel_state as ps

        self.tp_group, self.tp_rank = (
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
        )
        self.dp_group, self.dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
        self.model: Any = build_gpt_model(
            self.arch,
            spec=self.spec,
            fp8=self.fp8,
            pow2_scales=self.pow2_scales,
            tp=self.tp,
            recompute=model_cfg.gradient_checkpointing,
        )
        # The local spec's decoder linears (none with te), and those that compute in FP8.
        self.linears = [m for m in self.model.modules() if isinstance(m, ParallelLinear)]
        self.fp8_linears = [m for m in self.linears if m.fp8]
        self.te: te.TeRuntime | None = None
        self.optimizer: Any
        self.scheduler: Any
        if self.spec == "te":
            if self.fp8:
                te.check_fp8_weights(self.model)  # FP8 never runs silently in BF16
            self.te = te.TeRuntime(self.model, optimizer_cfg, fp8=self.fp8, dp_group=self.dp_group)
            self.model = self.te.ddp
            self.optimizer, self.scheduler = self.te, te.LrSchedule(optimizer_cfg, total_steps)
            self.load_hf_weights(ckpt.read_weights(Path(self.path)))
        else:
            self.load_hf_weights(ckpt.read_weights(Path(self.path)))
            self.model.to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Parameters split over TP ranks, from our mapping (megatron marks some only when it initializes them).
        self.tp_sharded = {
            id(p) for name, p in self.model.named_parameters() if hfm.split_kind(name) != "replicated"
        }
        if self.te is None:
            self.optimizer = build_optimizer(self.params, optimizer_cfg)
            self.scheduler = build_scheduler(self.optimizer, optimizer_cfg, total_steps)
        self.step = 0
        self.num_skipped = 0
        # trainer.cuda_graphs: the decoder layers' forward and backward replayed from CUDA graphs (graphs.py).
        self.layer_graphs: LayerGraphs | None = None
        blockers = [
            name
            for name, present in {
                f"device {self.device}": self.device.type != "cuda",
                "the te spec": self.spec == "te",
                f"tensor_parallel_size={self.tp}": self.tp > 1,
                "gradient checkpointing": model_cfg.gradient_checkpointing,
            }.items()
            if present
        ]
        if trainer_cfg.cuda_graphs is True and blockers:
            raise ValueError(
                "trainer.cuda_graphs=true with trainer.backend=megatron needs a CUDA device, the local spec, "
                f"tensor_parallel_size=1 and no gradient checkpointing; here: {', '.join(blockers)}"
            )
        if trainer_cfg.cuda_graphs is True or (trainer_cfg.cuda_graphs == "auto" and not blockers):
            self.layer_graphs = megatron_graphs.install(
                self.module.decoder, check_memory=trainer_cfg.cuda_graphs == "auto", refresh=self._refresh_fp8
            )
        if model_cfg.gradient_checkpointing and self.te is None:
            autocast_in_recompute(self.module.decoder, self.autocast)
            for linear in self.linears:  # FP8 weights not kept across the step (layers.py)
                linear.release_kept = True
        log.info(
            "megatron trainer rank %d: spec=%s fp8=%s tp=%d dp=%d, decoder layers %s",
            self.rank, self.spec, self.fp8, self.tp, self.dp_size,
            "replayed from CUDA graphs" if self.layer_graphs is not None else f"eager ({', '.join(blockers) or 'cuda_graphs=false'})",
        )  # fmt: skip
        if (
            self.fp8
            and self.spec == "local"
            and self.layer_graphs is None
            and self.device.type == "cuda"
            and self.rank == 0
        ):
            log.warning(
                "megatron backend, local spec, FP8 on a GPU without CUDA graphs: its FP8 linears run eagerly, "
                "host-bound at small shapes (slower than BF16 at 1.5B x 4,096 tokens, faster at a 7B-shaped layer x "
                "16,384: docs/performance.md, 'Megatron backend'); trainer.cuda_graphs=auto replays them from "
                "graphs where it can (one GPU, TP = 1, no gradient checkpointing)."
            )

    # ------------------------------------------------------------------ weights in and out
    @property
    def module(self) -> Any:
        """The GPTModel (inside megatron's DDP with the te spec)."""
        return self.te.module if self.te is not None else self.model

    @torch.no_grad()
    def load_hf_weights(self, hf: dict[str, Tensor]) -> None:
        """Copy an HF state dict into this rank's shards (FP32 masters; te: the optimizer's master shards)."""
        full = hfm.hf_to_megatron(hf, self.arch, fused_norms=self.spec == "te")
        local = {
            name: hfm.shard(name, hfm.pad_vocab(name, full[name], self.arch, self.tp), self.tp_rank, self.tp)
            for name in full
        }
        target = self.module.state_dict()
        missing = [k for k in target if k not in local and not k.endswith("_extra_state")]
        unexpected = [k for k in local if k not in target]
        if missing or unexpected:
            raise ValueError(
                f"{self.path}: HF weights do not fill the megatron model (missing {missing[:4]}, unexpected"
                f" {unexpected[:4]}); the checkpoint and its config.json disagree"
            )
        if self.te is not None:
            self.te.load_masters(local)
            return
        for name, value in local.items():
            target[name].copy_(value.to(target[name].dtype))
        self.invalidate_fp8_cache()

    def _gather(self, t: Tensor) -> list[Tensor]:
        """Every TP rank's copy of ``t`` (same shape on each), in rank order; FP8 travels as bytes."""
        if self.tp == 1:
            return [t]
        wire = (
            t.contiguous().view(torch.uint8)
            if t.element_size() == 1 and t.is_floating_point()
            else t.contiguous()
        )
        out = [torch.empty_like(wire) for _ in range(self.tp)]
        dist.all_gather(out, wire, group=self.tp_group)
        return [o.view(t.dtype) for o in out]

    def full_megatron_state(self, keep: Any = lambda name: True) -> dict[str, Tensor]:
        """Full (unsharded) FP32 masters in megatron names on every TP rank (collective over the TP group;
        te: also over the data-parallel group, whose ranks hold disjoint master shards)."""
        local = (
            self.te.master_state(keep)
            if self.te is not None
            else {
                k: v.detach()
                for k, v in self.model.state_dict().items()
                if keep(k) and not k.endswith("_extra_state")
            }
        )
        return {name: hfm.unshard(name, self._gather(value)) for name, value in local.items()}

    def hf_state(self, keep: Any = lambda name: True) -> dict[str, Tensor]:
        """HF-named FP32 masters (collective over the TP group); tied models carry no ``lm_head.weight``.
        ``keep`` (megatron names) leaves tensors out; a left-out tensor is also left out of the HF dict."""
        mc = self.full_megatron_state(keep)
        hf = hfm.megatron_to_hf(
            _with_placeholders(mc, self.module, self.tp), self.arch, fused_norms=self.spec == "te"
        )
        return {k: v for k, v in hf.items() if not v.is_meta}

    def _linears(self) -> Iterator[tuple[str, ParallelLinear]]:
        for name, module in self.model.named_modules():
            if isinstance(module, ParallelLinear):
                layer = int(name.split("decoder.layers.")[1].split(".")[0])
                block = "self_attn" if module.role in ("qkv", "proj") else "mlp"
                yield f"model.layers.{layer}.{block}.", module

    def _fp8_parts(self) -> Iterator[tuple[str, str, list[tuple[Tensor, Tensor]]]]:
        """(HF prefix, role, this rank's (FP8 bytes, FP32 scale_inv) of each HF part) of every decoder linear:
        the bytes its forward reads (local spec: ParallelLinear's cache; te: TE's FP8 parameter)."""
        if self.te is None:
            for prefix, module in self._linears():
                yield prefix, module.role, [(p.w_fp8, p.scale_inv) for p in module.fp8_parts()]
            return
        for layer, role, te_linear in te.te_linears(self.module):
            w_fp8, scale_inv = te.te_fp8_weight(te_linear.weight)
            rows = part_rows(role, self.module.config, w_fp8.shape[0])
            block = "self_attn" if role in ("qkv", "proj") else "mlp"
            yield f"model.layers.{layer}.{block}.", role, te.block_parts(w_fp8, scale_inv, rows)

    def export_weights(self, fp8: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors (collective over the TP group; te: and the DP group). With ``fp8`` each decoder
        projection is the FP8 bytes + FP32 ``weight_scale_inv`` its forward uses (TP shards' grids
        concatenated: the full grid). Trained without FP8 (bf16_train_fp8_rollout, either spec): our quantizer
        on the gathered FP32 masters, the torch backend's cast at sync; the shards' own grids are not the HF
        projection's under TP where a shard's rows are not whole 128-row blocks, which FP8 training alone is
        held to (config/parallel_rules.py), and their export had another shape. Dense tensors in the compute dtype, a tied lm_head left out
        (``trainers.engine_export``)."""
        from_te = fp8 and self.te is not None and self.fp8
        # TE's FP8 bytes replace the decoder linears' masters: those are not gathered at all.
        keep = (lambda name: not _is_te_linear_weight(name)) if from_te else (lambda name: True)
        state = self.hf_state(keep)
        if fp8 and not self.fp8:
            from infir2_rl.fp8.linear import DECODER_LINEAR_NAMES
            from infir2_rl.fp8.quant import quantize_weight_blockwise

            for name in [
                n for n in state if n.rsplit(".", 2)[-2] in DECODER_LINEAR_NAMES and n.endswith(".weight")
            ]:
                w_fp8, scale_inv = quantize_weight_blockwise(state[name], pow2_scales=self.pow2_scales)
                state[name], state[f"{name}_scale_inv"] = w_fp8, scale_inv
        elif fp8:
            for prefix, role, parts in self._fp8_parts():
                dim = 0 if role in ("qkv", "fc1") else 1
                for hf_name, (w_fp8, scale_inv) in zip(HF_PARTS[role], parts, strict=True):
                    state[f"{prefix}{hf_name}.weight"] = torch.cat(self._gather(w_fp8), dim=dim)
                    state[f"{prefix}{hf_name}.weight_scale_inv"] = torch.cat(self._gather(scale_inv), dim=dim)
        yield from for_engines(
            _scales_after_weights(state).items(), self.compute_dtype, self.arch.tied_embeddings
        )

    def invalidate_fp8_cache(self) -> None:
        for m in self.linears:  # (a BF16 trainer's export quantizes too)
            m.invalidate_fp8_cache()

    def _refresh_fp8(self) -> None:
        """Quantize the stale kept FP8 weights (the graphs read them as they are: layers.ParallelLinear)."""
        for m in self.fp8_linears:
            m.refresh_fp8()

    @contextlib.contextmanager
    def _fp8_off(self) -> Iterator[None]:
        if self.te is not None and self.fp8:
            raise ValueError(
                "forward_logprobs(fp8=False) with the te spec: TE's parameters are FP8 and there is no dense"
                " forward on the masters (metrics.dense_trainer_mismatch is refused at start for this reason)"
            )
        for m in self.fp8_linears:  # (a BF16 trainer's linears are dense already: its graphs' key stays)
            m.fp8_enabled = False
        try:
            yield
        finally:
            for m in self.fp8_linears:
                m.fp8_enabled = True

    # ------------------------------------------------------------------ forward helpers
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32 or self.te is not None:  # te: BF16 parameters, TE's own FP8
            return contextlib.nullcontext()
        # The CUDA graphs cannot hold autocast's cache of weight casts (a cast made in a capture would be graph
        # memory that later eager code reads); each forward then casts what it uses, as the cache would once.
        return torch.autocast(
            device_type=self.device.type, dtype=self.compute_dtype, cache_enabled=self.layer_graphs is None
        )

    @property
    def pads_to_buckets(self) -> bool:
        """Whether micro-batches run right-padded to their length bucket (under the layer graphs, so that few
        shapes occur: ``microbatch.bucket_length``); the trainer group then counts the bucket against the token
        budget."""
        return self.layer_graphs is not None

    def _bucketed(self, batch: TokenBatch) -> TokenBatch:
        if not self.pads_to_buckets:
            return batch
        return pad_length(batch, bucket_length(batch.input_ids.shape[1]))

    def _graph_order(self, batches: list[TokenBatch]) -> list[int]:
        """Largest (padded) micro-batch first under the layer graphs: the first capture sizes their shared memory
        pool and smaller shapes' captures fit in it (``TorchTrainer._graph_order``); else as given."""
        order = list(range(len(batches)))
        if self.layer_graphs is None:
            return order
        sizes = [b.input_ids.shape[0] * bucket_length(b.input_ids.shape[1]) for b in batches]
        return sorted(order, key=lambda i: -sizes[i])

    def _model_inputs(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        mask = batch.attention_mask
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "the megatron backend takes right-padded batches only (a row has padding before a token)"
            )
        ids = batch.input_ids
        return ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def _scores(
        self,
        batch: TokenBatch,
        select_BL: Tensor,
        temperature: float = 1.0,
        need_entropy: bool = False,
        num_selected: int | None = None,
    ) -> TokenScores:
        """`TokenScores`, zero outside ``select_BL`` and at t = 0, from the final hidden states and the output
        layer's weight in token chunks: no B x L x V logits, which held ~half of this backend's memory at the GPU
        RL config (docs/performance.md, "Megatron backend", session 49). Without TP the torch backend's scorer
        (``token_scores.chunked_token_scores``, its Triton passes on CUDA); under TP, where each rank holds a
        vocabulary shard of the weight, ``vocab_parallel_scores``. ``num_selected``: how many positions are scored
        (``select_BL & attention_mask`` at t >= 1), when the host knows it: then no wait for the device here."""
        keep_BL = select_BL.bool() & batch.attention_mask.bool()
        keep_BL[:, 0] = False
        ids, positions = self._model_inputs(batch)
        rows = nonzero_counted(keep_BL.reshape(-1), num_selected) - 1  # position t - 1 scores token t
        head = self.module.output_layer
        k = 2 if need_entropy else 1

        def scores_not_logits(
            hidden_SBH: Tensor, weight: Tensor | None = None, **_: Any
        ) -> tuple[Tensor, None]:
            # GPTModel calls its output layer with the final hidden states [s, b, h] (and the embedding as
            # ``weight`` when they are shared), then returns what it gives, transposed to [b, s, ...].
            w = head.weight if weight is None else weight  # this rank's vocabulary rows
            seq, batch_rows, width = hidden_SBH.shape
            # The scored rows, numbered in [b, s] order, picked from [s, b] order without a transposed copy.
            hidden = hidden_SBH.reshape(-1, width).index_select(0, (rows % seq) * batch_rows + rows // seq)
            targets = ids.reshape(-1).index_select(0, rows + 1)
            if self.tp == 1:  # the vocabulary is padded to a multiple of TP: not at all here
                logp, entropy = chunked_token_scores(
                    hidden, w, targets, temperature=temperature, need_entropy=need_entropy,
                    compute_dtype=self.compute_dtype,
                    fused=self.fused_token_scores and token_scores_fused.available(self.device),
                )  # fmt: skip
            else:
                logp, entropy = vocab_parallel_token_scores(
                    hidden, w, targets, vocab_start=self.tp_rank * w.shape[0], vocab_size=self.arch.vocab_size,
                    group=self.tp_group, temperature=temperature, need_entropy=need_entropy,
                    compute_dtype=self.compute_dtype,
                )  # fmt: skip
            values = logp[:, None] if entropy is None else torch.stack((logp, entropy), dim=1)
            out = values.new_zeros(ids.numel(), k).index_copy(0, rows + 1, values)
            return out.view(*ids.shape, k).transpose(0, 1), None

        head.forward = scores_not_logits  # an instance attribute shadows the method, for this call only
        try:
            with self.autocast():
                scores_BLK = self.model(ids, positions, None)
        finally:
            del head.forward
        return TokenScores(
            logprobs_BL=scores_BLK[..., 0], entropy_BL=scores_BLK[..., 1] if need_entropy else None
        )

    def _loss_scores(self, batch: TokenBatch, loss_fn: LossFn) -> TokenScores:
        num = batch.counts.num_targets if batch.counts is not None else None
        return self._scores(batch, batch.loss_mask > 0, loss_fn.temperature, loss_fn.needs_entropy, num)

    # ------------------------------------------------------------------ TrainerBackend
    def train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool = False
    ) -> TrainStats:
        if total_units < 1:
            raise ValueError(
                f"total_units={total_units}: the global batch has no loss units (empty loss mask?)"
            )
        start = time.perf_counter()
        self.model.train()
        if self.te is not None:
            self.te.zero_grad()
        # The loss sum stays on the device and the token count comes from the host's counts (TokenBatch.to):
        # nothing in a micro-batch waits for the device.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metrics = MetricMeans()
        num_tokens = num_sequences = 0
        items = [b.to(self.device) for b in batches]
        # keep_logprobs: the micro-batches' log-probs in the order given (dropout is 0: model.py)
        kept: list[Tensor | None] = [None] * len(items)
        for i in self._graph_order(items):
            batch = items[i]
            length = batch.input_ids.shape[1]
            batch = self._bucketed(batch)
            scores = self._loss_scores(batch, loss_fn)
            if keep_logprobs:
                kept[i] = scores.logprobs_BL[:, :length].detach()
            out = loss_fn(scores, batch)
            weight = out.num_units / total_units
            (out.loss * weight).backward()
            loss_sum += out.loss.detach().double() * weight
            metrics.add(out)
            counts = batch.counts  # (None only for a batch given on the device)
            num_tokens += (
                sum(counts.lengths) if counts is not None else int(batch.attention_mask.sum().item())
            )
            num_sequences += batch.num_sequences
        lr = float(self.scheduler.get_last_lr()[0])
        norm, skipped = self._update(lr)
        self.invalidate_fp8_cache()  # fused optimizers do not bump the weights' version counters
        if skipped:
            self.num_skipped += 1
            log.warning("step %d: gradient norm is %s: update skipped", self.step + 1, norm)
        else:
            self.scheduler.step()
        self.step += 1
        names = self._metric_names(metrics.weights)
        totals = self._sum_over_dp([loss_sum.item(), num_tokens, num_sequences, *metrics.totals(names)])
        return TrainStats(
            step=self.step,
            loss=totals[0],
            grad_norm=norm,
            lr=lr,
            num_tokens=int(round(totals[1])),
            num_sequences=int(round(totals[2])),
            skipped=skipped,
            step_time_s=time.perf_counter() - start,
            metrics=MetricMeans.means(names, totals[3:]),
            logprobs=merge_on_host(kept) if keep_logprobs else None,
        )

    def _update(self, lr: float) -> tuple[float, bool]:
        """Reduce gradients over data-parallel ranks, then step unless the global norm is not finite (on CUDA,
        with fused AdamW, decided on the device: the host waits once, after the update is queued, as in the torch
        backend; ``optim.step_unless_nonfinite``)."""
        clip = self.optimizer_cfg.grad_clip
        if self.te is not None:
            return self.te.update(clip, lr)
        if self.dp_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for p in self.params:
                dist.all_reduce(p.grad, group=self.dp_group)  # type: ignore[arg-type]
        grad_norm = self._grad_norm()
        skipped = step_unless_nonfinite(self.optimizer, self.params, grad_norm, clip)
        # The backward graphs add into the .grad tensors they were captured with: zero those in place.
        self.optimizer.zero_grad(set_to_none=self.layer_graphs is None)
        return float(grad_norm.item()), skipped

    def _grad_norm(self) -> Tensor:
        """Global L2 norm: TP-sharded parameters summed over the TP group, replicated ones counted once. Per-tensor
        norms in FP32 (``torch._foreach_norm``, one kernel per few tensors), their squares summed in FP64: an FP64
        copy of every gradient cost ~17 ms per step at 1.5B on an H200 (docs/performance.md, session 50)."""

        def squares(grads: list[Tensor]) -> Tensor:
            if not grads:
                return torch.zeros((), dtype=torch.float64, device=self.device)
            return torch.stack(torch._foreach_norm(grads)).double().square().sum()

        grads = [(p.grad.detach(), id(p) in self.tp_sharded) for p in self.params if p.grad is not None]
        sharded = squares([g for g, is_sharded in grads if is_sharded])
        replicated = squares([g for g, is_sharded in grads if not is_sharded])
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return (sharded + replicated).sqrt().float()

    def _metric_names(self, local: dict[str, float]) -> list[str]:
        if self.world_size == 1:
            return sorted(local)
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(local))
        return sorted({n for names in gathered for n in names or []})

    def _sum_over_dp(self, values: list[float]) -> list[float]:
        if self.dp_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return [float(v) for v in t.cpu().tolist()]

    @torch.no_grad()
    def forward_logprobs(
        self, batches: Sequence[TokenBatch], temperature: float = 1.0, fp8: bool = True
    ) -> list[Tensor]:
        self.model.eval()
        out: list[Tensor] = []
        with contextlib.nullcontext() if fp8 else self._fp8_off():
            for batch in (b.to(self.device) for b in batches):
                length = batch.input_ids.shape[1]
                batch = self._bucketed(batch)
                counts = batch.counts  # every real token after its row's first
                num = sum(max(n - 1, 0) for n in counts.lengths) if counts is not None else None
                scores = self._scores(batch, batch.attention_mask > 0, temperature, num_selected=num)
                out.append(scores.logprobs_BL[:, :length].cpu())
        self.model.train()
        return out

    @torch.no_grad()
    def evaluate_loss(self, batches: Sequence[TokenBatch], loss_fn: LossFn) -> tuple[float, int]:
        self.model.eval()
        total: Tensor | float = 0.0  # on the device until the end, as the torch trainer's
        units = 0
        for batch in (self._bucketed(b.to(self.device)) for b in batches):
            out = loss_fn(self._loss_scores(batch, loss_fn), batch)
            total = total + out.loss.detach().double() * out.num_units
            units += out.num_units
        self.model.train()
        return float(total), units

    def forward_ref_logprobs(self, batches: Sequence[TokenBatch], temperature: float = 1.0) -> list[Tensor]:
        raise RuntimeError(
            "forward_ref_logprobs: the megatron backend holds no reference model (kl_coef = 0)"
        )

    def save(self, directory: Path) -> None:
        """directory/hf (rank 0: FP32 masters in HF names + tokenizer) and train_state/rank_K.pt (every rank)."""
        ckpt.save_checkpoint(self, Path(directory))

    def load(self, directory: Path) -> None:
        ckpt.load_checkpoint(self, Path(directory))

    def save_hf(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        ckpt.save_hf(self, Path(directory), dtype or self.compute_dtype)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return ckpt.generate_greedy(self, prompts, max_new_tokens)

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    def make_room(self, wanted_bytes: int) -> bool:
        """Colocated with a rollout engine, before a rollout: where the GPU's free memory is below ``wanted_bytes``
        (what the engine's KV cache wants, ``NativeEngine.memory_wanted``), return this process's cached blocks,
        then drop the layer graphs if still short (``layer_graphs.drop_for_room``, as the torch backend does).
        Weights, masters and optimizer states stay (nothing is offloaded), so it may still be short: the step's
        ``rollout/kv_slots_short`` says so. True when the graphs went."""
        return drop_for_room(self.device, wanted_bytes, self.layer_graphs)


def _scales_after_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each ``X.weight_scale_inv`` right after ``X.weight``. Assigning a scale to a dict that held
    the weight already appended it at the end, so every FP8 weight and its scale went in different buckets, and
    an engine held each weight (and the received buffer it is a view of) until the last bucket: the bucket size
    no longer bounded its memory (``weight_sync/buckets.py`` keeps the two halves together when they come in
    order)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in state:
            continue
        out[name] = tensor
        if (scale := state.get(f"{name}_scale_inv")) is not None:
            out[f"{name}_scale_inv"] = scale
    return out


def _is_te_linear_weight(name: str) -> bool:
    """A te-spec decoder linear's weight (megatron name), whose FP8 bytes the export takes from TE."""
    return name.endswith(".weight") and any(name.endswith(f"{local}.weight") for local in te.TE_LINEAR_ROLES)


def _with_placeholders(mc: dict[str, Tensor], module: Any, tp: int) -> dict[str, Tensor]:
    """``mc`` plus a meta tensor of the full shape for each parameter left out, so that the HF mapping runs
    (`MegatronTrainer.hf_state` drops what comes out of them)."""
    out = dict(mc)
    for name, param in module.named_parameters():
        if name not in out:
            out[name] = hfm.unshard(name, [torch.empty(param.shape, device="meta")] * tp)
    return out
