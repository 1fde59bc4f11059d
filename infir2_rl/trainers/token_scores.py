"""Per-token log-probs (and entropies) straight from hidden states and the lm_head weight, in token chunks.

Shapes: N scored tokens, H hidden size, V vocabulary, C tokens in one chunk.

Why: a causal LM's loss needs one number per token, ``log p(y) = z_y - logsumexp(z)`` with
``z = (h . W^T) / temperature``, but computing it through the model's logits materialises B x L x V
values (8,192 x 151,936 = 1.24G: 2.5 GB in BF16, 5 GB as the FP32 copy the log-softmax reads, and the same
again for their gradients). Here the logits exist one chunk of C tokens at a time, forward and backward:

* forward, per chunk: ``z = (h_c . W^T).float() / T`` (the GEMM in the compute dtype, as autocast runs the
  lm_head), then ``lse = logsumexp(z)``, ``logp = z[y] - lse`` and, when asked, the entropy
  ``H = -sum p log p`` on ``log_softmax(z)`` (``lse - E_p[z]`` is the same number but loses digits to
  cancellation on peaked rows). Only ``h`` (N x H), the targets, ``lse`` and ``H`` are kept.
* backward, per chunk: the chunk's logits are recomputed (one more GEMM, 1/3 of the lm_head's work) and
  ``p = exp(z - lse)``; then
      d logp / dz = onehot(y) - p,      d H / dz = -p * (z - E_p[z]) = -p * (log p + H),
  so ``g_z = onehot(y) * g_logp - p * (g_logp + g_H * (log p + H))``, and ``g_logits = g_z / T``.
  ``dh = g_logits . W`` and ``dW += g_logits^T . h_c``, accumulated in FP32 over chunks. On CUDA each chunk's
  GEMM adds its part into the FP32 sum itself (``torch.addmm`` with an FP32 output, beta = 1); where the weight
  has an FP32 master (``fp8.ops.WGRAD_INTO``, trainers/torch/master_weights.py) that sum is the master's
  gradient and no dW is returned (``_wgrad_target``). At the 1.5B shape (V x H = 233M) the old way (a 16-bit
  GEMM output per chunk, its FP32 copy and an FP32 add; then the sum zeroed before, rounded to the weight's
  dtype after, added to a tied embedding's gradient and into the master's) moved 4.7 GB per chunk where the
  GEMM's FP32 epilogue moves 1.9, and 3.7 GB more per step (docs/performance.md, session 56).

Peak extra memory is one chunk: C x V x (2 + 4 + 4) bytes (the compute-dtype logits, their FP32 copy and
one FP32 temporary), 6 GB for C = 4,096 and V = 152K; the default 2,048 halves that.

Precision: the same as the plain path (BF16 GEMM output, FP32 softmax) up to summation order; with FP32
compute (CPU) it agrees with ``algo.logprobs.token_logprobs`` to FP32 rounding (tests/test_token_scores.py).

``fused=True`` (CUDA; the torch trainer's ``fused_kernels``): the per-chunk softmax work above, forward and
backward, is one Triton pass each over the chunk's logits in the compute dtype (``token_scores_fused``): no
FP32 copy of the logits, and the backward writes the gradient over them in place. With a chunk scorer of its
own (true_on_policy's, whose forward values must be the engine's) only the backward takes the Triton pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from infir2_rl.fp8.ops import gradient_target
from infir2_rl.trainers import token_scores_fused

DEFAULT_CHUNK_TOKENS = 2048


def chunk_z(h_c: Tensor, w_c: Tensor, temperature: float) -> Tensor:
    """FP32 tempered logits of one chunk; the GEMM runs in the operands' (compute) dtype."""
    z = (h_c @ w_c.t()).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


# One chunk's scores: (h_c (C, H), w (V, H), targets (C,), T, need_z) -> (logp (C,), lse (C,), the tempered
# FP32 logits z (C, V) when need_z, else None).
ChunkScores = Callable[[Tensor, Tensor, Tensor, float, bool], tuple[Tensor, Tensor, Tensor | None]]


