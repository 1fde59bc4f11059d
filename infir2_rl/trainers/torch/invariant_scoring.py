"""Trainer-side scoring under ``true_on_policy``: per-token log-probs by the engine's batch-invariant walk.

``score_tokens`` runs ``models/invariant.hidden_states`` over right-padded rows (each row attends within
itself through ``invariant_ops.causal_attention``), then the lm_head and log-softmax the way the engine's
sampler computes them (``_InvariantScores``: the invariant BF16 GEMM and the sampler's chunked log-sum-exp),
so the log-prob of a sampled token equals the engine's bit for bit. Backward is plain torch math (the
inherited ``_ChunkedScores.backward`` recomputes each chunk's logits with the ordinary GEMM): only forward
values enter the policy ratio. Like ``scoring.py`` it never materialises the logits of the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from infir2_rl.models import invariant
from infir2_rl.models import invariant_ops as ops
from infir2_rl.trainers.token_scores import _ChunkedScores


class _InvariantScores(_ChunkedScores):
    """``_ChunkedScores`` whose forward is the engine's: invariant lm_head GEMM, the sampler's log-sum-exp.
    Backward (inherited) recomputes the chunk's logits with the plain GEMM."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        targets_N: Tensor,
        temperature: float,
        need_entropy: bool,
        compute_dtype: torch.dtype,
        chunk_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        n = hidden_NH.shape[0]
        h, w = hidden_NH.to(compute_dtype), weight_VH.to(compute_dtype)
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if need_entropy else logp.new_empty(0)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = ops.mm(h[s:e], w)
            temps = torch.full((e - s,), temperature, dtype=torch.float32, device=h.device)
            logp[s:e], lse[s:e] = ops.token_logprobs(z, temps, targets_N[s:e])
            if need_entropy:  # a metric and a bonus term: torch's log-softmax, not bit-matched to anything
                logp_all = torch.log_softmax(z.float() / temperature, dim=-1)
                entropy[s:e] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(h, weight_VH, targets_N, lse, entropy)
        ctx.temperature, ctx.need_entropy, ctx.chunk_tokens = temperature, need_entropy, chunk_tokens
        ctx.hidden_dtype = hidden_NH.dtype
        return logp, entropy


def score_tokens(
    model: nn.Module,
    input_ids_BL: Tensor,
    select_BL: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    chunk_tokens: int = 2048,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, L), entropies (B, L) or None) of right-padded rows, zeros where not selected; position
    t is scored from the hidden state at t - 1, as ``trainers/torch/scoring.score_tokens`` does."""
    batch, length = input_ids_BL.shape
    config: Any = model.config  # type: ignore[assignment]
    device = input_ids_BL.device
    cos, sin = invariant.rope_tables(config, length, device)
    positions = torch.arange(length, device=device).repeat(batch)

    def attend(_: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = (t.view(batch, length, *t.shape[1:]).transpose(1, 2) for t in (k, v))
        return ops.causal_attention(q.view(batch, length, *q.shape[1:]), *kv).view(batch * length, -1)

    with torch.autocast(device.type, enabled=False):
        hidden = invariant.hidden_states(model, input_ids_BL.reshape(-1), positions, attend, cos, sin)
        hidden = hidden.view(batch, length, -1)
        picked = select_BL.bool().clone()
        picked[:, 0] = False
        head: Any = model.get_output_embeddings()  # type: ignore[operator]
        logp, entropy = _InvariantScores.apply(
            hidden[:, :-1][picked[:, 1:]], head.weight, input_ids_BL[:, 1:][picked[:, 1:]].long(),
            float(temperature), need_entropy, invariant.DTYPE, chunk_tokens,
        )  # fmt: skip
    logp_BL = logp.new_zeros(batch, length)
    logp_BL[picked] = logp
    entropy_BL = None
    if need_entropy:
        entropy_BL = entropy.new_zeros(batch, length)
        entropy_BL[picked] = entropy
    return logp_BL, entropy_BL
