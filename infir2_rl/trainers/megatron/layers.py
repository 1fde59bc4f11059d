"""The local layer spec's own modules: an FP8 tensor-parallel linear and SDPA core attention.

``ParallelLinear`` stands behind megatron's linear interface (constructor ``(input_size, output_size, *,
config, init_method, bias, skip_bias_add, gather_output / input_is_parallel, tp_comm_buffer_name, ...)``,
forward on ``[s, b, h]`` returning ``(out, bias_or_None)``). Its role comes from ``tp_comm_buffer_name``:

* ``qkv`` and ``fc1`` are column-parallel: weight ``[N / tp, K]``, input copied into the TP region.
* ``proj`` and ``fc2`` are row-parallel: weight ``[N, K / tp]``, partial outputs all-reduced, bias after.

Its weight is kept in megatron's layout (``linear_qkv`` rows per KV group as [the group's q heads, k, v];
``linear_fc1`` = [gate; up]), but FP8 quantization follows the HF projections: each HF part (q_proj, k_proj,
v_proj; gate_proj, up_proj) is quantized on its own 128x128 grid, which is the grid the torch backend's
``Fp8Linear`` and the rollout engines use. So the FP8 bytes this trainer computes with are the bytes weight
sync sends, whatever the head layout. Three layouts, the same numbers:

* ``direct``: every part's rows are runs of whole, aligned 128-row blocks of the weight (q, k, v with a
  head_dim of 128; gate and up with an MLP size that is a multiple of 128; any single-part linear). The
  weight's own grid is then each part's grid with block rows permuted: it is quantized and multiplied as it
  is, nothing is permuted, and on the GPU the wgrad adds into ``.grad`` inside its GEMM (``ops.WGRAD_INTO``).
* stacked (``single_gemm``): every part but the last has a multiple of 128 rows, so the parts' grids tile
  their HF-ordered stack; one GEMM runs on [q; k; v] and its outputs are permuted back to megatron's order.
* otherwise one GEMM per part.

Under TP every part's local rows (and a row-parallel layer's local columns) must be a multiple of 128 so the
shards' grids are slices of the full grid (config/parallel_rules.py checks it).

The FP8 weight lives in buffers kept for the module's life: the whole weight's (direct), one buffer with each
part's rows a view of it (stacked: no second copy), or one per part. They are rewritten in place, without a
version bump, when the weight changes (its version or storage) or the trainer says so
(``invalidate_fp8_cache``: a fused optimizer updates weights without bumping their versions). So a CUDA
graph captured over the layer reads them as they are at each replay (``trainers/megatron/graphs.py``);
the trainer refreshes stale ones before each capture and graphed micro-batch (``refresh_fp8``), and a capture
that finds them stale is an error, not a quantization recorded into the graph. ``fp8_parts`` gives each HF
part's bytes and scales for weight sync.

With ``release_kept`` (the trainer sets it under gradient checkpointing, which runs no graphs) a forward that
records for backward lets the buffers go once it has used them: the autograd graph still holds what this
linear's backward reads, freed when that backward has run, and the next forward quantizes again (once per
micro-batch instead of once per step). Under full recompute the forward keeps only each layer's input, so FP8
saves almost no activation memory and the kept weights (1 byte per parameter) made FP8's peak, at the end of
the backward, larger than BF16's (1.045x at 1.5B x 16,384 tokens; docs/megatron.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.fp8 import gemm, quant_triton
from infir2_rl.fp8.ops import (
    WGRAD_INTO,
    Fp8Weight,
    autocast_output,
    forget_dequantized,
    fp8_linear,
    fp8_linear_forward,
)
from infir2_rl.fp8.quant import quantize_weight_blockwise

COLUMN_ROLES = ("qkv", "fc1")
ROW_ROLES = ("proj", "fc2")
# HF projection names of each role's parts, in HF order.
HF_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "fc1": ("gate_proj", "up_proj"), "proj": ("o_proj",)}
HF_PARTS["fc2"] = ("down_proj",)


def _whole_blocks(parts: list[Tensor]) -> bool:
    """Whether every part's rows (HF order) are runs of whole, aligned 128-row blocks of the weight."""
    for rows in parts:
        if len(rows) % 128:
            return False
        blocks = rows.view(-1, 128)
        if bool((blocks[:, 0] % 128).any()) or not torch.equal(
            blocks - blocks[:, :1], torch.arange(128).expand_as(blocks)
        ):
            return False
    return True


