"""Per-token log-probabilities and entropies from logits, without a full float32 copy of the logits.

Shapes: B sequences, T positions, V vocabulary. ``logits_BTV[:, t]`` scores ``targets_BT[:, t]``:
the caller does the next-token shift (for a causal LM, pass ``logits[:, :-1]`` and
``input_ids[:, 1:]``; slicing the time dimension makes no copy here).

Why chunked: log_softmax over the vocabulary in float32 costs B*T*V*4 bytes. For an RL batch of
16K-token responses and Qwen's 152K vocabulary that is ~10 GB per sequence, and autograd would keep
it until backward. We only need one number per token: ``log p(y) = z_y - logsumexp(z)`` with
``z = logits.float() / temperature``. So the time dimension is processed in chunks of about
``chunk_tokens`` tokens; under autograd each chunk is wrapped in activation checkpointing, so
backward recomputes the chunk's float32 copy instead of storing it. Peak extra memory is about one
chunk, chunk_tokens * V * 4 bytes (2.5 GB for the default 4096 tokens and V = 152K; lower
``chunk_tokens`` on smaller GPUs). The gradient w.r.t. the logits is still a full B*T*V tensor in the
logits' dtype: avoiding that needs the loss fused into the lm_head matmul, which is not done here.

Temperature: the rollout engine samples from softmax(z / temperature) and reports that log-prob, so
the trainer must divide by the same temperature, or the train/rollout ratio measures the
temperature instead of the precision gap (RECIPE.md, TIS section).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from infir2_rl.types import TokenScores

DEFAULT_CHUNK_TOKENS = 4096


def _logprobs_chunk(logits_BCV: Tensor, targets_BC: Tensor, temperature: float) -> Tensor:
    z = logits_BCV.float()
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _entropy_chunk(logits_BCV: Tensor, temperature: float) -> Tensor:
    z = logits_BCV.float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    # -inf logits (masked vocabulary) give p = 0 and log p = -inf; 0 * -inf would be NaN in the value
    # and in the gradient, so such entries are replaced by 0 before the product.
    logp_finite = torch.where(
        torch.isfinite(logp), logp, torch.zeros((), dtype=logp.dtype, device=logp.device)
    )
    return -(logp.exp() * logp_finite).sum(dim=-1)


def _check(logits_BTV: Tensor, temperature: float, chunk_tokens: int) -> None:
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits has shape {tuple(logits_BTV.shape)}: expected (B, T, V).")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use the rollout's sampling temperature).")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1.")


def _map_time_chunks(
    fn: Callable[..., Tensor], logits_BTV: Tensor, *rest_BT: Tensor, chunk_tokens: int
) -> Tensor:
    """Apply ``fn(logits_chunk, *rest_chunks)`` over slices of the time dimension and concatenate."""
    B, T, _ = logits_BTV.shape
    if T == 0:
        return logits_BTV.new_zeros((B, 0), dtype=torch.float32)
    chunk_t = max(1, chunk_tokens // max(B, 1))
    use_ckpt = torch.is_grad_enabled() and logits_BTV.requires_grad
    outs = []
    for t0 in range(0, T, chunk_t):
        args = (logits_BTV[:, t0 : t0 + chunk_t], *(x[:, t0 : t0 + chunk_t] for x in rest_BT))
        out = checkpoint(fn, *args, use_reentrant=False) if use_ckpt else fn(*args)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def token_logprobs(
    logits_BTV: Tensor,
    targets_BT: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(logits / temperature)[target] per position, float32, shape (B, T).

    Differentiable w.r.t. ``logits_BTV``. Targets must be int64 indices aligned with the logits.
    """
    _check(logits_BTV, temperature, chunk_tokens)
    if targets_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"targets has shape {tuple(targets_BT.shape)}: it must be logits.shape[:2] = "
            f"{tuple(logits_BTV.shape[:2])} (did you forget the next-token shift?)."
        )
    targets = targets_BT.long()

    def fn(lg: Tensor, tg: Tensor) -> Tensor:
        return _logprobs_chunk(lg, tg, temperature)

    return _map_time_chunks(fn, logits_BTV, targets, chunk_tokens=chunk_tokens)


def entropy_from_logits(
    logits_BTV: Tensor, temperature: float = 1.0, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """Entropy (nats) of softmax(logits / temperature) per position, float32, shape (B, T)."""
    _check(logits_BTV, temperature, chunk_tokens)

    def fn(lg: Tensor) -> Tensor:
        return _entropy_chunk(lg, temperature)

    return _map_time_chunks(fn, logits_BTV, chunk_tokens=chunk_tokens)


def scores_from_logits(
    logits_BLV: Tensor,
    input_ids_BL: Tensor,
    temperature: float = 1.0,
    *,
    need_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> TokenScores:
    """``TokenScores`` of every position t >= 1 from a model's full logits (position t-1 predicts token t).

    The plain path, for models whose logits already exist (tests, the engine); the trainer computes the same
    numbers from hidden states without the logits (trainers/token_scores.py).
    """
    logits_BTV = logits_BLV[:, :-1]
    logp = torch.nn.functional.pad(
        token_logprobs(logits_BTV, input_ids_BL[:, 1:], temperature, chunk_tokens=chunk_tokens), (1, 0)
    )
    entropy = None
    if need_entropy:
        entropy = torch.nn.functional.pad(
            entropy_from_logits(logits_BTV, temperature, chunk_tokens=chunk_tokens), (1, 0)
        )
    return TokenScores(logprobs_BL=logp, entropy_BL=entropy)
