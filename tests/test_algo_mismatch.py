"""mismatch_metrics against hand-computed values and the KL(rollout || train) convention of K3."""

import math

import pytest
import torch

from infir2_rl.algo.mismatch import mismatch_metrics


def test_hand_values_and_masked_tokens_excluded() -> None:
    # r = logp_train - logp_rollout = [.1, -.2, 0] on valid tokens; the padded token differs by 100.
    logp_rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    logp_train = logp_rollout + torch.tensor([[0.1, -0.2, 0.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    s = mismatch_metrics(logp_train, logp_rollout, mask, tis_low=0.9, tis_high=1.05)
    e1, e2 = math.exp(0.1), math.exp(-0.2)
    assert s.num_tokens == 3
    assert s.abs_logp_diff_mean == pytest.approx(0.1, abs=1e-12)
    assert s.abs_logp_diff_max == pytest.approx(0.2, abs=1e-12)
    assert s.k3 == pytest.approx(((e1 - 1.1) + (e2 - 0.8)) / 3, abs=1e-12)
    assert s.is_ratio_min == pytest.approx(e2, abs=1e-12)
    assert s.is_ratio_max == pytest.approx(e1, abs=1e-12)
    assert s.is_ratio_mean == pytest.approx((e1 + e2 + 1) / 3, abs=1e-12)
    # e^.1 = 1.105 > 1.05 and e^-.2 = .819 < .9 are clipped; 1.0 is not.
    assert s.tis_clip_frac == pytest.approx(2 / 3)


def test_k3_estimates_kl_rollout_to_train() -> None:
    # Tokens drawn from mu in exact proportions (mu = [7/8, 1/8] -> 7 and 1 of 8 tokens); the trainer's
    # pi = [1/2, 1/2]. Then the mean of k3 over the tokens equals
    # E_mu[pi/mu - 1 - log(pi/mu)] = KL(mu || pi) = sum mu log(mu / pi) exactly.
    mu = [0.875, 0.125]
    pi = [0.5, 0.5]
    outcomes = [0] * 7 + [1]
    logp_rollout = torch.tensor([[math.log(mu[i]) for i in outcomes]], dtype=torch.float64)
    logp_train = torch.tensor([[math.log(pi[i]) for i in outcomes]], dtype=torch.float64)
    kl_mu_pi = 0.875 * math.log(1.75) + 0.125 * math.log(0.25)  # = 0.3164
    s = mismatch_metrics(logp_train, logp_rollout, torch.ones(1, 8))
    assert s.k3 == pytest.approx(kl_mu_pi, abs=1e-12)
    # The reverse direction KL(pi || mu) = .5 ln(.5/.875) + .5 ln 4 = 0.4133 differs: the convention is pinned.
    kl_pi_mu = 0.5 * math.log(0.5 / 0.875) + 0.5 * math.log(4.0)
    assert abs(kl_pi_mu - s.k3) > 0.05
    assert s.is_ratio_mean == pytest.approx(1.0, abs=1e-12)  # E_mu[pi / mu] = 1


def test_k3_small_differences_keep_precision_from_float32_inputs() -> None:
    logp_train = torch.tensor([[-2.0]], dtype=torch.float32)
    logp_rollout = torch.tensor([[-2.001]], dtype=torch.float32)
    r = float(logp_train.item()) - float(logp_rollout.item())  # exact difference of the float32 values
    expected = math.expm1(r) - r  # ~5e-7; float32 arithmetic would be off by ~10%
    s = mismatch_metrics(logp_train, logp_rollout, torch.ones(1, 1))
    assert s.k3 == pytest.approx(expected, rel=1e-9)


def test_errors() -> None:
    with pytest.raises(ValueError, match="no valid token"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shapes must match"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="tis_high"):
        mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), tis_low=2.0, tis_high=1.0)
