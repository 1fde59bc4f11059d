"""policy_loss against hand-computed values: PPO clip, TIS, MIS, KL, entropy, reductions, gradients."""

import math

import pytest
import torch

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.losses import kl_estimate, policy_loss

NO_TIS = AlgorithmConfig(tis=False)  # plain clipped surrogate (configs are never mutated)


def _ln(values: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(v) for v in values]])


def _case(ratios: list[float], is_ratios: list[float] | None = None) -> tuple[torch.Tensor, ...]:
    """One sequence with exp(logp - logp_old) = ratios and exp(logp_old - logp_rollout) = is_ratios."""
    logp_old = torch.full((1, len(ratios)), -1.0)
    logp = (logp_old + _ln(ratios)).requires_grad_(True)
    is_r = is_ratios if is_ratios is not None else [1.0] * len(ratios)
    logp_rollout = logp_old - _ln(is_r)
    return logp, logp_old, logp_rollout, torch.ones(1, len(ratios))


@pytest.mark.parametrize(
    ("adv", "expected_loss", "expected_grad"),
    [
        # A = +1: pg = max(-r, -clip(r, .8, 1.28)): r=1.5 -> -1.28 (clipped, no grad), 1.1 -> -1.1,
        # 0.7 -> -0.7 (the low clip does not bind for A > 0). Gradient of pg/3 wrt logp: -A r / 3.
        (1.0, (-1.28 - 1.1 - 0.7) / 3, [0.0, -1.1 / 3, -0.7 / 3]),
        # A = -1: pg = max(r, clip(r)): 1.5 -> 1.5, 1.1 -> 1.1, 0.7 -> 0.8 (clipped, no grad).
        (-1.0, (1.5 + 1.1 + 0.8) / 3, [1.5 / 3, 1.1 / 3, 0.0]),
    ],
)
def test_clipped_surrogate_asymmetric_bounds(
    adv: float, expected_loss: float, expected_grad: list[float]
) -> None:
    logp, logp_old, logp_rollout, mask = _case([1.5, 1.1, 0.7])
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([adv]), mask, NO_TIS)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert stats.loss == pytest.approx(expected_loss, abs=1e-6)
    assert stats.pg_clip_frac == pytest.approx(1 / 3)
    assert stats.ratio_mean == pytest.approx((1.5 + 1.1 + 0.7) / 3, abs=1e-6)
    assert stats.tis_weight_mean == 1.0 and stats.tis_clip_frac == 0.0 and stats.mis_mask_frac == 0.0
    assert stats.kl is None and stats.entropy is None and stats.num_tokens == 3 and stats.num_samples == 1
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([expected_grad]), rtol=0, atol=1e-6)


def test_clip_boundaries_are_1_28_and_0_8() -> None:
    # Just inside the clip range the ratio passes through, just outside it is clipped.
    for r, adv, clipped in [
        (1.279, 1.0, False),
        (1.281, 1.0, True),
        (0.801, -1.0, False),
        (0.799, -1.0, True),
    ]:
        logp, logp_old, logp_rollout, mask = _case([r])
        _, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([adv]), mask, NO_TIS)
        assert stats.pg_clip_frac == (1.0 if clipped else 0.0), (r, adv)


def test_tis_weight_clamped_at_2_and_detached() -> None:
    # ratio 1 everywhere, A = +1 -> pg = -1 per token; TIS ratios [3, 1, .5] -> weights [2, 1, .5].
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0, 1.0], is_ratios=[3.0, 1.0, 0.5])
    logp_old.requires_grad_(True)
    logp_rollout.requires_grad_(True)
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([1.0]), mask, AlgorithmConfig())
    assert loss.item() == pytest.approx(-(2 + 1 + 0.5) / 3, abs=1e-6)
    assert stats.tis_weight_mean == pytest.approx(3.5 / 3, abs=1e-6)
    assert stats.tis_clip_frac == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -1 / 3, -0.5 / 3]]), rtol=0, atol=1e-6)
    # The weight is a constant: no gradient reaches the old or the rollout log-probs.
    assert logp_old.grad is None and logp_rollout.grad is None


