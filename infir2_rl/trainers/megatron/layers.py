"""The local layer spec's own modules: an FP8 tensor-parallel linear and SDPA core attention.

``ParallelLinear`` stands behind megatron's linear interface (constructor ``(input_size, output_size, *,
config, init_method, bias, skip_bias_add, gather_output / input_is_parallel, tp_comm_buffer_name, ...)``,
forward on ``[s, b, h]`` returning ``(out, bias_or_None)``). Its role comes from ``tp_comm_buffer_name``:

* ``qkv`` and ``fc1`` are column-parallel: weight ``[N / tp, K]``, input copied into the TP region.
* ``proj`` and ``fc2`` are row-parallel: weight ``[N, K / tp]``, partial outputs all-reduced, bias after.

Its weight is kept in megatron's layout (``linear_qkv`` rows per KV group as [the group's q heads, k, v];
``linear_fc1`` = [gate; up]), but FP8 quantization follows the HF projections: the rows of each HF part
(q_proj, k_proj, v_proj; gate_proj, up_proj) are gathered and quantized on their own 128x128 grid, which
is the grid the torch backend's ``Fp8Linear`` and the rollout engines use. So the FP8 bytes this trainer
computes with are the bytes weight sync sends, whatever the head layout. When every part but the last
has a multiple of 128 rows, the parts' grids tile the concatenated weight exactly, and one GEMM runs on
[q; k; v] (outputs permuted back to megatron's order); otherwise one GEMM per part. Both give the same
numbers. Under TP every part's local rows (and a row-parallel layer's local columns) must be a multiple
of 128 so the shards' grids are slices of the full grid (config/parallel_rules.py checks it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.fp8 import gemm, quant_triton
from infir2_rl.fp8.ops import Fp8Weight, fp8_linear, fp8_linear_forward
from infir2_rl.fp8.quant import quantize_weight_blockwise

COLUMN_ROLES = ("qkv", "fc1")
ROW_ROLES = ("proj", "fc2")
# HF projection names of each role's parts, in HF order.
HF_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "fc1": ("gate_proj", "up_proj"), "proj": ("o_proj",)}
HF_PARTS["fc2"] = ("down_proj",)


def quantize_for_training(w: Tensor, pow2_scales: bool) -> Fp8Weight:
    """The quantization ``Fp8Linear`` uses. No W^T: the cache below keeps every layer's FP8 weight for the
    whole step, and a kept transpose would add a byte per weight (1.2 GiB at 1.5B) for what one byte-moving
    kernel makes in backward (``fp8.ops``, docs/performance.md "W^T at backward"), as the torch backend does."""
    if gemm.fast_path_ok(w, w.shape[0], w.shape[1]):
        return Fp8Weight(*quant_triton.quantize_weight(w, pow2_scales))
    return Fp8Weight(*quantize_weight_blockwise(w, pow2_scales=pow2_scales))


def _concat(parts: list[Fp8Weight]) -> Fp8Weight:
    """Parts stacked along N; valid when each part but the last has a multiple of 128 rows."""
    w_t = [p.w_fp8_t for p in parts if p.w_fp8_t is not None]
    s_t = [p.scale_inv_t for p in parts if p.scale_inv_t is not None]
    return Fp8Weight(
        torch.cat([p.w_fp8 for p in parts]),
        torch.cat([p.scale_inv for p in parts]),
        torch.cat(w_t, dim=1) if len(w_t) == len(parts) else None,
        torch.cat(s_t, dim=1) if len(s_t) == len(parts) else None,
    )


def part_rows(role: str, config: Any, out_local: int) -> list[Tensor]:
    """Local row indices of each HF part (in HF order) in this rank's megatron-layout weight."""
    if role == "qkv":
        hd, groups = config.kv_channels, config.num_query_groups
        q_per_group = config.num_attention_heads // groups
        stride = (q_per_group + 2) * hd
        local_groups = out_local // stride
        base = (torch.arange(local_groups) * stride)[:, None]
        q = (base + torch.arange(q_per_group * hd)).flatten()
        k = (base + q_per_group * hd + torch.arange(hd)).flatten()
        v = (base + (q_per_group + 1) * hd + torch.arange(hd)).flatten()
        return [q, k, v]
    if role == "fc1":
        half = out_local // 2
        return [torch.arange(half), torch.arange(half, out_local)]
    return [torch.arange(out_local)]


