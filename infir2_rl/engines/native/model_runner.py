"""The engine's own Qwen2-family forward for rollout: fused projections, a slot KV cache, no Python per token.

Shapes: B decode rows, P prompts, L prompt tokens, V vocabulary, E hidden size, H / KVH query / KV heads,
D head dim.

Built on top of the loaded transformers model (``Qwen2ForCausalLM``, BF16 or with ``Fp8InferenceLinear``
decoder projections), whose tensors it shares (``linears.FusedLinear``): the same embedding, norms and
lm_head, q|k|v and gate|up fused into one GEMM each. It computes what ``Qwen2ForCausalLM`` computes, in the
same op order (RMSNorm in FP32 then cast, rotary tables from the model's own ``rotary_emb``, SiLU-gated
MLP), so on CPU in FP32 its log-probs equal the HF forward's up to summation order (tested).

Two entry points, both writing keys and values into a ``KVCache`` by slot:
* ``prefill(ids_PL, lengths_P, slots, prompt_of_row)``: right-padded prompts, causal attention, K/V copied
  into the slot of every row that shares a prompt (the n samples of a request share one prefill); returns
  the last real position's logits per prompt.
* ``decode(tokens_B, positions_B, slots_B)``: one token per row at its own position; no host sync and
  fixed shapes, so ``cuda_graphs`` can capture it.
Attention goes through ``attention.py`` and every projection through ``linears.py``: one place each.

``true_on_policy=True``: the trainer's log-probs must equal the engine's bit for bit (models/invariant.py).
Prefill runs ``invariant.hidden_states``, the walk the trainer scores with (``prefill_forward``, so small
prefills replay it from the prefill graphs). Decode keeps its fused kernels,
each of which computes what the walk's op computes bit for bit (add + RMSNorm, rotary, SiLU*up: same
roundings, per-row sums in one order), and swaps what is not invariant: every GEMM takes the invariant
shapes (``FusedLinear(invariant=True)``; fused q|k|v and gate|up give the same bits as the walk's separate
GEMMs: a column's result does not depend on its tile in the Triton kernels, and ``invariant_ops.plan`` checks
it for cuBLAS), attention is ``invariant_ops.attention`` over
the cache and the lm_head ``invariant_ops.mm``. In FP8 the norm and SiLU*up kernels quantize the next
GEMM's input as in the fast mode, with the walk's codes (the walk runs its norm, then ``quantize_rows``): the
quantizer is the same code, and the norm runs with the walk's warp count (``fused_ops.NORM_WARPS``), which
sets the order of its FP32 mean. With the quantizing default of 16 warps its codes differed in 8 of 32,768
rows at hidden 1536 (H100, 2026-11-25), enough to give unified FP8 at 1.5B a train/rollout K3 of 9e-4 instead
of 0. o_proj's input is quantized by the attention kernel (``invariant_ops.attention_quantized``, head dim
128; by the GEMM otherwise). Every token (the first one too) is sampled
by ``sampler.py``, whose log-sum-exp the trainer's scoring shares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.engines.native import attention, fused_ops, sampler
from infir2_rl.engines.native.fused_ops import rms_norm_torch as rms_norm
from infir2_rl.engines.native.kv_cache import KVCache
from infir2_rl.engines.native.linears import Fp8GemmChooser, FusedLinear
from infir2_rl.models import invariant
from infir2_rl.models import invariant_ops as inv_ops

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2",)


class _Layer:
    def __init__(
        self, layer: Any, chooser: Fp8GemmChooser | None, dtype: torch.dtype, invariant: bool
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm: Tensor = layer.input_layernorm.weight
        self.post_norm: Tensor = layer.post_attention_layernorm.weight
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], chooser, dtype, invariant)
        self.o = FusedLinear([attn.o_proj], chooser, dtype, invariant)
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], chooser, dtype, invariant)
        self.down = FusedLinear([mlp.down_proj], chooser, dtype, invariant)


class Qwen2Runner:
    """Prefill and decode over a slot KV cache for a loaded Qwen2 model (module docstring)."""

    def __init__(
        self, model: nn.Module, attention_impl: str | None = None, true_on_policy: bool = False
    ) -> None:
        config: Any = model.config  # type: ignore[assignment]
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={config.model_type!r}: the graph decode runner supports {SUPPORTED_MODEL_TYPES}; "
                "use the eager engine path (cuda_graphs=False)"
            )
        inner: Any = model.model  # type: ignore[assignment]
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.num_layers = int(config.num_hidden_layers)
        self.eps = float(config.rms_norm_eps)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(config.max_position_embeddings)
        pow2 = any(getattr(m, "pow2_scales", False) for m in model.modules())
        self.chooser = Fp8GemmChooser(pow2) if self.device.type == "cuda" else None
        self.embed: Tensor = inner.embed_tokens.weight
        self.final_norm: Tensor = inner.norm.weight
        head: Any = model.lm_head
        self.lm_head: Tensor = head.weight  # BF16: never quantized
        self.true_on_policy = true_on_policy
        self.layers = [_Layer(layer, self.chooser, self.dtype, true_on_policy) for layer in inner.layers]
        self.fp8 = self.layers[0].qkv.fp8
        self.pow2 = pow2
        q_part, k_part, v_part = self.layers[0].qkv.part_slices
        self.k_offset, self.v_offset = k_part.start, v_part.start
        self.attention_impl = attention_impl or attention.default_impl(self.device)
        # FP8: the Triton decode attention quantizes o_proj's input (one head = one 1x128 tile).
        self.quant_attention = self.attention_impl == "triton" and self.head_dim == 128
        with torch.no_grad():
            positions = torch.arange(self.max_positions, device=self.device)[None]
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # (max_positions, D) in the model dtype
        self.model = model
        if true_on_policy:
            invariant.check_model(model)
            if self.dtype != invariant.DTYPE or not inv_ops.kernels_available(self.device):
                raise ValueError(
                    f"true_on_policy needs the batch-invariant kernels: a CUDA device with Triton and a"
                    f" {invariant.DTYPE} model (got {self.device}, {self.dtype})"
                )
            self.cos, self.sin = invariant.rope_tables(config, self.max_positions, self.device)
            for line in invariant.plan_gemms(model, self.device):
                logger.info("true_on_policy engine: %s", line)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        if max_len > self.max_positions:
            raise ValueError(
                f"prompt + max_new_tokens = {max_len} exceeds the model's max_position_embeddings "
                f"{self.max_positions}; shorten the prompt or max_new_tokens"
            )
        return KVCache(
            self.num_layers, num_slots, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device
        )

    @torch.no_grad()
    def prefill(
        self, ids_PL: Tensor, lengths_P: Tensor, cache: KVCache, slots: Tensor, prompt_of_row: Tensor
    ) -> Tensor:
        """Run right-padded prompts, store their K/V in ``slots`` (row r takes prompt ``prompt_of_row[r]``);
        returns logits (P, V) at each prompt's last real token.

        This is the eager prefill (any shape); small prefills on a GPU replay CUDA graphs of
        ``prefill_forward`` instead (``prefill_graphs.PrefillGraphs``, the scheduler's choice). Eagerly its
        host time is its launches: on CUDA the residual
        add + RMSNorm and SiLU*up are the decode step's fused kernels, which in FP8 also quantize the next
        GEMM's input, and every FP8 GEMM takes cuBLASLt (``FusedLinear(..., prefill=True)``: no choice timed
        per prompt size). Before, FP8 quantized each GEMM input in a launch of its own and the norms were 7
        torch ops each: a prefill of 2 x 128 tokens took 42 ms in FP8 against 17 in BF16 on an H100, for
        6.1 and 5.5 ms of kernels (bench/prefill.py, docs/performance.md)."""
        shape = (ids_PL.shape[0], self.num_kv_heads, ids_PL.shape[1], self.head_dim)
        k_st, v_st = (torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(2))

        def kv_written(i: int) -> None:
            attention.write_prefill(cache.k[i], cache.v[i], slots, prompt_of_row, k_st, v_st)

        return self.prefill_forward(ids_PL, lengths_P, lambda i: (k_st, v_st), kv_written)

    @torch.no_grad()
    def prefill_forward(
        self,
        ids_PL: Tensor,
        lengths_P: Tensor,
        kv_out: Callable[[int], tuple[Tensor, Tensor]],
        kv_written: Callable[[int], None] | None = None,
        choose_gemms: bool = False,
    ) -> Tensor:
        """``prefill``'s forward: layer i's rotated keys and values are written into ``kv_out(i)`` = (k, v),
        each (P, KVH, L, D), and ``kv_written(i)`` is called after; returns the logits (P, V) at each prompt's
        last real token. ``choose_gemms``: FP8 GEMMs of up to ``linears.DECODE_MAX_ROWS`` rows take the
        chooser's timed choice at this M, as decode does (the prefill graphs, whose M is one of a few
        buckets), and a split-K GEMM hands its partials to the kernel after it (the rotary kernel, the next
        norm), as in decode; otherwise cuBLASLt (eager prefill, any M).

        The rotary embedding and the K/V stores are the decode step's kernel (``fused_ops.rope_write_kv``,
        with slot = prompt and position = token): torch's rotary was ~14 launches per layer, 1.1 ms of
        the 3.8 ms of kernels of a 2 x 128-token prefill at 1.5B (H100, docs/performance.md, session 22).
        Under ``true_on_policy`` the walk computes it instead (``_prefill_invariant``)."""
        if self.true_on_policy:
            return self._prefill_invariant(ids_PL, lengths_P, kv_out, kv_written)
        num_prompts, length = ids_PL.shape
        device = ids_PL.device
        positions = torch.arange(length, device=device).repeat(num_prompts)
        prompt_ids = torch.arange(num_prompts, device=device).repeat_interleave(length)
        quant, pow2, eps = self.fp8 and ids_PL.is_cuda, self.pow2, self.eps
        cublas = not choose_gemms
        h = F.embedding(ids_PL, self.embed).reshape(num_prompts * length, -1)
        delta: Tensor | fused_ops.SplitPartials | None = None
        for i, layer in enumerate(self.layers):
            x = fused_ops.add_rms_norm(h, delta, layer.input_norm, eps, quant, pow2)  # h += delta in place
            k, v = kv_out(i)
            q = fused_ops.rope_write_kv(
                layer.qkv(x, prefill=True) if cublas else layer.qkv.deferred(x), positions, prompt_ids,
                self.cos, self.sin, k, v, self.num_heads, self.num_kv_heads, self.k_offset, self.v_offset,
            )  # fmt: skip
            if kv_written is not None:
                kv_written(i)
            q = q.view(num_prompts, length, self.num_heads, -1).transpose(1, 2)
            a = attention.prefill(q, k, v).reshape(num_prompts * length, -1)
            o = layer.o(a, prefill=True) if cublas else layer.o.deferred(a)
            x = fused_ops.add_rms_norm(h, o, layer.post_norm, eps, quant, pow2)
            s = fused_ops.silu_mul(layer.gate_up(x, prefill=cublas), quant, pow2)
            last = i == len(self.layers) - 1
            delta = layer.down(s, prefill=cublas) if cublas or last else layer.down.deferred(s)
        assert isinstance(delta, Tensor)
        h = h + delta
        last_rows = h.view(num_prompts, length, -1)[torch.arange(num_prompts, device=device), lengths_P - 1]
        return F.linear(rms_norm(last_rows, self.final_norm, self.eps), self.lm_head)

    @torch.no_grad()
    def decode(self, tokens_B: Tensor, positions_B: Tensor, slots_B: Tensor, cache: KVCache) -> Tensor:
        """One decode step: token ``tokens_B[b]`` at ``positions_B[b]`` of slot ``slots_B[b]`` -> logits (B, V).

        The elementwise work runs in ``fused_ops`` kernels on CUDA (torch twins on CPU); in FP8 the norm
        and SiLU*up kernels, and the attention (head_dim 128: the Triton decode attention, or under
        true_on_policy the invariant kernel), also quantize the next GEMM's input."""
        invariant_ = self.true_on_policy
        # FP8: the norm and SiLU*up kernels also quantize the next GEMM's input (one launch fewer each). Under
        # true_on_policy the norm runs with the walk's (non-quantizing) warp count, which sets the order of its
        # FP32 mean: then its codes are the walk's quantize_rows of the walk's norm (module docstring).
        quant, pow2, eps = self.fp8 and tokens_B.is_cuda, self.pow2, self.eps
        quant_attn = quant and self.quant_attention and not invariant_
        quant_inv_attn = quant and invariant_ and self.head_dim == 128
        warps = fused_ops.NORM_WARPS if invariant_ else None
        lengths_B = (positions_B + 1).to(torch.int32)
        h = F.embedding(tokens_B, self.embed)
        # split-K GEMMs hand their partials to the kernel after them, which sums them (``deferred``)
        delta: Tensor | fused_ops.SplitPartials | None = None
        for i, layer in enumerate(self.layers):
            x = fused_ops.add_rms_norm(h, delta, layer.input_norm, eps, quant, pow2, warps)
            q = fused_ops.rope_write_kv(
                layer.qkv.deferred(x), positions_B, slots_B, self.cos, self.sin, cache.k[i], cache.v[i],
                self.num_heads, self.num_kv_heads, self.k_offset, self.v_offset,
            )  # fmt: skip
            a: Tensor | fused_ops.QuantizedRows
            if quant_inv_attn:  # the walk's attention, then its quantize_rows, in one kernel
                a = inv_ops.attention_quantized(q, cache.k[i], cache.v[i], slots_B, lengths_B, pow2)
            elif invariant_:
                a = inv_ops.attention(q, cache.k[i], cache.v[i], slots_B, lengths_B)
            else:
                a = attention.decode(
                    q, cache.k[i], cache.v[i], slots_B, lengths_B, self.attention_impl, quant_attn, pow2,
                    cache.arrivals,
                )  # fmt: skip
            x = fused_ops.add_rms_norm(h, layer.o.deferred(a), layer.post_norm, eps, quant, pow2, warps)
            gate_up = layer.gate_up(x)
            rows = layer.down.input_rows(gate_up)  # (BF16 true_on_policy: down_proj's padded plan, no copy)
            delta = layer.down.deferred(fused_ops.silu_mul(gate_up, quant, pow2, rows=rows))
        x = fused_ops.add_rms_norm(h, delta, self.final_norm, eps)
        assert isinstance(x, Tensor)
        return inv_ops.mm(x, self.lm_head) if invariant_ else F.linear(x, self.lm_head)

    def _prefill_invariant(
        self,
        ids_PL: Tensor,
        lengths_P: Tensor,
        kv_out: Callable[[int], tuple[Tensor, Tensor]],
        kv_written: Callable[[int], None] | None,
    ) -> Tensor:
        """``prefill_forward`` by the trainer's walk: token t of prompt p attends to keys 0..t of its prompt.
        Layer i's rotated keys and values are copied into ``kv_out(i)`` and attended there (the same bits
        as over the walk's own tensors: a row's sums do not depend on where its keys are stored)."""
        num_prompts, length = ids_PL.shape
        device = ids_PL.device
        positions = torch.arange(length, device=device).repeat(num_prompts)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_st, v_st = kv_out(i)  # (P, KVH, L, D)
            for src, dst in ((k, k_st), (v, v_st)):
                dst.copy_(src.view(num_prompts, length, *src.shape[1:]).transpose(1, 2))
            if kv_written is not None:
                kv_written(i)
            return inv_ops.causal_rows(q, k_st, v_st)

        h = invariant.hidden_states(self.model, ids_PL.reshape(-1), positions, attend, self.cos, self.sin)
        last = h.view(num_prompts, length, -1)[torch.arange(num_prompts, device=device), lengths_P - 1]
        return invariant.logits(self.model, last)

    def sample(
        self, logits_BV: Tensor, params: Any, steps_B: Tensor, truncating: bool
    ) -> tuple[Tensor, Tensor]:
        """The sampling rule of ``engines.sampling`` (one Triton kernel on CUDA, ``sampler.py``)."""
        return sampler.sample(logits_BV, params, steps_B, truncating)
