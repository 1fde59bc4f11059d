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
from torch.nn.utils import clip_grads_with_norm_

from infir2_rl.algo.logprobs import scores_from_logits
from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.metrics.logger import peak_memory_gb
from infir2_rl.trainers.megatron import checkpoint as ckpt
from infir2_rl.trainers.megatron import hf_mapping as hfm
from infir2_rl.trainers.megatron.layers import HF_PARTS, ParallelLinear, gather_vocab
from infir2_rl.trainers.megatron.model import build_gpt_model, init_parallel_state, resolve_spec
from infir2_rl.trainers.optim import build_optimizer, build_scheduler
from infir2_rl.trainers.torch import distributed as D
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
        assert not reference and not trainer_cfg.pack_sequences, "refused by the stage config"
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
        self.tp, cp = trainer_cfg.tensor_parallel_size, trainer_cfg.context_parallel_size
        self.spec = resolve_spec(trainer_cfg.megatron_spec, fp8, cp)
        self.path = model_cfg.path
        self.hf_config: Any = AutoConfig.from_pretrained(self.path, local_files_only=True)
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
        self.load_hf_weights(ckpt.read_weights(Path(self.path)))
        self.model.to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Parameters split over TP ranks, from our mapping (megatron marks some only when it initializes them).
        self.tp_sharded = {
            id(p) for name, p in self.model.named_parameters() if hfm.split_kind(name) != "replicated"
        }
        self.optimizer = build_optimizer(self.params, optimizer_cfg)
        self.scheduler = build_scheduler(self.optimizer, optimizer_cfg, total_steps)
        self.step = 0
        self.num_skipped = 0
        log.info(
            "megatron trainer rank %d: spec=%s fp8=%s tp=%d dp=%d",
            self.rank,
            self.spec,
            self.fp8,
            self.tp,
            self.dp_size,
        )

    # ------------------------------------------------------------------ weights in and out
    @torch.no_grad()
    def load_hf_weights(self, hf: dict[str, Tensor]) -> None:
        """Copy an HF state dict into this rank's shards (FP32 masters)."""
        full = hfm.hf_to_megatron(hf, self.arch, fused_norms=self.spec == "te")
        local = {
            name: hfm.shard(name, hfm.pad_vocab(name, full[name], self.arch, self.tp), self.tp_rank, self.tp)
            for name in full
        }
        target = self.model.state_dict()
        missing = [k for k in target if k not in local and not k.endswith("_extra_state")]
        unexpected = [k for k in local if k not in target]
        if missing or unexpected:
            raise ValueError(
                f"{self.path}: HF weights do not fill the megatron model (missing {missing[:4]}, unexpected"
                f" {unexpected[:4]}); the checkpoint and its config.json disagree"
            )
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

    def full_megatron_state(self) -> dict[str, Tensor]:
        """Full (unsharded) megatron tensors on every TP rank (collective over the TP group)."""
        return {
            name: hfm.unshard(name, self._gather(value.detach()))
            for name, value in self.model.state_dict().items()
            if not name.endswith("_extra_state")
        }

    def hf_state(self) -> dict[str, Tensor]:
        """HF-named FP32 masters (collective over the TP group); tied models carry no ``lm_head.weight``."""
        return hfm.megatron_to_hf(self.full_megatron_state(), self.arch, fused_norms=self.spec == "te")

    def _linears(self) -> Iterator[tuple[str, ParallelLinear]]:
        for name, module in self.model.named_modules():
            if isinstance(module, ParallelLinear):
                layer = int(name.split("decoder.layers.")[1].split(".")[0])
                block = "self_attn" if module.role in ("qkv", "proj") else "mlp"
                yield f"model.layers.{layer}.{block}.", module

    def export_weights(self, fp8: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors (collective over the TP group). With ``fp8`` each decoder projection is the FP8
        bytes + FP32 ``weight_scale_inv`` its forward uses (TP shards' grids concatenated: the full grid)."""
        state = self.hf_state()
        if self.arch.tied_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        if fp8:
            for prefix, module in self._linears():
                parts, _ = module.fp8_parts()
                for hf_name, part in zip(HF_PARTS[module.role], parts, strict=True):
                    dim = 0 if module.column else 1
                    state[f"{prefix}{hf_name}.weight"] = torch.cat(self._gather(part.w_fp8), dim=dim)
                    state[f"{prefix}{hf_name}.weight_scale_inv"] = torch.cat(
                        self._gather(part.scale_inv), dim=dim
                    )
        yield from state.items()

    def invalidate_fp8_cache(self) -> None:
        for m in self.model.modules():
            if isinstance(m, ParallelLinear):
                m.invalidate_fp8_cache()

    @contextlib.contextmanager
    def _fp8_off(self) -> Iterator[None]:
        linears = [m for m in self.model.modules() if isinstance(m, ParallelLinear)]
        for m in linears:
            m.fp8_enabled = False
        try:
            yield
        finally:
            for m in linears:
                m.fp8_enabled = True

    # ------------------------------------------------------------------ forward helpers
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _logits(self, batch: TokenBatch) -> Tensor:
        mask = batch.attention_mask
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "the megatron backend takes right-padded batches only (a row has padding before a token)"
            )
        ids = batch.input_ids
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        with self.autocast():
            logits = gather_vocab(self.model(ids, positions, None), self.tp_group)
        return logits[..., : self.arch.vocab_size]

    def _scores(
        self, batch: TokenBatch, select_BL: Tensor, temperature: float = 1.0, need_entropy: bool = False
    ) -> TokenScores:
        """`TokenScores` from the full logits (gathered over TP), zero outside ``select_BL`` and at t = 0."""
        scores = scores_from_logits(
            self._logits(batch), batch.input_ids, temperature, need_entropy=need_entropy
        )
        keep = (select_BL.bool() & batch.attention_mask.bool()).float()
        keep[:, 0] = 0.0
        entropy = scores.entropy_BL * keep if scores.entropy_BL is not None else None
        return TokenScores(logprobs_BL=scores.logprobs_BL * keep, entropy_BL=entropy)

    def _loss_scores(self, batch: TokenBatch, loss_fn: LossFn) -> TokenScores:
        return self._scores(batch, batch.loss_mask > 0, loss_fn.temperature, loss_fn.needs_entropy)

    # ------------------------------------------------------------------ TrainerBackend
    def train_step(self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int) -> TrainStats:
        if total_units < 1:
            raise ValueError(
                f"total_units={total_units}: the global batch has no loss units (empty loss mask?)"
            )
        start = time.perf_counter()
        self.model.train()
        self.invalidate_fp8_cache()
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        num_tokens = num_sequences = 0
        for batch in (b.to(self.device) for b in batches):
            out = loss_fn(self._loss_scores(batch, loss_fn), batch)
            weight = out.num_units / total_units
            (out.loss * weight).backward()
            loss_sum += float(out.loss.detach().double().item()) * weight
            for name, value in out.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + float(value) * weight
            num_tokens += int(batch.attention_mask.sum().item())
            num_sequences += batch.num_sequences
        if self.dp_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for p in self.params:
                dist.all_reduce(p.grad, group=self.dp_group)  # type: ignore[arg-type]
        grad_norm = self._grad_norm()
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not bool(torch.isfinite(grad_norm).item())
        if skipped:
            self.num_skipped += 1
            log.warning("step %d: gradient norm is %s: update skipped", self.step + 1, grad_norm.item())
        else:
            if self.optimizer_cfg.grad_clip > 0:
                clip_grads_with_norm_(self.params, self.optimizer_cfg.grad_clip, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        names = self._metric_names(metric_sums)
        totals = self._sum_over_dp(
            [loss_sum, num_tokens, num_sequences, *(metric_sums.get(n, 0.0) for n in names)]
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
            metrics=dict(zip(names, totals[3:])),
        )

    def _grad_norm(self) -> Tensor:
        """Global L2 norm: TP-sharded parameters summed over the TP group, replicated ones counted once."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if id(p) in self.tp_sharded:
                sharded += sq
            else:
                replicated += sq
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
        self.invalidate_fp8_cache()
        out: list[Tensor] = []
        with contextlib.nullcontext() if fp8 else self._fp8_off():
            for batch in (b.to(self.device) for b in batches):
                out.append(self._scores(batch, batch.attention_mask > 0, temperature).logprobs_BL.cpu())
        self.model.train()
        return out

    @torch.no_grad()
    def evaluate_loss(self, batches: Sequence[TokenBatch], loss_fn: LossFn) -> tuple[float, int]:
        self.model.eval()
        self.invalidate_fp8_cache()
        total, units = 0.0, 0
        for batch in (b.to(self.device) for b in batches):
            out = loss_fn(self._loss_scores(batch, loss_fn), batch)
            total += float(out.loss.item()) * out.num_units
            units += out.num_units
        self.model.train()
        return total, units

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
