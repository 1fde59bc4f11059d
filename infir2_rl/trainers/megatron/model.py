"""Build a megatron-core GPTModel for a Qwen2/Llama HF checkpoint, with one of two layer specs.

* ``local``: megatron's local spec (RMSNorm modules, SwiGLU MLP, RoPE) with our `layers.ParallelLinear`
  for linear_qkv / linear_proj / linear_fc1 / linear_fc2 (blockwise FP8 through the project's quantizer
  and autograd, emulated on CPU, cuBLASLt on Hopper) and `layers.SdpaAttention` as core attention. Runs on
  CPU (gloo, with shims.py) and on GPUs without Transformer Engine. megatron's own ``config.fp8`` stays
  off: FP8 is ours, so it cannot silently fall back to BF16.
* ``te``: megatron's Transformer Engine spec (norms fused into ``linear_qkv`` / ``linear_fc1``) with
  ``fp8="e4m3"``, ``fp8_recipe="blockwise"``, ``fp8_param=True`` (TE's Float8BlockScaling: 128x128 weight
  blocks, 1x128 activation tiles, FP32 scales), BF16 parameters, megatron DDP and the distributed optimizer
  (te.py). Needs ``transformer_engine`` and a GPU. Written and contract-tested against the pinned sources,
  never run (no TE on the machines used).

Local spec: parameters are FP32 masters; BF16 compute runs under autocast (the torch backend's convention), so
the two backends compute the same numbers from the same weights. te spec: BF16 (or TE FP8) parameters, FP32
masters in the distributed optimizer's shards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from infir2_rl.trainers.megatron import shims
from infir2_rl.trainers.megatron.hf_mapping import Arch, padded_vocab
from infir2_rl.trainers.megatron.layers import ParallelLinear, SdpaAttention

log = logging.getLogger(__name__)

MEGATRON_MISSING = (
    "trainer.backend=megatron needs megatron-core, which is not installed: pip install -e '.[megatron]'"
    " (megatron-core 0.16 on Python 3.11, up to 0.19 on 3.12), or use trainer.backend=torch"
)


def megatron_available() -> bool:
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def resolve_spec(
    setting: str,
    fp8: bool,
    context_parallel_size: int = 1,
    *,
    pow2_scales: bool = False,
    hf_config: dict[str, Any] | None = None,
    dense_forward: bool = False,
) -> str:
    """The layer spec to build (``local`` or ``te``); refuses, in one sentence naming the field, what cannot run.

    ``auto`` is ``te`` where Transformer Engine imports and ``local`` elsewhere (logged). With ``te``: TE must
    import; with FP8 training its blockwise recipe must use ``trainer.fp8_pow2_scales``'s scale rule, the model's
    projections must fill whole 128-row blocks of the fused weights (``hf_config``, when known), and no dense
    (FP8-off) scoring may be asked for (``dense_forward``: TE's parameters are FP8 and have no BF16 copy).
    Called by TrainerGroup on the driver before any actor starts and again in each worker (whose image may
    differ); the worker also checks the GPU (`te.runtime_problem`).
    """
    from infir2_rl.trainers.megatron import te

    if not megatron_available():
        raise ValueError(MEGATRON_MISSING)
    if context_parallel_size > 1:
        raise ValueError(
            f"trainer.context_parallel_size={context_parallel_size}: the megatron trainer feeds whole sequences to"
            " every rank (neither layer spec splits them for context parallelism); set it to 1"
        )
    if setting == "local":
        return "local"
    problem = te.import_problem(pow2_scales)
    if problem is not None:
        if setting == "te":
            raise ValueError(
                f"trainer.megatron_spec=te needs Transformer Engine, which does not import here ({problem});"
                " install it (docker/Dockerfile) or set trainer.megatron_spec=local"
            )
        log.info(
            "trainer.megatron_spec=auto: the local spec (Transformer Engine does not import: %s)", problem
        )
        return "local"
    if fp8:
        from infir2_rl.config.parallel_rules import te_fp8_layout_problem

        recipe = te.recipe_problem(pow2_scales)
        if recipe is not None:
            raise ValueError(recipe)
        layout = te_fp8_layout_problem(hf_config) if hf_config is not None else None
        if layout is not None:
            raise ValueError(f"trainer.megatron_spec={setting} (te) with FP8 training: {layout}")
        if dense_forward:
            raise ValueError(
                f"metrics.dense_trainer_mismatch=true with trainer.megatron_spec={setting} (te) and FP8 training:"
                " TE keeps the parameters in FP8, so there is no dense forward on the masters; set it to false"
                " or trainer.megatron_spec=local"
            )
    return "te"


def resolve_stage_spec(cfg: Any) -> str:
    """`resolve_spec` for a stage config (SFT or RL), on the driver: the model's config.json when it exists
    (a later pipeline stage's model does not yet; its workers check again), the dense-scoring metric of RL."""
    import json
    from pathlib import Path

    config_file = Path(cfg.model.path) / "config.json"
    metrics = getattr(cfg, "metrics", None)
    return resolve_spec(
        cfg.trainer.megatron_spec,
        cfg.train_fp8,
        cfg.trainer.context_parallel_size,
        pow2_scales=cfg.trainer.fp8_pow2_scales,
        hf_config=json.loads(config_file.read_text()) if config_file.is_file() else None,
        dense_forward=cfg.kind == "rl" and bool(getattr(metrics, "dense_trainer_mismatch", False)),
    )


def transformer_config(arch: Arch, *, spec: str, fp8: bool, tp: int, cp: int, recompute: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **transformer_config_kwargs(arch, spec=spec, fp8=fp8, tp=tp, cp=cp, recompute=recompute)
    )


def transformer_config_kwargs(
    arch: Arch, *, spec: str, fp8: bool, tp: int, cp: int, recompute: bool
) -> dict[str, Any]:
    """The TransformerConfig keywords (tests/test_megatron_te_contract.py checks them against megatron-core)."""
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        # Every weight is loaded from an HF checkpoint right after construction: no random init.
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec == "te":
        kwargs.update(te_config_kwargs(fp8))
    return kwargs


def te_config_kwargs(fp8: bool) -> dict[str, Any]:
    """What the te spec changes in the TransformerConfig (checked against megatron-core's fields in CI)."""
    kwargs: dict[str, Any] = dict(
        # BF16 parameters (FP8 ones with fp8_param); the FP32 masters live in the distributed optimizer.
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=False,
        # Random init before the HF weights overwrite it: TE quantizes FP8 parameters when it creates them,
        # and uninitialized memory could hold NaN.
        perform_initialization=True,
        # Our loss is already divided by the global batch's units: DDP sums gradients instead of averaging.
        calculate_per_token_loss=True,
    )
    if fp8:
        kwargs.update(fp8="e4m3", fp8_recipe="blockwise", fp8_param=True)
    return kwargs


def linear_class(fp8: bool, pow2_scales: bool) -> type[ParallelLinear]:
    """A ParallelLinear subclass carrying the FP8 settings (megatron calls the spec's class directly)."""
    return type(
        "Fp8ParallelLinear" if fp8 else "ParallelLinear",
        (ParallelLinear,),
        {"fp8": fp8, "pow2_scales": pow2_scales},
    )


def layer_spec(spec: str, fp8: bool, pow2_scales: bool) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "te":  # RMSNorm fused into linear_qkv / linear_fc1 (config.normalization), TE attention
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    linear = linear_class(fp8, pow2_scales)
    attention = layer.submodules.self_attention.submodules
    attention.linear_qkv = attention.linear_proj = linear
    attention.core_attention = SdpaAttention
    mlp_spec = layer.submodules.mlp  # a ModuleSpec up to megatron-core 0.16, a functools.partial from 0.17
    mlp = mlp_spec.keywords["submodules"] if isinstance(mlp_spec, functools.partial) else mlp_spec.submodules
    mlp.linear_fc1 = mlp.linear_fc2 = linear
    return layer


def build_gpt_model(
    arch: Arch, *, spec: str, fp8: bool, pow2_scales: bool, tp: int, cp: int = 1, recompute: bool = False
) -> Any:
    """GPTModel returning this TP rank's vocab shard of the logits ``[b, s, padded_vocab / tp]`` (the trainer
    swaps its output layer for a scorer, ``MegatronTrainer._scores``, so these logits are never made)."""
    from megatron.core.models.gpt import GPTModel

    shims.install()
    config = transformer_config(arch, spec=spec, fp8=fp8, tp=tp, cp=cp, recompute=recompute)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, fp8, pow2_scales),
        vocab_size=padded_vocab(arch, tp),
        max_sequence_length=arch.max_positions,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )


def autocast_in_recompute(
    decoder: Any, autocast: Callable[[], contextlib.AbstractContextManager[Any]]
) -> None:
    """Run each decoder layer's forward under the trainer's ``autocast``, so megatron's full recompute computes
    what the forward computed. The recompute reruns a layer inside ``backward``, where torch's autocast state
    is that of the ``.backward()`` call (off: the trainer autocasts its forward only); megatron's
    ``CheckpointFunction`` restores the RNG states but not autocast (megatron casts its parameters to BF16 and
    does not autocast), so over our FP32 parameters the recompute ran in FP32: FP32 GEMMs, attention on SDPA's
    math kernel (28 GiB of scores at 7B x 16,384 tokens: out of memory), FP8 inputs quantized unrounded, and
    gradients of other numbers than the forward's. In the forward the nested autocast changes nothing.
    ``torch.utils.checkpoint`` (the torch backend's) restores autocast itself."""
    for layer in decoder.layers:

        def under_autocast(*args: Any, _forward: Callable[..., Any] = layer.forward, **kwargs: Any) -> Any:
            with autocast():
                return _forward(*args, **kwargs)

        layer.forward = under_autocast  # per instance: names and state dicts unchanged


def init_parallel_state(tp: int, cp: int, seed: int) -> None:
    """megatron's process groups over the already initialized torch.distributed world (TP fastest)."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
