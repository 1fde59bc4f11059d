"""The ``te`` layer spec's runtime: Transformer Engine linears, megatron DDP and the distributed optimizer.

WRITTEN AND CONTRACT-TESTED, NEVER RUN: Transformer Engine installs on neither the development machines nor the
GPU machine this project used. Every TE and megatron-core name, keyword and attribute used here is checked
against the source of the pinned versions (``TE_VERSION``, megatron-core 0.19.2 of docker/Dockerfile, and the
installed megatron-core) by tests/test_megatron_te_contract.py; nothing of it has executed.

What the ``te`` spec is (model.py builds it, this module trains and exports it):

* megatron's Transformer Engine layer spec (``get_gpt_layer_with_transformer_engine_spec``): the norms fused
  into ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``), TE's attention, BF16 parameters.
* FP8: ``TransformerConfig(fp8="e4m3", fp8_recipe="blockwise", fp8_param=True)``. megatron builds each layer
  under TE's ``fp8_model_init`` and runs it under ``fp8_autocast`` with ``Float8BlockScaling`` (128x128
  weight blocks, 1x128 activation tiles), so every decoder linear's weight parameter is TE's
  ``Float8BlockwiseQTensor``: the bytes the GEMMs read. `check_fp8_weights` refuses a model where one is not.
  The recipe's scales are FP32 amax/448 unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` is unset or 0 when TE
  is imported (then powers of two): `import_problem` sets it from ``trainer.fp8_pow2_scales`` before the
  first import and `recipe_problem` refuses a TE imported with the other rule.
* megatron's ``DistributedDataParallel`` (gradients summed over data-parallel ranks: the loss is already
  divided by the global batch's units, hence ``calculate_per_token_loss``) and distributed optimizer (Adam
  with FP32 master shards, ``get_megatron_optimizer``). The HF weights are FP32; writing them into BF16 or
  FP8 parameters would round the masters, so `TeRuntime.load_masters` writes the FP32 values straight into
  each rank's master shards (the parameters get TE's quantization of the same FP32 values).
* The train step (`TeRuntime.update`): gradient reduce-scatter, the global gradient norm (megatron's, over
  TP and DP), a non-finite norm skips the update (megatron's bf16 step would apply it), clipping by that
  norm, the learning rate of our schedule (`trainers.optim.LrFactor`) written into every parameter group.
* Export for weight sync in HF names: each decoder projection as TE's own FP8 bytes and FP32
  ``weight_scale_inv`` (`te_fp8_weight`), cut into the HF projections by `block_parts`. That is exact only
  when every HF projection of a fused weight starts and ends on a 128-row block (head_dim and the MLP size
  multiples of 128: Qwen2.5 1.5B and 7B are): the stage refuses te + FP8 for other shapes
  (`config.parallel_rules.te_fp8_layout_problem`) instead of sending the engines other bytes than the trainer
  computes with. Without FP8 training, export quantizes the FP32 masters with our quantizer (what the torch
  backend does for bf16_train_fp8_rollout).
* Save/load: the ``hf/`` FP32 masters gathered from the shards (`master_state`) and, per rank, the inner
  optimizers' state dicts (moments of this rank's shards); resume needs the same ranks and TP size.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from infir2_rl.config import OptimizerConfig
from infir2_rl.trainers.optim import LrFactor

# The Transformer Engine release this path is written and contract-tested against (docker/Dockerfile installs it).
TE_VERSION = "2.20.2"
# megatron-core of the image (docker/Dockerfile); CI also checks the installed one (0.16 on Python 3.11).
MEGATRON_IMAGE_VERSION = "0.19.2"
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
BLOCK = 128
# megatron names of the TE decoder linears and the role ``layers.part_rows`` knows them by.
TE_LINEAR_ROLES = {
    "self_attention.linear_qkv": "qkv",
    "self_attention.linear_proj": "proj",
    "mlp.linear_fc1": "fc1",
    "mlp.linear_fc2": "fc2",
}


# ---------------------------------------------------------------------- start-up checks (one sentence each)
def import_problem(pow2_scales: bool) -> str | None:
    """Why Transformer Engine's PyTorch API does not import here (None when it does).

    Sets ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` from ``trainer.fp8_pow2_scales`` first unless the environment
    already names it: TE reads it once, when its recipe module is imported.
    """
    os.environ.setdefault(FP32_SCALES_ENV, "0" if pow2_scales else "1")
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, or its CUDA library failing to load: TE is not usable here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}"
    return None


def recipe_problem(pow2_scales: bool) -> str | None:
    """Why TE's blockwise recipe would not use ``trainer.fp8_pow2_scales``'s scale rule (None when it does)."""
    from transformer_engine.common.recipe import Float8BlockScaling

    te_pow2 = bool(Float8BlockScaling.fp8_quant_fwd_weight.power_2_scale)
    if te_pow2 == pow2_scales:
        return None
    return (
        f"trainer.fp8_pow2_scales={str(pow2_scales).lower()} but Transformer Engine's blockwise recipe was"
        f" imported with power_2_scale={te_pow2} ({FP32_SCALES_ENV}={os.environ.get(FP32_SCALES_ENV)!r}); set"
        f" {FP32_SCALES_ENV}={'0' if pow2_scales else '1'} in the trainer's environment"
    )


def runtime_problem(fp8: bool) -> str | None:
    """Why the te spec (with TE's blockwise FP8 when ``fp8``) cannot run on this rank's device (None if it can)."""
    if not torch.cuda.is_available():
        return (
            "trainer.megatron_spec=te needs a CUDA GPU (Transformer Engine); use trainer.megatron_spec=local"
        )
    if not fp8:
        return None
    import transformer_engine.pytorch as te

    ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
    if not ok:
        return (
            f"trainer.megatron_spec=te with FP8: Transformer Engine's blockwise FP8 is unavailable on this GPU"
            f" ({reason}); use trainer.megatron_spec=local or an FP8-free precision"
        )
    return None


# ---------------------------------------------------------------------- TE's FP8 weights
def te_fp8_weight(weight: Any) -> tuple[Tensor, Tensor]:
    """TE's row-wise FP8 bytes ``[N, K]`` (e4m3) and FP32 dequant multipliers ``[ceil(N/128), ceil(K/128)]``
    of a ``Float8BlockwiseQTensor`` parameter (TE pads the scale columns to a multiple of 4: dropped here).

    Refuses anything else: a BF16 weight here means FP8 would not run, which is never silent.
    """
    data = getattr(weight, "_rowwise_data", None)
    scale_inv = getattr(weight, "_rowwise_scale_inv", None)
    if data is None or scale_inv is None or not getattr(weight, "_is_2D_scaled", False):
        raise ValueError(
            f"a decoder linear's weight is {type(weight).__name__}, not Transformer Engine's 128x128 blockwise FP8"
            " tensor: the te spec would train this layer in BF16; refusing (fp8 never runs silently in BF16)"
        )
    n, k = data.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    if scale_inv.shape[0] != nb or scale_inv.shape[1] < kb:
        raise ValueError(
            f"TE blockwise scales {tuple(scale_inv.shape)} do not cover a {n}x{k} weight in 128 blocks"
        )
    return data.view(torch.float8_e4m3fn), scale_inv[:, :kb].float()


def aligned_block_rows(rows: Tensor) -> Tensor | None:
    """The 128-row block indices that make up ``rows`` (None unless ``rows`` is whole aligned blocks in order)."""
    if rows.numel() % BLOCK:
        return None
    blocks = rows.view(-1, BLOCK)
    starts = blocks[:, 0]
    if bool((starts % BLOCK).any()) or not torch.equal(
        blocks - starts[:, None], torch.arange(BLOCK).expand_as(blocks)
    ):
        return None
    return starts // BLOCK


def block_parts(w_fp8: Tensor, scale_inv: Tensor, parts: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """A fused weight's FP8 bytes and 128x128 scales cut into its HF projections' rows (``layers.part_rows``).

    Exact (the same bytes and scales a per-projection quantization on the projection's own grid gives) because
    each part is made of whole 128-row blocks of the fused weight; anything else raises.
    """
    out = []
    for rows in parts:
        blocks = aligned_block_rows(rows)
        if blocks is None:
            raise ValueError(
                "an HF projection's rows straddle TE's 128-row FP8 blocks of the fused weight (head_dim or the"
                " MLP size is not a multiple of 128); the te spec cannot export the bytes it trains with"
            )
        out.append(
            (
                w_fp8.index_select(0, rows.to(w_fp8.device)),
                scale_inv.index_select(0, blocks.to(scale_inv.device)),
            )
        )
    return out


def te_linears(model: nn.Module) -> Iterator[tuple[int, str, nn.Module]]:
    """(layer index, role, module) of every TE decoder linear of a GPTModel, in layer order."""
    for name, module in model.named_modules():
        head, _, tail = name.partition("decoder.layers.")
        if head or not tail:
            continue
        index, _, local = tail.partition(".")
        if local in TE_LINEAR_ROLES:
            yield int(index), TE_LINEAR_ROLES[local], module


def check_fp8_weights(model: nn.Module) -> int:
    """Every TE decoder linear holds a blockwise FP8 weight (raises otherwise); returns how many."""
    count = 0
    for _, _, module in te_linears(model):
        te_fp8_weight(module.weight)
        count += 1
    if count == 0:
        raise ValueError("the te spec built no Transformer Engine decoder linears; refusing to train in BF16")
    return count


# ---------------------------------------------------------------------- megatron DDP + distributed optimizer
def ddp_config_kwargs(fp8: bool) -> dict[str, Any]:
    """``DistributedDataParallelConfig``: FP32 gradient reduction, the distributed optimizer, FP8 parameter
    gathers when the parameters are FP8 (megatron pairs ``fp8_param_gather`` with ``fp8_param``)."""
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        fp8_param_gather=fp8,
    )


def optimizer_config_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """megatron ``OptimizerConfig`` of our AdamW settings. Clipping is ours (`TeRuntime.update`), so 0 here.
    Biases and norm weights get no weight decay (megatron's wd_mult, applied in `TeRuntime`; the torch backend
    and the local spec decay every parameter)."""
    return dict(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )


class LrSchedule:
    """Our schedule (`LrFactor`) with the state_dict of a torch scheduler, written into megatron's groups."""

    def __init__(self, cfg: OptimizerConfig, total_steps: int) -> None:
        self.peak, self.factor, self.last_epoch = cfg.lr, LrFactor(cfg, total_steps), 0

    def get_last_lr(self) -> list[float]:
        return [self.peak * self.factor(self.last_epoch)]

    def step(self) -> None:
        self.last_epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_epoch = int(state["last_epoch"])


class TeRuntime:
    """megatron DDP around a te-spec GPTModel and its distributed optimizer (one rank's view)."""

    def __init__(self, model: nn.Module, optimizer_cfg: OptimizerConfig, *, fp8: bool, dp_group: Any) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        config: Any = model.config
        self.module = model
        self.ddp: Any = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(**ddp_config_kwargs(fp8)), module=model
        )
        self.optimizer: Any = get_megatron_optimizer(
            MegatronOptimizerConfig(**optimizer_config_kwargs(optimizer_cfg)), [self.ddp]
        )
        # megatron marks biases and norm weights with wd_mult 0, but only its OptimizerParamScheduler (not used
        # here: our schedule writes lr) turns that into each group's weight_decay; Adam otherwise decays every
        # group by the config's value (megatron-core 0.16.1's optimizer/__init__.py).
        for group in self.optimizer.param_groups:
            group["weight_decay"] = optimizer_cfg.weight_decay * group.get("wd_mult", 1.0)
        self.dp_group = dp_group
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def _shards(self) -> Iterator[tuple[str, Any, Tensor, int, int]]:
        """(name, model param, FP32 master shard, start, end) of every master shard this rank holds."""
        for opt in self._optimizers():
            for param in opt.model_param_gbuf_map:
                shard = getattr(param, "main_param", None)
                if shard is None:
                    raise ValueError(
                        "megatron's optimizer holds no FP32 master shard (precision-aware optimizer?)"
                    )
                span = opt._get_model_param_range_map(param)["param"]
                yield self.names[id(param)], param, shard, span.start, span.end

    # -------------------------------------------------------------- weights
    @torch.no_grad()
    def load_masters(self, local: dict[str, Tensor]) -> None:
        """This rank's TP shards (FP32, megatron names) into the parameters and the FP32 master shards."""
        params = dict(self.module.named_parameters())
        for name, value in local.items():
            params[name].copy_(value.to(params[name].device))  # FP8 parameters: TE quantizes the FP32 values
        for name, _, shard, start, end in self._shards():
            shard.copy_(local[name].to(shard.device).reshape(-1)[start:end])

    @torch.no_grad()
    def master_state(self, keep: Callable[[str], bool] = lambda name: True) -> dict[str, Tensor]:
        """This TP rank's FP32 masters in megatron names, whole over the data-parallel ranks.

        Each rank owns a disjoint slice of every parameter's master; a zero-filled tensor with this rank's slice
        written, summed over the data-parallel group, is the whole master (x + 0 = x in FP32).
        """
        owned: dict[str, list[tuple[Tensor, int, int]]] = {}
        for name, _, shard, start, end in self._shards():
            owned.setdefault(name, []).append((shard, start, end))
        out = {}
        for name, param in self.module.named_parameters():  # the same order on every rank
            if not keep(name):
                continue
            full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            for shard, start, end in owned.get(name, []):
                full[start:end] = shard
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(full, group=self.dp_group)
            out[name] = full.view(param.shape)
        return out

    # -------------------------------------------------------------- step
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def update(self, clip: float, lr: float) -> tuple[float, bool]:
        """Reduce gradients, then step unless the global norm is not finite; returns (norm, skipped)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.ddp.finish_grad_sync()
        found_inf = bool(self.optimizer.prepare_grads())  # False without a loss scaler (bf16)
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            return norm, True
        if clip > 0:
            shards = [p for opt in self._optimizers() for p in opt.get_parameters()]  # FP32 masters
            clip_grad_by_total_norm_fp32(shards, clip, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Adam on the FP32 shards, then the updated masters into the BF16/FP8 parameters and their all-gather.
        self.optimizer.step_with_ready_grads()
        return norm, False

    # -------------------------------------------------------------- optimizer state (per rank)
    def state_dict(self) -> dict[str, Any]:
        return {"inner": [opt.optimizer.state_dict() for opt in self._optimizers()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = state["inner"]
        optimizers = self._optimizers()
        if len(inner) != len(optimizers):
            raise ValueError(
                f"checkpoint holds {len(inner)} optimizer states, this model has {len(optimizers)}"
            )
        for opt, sd in zip(optimizers, inner, strict=True):
            opt.optimizer.load_state_dict(sd)
