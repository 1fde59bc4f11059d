"""Attention for the graph decode path: every attention call of the engine's model runner goes through here.

Shapes: B decode rows, P prompts, L prompt tokens (right-padded), H query heads, G = H / KVH query heads per
KV head (grouped-query attention), D head dim, S cache slots (+1 scratch slot), T cache length per slot.

The KV cache of one layer is ``k_cache`` / ``v_cache`` of shape (S + 1, KVH, T, D): one slot per running
sequence, written by index (``write_decode``), so shapes never change and the decode step can be captured
in a CUDA graph. Row b of a decode batch reads slot ``slot_ids[b]`` up to ``lengths[b]`` tokens.

Decode, two implementations of the same function:

* ``"triton"`` (CUDA): split-K "flash decoding". Program (b, kv head, split) takes the G query heads that
  share one KV head (padded to 16 rows for the tensor cores), streams its split's keys in blocks with an
  online softmax, and writes an unnormalized partial (acc, running max m, running sum l); a second kernel
  merges the splits: ``out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)``, M = max_s m_s. It reads
  each row's keys and values once, and only up to that row's length, which is the memory floor. Splits
  keep the GPU busy when B x KVH alone is too few programs; empty splits (past the row's length) exit.
* ``"sdpa"`` (any device; the CPU eager path and the reference in tests): gather the rows' slots up to the
  longest length, mask the tail, ``F.scaled_dot_product_attention`` with GQA expanded.

Prefill (``prefill``) is causal SDPA over right-padded prompts: a real token never attends to padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native import pdl
    from infir2_rl.engines.native.fused_ops import _quant_store
    from infir2_rl.engines.native.pdl import wait_then_release

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

from infir2_rl.engines.native import fused_ops
from infir2_rl.engines.native.fused_ops import QuantizedRows


def write_decode(
    k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, positions: Tensor, k: Tensor, v: Tensor
) -> None:
    """Store one new key/value per row: k, v (B, KVH, D) into slot ``slot_ids[b]`` at ``positions[b]``."""
    k_cache[slot_ids, :, positions] = k
    v_cache[slot_ids, :, positions] = v


def write_prefill(
    k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, prompt_of_row: Tensor, k: Tensor, v: Tensor
) -> None:
    """Copy prompt keys/values k, v (P, KVH, L, D) into the slots of the rows that share each prompt."""
    length = k.shape[2]
    k_cache[slot_ids, :, :length] = k[prompt_of_row]
    v_cache[slot_ids, :, :length] = v[prompt_of_row]


def prefill(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention over right-padded prompts: q (P, H, L, D), k/v (P, KVH, L, D) -> (P, L, H * D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def decode_sdpa(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, lengths: Tensor) -> Tensor:
    """Reference decode attention: q (B, H, D) -> (B, H * D); reads up to the longest length (host sync)."""
    num_rows, heads, dim = q.shape
    longest = int(lengths.max())
    k = k_cache[slot_ids, :, :longest]  # (B, KVH, T', D)
    v = v_cache[slot_ids, :, :longest]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(longest, device=q.device)[None, :] < lengths[:, None]  # (B, T')
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :])
    return out.reshape(num_rows, heads * dim)


if _HAVE_TRITON:

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, acc_ptr, ml_ptr,
        stride_qb, stride_cs, stride_ch, stride_ct, sm_scale, chunk, num_splits,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv = tl.num_programs(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        length = tl.load(len_ptr + b).to(tl.int32)
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * D + d[None, :], mask=g[:, None] < GROUP, other=0.0
        )
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, D), tl.float32)
        base = slot * stride_cs + kvh * stride_ch
        for n0 in range(start, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            valid = t < end
            offs = base + t[:, None].to(tl.int64) * stride_ct + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # Partials: acc (B, H, splits, D), then m and l (B, H, splits, 2).
        row = (b * num_kv * GROUP + heads).to(tl.int64) * num_splits + sp
        keep = g < GROUP
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=keep)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=keep)

    @triton.jit
    def _merge_kernel(
        acc_ptr, ml_ptr, out_ptr, q_ptr, s_ptr, total, heads, rows_pad,
        SPLITS: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        bh = tl.program_id(0).to(tl.int64)
        valid = bh < total  # QUANT: programs past B x H write the padding rows (codes 0, scale 1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        m = tl.load(ml_ptr + (bh * SPLITS + s) * 2, mask=valid, other=float("-inf"))
        l_s = tl.load(ml_ptr + (bh * SPLITS + s) * 2 + 1, mask=valid, other=0.0)
        big = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)
        acc = tl.load(acc_ptr + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=valid, other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        out = tl.where(valid, out, 0.0).to(out_ptr.dtype.element_ty)  # rounded to the model dtype first
        if QUANT:  # D == 128: one head is one 1x128 tile of the o_proj input row
            row, head = bh // heads, bh % heads
            tile = tl.full((1, 1), 0, tl.int64) + head
            _quant_store(
                out.to(tl.float32)[None, :], q_ptr, s_ptr, row, rows_pad, heads * D, tile,
                head * D + d[None, :], POW2,
            )  # fmt: skip
        else:
            tl.store(out_ptr + bh * D + d, out)


def decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_ids: Tensor,
    lengths: Tensor,
    num_splits: int = 8,
    block_n: int = 32,
    quant: bool = False,
    pow2: bool = False,
) -> Tensor | QuantizedRows:
    """Split-K decode attention (module docstring): q (B, H, D) contiguous -> (B, H * D); no host sync.

    ``quant`` (D = 128): the merge also quantizes its output for o_proj in 1x128 tiles (one per head), by
    the trainer's rule from the values rounded to q's dtype, and returns ``QuantizedRows``."""
    num_rows, heads, dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    chunk = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    acc = torch.empty(num_rows, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_rows, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    launch = pdl.launch_kwargs(q.device)
    _split_kernel[(num_rows, kv_heads, num_splits)](
        q, k_cache, v_cache, slot_ids, lengths, acc, ml,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), dim**-0.5, chunk, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        num_warps=4, num_stages=2, **launch,
    )  # fmt: skip
    if quant:
        if dim != 128:
            raise ValueError(
                f"quantized decode attention needs head_dim 128 (one 1x128 tile per head), got {dim}"
            )
        qr = fused_ops.quant_buffers(num_rows, heads * dim, q.device)
        rows_pad = qr.q.shape[0]
        # out_ptr = q: never written here, it gives the dtype the output is rounded to before quantizing.
        _merge_kernel[(rows_pad * heads,)](
            acc, ml, q, qr.q, qr.s_t, num_rows * heads, heads, rows_pad,
            SPLITS=num_splits, D=dim, QUANT=True, POW2=pow2, num_warps=1, **launch,
        )  # fmt: skip
        return qr
    out = torch.empty(num_rows, heads * dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(num_rows * heads,)](
        acc, ml, out, out, out, num_rows * heads, heads, 0, SPLITS=num_splits, D=dim, QUANT=False, POW2=False,
        num_warps=1, **launch,
    )  # fmt: skip
    return out


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_ids: Tensor,
    lengths: Tensor,
    impl: str,
    quant: bool = False,
    pow2: bool = False,
) -> Tensor | QuantizedRows:
    """Decode attention by ``impl`` ("triton" or "sdpa"); q (B, H, D) -> (B, H * D) in q's dtype, or FP8
    rows for o_proj when ``quant`` (Triton only)."""
    if impl == "triton":
        return decode_triton(q.contiguous(), k_cache, v_cache, slot_ids, lengths, quant=quant, pow2=pow2)
    if quant:
        raise ValueError("quantized decode attention needs impl='triton'")
    return decode_sdpa(q, k_cache, v_cache, slot_ids, lengths)


def default_impl(device: torch.device) -> str:
    """Triton split-K on CUDA (measured faster than SDPA over a static cache, docs/performance.md), else SDPA."""
    return "triton" if device.type == "cuda" and _HAVE_TRITON else "sdpa"
