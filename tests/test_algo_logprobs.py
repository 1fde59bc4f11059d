"""token_logprobs, entropy_from_logits and sft_loss against hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F

from infir2_rl.algo.logprobs import entropy_from_logits, scores_from_logits, token_logprobs
from infir2_rl.algo.sft_loss import sft_loss

LN2 = math.log(2.0)


def _hand_logits() -> torch.Tensor:
    # Position 0: logits [1, 2, 3]. Position 1: [0, 0, ln 2] = log of probabilities [1/4, 1/4, 1/2].
    return torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, LN2]]])


def test_token_logprobs_hand_values_with_temperature() -> None:
    logits = _hand_logits()
    targets = torch.tensor([[2, 0]])
    lp = token_logprobs(logits, targets)
    e = math.e
    torch.testing.assert_close(
        lp, torch.tensor([[3 - math.log(e + e**2 + e**3), -math.log(4.0)]]), rtol=0, atol=1e-6
    )
    # T = 2: position 0 -> z = [.5, 1, 1.5]; position 1 -> probabilities proportional to [1, 1, sqrt 2].
    lp2 = token_logprobs(logits, targets, temperature=2.0)
    expected2 = [1.5 - math.log(math.exp(0.5) + e + math.exp(1.5)), -math.log(2 + math.sqrt(2))]
    torch.testing.assert_close(lp2, torch.tensor([expected2]), rtol=0, atol=1e-6)
    assert lp2.dtype == torch.float32


def test_token_logprobs_gradient_is_onehot_minus_softmax() -> None:
    logits = torch.tensor([[[0.0, 0.0, LN2]]], requires_grad=True)
    token_logprobs(logits, torch.tensor([[2]])).sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, -0.25, 0.5]]]), rtol=0, atol=1e-6)
    # With temperature T the gradient is (onehot - softmax(z / T)) / T.
    logits.grad = None
    token_logprobs(logits, torch.tensor([[0]]), temperature=2.0).sum().backward()
    p = [1 / (2 + math.sqrt(2)), 1 / (2 + math.sqrt(2)), math.sqrt(2) / (2 + math.sqrt(2))]
    expected = torch.tensor([[[(1 - p[0]) / 2, -p[1] / 2, -p[2] / 2]]])
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 10_000])
def test_chunking_matches_float64_reference_values_and_grads(chunk_tokens: int) -> None:
    torch.manual_seed(0)
    B, T, V, temp = 3, 7, 11, 1.1
    base = torch.randn(B, T, V, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T, dtype=torch.float64)
    base_g = base.clone().requires_grad_(True)
    ref = torch.log_softmax(base_g / temp, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    assert base_g.grad is not None

    logits = base.float().requires_grad_(True)
    lp = token_logprobs(logits, targets, temperature=temp, chunk_tokens=chunk_tokens)
    (lp * weights.float()).sum().backward()
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=0, atol=1e-5)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad.double(), base_g.grad, rtol=0, atol=1e-5)


def test_bf16_logits_are_scored_in_float32() -> None:
    logits = (torch.randn(2, 5, 9) * 4).bfloat16()
    targets = torch.randint(0, 9, (2, 5))
    lp = token_logprobs(logits, targets, chunk_tokens=3)
    ref = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


def test_entropy_hand_values() -> None:
    # [0, 0, ln 2] -> p = [1/4, 1/4, 1/2]: H = 2 * (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2.
    # Uniform over 3 -> ln 3. Large temperature flattens towards ln 3 as well.
    logits = torch.tensor([[[0.0, 0.0, LN2], [5.0, 5.0, 5.0]]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[1.5 * LN2, math.log(3)]]))
    # T = 2 on [0, 0, ln 2]: p proportional to [1, 1, sqrt 2], H = -sum p ln p.
    q = [1 / (2 + math.sqrt(2)), 1 / (2 + math.sqrt(2)), math.sqrt(2) / (2 + math.sqrt(2))]
    h2 = -sum(x * math.log(x) for x in q)
    torch.testing.assert_close(entropy_from_logits(logits, temperature=2.0)[0, 0], torch.tensor(h2))


def test_entropy_with_masked_vocab_has_finite_value_and_grad() -> None:
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(logits, chunk_tokens=1)
    torch.testing.assert_close(h, torch.tensor([[LN2]]))
    h.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # dH/dz_i = -p_i (ln p_i + H) = 0 at the uniform point over the two live entries.
    torch.testing.assert_close(logits.grad, torch.zeros(1, 1, 3))


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="next-token shift"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        entropy_from_logits(torch.zeros(1, 2, 3), chunk_tokens=0)


# ---- SFT loss --------------------------------------------------------------------------------------


def _sft_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # labels [0, 1, 2, 0], mask [1, 0, 1, 1] (the first bit can never be used).
    # logits[:, 0] predicts labels[1] (mask 0: excluded), logits[:, 1] predicts labels[2] = 2,
    # logits[:, 2] predicts labels[3] = 0, logits[:, 3] predicts nothing.
    logits = torch.tensor(
        [
            [
                [100.0, -100.0, 3.0],  # excluded position: would dominate the loss if used
                [math.log(0.5), math.log(0.25), math.log(0.25)],  # -log p(2) = ln 4
                [math.log(0.125), math.log(0.375), math.log(0.5)],  # -log p(0) = ln 8
                [-100.0, 100.0, 7.0],  # no next token
            ]
        ]
    )
    return logits, torch.tensor([[0, 1, 2, 0]]), torch.tensor([[1, 0, 1, 1]])


def test_sft_loss_uses_target_token_mask_with_shift() -> None:
    logits, labels, mask = _sft_case()
    loss, n = sft_loss(scores_from_logits(logits, labels).logprobs_BL, mask)
    assert n == 2
    assert loss.item() == pytest.approx((2 * LN2 + 3 * LN2) / 2, abs=1e-6)
    # The first token's mask bit is ignored: nothing predicts it.
    loss0, n0 = sft_loss(scores_from_logits(logits, labels).logprobs_BL, torch.tensor([[0, 0, 1, 1]]))
    assert n0 == 2 and loss0.item() == pytest.approx(loss.item(), abs=1e-7)


def test_sft_loss_denominator_and_gradient() -> None:
    logits, labels, mask = _sft_case()
    logits.requires_grad_(True)
    loss, _ = sft_loss(scores_from_logits(logits, labels).logprobs_BL, mask, denominator=4.0)
    assert loss.item() == pytest.approx(5 * LN2 / 4, abs=1e-6)
    loss.backward()
    assert logits.grad is not None
    # d(-log p_y)/dz = softmax - onehot, divided by the denominator; unused positions get 0.
    expected = torch.zeros(1, 4, 3)
    expected[0, 1] = (torch.tensor([0.5, 0.25, 0.25]) - torch.tensor([0.0, 0.0, 1.0])) / 4
    expected[0, 2] = (torch.tensor([0.125, 0.375, 0.5]) - torch.tensor([1.0, 0.0, 0.0])) / 4
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-6)


def test_sft_loss_matches_cross_entropy_on_random_batch() -> None:
    torch.manual_seed(1)
    B, T, V = 3, 6, 13
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1).float()
    expected = (ce * m).sum() / m.sum()
    loss, n = sft_loss(scores_from_logits(logits, labels, chunk_tokens=2).logprobs_BL, mask)
    assert n == int(m.sum().item()) == 10  # 3 + 5 + 2 targets after the shift
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)


def test_sft_loss_with_no_targets_is_zero_and_differentiable() -> None:
    logits = torch.randn(1, 3, 4, requires_grad=True)
    loss, n = sft_loss(
        scores_from_logits(logits, torch.zeros(1, 3, dtype=torch.long)).logprobs_BL, torch.zeros(1, 3)
    )
    assert n == 0 and loss.item() == 0.0
    loss.backward()
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros(1, 3, 4))