def _grad_of(weight: Tensor) -> Tensor | None:
    """``ops.WGRAD_INTO`` of a direct linear's weight: its ``.grad`` (None before the first backward allocates it;
    with CUDA graphs it stays allocated), which the FP8 wgrad GEMM adds into."""
    return weight.grad


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
        # The parts' rows as buffers too: they move with the module, so no forward copies indices from the host
        # (a copy a CUDA graph capture cannot record).
        for j, rows in enumerate(self.parts):
            self.register_buffer(f"_part{j}", rows, persistent=False)
        self.single_gemm = all(len(p) % 128 == 0 for p in self.parts[:-1])
        # Each HF part's rows are runs of whole 128-row blocks of this weight (q, k, v with a head_dim of 128,
        # as in Qwen2.5: megatron's per-group order permutes whole blocks): the weight's own 128x128 grid is then
        # every part's grid with block rows permuted, so it is quantized and multiplied as it is, with no
        # permutation of rows or outputs, and its GPU wgrad can add into ``.grad`` inside the GEMM.
        self.direct = (len(self.parts) == 1 and self.identity_order) or _whole_blocks(self.parts)
        if self.direct:
            setattr(self.weight, WGRAD_INTO, _grad_of)
        # False runs the dense path on the master weight (see `fp8.linear.fp8_disabled`'s counterpart).
        self.fp8_enabled = True
        # The kept FP8 weight (module docstring): each part's, and the whole one when one GEMM runs; the weight
        # stamp they were made from (None: stale).
        self._kept: tuple[list[Fp8Weight], Fp8Weight | None] | None = None
        self._kept_key: tuple[object, ...] | None = None
        self.release_kept = False  # (module docstring)

    # ------------------------------------------------------------------ FP8 weight
    def part_rows_here(self) -> list[Tensor]:
        """Each HF part's local row indices, on the module's device."""
        return [getattr(self, f"_part{j}") for j in range(len(self.parts))]

    def _stamp(self) -> tuple[object, ...]:
        # The weight read from ``_parameters``: ``nn.Module.__getattr__``'s Python fallback is the slow part of a
        # ``self.weight``, and this runs for every FP8 linear before each graphed micro-batch (as
        # ``Fp8Linear._kept_stamp``).
        w = self._parameters["weight"]
        assert w is not None
        return (w._version, w.data_ptr())

    def invalidate_fp8_cache(self) -> None:
        """The weight changed without a version bump (a fused optimizer, an in-place load): requantize."""
        self._kept_key = None

    def _allocate_kept(self) -> tuple[list[Fp8Weight], Fp8Weight | None]:
        """(the buffers ``refresh_fp8`` quantizes into, one per HF part or the one whole weight when ``direct``;
        the whole weight's buffers when one GEMM runs, else None)."""
        w = self.weight
        k, kb = w.shape[1], -(-w.shape[1] // 128)

        def buffers(n: int) -> Fp8Weight:
            return Fp8Weight(
                torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device),
                torch.empty(-(-n // 128), kb, dtype=torch.float32, device=w.device),
            )

        if self.direct:
            whole = buffers(w.shape[0])
            return [whole], whole
        sizes = [len(rows) for rows in self.parts]
        if not self.single_gemm:
            return [buffers(n) for n in sizes], None
        # Every part but the last fills whole 128-row blocks: each part's grid is a slice of the stack's.
        whole, parts, row = buffers(sum(sizes)), [], 0
        for n in sizes:
            parts.append(
                Fp8Weight(whole.w_fp8[row : row + n], whole.scale_inv[row // 128 : -(-(row + n) // 128)])
            )
            row += n
        return parts, whole

    def refresh_fp8(self) -> bool:
        """Quantize the weight into the kept buffers if they are stale (each HF part on its own grid, or the
        weight as it is when ``direct``); returns whether it did. Written without a version bump (a Triton
        kernel, or a copy through ``.data``), as ``Fp8Linear`` does: readers that cache by version are told
        directly (``ops.forget_dequantized``). The freshness test runs outside ``torch.no_grad`` (entering it
        costs host time on every call; only the quantization needs it)."""
        stamp = self._stamp()
        if self._kept is not None and self._kept_key == stamp:
            return False
        self._quantize_kept(stamp)
        return True

    @torch.no_grad()
    def _quantize_kept(self, stamp: tuple[object, ...]) -> None:
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ParallelLinear: a CUDA graph capture found the kept FP8 weight stale (refresh_fp8 before "
                "capturing: the graph reads the buffers, it does not quantize)"
            )
        if self._kept is None or self._kept[0][0].w_fp8.device != self.weight.device:  # (the module moved)
            self._kept = self._allocate_kept()
        buffers, whole = self._kept
        w = self.weight.detach()
        sources = [w] if self.direct else [w.index_select(0, rows) for rows in self.part_rows_here()]
        for src, kept in zip(sources, buffers, strict=True):
            if gemm.fast_path_ok(src, src.shape[0], src.shape[1]):
                quant_triton.quantize_weight(src, self.pow2_scales, out=(kept.w_fp8, kept.scale_inv))
            else:
                w_fp8, scale_inv = quantize_weight_blockwise(src, pow2_scales=self.pow2_scales)
                kept.w_fp8.data.copy_(w_fp8)
                kept.scale_inv.data.copy_(scale_inv)
        for kept in [*buffers, *([whole] if whole is not None else [])]:
            forget_dequantized(kept.w_fp8)
        self._kept_key = stamp

    def _kept_fresh(self) -> tuple[list[Fp8Weight], Fp8Weight | None]:
        self.refresh_fp8()
        assert self._kept is not None
        return self._kept

    def fp8_parts(self) -> list[Fp8Weight]:
        """Each HF part's FP8 weight on its own grid, as weight sync sends it: the kept buffers, or when
        ``direct`` with several parts, each part's rows and block rows taken from the whole (copies)."""
        buffers, whole = self._kept_fresh()
        if not self.direct or len(self.parts) == 1:
            return buffers
        assert whole is not None
        return [
            Fp8Weight(whole.w_fp8.index_select(0, rows), whole.scale_inv.index_select(0, rows[::128] // 128))
            for rows in self.part_rows_here()
        ]

    # ------------------------------------------------------------------ forward
    def _rows(self, t: Tensor | None, rows: Tensor) -> Tensor | None:
        if t is None:
            return None
        return t if rows.numel() == t.shape[0] and self.identity_order else t.index_select(0, rows)

    def _fp8_matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        buffers, whole = self._kept_fresh()
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad and self.release_kept:  # this call's references keep them until its backward
            self._kept = self._kept_key = None
        out_dtype, round_to = autocast_output(x)
        if self.direct:  # the weight and its output in megatron's order: nothing to permute
            assert whole is not None
            if needs_grad:
                return fp8_linear(x, self.weight, bias, whole, self.pow2_scales, out_dtype, round_to)
            return fp8_linear_forward(
                x, whole.w_fp8, whole.scale_inv, bias, self.pow2_scales, out_dtype, round_to
            )
        pieces = [(self._order, whole)] if whole is not None else list(zip(self.part_rows_here(), buffers))
        outs = []
        for rows, fp8w in pieces:
            b = self._rows(bias, rows)
            if needs_grad:
                w = self._rows(self.weight, rows)
                assert w is not None
                outs.append(fp8_linear(x, w, b, fp8w, self.pow2_scales, out_dtype, round_to))
            else:
                outs.append(
                    fp8_linear_forward(
                        x, fp8w.w_fp8, fp8w.scale_inv, b, self.pow2_scales, out_dtype, round_to
                    )
                )
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
