"""The graph decode path's sampler: ``engines.sampling``'s rule in one Triton kernel per step (CUDA).

The rule (see ``engines/sampling.py``): z = logits.float() / T; log-prob = ``log_softmax(z)[token]``;
token = the first index whose cumulative probability exceeds ``u * total`` (u from the row's key and
step), at most the last index with non-zero probability; greedy rows take ``argmax z`` (first maximum).

torch computes it in ~12 kernels over (B, V) FP32 tensors (cast, divide, log-softmax, exp, cumsum,
searchsorted, flip, argmax, gather): at batch 256 and V = 151,936 that is over 1 GB of traffic per step.
One program per row here reads the BF16 logits three times (max and sum of exponentials; the total of
the probabilities; the scan to u * total, stopping once found) and writes two numbers. The only
difference from torch is the order of the FP32 running sum (block-wise instead of torch's scan), which
moves a CDF boundary by ~1e-7: a token can differ only when u lands that close to one.

Rows with top-k / top-p truncation use the torch version (``sample_tokens``), as on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infir2_rl.engines.sampling import RowSampling, sample_tokens, uniforms

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False

if _HAVE_TRITON:

    @triton.jit
    def _sample_kernel(
        logits_ptr, temp_ptr, greedy_ptr, u_ptr, tok_ptr, lp_ptr, V, stride, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        temp = tl.load(temp_ptr + row)
        offs = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK,), 0, tl.int32)
        for start in range(0, V, BLOCK):  # pass 1: per-lane running max, sum of exp, argmax
            idx = start + offs
            z = tl.math.div_rn(tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32), temp)
            m_new = tl.maximum(m, z)
            s = tl.where(m_new > float("-inf"), s * tl.exp(m - m_new) + tl.exp(z - m_new), 0.0)
            m = m_new
            better = z > best
            best_idx = tl.where(better, idx, best_idx)
            best = tl.where(better, z, best)
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
        top = tl.max(best, axis=0)
        argmax = tl.min(tl.where(best == top, best_idx, V), axis=0)
        total = 0.0
        last = 0
        for start in range(0, V, BLOCK):  # pass 2: total probability, last index with mass
            idx = start + offs
            z = tl.math.div_rn(tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32), temp)
            p = tl.exp(z - lse)
            total += tl.sum(p, axis=0)
            last = tl.maximum(last, tl.max(tl.where(p > 0, idx, 0), axis=0))
        target = tl.load(u_ptr + row) * total
        running = 0.0
        found = V
        for start in range(0, V, BLOCK):  # pass 3: first index whose cumulative probability > target
            if found == V:
                idx = start + offs
                z = tl.math.div_rn(
                    tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32), temp
                )
                c = tl.cumsum(tl.exp(z - lse), axis=0) + running
                found = tl.min(tl.where((c > target) & (idx < V), idx, V), axis=0)
                running = tl.max(c, axis=0)
        token = tl.minimum(found, last)
        token = tl.where(tl.load(greedy_ptr + row) != 0, argmax, token)
        z_tok = tl.math.div_rn(tl.load(base + token).to(tl.float32), temp)
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(lp_ptr + row, z_tok - lse)


def sample(
    logits_BV: Tensor, params: RowSampling, steps_B: Tensor, truncating: bool
) -> tuple[Tensor, Tensor]:
    """(tokens_B int64, logprobs_B float32) by the rule of ``engines.sampling``; no host sync."""
    if truncating or not (_HAVE_TRITON and logits_BV.is_cuda):
        return sample_tokens(logits_BV, params, steps_B, truncating)
    rows, vocab = logits_BV.shape
    u = uniforms(params.keys_B, steps_B).float()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits_BV.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits_BV.device)
    _sample_kernel[(rows,)](
        logits_BV, params.temperature_B, params.greedy_B, u, tokens, logprobs, vocab, logits_BV.stride(0),
        BLOCK=4096, num_warps=8,
    )  # fmt: skip
    return tokens, logprobs
