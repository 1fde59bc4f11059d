"""Next-token sampling for the native engine: tempered softmax, optional top-k / top-p, per-row seeds.

Shapes: B rows (sequences) of the decode batch, V vocabulary.

What is sampled. Row b draws from ``softmax(z_b / T_b)`` with ``z = logits.float()``, after optional
top-k / top-p truncation; a greedy row takes ``argmax z_b``. RL runs with top_p = 1 and top_k = -1, so
the sampling distribution is exactly the tempered softmax the trainer recomputes.

What log-prob is returned. ``log_softmax(z_b / T_b)[token]`` of the *untruncated* tempered softmax, in
float32: the number ``algo.logprobs.token_logprobs`` computes on the trainer side at the same
temperature (equal to the sampling distribution's log-prob whenever no truncation is on). Greedy rows
report the temperature-1 log-prob.

How randomness is drawn (reproducible, independent of the batch). ``torch.multinomial`` takes one
``torch.Generator`` for a whole call, so per-request seeds would need one call per row per step.
Instead each row owns a 32-bit key derived from (request seed, sample index), and at decode step s it
uses the uniform ``u = (hash32(key ^ hash32(s)) + 0.5) / 2^32`` (a counter-based generator: a pure
function of key and step). The token is drawn by inverse-CDF sampling: the first index whose cumulative
probability exceeds ``u * total``. That is an exact draw from the categorical distribution; the only
deviation is float32 rounding of the running sum, which moves each token's share of [0, 1) by at most
one rounding of the sum (~2^-24 absolute). Because u depends only on (seed, index, step), a sample is
the same whatever else shares its batch, up to the floating-point noise of batched matmuls (which
would have to land within ~1e-7 of a CDF boundary to change a token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# Multiplier of a well-mixing 32-bit integer hash (xor-shift-multiply, 3 rounds). It is below 2^27, so
# the product of a 32-bit value and it stays below 2^63: no int64 overflow in torch.
_HASH_MUL = 0x45D9F3B


def _hash32_int(x: int) -> int:
    x &= _MASK32
    for _ in range(2):
        x = ((x >> 16) ^ x) * _HASH_MUL & _MASK32
    return (x >> 16) ^ x


def _hash32(x: Tensor) -> Tensor:
    """The same hash as ``_hash32_int`` on an int64 tensor of values in [0, 2^32)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * _HASH_MUL & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int, index: int) -> int:
    """32-bit key of sample ``index`` of a request with ``seed`` (any Python ints, negatives included)."""
    seed &= (1 << 64) - 1
    h = _hash32_int(seed & _MASK32)
    h = _hash32_int(h ^ (seed >> 32))
    return _hash32_int(h ^ _hash32_int(index & _MASK32))


def uniforms(keys_B: Tensor, step: int | Tensor) -> Tensor:
    """One float64 uniform in (0, 1) per row, a pure function of (key, step); ``step`` may be a per-row
    int64 tensor (the graph decode path, where rows are at different steps), with the same values."""
    if isinstance(step, Tensor):
        h = _hash32(keys_B ^ _hash32((step + 0x9E3779B9) & _MASK32))
    else:
        h = _hash32(keys_B ^ _hash32_int(step + 0x9E3779B9))
    return (h.double() + 0.5) / float(1 << 32)


@dataclass
class RowSampling:
    """Per-row sampling parameters as device tensors (B rows)."""

    temperature_B: Tensor  # float32, > 0; 1.0 on greedy rows
    top_k_B: Tensor  # int64; V (or more) = off
    top_p_B: Tensor  # float32 in (0, 1]
    greedy_B: Tensor  # bool
    keys_B: Tensor  # int64 32-bit keys from row_key

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        greedy: list[bool],
        keys: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> RowSampling:
        temps = [1.0 if g else t for t, g in zip(temperature, greedy)]
        ks = [vocab_size if k <= 0 or k > vocab_size else k for k in top_k]
        return cls(
            temperature_B=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k_B=torch.tensor(ks, dtype=torch.int64, device=device),
            top_p_B=torch.tensor(top_p, dtype=torch.float32, device=device),
            greedy_B=torch.tensor(greedy, dtype=torch.bool, device=device),
            keys_B=torch.tensor(keys, dtype=torch.int64, device=device),
        )

    def select(self, rows: Tensor) -> RowSampling:
        """The parameters of the rows at indices ``rows`` (dropping finished sequences)."""
        return RowSampling(
            self.temperature_B[rows],
            self.top_k_B[rows],
            self.top_p_B[rows],
            self.greedy_B[rows],
            self.keys_B[rows],
        )


def _truncate(z_BV: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """Set logits outside each row's top-k and top-p (nucleus) sets to -inf; the top token always stays."""
    vocab = z_BV.shape[-1]
    sorted_z, order = z_BV.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=z_BV.device)
    keep_sorted = ranks[None, :] < top_k_B[:, None]
    probs_sorted = torch.softmax(sorted_z, dim=-1)
    # Keep a token while the mass strictly before it is below top_p (so the first token is always kept).
    keep_sorted &= (probs_sorted.cumsum(-1) - probs_sorted) < top_p_B[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return z_BV.masked_fill(~keep, float("-inf"))


def sample_tokens(
    logits_BV: Tensor, params: RowSampling, step: int | Tensor, truncating: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Draw one token per row; returns (tokens_B int64, logprobs_B float32) as described in the module doc.

    ``truncating`` (whether any row has top-k / top-p on) is read from ``params`` when None, which syncs
    with the device; the graph decode path passes it so that the step has no host synchronisation."""
    z = logits_BV.float() / params.temperature_B[:, None]
    logprobs_BV = torch.log_softmax(z, dim=-1)
    if truncating is None:
        truncating = bool(((params.top_k_B < z.shape[-1]) | (params.top_p_B < 1.0)).any())
    probs = (
        torch.softmax(_truncate(z, params.top_k_B, params.top_p_B), dim=-1)
        if truncating
        else logprobs_BV.exp()
    )
    cdf = probs.cumsum(dim=-1)
    u = uniforms(params.keys_B, step).to(cdf.dtype) * cdf[:, -1]
    sampled = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    # u * total can round up to total itself (no index qualifies): fall back to the last token with mass.
    last_with_mass = z.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    sampled = torch.minimum(sampled, last_with_mass)
    tokens = torch.where(params.greedy_B, z.argmax(dim=-1), sampled)
    return tokens, logprobs_BV.gather(-1, tokens[:, None]).squeeze(-1)