class ParallelLinear(nn.Module):
    """A tensor-parallel linear (column or row by role) whose GEMMs run in blockwise FP8 when ``fp8``.

    Subclassed by `model.linear_class` with the class attributes ``fp8`` and ``pow2_scales`` set, because
    megatron calls the spec's class directly with its own arguments.
    """

    fp8: bool = False
    pow2_scales: bool = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Any = None,
        **unused: Any,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        role = tp_comm_buffer_name or ""
        if role not in COLUMN_ROLES + ROW_ROLES:
            raise ValueError(f"ParallelLinear role {role!r}: expected one of {COLUMN_ROLES + ROW_ROLES}")
        if getattr(config, "sequence_parallel", False):
            raise ValueError("the local megatron spec does not implement sequence parallelism")
        self.role, self.column = role, role in COLUMN_ROLES
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        tp = self.tp_group.size()
        self.skip_bias_add = skip_bias_add
        out_local, in_local = (
            (output_size // tp, input_size) if self.column else (output_size, input_size // tp)
        )
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=config.params_dtype))
        if getattr(config, "perform_initialization", True):
            init_method(self.weight)
        set_tensor_model_parallel_attributes(self.weight, True, 0 if self.column else 1, 1)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_local if self.column else output_size, dtype=config.params_dtype)
            )
            set_tensor_model_parallel_attributes(self.bias, self.column, 0, 1)
        self.parts = part_rows(role, config, out_local)
        order = torch.cat(self.parts)
        self.identity_order = bool(torch.equal(order, torch.arange(out_local)))
        self._order: Tensor
        self._inverse: Tensor
        self.register_buffer("_order", order, persistent=False)
        self.register_buffer("_inverse", torch.argsort(order), persistent=False)
        self.single_gemm = all(len(p) % 128 == 0 for p in self.parts[:-1])
        # False runs the dense path on the master weight (see `fp8.linear.fp8_disabled`'s counterpart).
        self.fp8_enabled = True
        self._cache: tuple[tuple[object, ...], list[Fp8Weight], Fp8Weight | None] | None = None

    # ------------------------------------------------------------------ FP8 weight
    def _key(self) -> tuple[object, ...]:
        w = self.weight
        return (w._version, w.data_ptr(), w.device, w.dtype, self.pow2_scales)

    def invalidate_fp8_cache(self) -> None:
        self._cache = None

    @torch.no_grad()
    def fp8_parts(self) -> tuple[list[Fp8Weight], Fp8Weight | None]:
        """Each HF part's quantization (cached per weight version), and their stack when one GEMM can run."""
        key = self._key()
        if self._cache is None or self._cache[0] != key:
            w = self.weight.detach()
            parts = [
                quantize_for_training(w.index_select(0, rows.to(w.device)), self.pow2_scales)
                for rows in self.parts
            ]
            self._cache = (key, parts, _concat(parts) if self.single_gemm and len(parts) > 1 else None)
        return self._cache[1], (self._cache[2] if len(self._cache[1]) > 1 else self._cache[1][0])

    # ------------------------------------------------------------------ forward
    def _rows(self, t: Tensor | None, rows: Tensor) -> Tensor | None:
        if t is None:
            return None
        return (
            t if rows.numel() == t.shape[0] and self.identity_order else t.index_select(0, rows.to(t.device))
        )

    def _fp8_matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        parts, stacked = self.fp8_parts()
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if stacked is not None:
            pieces = [(self._order, stacked)]
        else:
            pieces = list(zip(self.parts, parts))
        outs = []
        for rows, fp8w in pieces:
            rows = rows.to(self.weight.device)
            b = self._rows(bias, rows)
            if needs_grad:
                w = self._rows(self.weight, rows)
                assert w is not None
                outs.append(fp8_linear(x, w, b, fp8w, self.pow2_scales))
            else:
                outs.append(fp8_linear_forward(x, fp8w.w_fp8, fp8w.scale_inv, b, self.pow2_scales))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.identity_order else y.index_select(-1, self._inverse)

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.fp8 and self.fp8_enabled:
            return self._fp8_matmul(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        tp = self.tp_group.size()
        if self.column:
            if tp > 1:
                x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            y = self._matmul(x, None if self.skip_bias_add else self.bias)
            return y, (self.bias if self.skip_bias_add else None)
        y = self._matmul(x, None)
        if tp > 1:
            y = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return y, (self.bias if self.skip_bias_add else None)
        return y + self.bias, None

    def extra_repr(self) -> str:
        mode = "column" if self.column else "row"
        return f"{self.role} ({mode}-parallel) {tuple(self.weight.shape)}, fp8={self.fp8}, parts={len(self.parts)}"


class SdpaAttention(nn.Module):
    """Causal core attention through ``torch.nn.functional.scaled_dot_product_attention`` (GQA native).

    Takes megatron's ``[s, b, heads, head_dim]`` query and ``[s, b, groups, head_dim]`` key/value and
    returns ``[s, b, heads * head_dim]``. The mask argument is ignored: batches are right-padded, so the
    causal mask alone keeps every real token from seeing padding (the trainer checks the padding side).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        softmax_scale: float | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **unused: Any
    ) -> Tensor:
        if self.config.context_parallel_size > 1:
            raise ValueError("SdpaAttention does not implement context parallelism; use the te spec")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
