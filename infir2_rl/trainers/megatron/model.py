"""Build a megatron-core GPTModel for a Qwen2/Llama HF checkpoint, with one of two layer specs.

* ``local``: megatron's local spec (RMSNorm modules, SwiGLU MLP, RoPE) with our `layers.ParallelLinear`
  for linear_qkv / linear_proj / linear_fc1 / linear_fc2 (blockwise FP8 through the project's quantizer
  and autograd, emulated on CPU, cuBLASLt on Hopper) and `layers.SdpaAttention` as core attention. Runs on
  CPU (gloo, with shims.py) and on GPUs without Transformer Engine. megatron's own ``config.fp8`` stays
  off: FP8 is ours, so it cannot silently fall back to BF16.
* ``te``: megatron's Transformer Engine spec with ``fp8="e4m3"``, ``fp8_recipe="blockwise"``
  (TE's Float8BlockScaling: 128x128 weight blocks, 1x128 activation tiles, FP32 scales). Needs
  ``transformer_engine``. Only the model construction is written (against megatron-core's TE spec API) and
  it was never run (no TE on the machines used); `resolve_spec` refuses ``te`` until the train step exists.

Parameters are FP32 masters; BF16 compute runs under autocast (the torch backend's convention), so the two
backends compute the same numbers from the same weights.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from infir2_rl.trainers.megatron import shims
from infir2_rl.trainers.megatron.hf_mapping import Arch, padded_vocab
from infir2_rl.trainers.megatron.layers import ParallelLinear, SdpaAttention

TE_NOT_BUILT = (
    "trainer.megatron_spec=te builds megatron's Transformer Engine spec, but its train step (megatron DDP,"
    " distributed optimizer, TE's FP8 bytes in the export) is not written yet; use trainer.megatron_spec=local"
)
MEGATRON_MISSING = (
    "trainer.backend=megatron needs megatron-core, which is not installed: pip install -e '.[megatron]'"
    " (megatron-core 0.16 on Python 3.11, up to 0.19 on 3.12), or use trainer.backend=torch"
)


def megatron_available() -> bool:
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def resolve_spec(setting: str, fp8: bool, context_parallel_size: int = 1) -> str:
    """The layer spec to build: ``local`` for ``local`` and ``auto``; refuses what cannot run.

    ``te`` is refused until its train step exists (see TE_NOT_BUILT), so ``auto`` means ``local`` for now,
    also where Transformer Engine imports. Every refusal is one sentence naming the field, raised before any
    actor starts (TrainerGroup calls this on the driver) and again in each worker (whose image may differ).
    ``fp8`` is accepted for symmetry with the te path, where it selects TE's blockwise recipe.
    """
    if not megatron_available():
        raise ValueError(MEGATRON_MISSING)
    if setting == "te":
        raise ValueError(TE_NOT_BUILT)
    if context_parallel_size > 1:
        raise ValueError(
            f"trainer.context_parallel_size={context_parallel_size}: the local megatron spec has no context"
            " parallelism (only the te spec would, and it is not built yet); set it to 1"
        )
    return "local"


def transformer_config(arch: Arch, *, spec: str, fp8: bool, tp: int, cp: int, recompute: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

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
        # TE computes in BF16 with FP32 masters kept by megatron's distributed optimizer.
        kwargs.update(bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False)
        if fp8:
            kwargs.update(fp8="e4m3", fp8_recipe="blockwise", fp8_param=True)
    return TransformerConfig(**kwargs)


def linear_class(fp8: bool, pow2_scales: bool) -> type[ParallelLinear]:
    """A ParallelLinear subclass carrying the FP8 settings (megatron calls the spec's class directly)."""
    return type(
        "Fp8ParallelLinear" if fp8 else "ParallelLinear",
        (ParallelLinear,),
        {"fp8": fp8, "pow2_scales": pow2_scales},
    )


def layer_spec(spec: str, fp8: bool, pow2_scales: bool) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "te":
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
    """GPTModel returning this TP rank's vocab shard of the logits ``[b, s, padded_vocab / tp]``
    (`layers.gather_vocab` makes them whole)."""
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


def init_parallel_state(tp: int, cp: int, seed: int) -> None:
    """megatron's process groups over the already initialized torch.distributed world (TP fastest)."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
