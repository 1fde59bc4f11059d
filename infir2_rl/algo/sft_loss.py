"""Supervised fine-tuning loss: next-token cross-entropy on the tokens the mask selects.

Alignment (the one thing to get right): ``loss_mask_BL[b, t] = 1`` means "token ``input_ids[b, t]`` is
a training target" (an assistant token), stated about the TARGET token, the way data/ builds it from the
chat template. A causal LM predicts token t from positions < t, i.e. from ``logits[:, t - 1]``; the
trainer's ``TokenScores.logprobs_BL[:, t]`` already holds that log-prob of token t at position t. So the
loss reads ``logprobs_BL[:, 1:]`` under ``loss_mask[:, 1:]``; the mask bit of the first token is never
used (nothing predicts it).

Example, one sequence ``[sys, user, A1, A2, eos]`` with mask ``[0, 0, 1, 1, 1]``: the loss is the mean
of ``-log p(A1 | sys user)``, ``-log p(A2 | .. A1)`` and ``-log p(eos | .. A2)``, read from logits at
positions 1, 2 and 3.

The mean is over all selected tokens of the batch (per-token CE, as InfiR2's SFT). For gradient
accumulation across micro-batches, pass ``denominator`` = the number of target tokens in the whole
global batch; the micro-batch losses then sum to the global per-token mean. Log-probs come in float32
from the trainer (trainers/token_scores.py: chunked, the full logits never exist) or, from a model's
logits, from ``algo.logprobs.scores_from_logits``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sft_loss(
    logprobs_BL: Tensor,
    loss_mask_BL: Tensor,
    *,
    denominator: float | None = None,
    num_tokens: int | None = None,
) -> tuple[Tensor, int]:
    """Mean next-token cross-entropy over target tokens.

    Args:
        logprobs_BL: log p(token t | tokens < t) at position t (``TokenScores.logprobs_BL``), shape (B, L).
        loss_mask_BL: 1 where the token at that position is a training target, shape (B, L).
        denominator: divide the summed CE by this instead of the local target count.
        num_tokens: the target count when the caller knows it on the host (``TokenBatch.counts``); counting
            the mask on a GPU makes the host wait for every queued kernel.

    Returns:
        (loss, num_tokens): scalar float32 loss and the number of target tokens in this batch.
        With no target tokens the loss is 0 (still attached to the graph) and num_tokens is 0.
    """
    if logprobs_BL.dim() != 2 or loss_mask_BL.shape != logprobs_BL.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs_BL.shape)} and loss_mask {tuple(loss_mask_BL.shape)}: expected the same (B, L)."
        )
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator={denominator}: must be > 0 (the global number of target tokens).")

    logp_BT = logprobs_BL[:, 1:].float()
    mask_BT = loss_mask_BL[:, 1:].to(torch.float32)
    if num_tokens is None:
        num_tokens = int((mask_BT > 0).sum().item())
    # torch.where, not multiplication, so a -inf log-prob at an unselected position cannot make NaN.
    nll_sum = -torch.where(mask_BT > 0, logp_BT, torch.zeros_like(logp_BT)).sum()
    denom = float(denominator) if denominator is not None else float(max(num_tokens, 1))
    return nll_sum / denom, num_tokens
