"""True on-policy forward: one Qwen2 walk, run by the trainer and the rollout engine alike.

Under ``true_on_policy`` (an RL stage setting) the trainer's log-prob of every sampled token equals, bit for
bit, the one the engine reported, in BF16 and in unified FP8. Two things make that so:

1. Both sides run *this* function over the transformers modules they hold (the trainer's FP32 masters
   cast to BF16, or its ``Fp8Linear`` FP8 bytes; the engine's BF16 copy or ``Fp8InferenceLinear`` buffers
   filled from those bytes), so the op order, roundings and precision flow are one piece of code: BF16
   residual stream, RMSNorm in FP32 then cast, rotary tables computed once by ``rope_tables``, SiLU-gated
   MLP, BF16 lm_head, log-softmax of ``logits.float() / T``.
2. Every op with a reduction runs a batch-invariant kernel (``invariant_ops``), so a token's numbers do not
   depend on whether it sits in a decode batch of 64 rows or in the trainer's 8,192-token forward.

Attention is a callback (``Attend``): the trainer attends within each sequence of its batch
(``invariant_ops.causal_attention``, in ``trainers/torch/invariant_scoring.py``, which also holds the
trainer's lm_head + log-prob), the engine writes K/V into its cache and attends over the cache.

The engine's prefill runs this function; its decode step keeps its fused kernels, each bit-identical to
the op here it replaces (engines/native/model_runner.py says which). What it costs: the invariant GEMMs and
attention trade shape-tuned speed for shapes that give the same bits at every M (bench/true_on_policy.py
measures the cost, bench/invariant_gemm.py the shapes). The trainer path is differentiable (invariant forward, plain torch backward) and keeps the padded layout;
gradient checkpointing and FSDP are not applied to it (the trainer refuses FSDP with true_on_policy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.fp8.linear import Fp8InferenceLinear, Fp8Linear
from infir2_rl.fp8.ops import fp8_linear
from infir2_rl.models import invariant_ops as ops

DTYPE = torch.bfloat16  # the one compute dtype of the walk on a GPU
SUPPORTED_MODEL_TYPES = ("qwen2",)

# attend(layer index, q (N, H, D), k (N, KVH, D), v (N, KVH, D)) -> (N, H * D), all rotated already.
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
LayerAttend = Callable[[Tensor, Tensor, Tensor], Tensor]  # the same for one layer


def check_model(model: nn.Module) -> None:
    """Refuse models the walk does not compute exactly as transformers does (one clear line)."""
    config: Any = model.config  # type: ignore[assignment]
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    problems = []
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {config.model_type!r} (supported: {SUPPORTED_MODEL_TYPES})")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (only 'default')")
    if getattr(config, "use_sliding_window", False):
        problems.append("sliding-window attention")
    if problems:
        raise ValueError("true_on_policy: the invariant forward does not support " + ", ".join(problems))


def plan_gemms(model: nn.Module, device: torch.device) -> list[str]:
    """Probe the GEMMs the walk will run for this model on ``device`` (``invariant_ops.plan``: cuBLAS where it
    gives the same bits at every batch size, the Triton kernels elsewhere): the decoder's in each precision it
    holds and the lm_head. The trainer and the engine each call this before their first forward and before any
    CUDA graph capture. Returns the plan in words, one line per GEMM group."""
    config: Any = model.config  # type: ignore[assignment]
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads, inter = int(config.num_key_value_heads), int(config.intermediate_size)
    dim = int(getattr(config, "head_dim", None) or hidden // heads)
    decoder = [(hidden, [heads * dim, kv_heads * dim, kv_heads * dim]), (heads * dim, [hidden]),
               (hidden, [inter, inter]), (inter, [hidden])]  # fmt: skip
    inner: Any = model.model  # type: ignore[assignment]
    kinds = {
        _fp8_pow2(m) is not None
        for layer in inner.layers
        for m in (layer.self_attn.q_proj, layer.mlp.down_proj)
    }
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    fp8_groups = decoder if True in kinds else []
    bf16_groups = (decoder if False in kinds else []) + [(hidden, [int(head.weight.shape[0])])]
    return ops.plan(fp8_groups, True, device) + ops.plan(bf16_groups, False, device)


def _fp8_pow2(module: nn.Module) -> bool | None:
    """Whether an FP8 module quantizes with power-of-two scales; None for a BF16 one."""
    if isinstance(module, Fp8InferenceLinear) or (isinstance(module, Fp8Linear) and module.fp8_enabled):
        return bool(module.pow2_scales)
    return None


def rope_tables(config: Any, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin (max_positions, D) in BF16, transformers' default rotary formula computed on ``device``: the
    trainer and the engine call this one function, so their tables are the same bytes."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    inv_freq, scaling = Qwen2RotaryEmbedding.compute_default_rope_parameters(config)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(DTYPE), (emb.sin() * scaling).to(DTYPE)


def _cast(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(DTYPE)


def linear(x: Tensor, module: nn.Module, rows: ops.QuantizedRows | None = None) -> Tensor:
    """The module's projection of x (N, K) BF16 through the invariant GEMM of its kind; ``rows``: x already
    quantized for an FP8 module (``linears``)."""
    fprop: Any = ops.fp8_mm if rows is None else functools.partial(ops.fp8_mm_rows, rows)
    if isinstance(module, Fp8InferenceLinear):
        return fprop(x, module.weight, module.weight_scale_inv, _cast(module.bias), module.pow2_scales)
    if isinstance(module, Fp8Linear) and module.fp8_enabled:
        fp8w, bias = module._fp8_weight(), _cast(module.bias)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or module.weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if not needs_grad:  # scoring: the GEMM alone, nothing quantized or kept for a backward
            return fprop(x, fp8w.w_fp8, fp8w.scale_inv, bias, module.pow2_scales)
        return fp8_linear(x, module.weight, bias, fp8w, module.pow2_scales, DTYPE, fprop=fprop)
    if isinstance(module, nn.Linear):
        return ops.mm(x, module.weight.to(DTYPE), _cast(module.bias))
    raise TypeError(f"true_on_policy: no invariant GEMM for {type(module).__name__}")


def linears(x: Tensor, modules: tuple[nn.Module, ...]) -> list[Tensor]:
    """The projections of one input by several modules (q, k, v; gate, up). FP8 modules share one
    quantization of x, padded for all of their GEMMs (``invariant_ops.quantize_rows``): the same codes each
    would make alone, one launch instead of one per module."""
    pow2 = {_fp8_pow2(m) for m in modules}
    if not ops.kernels_available(x.device) or None in pow2 or len(pow2) > 1:
        return [linear(x, m) for m in modules]
    weights: list[Tensor] = [m.weight for m in modules]  # type: ignore[misc]  # (N, K): the GEMMs' shapes
    rows = ops.quantize_rows(x, weights, bool(pow2.pop()))
    return [linear(x, m, rows) for m in modules]


def decoder_layer(
    layer: Any,
    config: Any,
    h_N: Tensor,
    positions_N: Tensor,
    attend: LayerAttend,
    cos: Tensor,
    sin: Tensor,
) -> Tensor:
    """One decoder layer of the walk: the residual stream h (N, E) BF16 in, out. The trainer runs each layer
    through this function (from CUDA graphs on a GPU: ``trainers/torch/invariant_scoring.py``), the engine's
    prefill through ``hidden_states``; both compute the same ops in the same order."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    eps = float(config.rms_norm_eps)
    n = h_N.shape[0]
    x = ops.rms_norm(h_N, layer.input_layernorm.weight.to(DTYPE), eps)
    q, k, v = linears(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = ops.rope(q.view(n, heads, dim), k.view(n, kv_heads, dim), positions_N, cos, sin)
    h = h_N + linear(attend(q, k, v.view(n, kv_heads, dim)), attn.o_proj)
    x = ops.rms_norm(h, layer.post_attention_layernorm.weight.to(DTYPE), eps)
    return h + linear(ops.silu_mul(*linears(x, (mlp.gate_proj, mlp.up_proj))), mlp.down_proj)


def hidden_states(
    model: nn.Module, ids_N: Tensor, positions_N: Tensor, attend: Attend, cos: Tensor, sin: Tensor
) -> Tensor:
    """Final (normed) hidden states (N, E) in BF16 of tokens ``ids_N`` at ``positions_N``."""
    inner: Any = model.model  # type: ignore[assignment]
    h = embed(model, ids_N)
    for i, layer in enumerate(inner.layers):
        h = decoder_layer(layer, model.config, h, positions_N, functools.partial(attend, i), cos, sin)
    return final_norm(model, h)


def embed(model: nn.Module, ids_N: Tensor) -> Tensor:
    """The residual stream's start: the token embeddings in BF16."""
    inner: Any = model.model  # type: ignore[assignment]
    return F.embedding(ids_N, inner.embed_tokens.weight).to(DTYPE)


def final_norm(model: nn.Module, h_NE: Tensor) -> Tensor:
    """The model's last RMSNorm, ahead of the lm_head."""
    inner: Any = model.model  # type: ignore[assignment]
    config: Any = model.config  # type: ignore[assignment]
    return ops.rms_norm(h_NE, inner.norm.weight.to(DTYPE), float(config.rms_norm_eps))


def logits(model: nn.Module, hidden_NE: Tensor) -> Tensor:
    """BF16 logits (N, V) through the invariant GEMM (the engine's lm_head)."""
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    return ops.mm(hidden_NE, head.weight.to(DTYPE))