def _plain_chunk(
    h_c: Tensor, w: Tensor, targets_C: Tensor, temperature: float, need_z: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    z = chunk_z(h_c, w, temperature)
    lse_c = torch.logsumexp(z, dim=-1)
    return z.gather(1, targets_C[:, None]).squeeze(1) - lse_c, lse_c, z


def _plain_grad_logits(
    logits_CV: Tensor,
    targets_C: Tensor,
    temperature: float,
    lse_C: Tensor,
    g_logp_C: Tensor,
    entropy_C: Tensor | None,
    g_entropy_C: Tensor | None,
) -> Tensor:
    """d loss / d logits of one chunk in the logits' dtype (module docstring), by torch ops in FP32; the
    signature of ``token_scores_fused.grad_logits_``, which computes the same in one Triton pass."""
    logp_all = logits_CV.float()
    if temperature != 1.0:
        logp_all.div_(temperature)
    logp_all.sub_(lse_C[:, None])
    gl = g_logp_C[:, None]
    if entropy_C is not None and g_entropy_C is not None:
        # z - E[z] = log p + H, so g_z = -p * (g_logp + g_H * (log p + H)), built in place.
        p = logp_all.exp()
        g_z = logp_all.add_(entropy_C[:, None]).mul_(g_entropy_C[:, None]).add_(gl).mul_(p).neg_()
        del p
    else:
        g_z = logp_all.exp_().mul_(-gl)
    g_z.scatter_add_(1, targets_C[:, None], gl)
    if temperature != 1.0:
        g_z.div_(temperature)
    return g_z.to(logits_CV.dtype)


class _ChunkedScores(torch.autograd.Function):
    """(logp (N,), entropy (N,) or empty) from hidden (N, H) and weight (V, H); see the module docstring.
    The forward's per-chunk log-probs come from ``chunk_scores``; the backward recomputes each chunk's logits
    with the plain GEMM, whatever scored the forward."""

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
        chunk_scores: ChunkScores,
        fused: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden_NH.shape[0]
        h = hidden_NH.to(compute_dtype)
        w = weight_VH.to(compute_dtype)
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if need_entropy else logp.new_empty(0)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                if fused and chunk_scores is _plain_chunk:  # one Triton pass over the chunk's logits
                    ent = entropy[s:e] if need_entropy else None
                    token_scores_fused.scores_(
                        h[s:e] @ w.t(), targets_N[s:e], temperature, logp[s:e], lse[s:e], ent
                    )
                    continue
                logp[s:e], lse[s:e], z = chunk_scores(h[s:e], w, targets_N[s:e], temperature, need_entropy)
                if need_entropy:
                    assert z is not None
                    # H = -sum p log p, with log p from log_softmax ((z - max) - log sum exp(z - max)): both
                    # lse - E[z] and z - lse lose digits to cancellation on peaked rows where z is large.
                    logp_all = torch.log_softmax(z, dim=-1)
                    entropy[s:e] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(h, weight_VH, targets_N, lse, entropy)
        ctx.weight_param = weight_VH  # the Parameter itself: saved tensors come back without its attributes
        ctx.temperature, ctx.need_entropy, ctx.chunk_tokens = temperature, need_entropy, chunk_tokens
        ctx.fused = fused
        ctx.hidden_dtype = hidden_NH.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_entropy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weight_VH, targets_N, lse, entropy = ctx.saved_tensors
        temperature, need_entropy, chunk = ctx.temperature, ctx.need_entropy, ctx.chunk_tokens
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight_VH.to(h.dtype)
        n = h.shape[0]
        dh = torch.empty(h.shape, dtype=ctx.hidden_dtype, device=h.device) if need_dh else None
        into = _wgrad_target(ctx.weight_param, h) if need_dw else None
        dw = into
        if need_dw and dw is None:
            dw = torch.zeros(weight_VH.shape, dtype=torch.float32, device=h.device)
        g_logp = g_logp.float()
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                entropy_c = entropy[s:e] if need_entropy else None
                g_entropy_c = g_entropy[s:e].float() if need_entropy else None
                grad_logits = token_scores_fused.grad_logits_ if ctx.fused else _plain_grad_logits
                g_c = grad_logits(
                    h[s:e] @ w.t(), targets_N[s:e], temperature, lse[s:e], g_logp[s:e], entropy_c, g_entropy_c
                )
                if dh is not None:
                    dh[s:e] = g_c @ w
                if dw is not None:
                    _add_chunk_wgrad(dw, g_c, h[s:e])
        dw_out = dw.to(weight_VH.dtype) if dw is not None and into is None else None
        return dh, dw_out, None, None, None, None, None, None, None


def _wgrad_target(weight: Tensor, h: Tensor) -> Tensor | None:
    """The FP32 tensor to add the weight's gradient into (``fp8.ops.WGRAD_INTO``: its master's gradient), on
    CUDA with a 16-bit compute dtype; else None, and dW is summed apart and returned."""
    if not h.is_cuda or h.dtype not in (torch.bfloat16, torch.float16):
        return None
    return gradient_target(weight, "chunked_token_scores")


def _add_chunk_wgrad(dw: Tensor, g_c: Tensor, h_c: Tensor) -> None:
    """``dw += g_c^T . h_c`` in FP32: on CUDA by the GEMM itself (FP32 output, beta = 1: FP32 accumulation and
    one rounding, no 16-bit product and no FP32 copy of it); on CPU as before (the demo's numbers)."""
    if dw.is_cuda and g_c.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(dw, g_c.t(), h_c, out_dtype=torch.float32, out=dw)
    elif dw.is_cuda:
        dw.addmm_(g_c.t(), h_c)
    else:
        dw += (g_c.t() @ h_c).float()


def check_score_inputs(
    hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, temperature: float, chunk_tokens: int
) -> None:
    """One ValueError naming what is wrong with a chunked scorer's inputs (this module's and the megatron
    backend's vocab-parallel one); ``weight_VH`` may be a vocabulary shard."""
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden_NH.shape)} and weight {tuple(weight_VH.shape)}: expected (N, H) and (V, H)."
        )
    if targets_N.shape != hidden_NH.shape[:1]:
        raise ValueError(f"targets has shape {tuple(targets_N.shape)}: expected ({hidden_NH.shape[0]},).")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use the rollout's sampling temperature).")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1.")