def test_tis_lower_bound() -> None:
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0, 1.0], is_ratios=[3.0, 1.0, 0.5])
    cfg = AlgorithmConfig(tis_low=0.6)
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([1.0]), mask, cfg)
    assert loss.item() == pytest.approx(-(2 + 1 + 0.6) / 3, abs=1e-6)
    assert stats.tis_clip_frac == pytest.approx(2 / 3)


def test_clip_and_tis_together_gradient() -> None:
    # ratios [1.5, 1.1, .7], A = +1, TIS weights [2, 1, .5]:
    # loss = (-1.28 * 2 - 1.1 * 1 - .7 * .5) / 3; grads = -A r w / 3 where unclipped, 0 where clipped.
    logp, logp_old, logp_rollout, mask = _case([1.5, 1.1, 0.7], is_ratios=[3.0, 1.0, 0.5])
    loss, _ = policy_loss(logp, logp_old, logp_rollout, torch.tensor([1.0]), mask, AlgorithmConfig())
    assert loss.item() == pytest.approx(-4.01 / 3, abs=1e-6)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1 / 3, -0.35 / 3]]), rtol=0, atol=1e-6)


def _mis_batch() -> tuple[torch.Tensor, ...]:
    # Three sequences of two tokens, train/rollout ratios per token:
    #   seq0 [1.5, 1.5]  token: keep both   product 2.25: out   geometric 1.5: in
    #   seq1 [3.0, 0.6]  token: keep 2nd    product 1.8: in     geometric 1.34: in
    #   seq2 [4.0, 1.8]  token: keep 2nd    product 7.2: out    geometric 2.68: out
    logp_old = torch.full((3, 2), -2.0)
    logp_rollout = logp_old - torch.log(torch.tensor([[1.5, 1.5], [3.0, 0.6], [4.0, 1.8]]))
    return logp_old.clone().requires_grad_(True), logp_old, logp_rollout, torch.ones(3, 2)


@pytest.mark.parametrize(
    ("level", "expected_loss", "expected_mask_frac"),
    [
        # ratio 1 -> pg = -A with A = [1, 2, 3]; rejected tokens contribute 0 but stay in the denominators.
        ("token", (-1 + (-2 / 2) + (-3 / 2)) / 3, 2 / 6),
        ("sequence", (0 - 2 + 0) / 3, 4 / 6),
        ("geometric", (-1 - 2 + 0) / 3, 2 / 6),
    ],
)
def test_mis_levels(level: str, expected_loss: float, expected_mask_frac: float) -> None:
    logp, logp_old, logp_rollout, mask = _mis_batch()
    adv = torch.tensor([1.0, 2.0, 3.0])
    cfg = AlgorithmConfig(tis=False, mis=level)  # type: ignore[arg-type]
    loss, stats = policy_loss(logp, logp_old, logp_rollout, adv, mask, cfg)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert stats.mis_mask_frac == pytest.approx(expected_mask_frac)
    assert stats.tis_weight_mean == 1.0


def test_mis_token_with_tis_weights_surviving_tokens() -> None:
    # Same batch, token level, TIS on: survivors are seq0 (1.5, 1.5), seq1 2nd (.6), seq2 2nd (1.8).
    logp, logp_old, logp_rollout, mask = _mis_batch()
    cfg = AlgorithmConfig(mis="token")
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([1.0, 2.0, 3.0]), mask, cfg)
    expected = (-1 * 1.5 + (-2 * 0.6) / 2 + (-3 * 1.8) / 2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # The TIS statistic is over all valid tokens: weights [1.5, 1.5, 2 (clamped 3), .6, 2 (clamped 4), 1.8].
    assert stats.tis_weight_mean == pytest.approx((1.5 + 1.5 + 2 + 0.6 + 2 + 1.8) / 6, abs=1e-6)
    assert stats.tis_clip_frac == pytest.approx(2 / 6)


def test_padding_with_nan_and_inf_and_both_reductions() -> None:
    # seq0 has 3 valid tokens, seq1 has 1; padding holds garbage that must not leak anywhere.
    nan, inf = float("nan"), float("inf")
    logp_old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, nan, -inf]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -inf, nan]], requires_grad=True)
    logp_rollout = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, inf, -inf]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [3.0, nan, inf]])
    for reduction, expected in [("sample_token_mean", (-1 - 3) / 2), ("token_mean", (-1 * 3 - 3) / 4)]:
        cfg = AlgorithmConfig(loss_reduction=reduction)  # type: ignore[arg-type]
        loss, stats = policy_loss(logp, logp_old, logp_rollout, adv, mask, cfg)
        assert loss.item() == pytest.approx(expected, abs=1e-6), reduction
        assert stats.num_tokens == 4 and stats.ratio_mean == pytest.approx(1.0)
        logp.grad = None
        loss.backward()
        assert logp.grad is not None and torch.isfinite(logp.grad).all()
        assert logp.grad[1, 1] == 0 and logp.grad[1, 2] == 0


