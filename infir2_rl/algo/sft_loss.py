"""Supervised fine-tuning loss: next-token cross-entropy on the tokens the mask selects.

Alignment (the one thing to get right): ``loss_mask_BT[b, t] = 1`` means "token ``labels[b, t]`` is a
training target" (an assistant token), stated about the TARGET token, the way data/ builds it from
the chat template. A causal LM predicts token t from positions < t, i.e. from ``logits[:, t - 1]``.
So the loss pairs ``logits[:, :-1]`` with ``labels[:, 1:]`` under ``loss_mask[:, 1:]``; the mask bit
of the first token is never used (nothing predicts it).

Example, one sequence ``[sys, user, A1, A2, eos]`` with mask ``[0, 0, 1, 1, 1]``: the loss is the mean
of ``-log p(A1 | sys user)``, ``-log p(A2 | .. A1)`` and ``-log p(eos | .. A2)``, read from logits at
positions 1, 2 and 3.

The mean is over all selected tokens of the batch (per-token CE, as InfiR2's SFT). For gradient
accumulation across micro-batches, pass ``denominator`` = the number of target tokens in the whole
global batch; the micro-batch losses then sum to the global per-token mean. Log-probs are computed in
float32 by ``token_logprobs`` (chunked, no full float32 copy of the logits kept).
"""

from __future__ import annotations

import torch
from torch import Tensor

from infir2_rl.algo.logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs


def sft_loss(
    logits_BTV: Tensor,
    labels_BT: Tensor,
    loss_mask_BT: Tensor,
    *,
    denominator: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, int]:
    """Mean next-token cross-entropy over target tokens.

    Args:
        logits_BTV: model outputs for ``labels_BT`` (the input ids), shape (B, T, V).
        labels_BT: the input ids, shape (B, T).
        loss_mask_BT: 1 where the token at that position is a training target, shape (B, T).
        denominator: divide the summed CE by this instead of the local target count.

    Returns:
        (loss, num_tokens): scalar float32 loss and the number of target tokens in this batch.
        With no target tokens the loss is 0 (still attached to the graph) and num_tokens is 0.
    """
    if logits_BTV.dim() != 3 or labels_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)}: expected (B, T, V) and (B, T)."
        )
    if loss_mask_BT.shape != labels_BT.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask_BT.shape)}: it must match labels {tuple(labels_BT.shape)}."
        )
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator={denominator}: must be > 0 (the global number of target tokens).")

    logp_BT = token_logprobs(logits_BTV[:, :-1], labels_BT[:, 1:], chunk_tokens=chunk_tokens)
    mask_BT = loss_mask_BT[:, 1:].to(torch.float32)
    num_tokens = int(mask_BT.sum().item())
    # torch.where, not multiplication, so a -inf log-prob at an unselected position cannot make NaN.
    nll_sum = -torch.where(mask_BT > 0, logp_BT, torch.zeros_like(logp_BT)).sum()
    denom = float(denominator) if denominator is not None else float(max(num_tokens, 1))
    return nll_sum / denom, num_tokens
