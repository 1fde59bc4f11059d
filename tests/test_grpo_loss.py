"""GrpoLoss, the glue between a trainer's token scores and policy_loss: KL to the reference and the entropy bonus."""

import math

import pytest
import torch

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.logprobs import entropy_from_logits, scores_from_logits, token_logprobs
from infir2_rl.algo.loss_fns import GrpoLoss
from infir2_rl.metrics import names
from infir2_rl.types import TokenBatch, TokenScores

TEMPERATURE = 0.7


def _batch(logits: torch.Tensor, ref_shift: float | None) -> TokenBatch:
    """Two sequences of 4 tokens, response = positions 2..3; old log-probs equal the current ones (ratio 1),
    reference log-probs lower by ``ref_shift`` (None: no reference)."""
    torch.manual_seed(0)
    ids = torch.randint(0, logits.shape[-1], (2, 4))
    logp = torch.zeros(2, 4)
    logp[:, 1:] = token_logprobs(logits[:, :-1].detach(), ids[:, 1:], TEMPERATURE)
    loss_mask = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    return TokenBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        rollout_logprobs=logp.clone(),
        old_logprobs=logp.clone(),
        ref_logprobs=None if ref_shift is None else logp - ref_shift,
        advantages=torch.zeros(2),  # silences the policy term: the loss is the KL / entropy term alone
    )


def _scores(logits: torch.Tensor, batch: TokenBatch, loss: GrpoLoss) -> TokenScores:
    """What the trainer hands the loss: token-aligned scores at the loss's temperature."""
    return scores_from_logits(logits, batch.input_ids, loss.temperature, need_entropy=loss.needs_entropy)


def _run(loss: GrpoLoss, logits: torch.Tensor, batch: TokenBatch):  # type: ignore[no-untyped-def]
    return loss(_scores(logits, batch, loss), batch)


def test_kl_term_reaches_the_loss_and_train_kl() -> None:
    logits = torch.randn(2, 4, 11)
    d = 0.3  # logp - logp_ref on every token
    batch = _batch(logits, ref_shift=d)
    out = _run(GrpoLoss(AlgorithmConfig(kl_coef=0.05, kl_type="k3"), TEMPERATURE), logits, batch)
    k3 = math.exp(-d) - 1 + d
    assert out.metrics[names.TRAIN_KL] == pytest.approx(k3, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.05 * k3, rel=1e-5)
    assert names.TRAIN_ENTROPY not in out.metrics
    # k1 reports d itself; with kl_coef = 0 no reference is needed and none is reported.
    k1 = _run(GrpoLoss(AlgorithmConfig(kl_coef=0.05, kl_type="k1"), TEMPERATURE), logits, batch)
    assert k1.metrics[names.TRAIN_KL] == pytest.approx(d, rel=1e-5)
    plain = _run(GrpoLoss(AlgorithmConfig(), TEMPERATURE), logits, _batch(logits, ref_shift=None))
    assert plain.loss.item() == 0.0 and names.TRAIN_KL not in plain.metrics


def test_kl_without_reference_logprobs_is_an_error() -> None:
    logits = torch.randn(2, 4, 11)
    with pytest.raises(ValueError, match="no ref_logprobs"):
        _run(GrpoLoss(AlgorithmConfig(kl_coef=0.05), TEMPERATURE), logits, _batch(logits, ref_shift=None))


def test_entropy_bonus_uses_the_tempered_distribution_at_response_tokens() -> None:
    logits = torch.randn(2, 4, 11, requires_grad=True)
    batch = _batch(logits, ref_shift=None)
    out = _run(GrpoLoss(AlgorithmConfig(entropy_coef=0.01), TEMPERATURE), logits, batch)
    ent = entropy_from_logits(logits[:, :-1].detach(), TEMPERATURE)  # position t-1 predicts token t
    per_seq = [ent[0, 1:3].mean(), ent[1, 1]]  # response tokens 2, 3 and 2 (mean per sequence, then mean)
    expected = float(sum(per_seq)) / 2
    token_mean = float((ent[0, 1] + ent[0, 2] + ent[1, 1]) / 3)
    assert out.metrics[names.TRAIN_ENTROPY] == pytest.approx(token_mean, rel=1e-5)
    assert out.loss.item() == pytest.approx(-0.01 * expected, rel=1e-5)
    out.loss.backward()  # the bonus is differentiable through the logits
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_old_from_scores_is_the_loss_with_the_forwards_own_logprobs_as_old() -> None:
    """An RL step's first update takes its old log-probs from its own forward (no scoring pass): the same loss,
    gradient and statistics as a batch carrying those log-probs; the batch must then carry none (and must
    carry them otherwise), so a caller that mixes the two up is told."""
    logits = torch.randn(2, 4, 11)
    scored = _batch(logits, ref_shift=None)
    scored.advantages = torch.tensor([1.0, -0.5])
    scored.rollout_logprobs = scored.old_logprobs - 0.1 * torch.rand(2, 4)  # TIS weights != 1
    unscored = TokenBatch(**{**scored.tensors(), "old_logprobs": None})
    outs, grads = [], []
    for loss, batch in ((GrpoLoss(AlgorithmConfig(), TEMPERATURE), scored),
                        (GrpoLoss(AlgorithmConfig(), TEMPERATURE, old_from_scores=True), unscored)):  # fmt: skip
        x = logits.clone().requires_grad_()
        outs.append(_run(loss, x, batch))
        outs[-1].loss.backward()
        grads.append(x.grad)
    assert outs[0].loss.item() == outs[1].loss.item() != 0.0
    assert torch.equal(grads[0], grads[1])
    assert {k: float(v) for k, v in outs[0].metrics.items()} == {
        k: float(v) for k, v in outs[1].metrics.items()
    }
    assert float(outs[1].metrics[names.TRAIN_RATIO_MEAN]) == 1.0
    with pytest.raises(ValueError, match="old_logprobs unless old_from_scores"):
        _run(GrpoLoss(AlgorithmConfig(), TEMPERATURE, old_from_scores=True), logits, scored)
    with pytest.raises(ValueError, match="old_logprobs unless old_from_scores"):
        _run(GrpoLoss(AlgorithmConfig(), TEMPERATURE), logits, unscored)