@pytest.mark.parametrize("reduction", ["sample_token_mean", "token_mean"])
def test_denominator_makes_micro_batches_add_up(reduction: str) -> None:
    torch.manual_seed(0)
    logp_old = -torch.rand(4, 5) * 3
    logp = (logp_old + 0.3 * torch.randn(4, 5)).requires_grad_(True)
    logp_rollout = logp_old + 0.5 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    cfg = AlgorithmConfig(loss_reduction=reduction)  # type: ignore[arg-type]
    full, _ = policy_loss(logp, logp_old, logp_rollout, adv, mask, cfg)
    denom = 4.0 if reduction == "sample_token_mean" else float(mask.sum())
    parts = [
        policy_loss(logp[s], logp_old[s], logp_rollout[s], adv[s], mask[s], cfg, denominator=denom)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=0, atol=1e-6)


def test_kl_k3_value_gradient_and_stat() -> None:
    # A = 0 silences the policy term. d = logp - logp_ref = [.5, -.5, 0];
    # k3 = e^-d - 1 + d = [e^-.5 - .5, e^.5 - 1.5, 0]; dk3/dd = 1 - e^-d.
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0, 1.0])
    logp_ref = logp.detach() - torch.tensor([[0.5, -0.5, 0.0]])
    cfg = AlgorithmConfig(kl_coef=0.1)
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([0.0]), mask, cfg, logp_ref=logp_ref)
    k3 = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]
    assert stats.kl == pytest.approx(sum(k3) / 3, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 3, abs=1e-7)
    loss.backward()
    assert logp.grad is not None
    expected = [0.1 * (1 - math.exp(-0.5)) / 3, 0.1 * (1 - math.exp(0.5)) / 3, 0.0]
    torch.testing.assert_close(logp.grad, torch.tensor([expected]), rtol=0, atol=1e-7)


def test_kl_estimators_and_coefficient_zero() -> None:
    d = torch.tensor([0.5, -0.5, 0.0])
    torch.testing.assert_close(kl_estimate(d, torch.zeros(3), "k1"), d)
    torch.testing.assert_close(kl_estimate(d, torch.zeros(3), "k2"), torch.tensor([0.125, 0.125, 0.0]))
    k3 = torch.tensor([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0])
    torch.testing.assert_close(kl_estimate(d, torch.zeros(3), "k3"), k3)
    torch.testing.assert_close(kl_estimate(d, torch.zeros(3), "low_var_kl"), k3)
    # low_var_kl clamps: d = -30 -> d clamped to -20, k3 = e^20 - 21 clamped to 10; d = 30 -> 20 - 1 + e^-20 -> 10.
    far = torch.tensor([-30.0, 30.0, -2.0])
    torch.testing.assert_close(
        kl_estimate(far, torch.zeros(3), "low_var_kl"), torch.tensor([10.0, 10.0, math.exp(2.0) - 3.0])
    )
    assert kl_estimate(far, torch.zeros(3), "k3")[0].item() > 1e12  # plain k3 is unbounded
    # With kl_coef = 0 a given reference is only reported, never added to the loss.
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0, 1.0])
    cfg = AlgorithmConfig(kl_type="k2")
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([0.0]), mask, cfg, logp_ref=logp - d)
    assert loss.item() == 0.0 and stats.kl == pytest.approx(0.25 / 3, abs=1e-7)
    with pytest.raises(ValueError, match="logp_ref is None"):
        policy_loss(logp, logp_old, logp_rollout, torch.tensor([0.0]), mask, AlgorithmConfig(kl_coef=0.1))


