"""Per-token log-probs (and entropies) from hidden states and a vocab-parallel output layer, in token chunks.

The tensor-parallel form of ``trainers/token_scores.chunked_token_scores``: under TP each rank holds the rows
``[vocab_start, vocab_start + V_r)`` of the (padded) output weight, and the same hidden states. Gathering the
logits over the TP group (what the megatron trainer did) puts B x L x V FP32 values on every rank, with their
gradient; here each rank makes one chunk of its own shard's logits at a time and the group combines three numbers
per token in the forward (the max, the sum of exponentials, the target's logit; and the entropy's sum) and
the hidden states' gradient once in the backward:

* forward, per chunk: ``z_r = (h_c . W_r^T).float() / T`` (padded rows, at or past ``vocab_size``, set to -inf),
  ``m = max over ranks of max(z_r)``, ``s = sum over ranks of sum exp(z_r - m)``, ``lse = m + log s``;
  ``logp = z[y] - lse`` (the rank holding y contributes it, the others 0); with ``need_entropy``
  ``H = -sum over ranks of sum p log p`` with ``log p = (z_r - m) - log s``, the log-softmax form the single-rank
  path uses against cancellation on peaked rows.
* backward, per chunk: ``z_r`` recomputed, ``p = exp(log p)``,
  ``g_z = onehot(y) * g_logp - p * (g_logp + g_H * (log p + H))``, ``/ T``; ``dW_r += g_z^T . h_c`` (FP32),
  ``dh += g_z . W_r`` summed over the group at the end (each rank's shard contributes to every token's
  gradient: megatron's column-parallel layer does the same all-reduce in its input's backward).

Same numbers as the single-rank path up to summation order (tests/test_megatron_vocab_parallel_scores.py runs two
gloo ranks against ``chunked_token_scores`` on the whole weight).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from infir2_rl.trainers.token_scores import DEFAULT_CHUNK_TOKENS, check_score_inputs, chunk_z


def _shard_z(h_c: Tensor, w: Tensor, temperature: float, padded: Tensor | None) -> Tensor:
    """``token_scores.chunk_z`` of this rank's shard, its padded vocabulary rows at -inf."""
    z = chunk_z(h_c, w, temperature)
    if padded is not None:
        z.masked_fill_(padded, float("-inf"))
    return z


def _log_softmax_parts(z: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """(m, log s) over the group: the global max of each row and the log of its sum of exp(z - m)."""
    m = z.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = (z - m[:, None]).exp_().sum(-1)
    dist.all_reduce(s, group=group)
    return m, s.log_()


class _VocabParallelScores(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        targets_N: Tensor,
        vocab_start: int,
        vocab_size: int,
        group: Any,
        temperature: float,
        need_entropy: bool,
        compute_dtype: torch.dtype,
        chunk_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        n, v_r = hidden_NH.shape[0], weight_VH.shape[0]
        h, w = hidden_NH.to(compute_dtype), weight_VH.to(compute_dtype)
        padded_rows = torch.arange(vocab_start, vocab_start + v_r, device=h.device) >= vocab_size
        padded = padded_rows[None, :] if bool(padded_rows.any()) else None
        local = targets_N - vocab_start
        owns = (local >= 0) & (local < v_r)
        local = local.clamp(0, v_r - 1)
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if need_entropy else logp.new_empty(0)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                z = _shard_z(h[s:e], w, temperature, padded)
                m, log_s = _log_softmax_parts(z, group)
                zy = torch.where(owns[s:e], z.gather(1, local[s:e, None]).squeeze(1), 0.0)
                dist.all_reduce(zy, group=group)
                lse[s:e] = m + log_s
                logp[s:e] = zy - lse[s:e]
                if need_entropy:
                    logq = z.sub_(m[:, None]).sub_(log_s[:, None])  # z is not needed after this
                    plogp = torch.where(torch.isfinite(logq), logq.exp() * logq, 0.0).sum(-1)
                    dist.all_reduce(plogp, group=group)
                    entropy[s:e] = -plogp
        ctx.save_for_backward(h, weight_VH, local, owns, lse, entropy)
        ctx.settings = (temperature, need_entropy, chunk_tokens, padded_rows if padded is not None else None)
        ctx.group, ctx.hidden_dtype = group, hidden_NH.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_entropy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weight_VH, local, owns, lse, entropy = ctx.saved_tensors
        temperature, need_entropy, chunk, padded_rows = ctx.settings
        padded = padded_rows[None, :] if padded_rows is not None else None
        w = weight_VH.to(h.dtype)
        n = h.shape[0]
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        dw = torch.zeros(weight_VH.shape, dtype=torch.float32, device=h.device)
        g_logp = g_logp.float()
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                logq = _shard_z(h[s:e], w, temperature, padded).sub_(lse[s:e, None])
                p = logq.exp()  # 0 on padded rows
                gl = g_logp[s:e, None]
                if need_entropy:
                    g_h = g_entropy[s:e, None].float()
                    scale = (
                        torch.where(torch.isfinite(logq), logq + entropy[s:e, None], 0.0).mul_(g_h).add_(gl)
                    )
                    g_z = scale.mul_(p).neg_()
                else:
                    g_z = p.mul_(-gl)
                rows = owns[s:e].nonzero().squeeze(1)
                g_z[rows, local[s:e][rows]] += g_logp[s:e][rows]
                if temperature != 1.0:
                    g_z.div_(temperature)
                g_c = g_z.to(h.dtype)
                dh[s:e] = (g_c @ w).float()
                dw += (g_c.t() @ h[s:e]).float()
        dist.all_reduce(dh, group=ctx.group)
        return dh.to(ctx.hidden_dtype), dw.to(weight_VH.dtype), None, None, None, None, None, None, None, None


def vocab_parallel_token_scores(
    hidden_NH: Tensor,
    weight_shard_VH: Tensor,
    targets_N: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Any,
    temperature: float = 1.0,
    need_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(h W^T / T)[y]`` per row (float32, (N,)) and, with ``need_entropy``, the entropy (nats), where
    this rank holds rows ``[vocab_start, vocab_start + V_r)`` of W and every rank of ``group`` the same hidden
    states and targets; rows at or past ``vocab_size`` are padding. Differentiable w.r.t. the hidden states (their
    gradient summed over the group) and this rank's weight shard; collective: every rank must call it."""
    check_score_inputs(hidden_NH, weight_shard_VH, targets_N, temperature, chunk_tokens)
    logp, entropy = _VocabParallelScores.apply(
        hidden_NH, weight_shard_VH, targets_N.long(), int(vocab_start), int(vocab_size), group, float(temperature),
        need_entropy, compute_dtype or hidden_NH.dtype, chunk_tokens,
    )  # fmt: skip
    return logp, (entropy if need_entropy else None)
