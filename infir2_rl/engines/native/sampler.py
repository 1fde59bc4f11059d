"""The graph decode path's sampler: ``engines.sampling``'s rule in one Triton kernel per step (CUDA).

The rule (see ``engines/sampling.py``): z = logits.float() / T; log-prob = ``log_softmax(z)[token]``;
token = the first index whose cumulative probability exceeds ``u * total`` (u from the row's key and
step), at most the last index with non-zero probability; greedy rows take ``argmax z`` (first maximum).

torch computes it in ~12 kernels over (B, V) FP32 tensors (cast, divide, log-softmax, exp, cumsum,
searchsorted, flip, argmax, gather): at batch 256 and V = 151,936 that is over 1 GB of traffic per step.
Here four small kernels, the vocabulary cut into ~32 chunks per row so that a few rows still fill the GPU:
per chunk the max, sum of exponentials and first argmax; per row the log-sum-exp and argmax; per chunk the
total probability and last index with mass; per row the chunk where the cumulative probability passes
u * total and the scan inside it (stopping once found). The BF16 logits are read twice plus one chunk. The
only difference from torch is the order of the FP32 sums (chunk- and block-wise instead of torch's scan),
which moves a CDF boundary by up to ~1e-6 at a 151,936-token vocabulary (a token's probability is ~7e-6
there): a token can differ from torch's only when u lands that close to a boundary, and then it is a
neighbour (tests/test_engine_runner.py).

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
    def _z(base, idx, hi, temp):
        return tl.math.div_rn(tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32), temp)

    @triton.jit
    def _chunk_max_kernel(
        logits_ptr, temp_ptr, m_ptr, s_ptr, best_ptr, best_idx_ptr, V, stride, CHUNK, NCH,
        BLOCK: tl.constexpr, ARGMAX: tl.constexpr,
    ):  # fmt: skip
        """Per (row, chunk): max of z, sum of exp(z - max), first argmax (ARGMAX; the max and sum do not
        depend on it)."""
        row, c = tl.program_id(0), tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride
        temp = tl.load(temp_ptr + row)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        offs = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK,), 0, tl.int32)
        for start in range(0, CHUNK, BLOCK):
            idx = lo + start + offs
            z = _z(base, idx, hi, temp)
            m_new = tl.maximum(m, z)
            s = tl.where(m_new > float("-inf"), s * tl.exp(m - m_new) + tl.exp(z - m_new), 0.0)
            m = m_new
            if ARGMAX:
                better = z > best
                best_idx = tl.where(better, idx, best_idx)
                best = tl.where(better, z, best)
        mx = tl.max(m, axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mx), 0.0), axis=0)
        out = row * NCH + c
        tl.store(m_ptr + out, mx)
        tl.store(s_ptr + out, total)
        if ARGMAX:
            top = tl.max(best, axis=0)
            tl.store(best_ptr + out, top)
            tl.store(best_idx_ptr + out, tl.min(tl.where(best == top, best_idx, V), axis=0))

    @triton.jit
    def _lse_kernel(
        m_ptr, s_ptr, best_ptr, best_idx_ptr, lse_ptr, argmax_ptr, V, NCH, CP2: tl.constexpr, ARGMAX: tl.constexpr
    ):  # fmt: skip
        """Per row: log-sum-exp and first argmax (ARGMAX) over the chunks' partials."""
        row = tl.program_id(0)
        offs = tl.arange(0, CP2)
        mask = offs < NCH
        mc = tl.load(m_ptr + row * NCH + offs, mask=mask, other=float("-inf"))
        sc = tl.load(s_ptr + row * NCH + offs, mask=mask, other=0.0)
        mx = tl.max(mc, axis=0)
        tl.store(
            lse_ptr + row,
            mx + tl.log(tl.sum(tl.where(mc > float("-inf"), sc * tl.exp(mc - mx), 0.0), axis=0)),
        )
        if ARGMAX:
            bc = tl.load(best_ptr + row * NCH + offs, mask=mask, other=float("-inf"))
            bi = tl.load(best_idx_ptr + row * NCH + offs, mask=mask, other=V)
            top = tl.max(bc, axis=0)
            tl.store(argmax_ptr + row, tl.min(tl.where(bc == top, bi, V), axis=0))

    @triton.jit
    def _chunk_mass_kernel(
        logits_ptr, temp_ptr, lse_ptr, t_ptr, last_ptr, V, stride, CHUNK, NCH, BLOCK: tl.constexpr
    ):
        """Per (row, chunk): total probability and last index with non-zero probability (-1: none)."""
        row, c = tl.program_id(0), tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride
        temp = tl.load(temp_ptr + row)
        lse = tl.load(lse_ptr + row)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        offs = tl.arange(0, BLOCK)
        total = 0.0
        last = -1
        for start in range(0, CHUNK, BLOCK):
            idx = lo + start + offs
            p = tl.exp(_z(base, idx, hi, temp) - lse)
            total += tl.sum(p, axis=0)
            last = tl.maximum(last, tl.max(tl.where(p > 0, idx, -1), axis=0))
        tl.store(t_ptr + row * NCH + c, total)
        tl.store(last_ptr + row * NCH + c, last)

    @triton.jit
    def _pick_kernel(
        logits_ptr, temp_ptr, greedy_ptr, u_ptr, lse_ptr, argmax_ptr, t_ptr, last_ptr, tok_ptr, lp_ptr,
        V, stride, CHUNK, NCH, CP2: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Per row: the chunk where the cumulative probability passes u * total, then the scan inside it."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        temp = tl.load(temp_ptr + row)
        lse = tl.load(lse_ptr + row)
        offs_c = tl.arange(0, CP2)
        mask_c = offs_c < NCH
        t = tl.load(t_ptr + row * NCH + offs_c, mask=mask_c, other=0.0)
        lasts = tl.load(last_ptr + row * NCH + offs_c, mask=mask_c, other=-1)
        target = tl.load(u_ptr + row) * tl.sum(t, axis=0)
        cum = tl.cumsum(t, axis=0)
        chunk = tl.min(tl.where((cum > target) & mask_c, offs_c, NCH), axis=0)
        # u * total can round up to the total (no chunk qualifies): the last token with mass, as torch's rule.
        token = tl.max(lasts, axis=0)
        if chunk < NCH:
            running = tl.sum(tl.where(offs_c == chunk, cum - t, 0.0), axis=0)
            lo = chunk * CHUNK
            hi = tl.minimum(lo + CHUNK, V)
            offs = tl.arange(0, BLOCK)
            found = V
            for start in range(0, CHUNK, BLOCK):
                if found == V:
                    idx = lo + start + offs
                    c = tl.cumsum(tl.exp(_z(base, idx, hi, temp) - lse), axis=0) + running
                    found = tl.min(tl.where((c > target) & (idx < hi), idx, V), axis=0)
                    running = tl.max(c, axis=0)
            # The scan's own sum can end a few ulps short of the chunk total: then the chunk's last token.
            chunk_last = tl.sum(tl.where(offs_c == chunk, lasts, 0), axis=0)
            token = tl.where(found < V, found, chunk_last)
        token = tl.where(tl.load(greedy_ptr + row) != 0, tl.load(argmax_ptr + row), token)
        z_tok = tl.math.div_rn(tl.load(base + token).to(tl.float32), temp)
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(lp_ptr + row, z_tok - lse)


# Chunks of the vocabulary per row: enough programs to fill the GPU at small batch (one program per row
# streamed all 151,936 logits three times: ~160 us per step at any batch up to 132 rows).
_BLOCK = 2048
_TARGET_CHUNKS = 32


def _chunks(vocab: int) -> tuple[int, int, int]:
    """(chunk size, chunks per row, their power-of-two vector size): a function of the vocabulary only, so a
    row's sums run in the same order whatever the batch (``models/invariant_ops`` relies on it)."""
    chunk = _BLOCK * -(-vocab // (_TARGET_CHUNKS * _BLOCK))
    nch = -(-vocab // chunk)
    return chunk, nch, max(16, triton.next_power_of_2(nch))  # the per-row kernels' vector (not size 1)


def _lse_and_argmax(logits_BV: Tensor, temp_B: Tensor, argmax: bool = True) -> tuple[Tensor, Tensor | None]:
    """Per row: log-sum-exp of z = logits.float() / T and, with ``argmax``, the first argmax (two kernels;
    the log-sum-exp's bits do not depend on ``argmax``)."""
    rows, vocab = logits_BV.shape
    chunk, nch, cp2 = _chunks(vocab)
    dev = logits_BV.device
    m, s = (torch.empty(rows, nch, dtype=torch.float32, device=dev) for _ in range(2))
    best = torch.empty(rows, nch, dtype=torch.float32, device=dev) if argmax else m  # (not written without)
    best_idx = torch.empty(rows, nch, dtype=torch.int32, device=dev) if argmax else m
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    top = torch.empty(rows, dtype=torch.int32, device=dev) if argmax else None
    if rows:
        _chunk_max_kernel[(rows, nch)](
            logits_BV, temp_B, m, s, best, best_idx, vocab, logits_BV.stride(0), chunk, nch, BLOCK=_BLOCK,
            ARGMAX=argmax,
        )  # fmt: skip
        _lse_kernel[(rows,)](
            m, s, best, best_idx, lse, top if top is not None else lse, vocab, nch, CP2=cp2, ARGMAX=argmax
        )  # fmt: skip
    return lse, top


def logsumexp(logits_BV: Tensor, temperature_B: Tensor) -> Tensor:
    """The sampler's log-sum-exp of ``logits.float() / T`` per row (CUDA), T FP32 per row: its bits, without
    the argmax the sampler also tracks (the trainer's true_on_policy scoring needs only this)."""
    return _lse_and_argmax(logits_BV, temperature_B, argmax=False)[0]


def sample(
    logits_BV: Tensor, params: RowSampling, steps_B: Tensor, truncating: bool
) -> tuple[Tensor, Tensor]:
    """(tokens_B int64, logprobs_B float32) by the rule of ``engines.sampling``; no host sync."""
    if truncating or not (_HAVE_TRITON and logits_BV.is_cuda):
        return sample_tokens(logits_BV, params, steps_B, truncating)
    rows, vocab = logits_BV.shape
    chunk, nch, cp2 = _chunks(vocab)
    dev, stride = logits_BV.device, logits_BV.stride(0)
    u = uniforms(params.keys_B, steps_B).float()
    temp = params.temperature_B
    lse, argmax = _lse_and_argmax(logits_BV, temp)
    assert argmax is not None
    t = torch.empty(rows, nch, dtype=torch.float32, device=dev)
    last = torch.empty(rows, nch, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _chunk_mass_kernel[(rows, nch)](logits_BV, temp, lse, t, last, vocab, stride, chunk, nch, BLOCK=_BLOCK)
    _pick_kernel[(rows,)](
        logits_BV, temp, params.greedy_B, u, lse, argmax, t, last, tokens, logprobs,
        vocab, stride, chunk, nch, CP2=cp2, BLOCK=_BLOCK,
    )  # fmt: skip
    return tokens, logprobs
