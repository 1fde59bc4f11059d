"""Sampling rule of the native engine: log-probs, greedy, truncation, and seeded, batch-independent draws."""

import pytest
import torch

from infir2_rl.engines import sampling
from infir2_rl.engines.sampling import RowSampling, row_key, sample_tokens, uniforms


def _params(
    num_rows: int,
    vocab: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
) -> RowSampling:
    return RowSampling.build(
        temperature=[temperature] * num_rows,
        top_k=[top_k] * num_rows,
        top_p=[top_p] * num_rows,
        greedy=[greedy] * num_rows,
        keys=[row_key(seed, i) for i in range(num_rows)],
        vocab_size=vocab,
        device=torch.device("cpu"),
    )


def test_row_keys_are_deterministic_distinct_32_bit() -> None:
    keys = {row_key(s, i) for s in (-1, 0, 1, 2**40 + 3) for i in range(50)}
    assert len(keys) == 200
    assert all(0 <= k < 2**32 for k in keys)
    # Pinned: the key must be the same in every process and after a resume (a change reorders all sampling).
    assert row_key(7, 3) == 4162450087 and row_key(-1, 5) == 692955642


def test_uniforms_are_in_open_interval_and_roughly_uniform() -> None:
    keys = torch.tensor([row_key(0, i) for i in range(20000)])
    u = uniforms(keys, step=5)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs((u < 0.25).float().mean().item() - 0.25) < 0.01
    assert not torch.equal(u, uniforms(keys, step=6))


def test_logprob_is_tempered_log_softmax_of_the_sampled_token() -> None:
    logits = torch.randn(6, 11)
    tokens, logprobs = sample_tokens(logits, _params(6, 11, temperature=0.7), step=0)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)


def test_greedy_takes_argmax_with_temperature_one_logprob() -> None:
    logits = torch.randn(5, 9)
    tokens, logprobs = sample_tokens(logits, _params(5, 9, temperature=0.3, greedy=True), step=3)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values, rtol=0, atol=1e-6)


def test_empirical_frequencies_follow_the_tempered_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    temperature = 2.0
    logits = (probs.log() * temperature).expand(40000, 4)  # softmax(logits / T) == probs
    tokens, _ = sample_tokens(logits, _params(40000, 4, temperature=temperature), step=0)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    # 40k draws: the standard error of each frequency is <= 0.0025, so 0.01 is 4 standard errors.
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.01)


def test_top_k_and_top_p_only_sample_inside_the_kept_set() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(20000, 4)
    tokens_k, _ = sample_tokens(logits, _params(20000, 4, top_k=2), step=0)
    assert set(tokens_k.tolist()) == {0, 1}
    # Renormalised over the top 2: 0.4 / 0.7.
    assert abs((tokens_k == 0).float().mean().item() - 4 / 7) < 0.015
    tokens_p, logprobs_p = sample_tokens(logits, _params(20000, 4, top_p=0.75), step=0)
    assert set(tokens_p.tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.75, so token 2 is still inside the nucleus
    # Log-probs are those of the untruncated softmax (what the trainer recomputes).
    torch.testing.assert_close(logprobs_p, probs.log()[tokens_p], rtol=0, atol=1e-6)


def test_a_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    logits = torch.randn(8, 50)
    full = _params(8, 50, seed=42)
    tokens_all, _ = sample_tokens(logits, full, step=4)
    rows = torch.tensor([5, 2])
    tokens_some, _ = sample_tokens(logits[rows], full.select(rows), step=4)
    assert torch.equal(tokens_some, tokens_all[rows])
    tokens_other_seed, _ = sample_tokens(logits, _params(8, 50, seed=43), step=4)
    assert not torch.equal(tokens_other_seed, tokens_all)


def test_u_rounding_up_to_the_total_never_picks_a_token_without_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "uniforms", lambda keys, step: torch.ones(keys.shape, dtype=torch.float64))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    tokens, _ = sample_tokens(logits, _params(1, 5, top_k=2), step=0)
    # Tokens 0..2 are outside the top 2 (zero mass); the last token with mass is 4 (it has the most mass).
    assert tokens.tolist() == [4]
    logits_rev = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    tokens_rev, _ = sample_tokens(logits_rev, _params(1, 5, top_k=2), step=0)
    assert tokens_rev.tolist() == [1]