def chunked_token_scores(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    *,
    temperature: float = 1.0,
    need_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_scores: ChunkScores = _plain_chunk,
    fused: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(h W^T / T)[y]`` per row (float32, (N,)) and, with ``need_entropy``, the entropy (nats).

    Differentiable w.r.t. ``hidden_NH`` and ``weight_VH``; never holds more than ``chunk_tokens`` rows of
    logits. ``compute_dtype`` is the GEMMs' dtype (default: the hidden states'); gradients come back in the
    inputs' dtypes, the weight's accumulated in FP32. ``chunk_scores`` computes a chunk's forward values (the
    true_on_policy scorer passes the engine's kernels); the backward is the plain path's either way.
    ``fused`` (CUDA with Triton; the trainer's ``fused_kernels``, and true_on_policy's backward): each chunk's
    softmax work, backward and (with the plain chunk scorer) forward, is one Triton pass over its logits in the
    compute dtype (``token_scores_fused``) instead of torch ops over FP32 copies; the same numbers up to exp's
    last bits and the sums' order.
    """
    check_score_inputs(hidden_NH, weight_VH, targets_N, temperature, chunk_tokens)
    if fused and not token_scores_fused.available(hidden_NH.device):
        raise ValueError(
            f"fused token scores need a CUDA device with Triton (device {hidden_NH.device}); pass fused=False"
        )
    dtype = compute_dtype or hidden_NH.dtype
    logp, entropy = _ChunkedScores.apply(
        hidden_NH, weight_VH, targets_N.long(), float(temperature), need_entropy, dtype, chunk_tokens,
        chunk_scores, fused,
    )  # fmt: skip
    return logp, (entropy if need_entropy else None)
