"""Attention for the graph decode path: every attention call of the engine's model runner goes through here.

Shapes: B decode rows, P prompts, L prompt tokens (right-padded), H query heads, G = H / KVH query heads per
KV head (grouped-query attention), D head dim, S cache slots (+1 scratch slot), T cache length per slot.

The KV cache of one layer is ``k_cache`` / ``v_cache`` of shape (S + 1, KVH, T, D): one slot per running
sequence, written by index (decode: ``fused_ops.rope_write_kv``; prefill: ``write_prefill``), so shapes never change and the decode step can be captured
in a CUDA graph. Row b of a decode batch reads slot ``slot_ids[b]`` up to ``lengths[b]`` tokens.

Decode, two implementations of the same function:

* ``"triton"`` (CUDA): split-K "flash decoding". Program (b, kv head, split) takes the G query heads that
  share one KV head (padded to 16 rows for the tensor cores) and streams its split's keys in blocks with an
  online softmax (``_attend``). It reads each row's keys and values once, and only up to that row's length,
  which is the memory floor; splits keep the GPU busy when B x KVH alone is too few programs, and splits past
  a row's length read no keys. The partials (acc, running max m, running sum l) are merged as
  ``out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)``, M = max_s m_s, in one of two forms
  (``decode_triton`` picks by batch size):

  - one launch (``_decode_kernel``; where B x KVH fills the GPU): splits of at least ``MIN_CHUNK`` keys; a
    row whose keys fit one split is finished by its program (no partial, no merge); a longer row's splits
    count themselves in ``arrivals`` (an atomic per row and KV head) and the one that arrives last merges
    them, in split order, and resets the count to 0;
  - two launches (``_split_kernel`` then ``_merge_kernel``; small batches): splits of the cache length / 8,
    then a merge program per row and head, which was faster there (docs/performance.md, "Rollout decode",
    session 54).

  In FP8 the merge (or the one program of a one-split row) also quantizes o_proj's input.
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
from infir2_rl.graph_capture import sm_count


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
    def _attend(q, k_ptr, v_ptr, base, start, end, stride_ct, sm_scale,
                GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """The G query heads ``q`` (GROUP_PAD, D) over keys start..end-1 of one cache slot and KV head (at
        ``base``), in blocks of BLOCK_N with an online softmax -> (acc, running max m, running sum l), not
        normalized. No keys (start >= end): acc 0, m -inf, l 0."""
        d = tl.arange(0, D)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, D), tl.float32)
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
        return acc, m_i, l_i

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
        base = slot * stride_cs + kvh * stride_ch
        acc, m_i, l_i = _attend(q, k_ptr, v_ptr, base, start, end, stride_ct, sm_scale, GROUP_PAD, D, BLOCK_N)
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

    @triton.jit
    def _store_heads(out, out_ptr, qc_ptr, s_ptr, b, heads_idx, keep, heads, rows_pad,
                     D: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr):  # fmt: skip
        """Row b's finished heads ``heads_idx`` (rows of ``out``, FP32; ``keep`` masks the padding heads),
        rounded to the model dtype (``out_ptr``'s), then stored, or (QUANT, D = 128) quantized for o_proj in
        1x128 tiles, one per head."""
        d = tl.arange(0, D)
        out = out.to(out_ptr.dtype.element_ty)
        if QUANT:
            tile = tl.where(keep, heads_idx, heads)[:, None]  # padding heads: a tile past the row, not stored
            _quant_store(out.to(tl.float32), qc_ptr, s_ptr, b, rows_pad, heads * D, tile, tile * D + d[None, :],
                         POW2)  # fmt: skip
        else:
            tl.store(out_ptr + (b * heads + heads_idx).to(tl.int64)[:, None] * D + d[None, :], out,
                     mask=keep[:, None])  # fmt: skip

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, acc_ptr, ml_ptr, count_ptr, out_ptr, qc_ptr, s_ptr,
        num_rows, rows_pad, stride_qb, stride_cs, stride_ch, stride_ct, sm_scale, chunk, num_splits,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            wait_then_release()
        b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv = tl.num_programs(1)
        heads = num_kv * GROUP
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads_idx = kvh * GROUP + g
        keep = g < GROUP
        real = b < num_rows  # QUANT: programs past the rows write o_proj's padding rows (codes 0, scales 1)
        length = tl.load(len_ptr + b, mask=real, other=0).to(tl.int32)
        active = tl.cdiv(length, chunk)  # splits that hold keys of this row; the others do nothing
        start = sp * chunk
        end = tl.minimum(start + chunk, length)  # start >= end: no keys here, the loop runs no block
        slot = tl.load(slot_ptr + b, mask=real, other=0).to(tl.int64)
        q = tl.load(
            q_ptr + b * stride_qb + heads_idx[:, None] * D + d[None, :], mask=keep[:, None] & real, other=0.0
        )
        base = slot * stride_cs + kvh * stride_ch
        acc, m_i, l_i = _attend(q, k_ptr, v_ptr, base, start, end, stride_ct, sm_scale, GROUP_PAD, D, BLOCK_N)
        if not real:
            if sp == 0:
                zero = tl.zeros((GROUP_PAD, D), tl.float32)
                _store_heads(
                    zero, out_ptr, qc_ptr, s_ptr, b, heads_idx, keep, heads, rows_pad, D, QUANT, POW2
                )
        elif active == 1:  # the row's keys fit one split: finished here, no partial and no merge
            if sp == 0:
                _store_heads(acc / l_i[:, None], out_ptr, qc_ptr, s_ptr, b, heads_idx, keep, heads, rows_pad, D,
                             QUANT, POW2)  # fmt: skip
        elif sp < active:
            # Partials: acc (B, H, splits, D), then m and l (B, H, splits, 2); the row's last split to finish
            # merges them (``arrivals`` counts the finished splits of each (row, KV head), then is reset to 0).
            part = (b * heads + heads_idx).to(tl.int64) * num_splits
            tl.store(acc_ptr + (part + sp)[:, None] * D + d[None, :], acc, mask=keep[:, None])
            tl.store(ml_ptr + (part + sp) * 2, m_i, mask=keep)
            tl.store(ml_ptr + (part + sp) * 2 + 1, l_i, mask=keep)
            tl.debug_barrier()  # every thread's partial stored before the arrival is counted (released by it)
            counter = count_ptr + b * num_kv + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                s_all = tl.arange(0, SPLITS)
                here = keep[:, None] & (s_all[None, :] < active)
                ml_at = (part[:, None] + s_all[None, :]) * 2
                m = tl.load(ml_ptr + ml_at, mask=here, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(ml_ptr + ml_at + 1, mask=here, other=0.0, cache_modifier=".cg")
                big = tl.max(m, axis=1)
                w = tl.where(here, tl.exp(m - big[:, None]), 0.0)
                total = tl.zeros((GROUP_PAD, D), tl.float32)
                for s_i in range(0, active):
                    w_s = tl.sum(tl.where(s_all[None, :] == s_i, w, 0.0), axis=1)
                    a_s = tl.load(acc_ptr + (part + s_i)[:, None] * D + d[None, :], mask=keep[:, None],
                                  other=0.0, cache_modifier=".cg")  # fmt: skip
                    total += a_s * w_s[:, None]
                out = total / tl.sum(l_s * w, axis=1)[:, None]
                _store_heads(out, out_ptr, qc_ptr, s_ptr, b, heads_idx, keep, heads, rows_pad, D, QUANT, POW2)


# The one-launch kernel's registers per thread: at 64 eight programs fit an SM, as the streaming loop alone
# needs; uncapped, the merge and quantizing code took it to 72-80 and 7 or 6 programs, and 256 rows x
# 2,048 keys (1,024 programs with keys) took a second wave: 166 against 131 us (H200, session 54).
MAX_REGISTERS = 64
# The one-launch kernel's keys per split, at least (a multiple of the key block): a row of fewer keys is
# finished by one program without a merge; a longer row's splits run side by side.
MIN_CHUNK = 256
# The one launch where rows x KV heads give at least this many programs per SM; below, the rows' programs
# alone leave SMs idle, and the two launches (splits of the cache length / 8, a merge kernel over every
# row and head) were faster: batch 64 at 1.5B, 2.07 against 2.15 ms per decode step (session 54).
ONE_LAUNCH_PROGRAMS_PER_SM = 2


def decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_ids: Tensor,
    lengths: Tensor,
    arrivals: Tensor | None = None,
    num_splits: int = 8,
    block_n: int = 32,
    quant: bool = False,
    pow2: bool = False,
    one_launch: bool | None = None,
) -> Tensor | QuantizedRows:
    """Split-K decode attention (module docstring): q (B, H, D) contiguous -> (B, H * D); no host sync.

    ``one_launch`` (default: where B x KVH >= ``ONE_LAUNCH_PROGRAMS_PER_SM`` x the SMs): splits of at least
    ``MIN_CHUNK`` keys merged by the row's last split, in one kernel; else splits of the cache length /
    ``num_splits`` and a merge kernel. ``arrivals`` (one launch): int32 zeros, at least B x KVH, which each
    launch leaves at zero (``KVCache.arrivals``; made here when None, which a CUDA graph capture must not
    need); launches that share it must not overlap. ``quant`` (D = 128): the output is quantized for o_proj
    in 1x128 tiles (one per head), by the trainer's rule from the values rounded to q's dtype, and returned
    as ``QuantizedRows``."""
    num_rows, heads, dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if quant and dim != 128:
        raise ValueError(
            f"quantized decode attention needs head_dim 128 (one 1x128 tile per head), got {dim}"
        )
    if one_launch is None:
        one_launch = num_rows * kv_heads >= ONE_LAUNCH_PROGRAMS_PER_SM * sm_count(q.device)
    chunk = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    if one_launch:
        chunk = max(MIN_CHUNK, chunk)
        num_splits = triton.cdiv(max_len, chunk)
    acc = torch.empty(num_rows, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_rows, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    qr = fused_ops.quant_buffers(num_rows, heads * dim, q.device) if quant else None
    out = q if qr is not None else torch.empty(num_rows, heads * dim, dtype=q.dtype, device=q.device)
    codes, scales, rows_pad = (qr.q, qr.s_t, qr.q.shape[0]) if qr is not None else (out, out, num_rows)
    launch = pdl.launch_kwargs(q.device)
    consts = {"D": dim, "QUANT": quant, "POW2": pow2, **launch}
    if one_launch:
        if arrivals is None:
            arrivals = torch.zeros(num_rows * kv_heads, dtype=torch.int32, device=q.device)
        elif arrivals.numel() < num_rows * kv_heads or arrivals.dtype != torch.int32:
            raise ValueError(
                f"arrivals: need {num_rows * kv_heads} int32 counters, got {arrivals.numel()} {arrivals.dtype}"
            )
        _decode_kernel[(rows_pad, kv_heads, num_splits)](
            q, k_cache, v_cache, slot_ids, lengths, acc, ml, arrivals, out, codes, scales, num_rows, rows_pad,
            q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), dim**-0.5, chunk, num_splits,
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            SPLITS=triton.next_power_of_2(num_splits), num_warps=4, num_stages=2, maxnreg=MAX_REGISTERS,
            **consts,
        )  # fmt: skip
        return qr if qr is not None else out
    _split_kernel[(num_rows, kv_heads, num_splits)](
        q, k_cache, v_cache, slot_ids, lengths, acc, ml,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), dim**-0.5, chunk, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        num_warps=4, num_stages=2, **launch,
    )  # fmt: skip
    # QUANT: programs past B x H write the padding rows of o_proj's input (codes 0, scales 1).
    _merge_kernel[(rows_pad * heads,)](
        acc, ml, out, codes, scales, num_rows * heads, heads, rows_pad if qr is not None else 0, SPLITS=num_splits,
        num_warps=1, **consts,
    )  # fmt: skip
    return qr if qr is not None else out


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_ids: Tensor,
    lengths: Tensor,
    impl: str,
    quant: bool = False,
    pow2: bool = False,
    arrivals: Tensor | None = None,
) -> Tensor | QuantizedRows:
    """Decode attention by ``impl`` ("triton" or "sdpa"); q (B, H, D) -> (B, H * D) in q's dtype, or FP8
    rows for o_proj when ``quant`` (Triton only). ``arrivals``: ``decode_triton``'s."""
    if impl == "triton":
        return decode_triton(
            q.contiguous(), k_cache, v_cache, slot_ids, lengths, arrivals, quant=quant, pow2=pow2
        )
    if quant:
        raise ValueError("quantized decode attention needs impl='triton'")
    return decode_sdpa(q, k_cache, v_cache, slot_ids, lengths)


def default_impl(device: torch.device) -> str:
    """Triton split-K on CUDA (measured faster than SDPA over a static cache, docs/performance.md), else SDPA."""
    return "triton" if device.type == "cuda" and _HAVE_TRITON else "sdpa"
