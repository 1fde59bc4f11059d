"""Trainer-side scoring under ``true_on_policy``: per-token log-probs by the engine's batch-invariant walk.

``score_tokens`` runs ``models/invariant.hidden_states`` over right-padded rows (each row attends within
itself through ``invariant_ops.causal_attention``), then the lm_head and log-softmax the way the engine's
sampler computes them (``_engine_chunk`` inside ``token_scores.chunked_token_scores``: the invariant BF16
GEMM and the sampler's chunked log-sum-exp), so the log-prob of a sampled token equals the engine's bit for
bit. Backward is plain torch math (``chunked_token_scores`` recomputes each chunk's logits with the ordinary
GEMM): only forward values enter the policy ratio. Like ``scoring.py`` it never materialises the logits of
the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from infir2_rl.models import invariant
from infir2_rl.models import invariant_ops as ops
from infir2_rl.trainers.token_scores import DEFAULT_CHUNK_TOKENS, chunked_token_scores


def _engine_chunk(
    h_c: Tensor, w: Tensor, targets_C: Tensor, temperature: float, need_z: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk as the engine scores it: the invariant lm_head GEMM, the sampler's log-sum-exp and
    ``z / T``; the entropy's logits (a metric and a bonus term) are not bit-matched to anything."""
    z = ops.mm(h_c, w)
    temps = torch.full((h_c.shape[0],), temperature, dtype=torch.float32, device=h_c.device)
    logp, lse = ops.token_logprobs(z, temps, targets_C)
    return logp, lse, z.float() / temperature if need_z else None


def score_tokens(
    model: nn.Module,
    input_ids_BL: Tensor,
    select_BL: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
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
        logp, entropy = chunked_token_scores(
            hidden[:, :-1][picked[:, 1:]], head.weight, input_ids_BL[:, 1:][picked[:, 1:]],
            temperature=temperature, need_entropy=need_entropy, compute_dtype=invariant.DTYPE,
            chunk_tokens=chunk_tokens, chunk_scores=_engine_chunk,
        )  # fmt: skip
    logp_BL = logp.new_zeros(batch, length)
    logp_BL[picked] = logp
    entropy_BL = None
    if entropy is not None:
        entropy_BL = entropy.new_zeros(batch, length)
        entropy_BL[picked] = entropy
    return logp_BL, entropy_BL