def test_entropy_bonus() -> None:
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0, 1.0])
    entropy = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    cfg = AlgorithmConfig(entropy_coef=0.01)
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([0.0]), mask, cfg, entropy=entropy)
    assert loss.item() == pytest.approx(-0.02, abs=1e-7) and stats.entropy == pytest.approx(2.0)
    loss.backward()
    assert entropy.grad is not None
    torch.testing.assert_close(entropy.grad, torch.full((1, 3), -0.01 / 3))
    with pytest.raises(ValueError, match="entropy is None"):
        policy_loss(logp, logp_old, logp_rollout, torch.tensor([0.0]), mask, cfg)


@pytest.mark.parametrize("reduction", ["sample_token_mean", "token_mean"])
def test_a_micro_batch_without_response_tokens_adds_zero_loss_and_no_statistics(reduction: str) -> None:
    # SGLang answers prompts it refuses with empty responses (engines/sglang/protocol.refused_samples): a
    # micro-batch of them once stopped the RL step with "no valid token".
    logp = torch.full((2, 3), float("nan")).requires_grad_()  # padding may hold anything
    cfg = AlgorithmConfig(loss_reduction=reduction)  # type: ignore[arg-type]
    zeros = torch.zeros(2, 3)
    loss, stats = policy_loss(logp, zeros, zeros, torch.zeros(2), zeros, cfg, denominator=4.0)
    assert loss.item() == 0.0 and stats.num_tokens == 0 and stats.num_samples == 2
    loss.backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros(2, 3))


def test_user_errors() -> None:
    logp, logp_old, logp_rollout, mask = _case([1.0, 1.0])
    adv = torch.tensor([1.0])
    with pytest.raises(ValueError, match="logp_rollout is None"):
        policy_loss(logp, logp_old, None, adv, mask, AlgorithmConfig())
    assert policy_loss(logp, logp_old, None, adv, mask, NO_TIS)[1].num_tokens == 2
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, logp_old, logp_rollout, torch.ones(3), mask, AlgorithmConfig())
    with pytest.raises(TypeError):
        AlgorithmConfig(0.2)  # type: ignore[misc]
    for bad, field in (
        ({"tis_high": 0.0}, "tis_high"),
        ({"mis": "bogus"}, "mis"),
        ({"eps_clip_low": 1.0}, "eps_clip_low"),
        ({"mis": "token", "mis_low": 3.0}, "mis_low"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_type": "k4"}, "kl_type"),
        ({"mis_veto": 1e-4}, "mis_veto"),  # removed knob: unknown keys are errors, not silent no-ops
    ):
        with pytest.raises(ValueError, match=field):
            AlgorithmConfig(**bad)  # type: ignore[arg-type]


def test_bf16_inputs_are_computed_in_float32() -> None:
    # One bf16 step at magnitude 1 is 2^-7: the ratio exp(2^-7) = 1.0078431 would round to 1.0078125 in bf16.
    logp = torch.tensor([[-1.0]], dtype=torch.bfloat16, requires_grad=True)
    logp_old = torch.tensor([[-1.0 - 2**-7]], dtype=torch.bfloat16)
    loss, _ = policy_loss(logp, logp_old, None, torch.tensor([1.0]), torch.ones(1, 1), NO_TIS)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-math.exp(2**-7), abs=1e-6)
    loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("level", "expected_loss", "expected_mask_frac"),
    [
        # seq0 ratios [.3, 1]: token keeps the 2nd; product .3 < .5 out; geometric sqrt(.3) = .548 in.
        # seq1 ratios [.6, .6]: token keeps both; product .36 out; geometric .6 in. A = [1, 2], ratio 1.
        ("token", (-1 / 2 - 2) / 2, 1 / 4),
        ("sequence", 0.0, 1.0),
        ("geometric", (-1 - 2) / 2, 0.0),
    ],
)
def test_mis_lower_bound(level: str, expected_loss: float, expected_mask_frac: float) -> None:
    logp_old = torch.full((2, 2), -2.0)
    logp_rollout = logp_old - torch.log(torch.tensor([[0.3, 1.0], [0.6, 0.6]]))
    logp = logp_old.clone().requires_grad_(True)
    cfg = AlgorithmConfig(tis=False, mis=level)  # type: ignore[arg-type]
    loss, stats = policy_loss(logp, logp_old, logp_rollout, torch.tensor([1.0, 2.0]), torch.ones(2, 2), cfg)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert stats.mis_mask_frac == pytest.approx(expected_mask_frac)
