"""The token scores' Triton passes (``trainers/token_scores_fused.py``, ``fused=True``) against the plain
chunked path: forward log-probs and entropies, and the gradients of both w.r.t. hidden states and the
lm_head weight. GPU only (Triton)."""

from __future__ import annotations

import pytest
import torch

from infir2_rl.trainers.token_scores import chunked_token_scores

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("need_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_token_scores_equal_the_plain_path(temperature: float, need_entropy: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 700, 256, 50_003  # vocabulary not a multiple of the kernels' blocks
    h = torch.randn(n, hidden, device="cuda", generator=gen)
    w = torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.08
    w[7] *= 6.0  # a few peaked rows: token 7 dominates where h aligns with it
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    targets[:50] = 7
    g_logp = torch.randn(n, device="cuda", generator=gen)
    g_ent = torch.randn(n, device="cuda", generator=gen)
    results = []
    for fused in (False, True):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, ent = chunked_token_scores(
            hh, ww, targets, temperature=temperature, need_entropy=need_entropy,
            compute_dtype=torch.bfloat16, chunk_tokens=256, fused=fused,
        )  # fmt: skip
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
        loss.backward()
        results.append((logp.detach(), ent, hh.grad, ww.grad))
    (lp0, e0, dh0, dw0), (lp1, e1, dh1, dw1) = results
    assert lp1.dtype == torch.float32 and torch.isfinite(lp1).all()
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=5e-5)
    if need_entropy:
        assert e0 is not None and e1 is not None
        torch.testing.assert_close(e1.detach(), e0.detach(), rtol=0, atol=5e-5)
        assert float(e1.min()) < 0.5 < float(e1.max())  # peaked and flat rows both present
    assert dh1 is not None and dw1 is not None and dh0 is not None and dw0 is not None
    assert dh1.dtype == h.dtype and dw1.dtype == w.dtype
    assert _rel(dh1, dh0) < 5e-3 and _rel(dw1, dw0) < 5e-3, (_rel(dh1, dh0), _rel(dw1, dw0))
