"""GRPO advantages and zero-spread detection against hand-computed values."""

import math

import pytest
import torch

from infir2_rl.algo.advantages import grpo_advantages, zero_spread_groups


def test_binary_group_unbiased_std() -> None:
    # Group [1, 0, 0, 0]: mean 0.25, deviations [.75, -.25, -.25, -.25],
    # unbiased var = (.5625 + 3 * .0625) / 3 = .25, std = .5 -> [1.5, -.5, -.5, -.5].
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-7)


def test_eps_is_added_to_std() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.5)
    # std .5 + eps .5 = 1 -> the plain deviations.
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]), rtol=0, atol=1e-7)


def test_several_groups_flat_and_2d_layouts_agree() -> None:
    # Group 0: [0, 2, 4, 6] mean 3, deviations [-3, -1, 1, 3], unbiased var 20/3.
    # Group 1: all equal -> exactly 0. Group 2: [1, 0, 0, 0] as above.
    rewards = [[0.0, 2.0, 4.0, 6.0], [0.7, 0.7, 0.7, 0.7], [1.0, 0.0, 0.0, 0.0]]
    s = math.sqrt(20.0 / 3.0)
    expected = torch.tensor([-3 / s, -1 / s, 1 / s, 3 / s, 0, 0, 0, 0, 1.5, -0.5, -0.5, -0.5])
    flat = grpo_advantages(torch.tensor(rewards).reshape(-1), group_size=4, eps=0.0)
    two_d = grpo_advantages(torch.tensor(rewards), group_size=4, eps=0.0)
    assert flat.shape == (12,) and two_d.shape == (12,)
    torch.testing.assert_close(flat, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(two_d, expected, rtol=0, atol=1e-6)


def test_mean_only_baseline() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0]), group_size=2, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0]), rtol=0, atol=1e-7)


def test_zero_spread_group_is_exactly_zero() -> None:
    # With eps = 0 a flat group is 0 / 0 = NaN unless it is special-cased; the contract is exact zeros
    # for every eps, so that a flat group can never inject NaN or noise into the loss.
    for eps in (0.0, 1e-6):
        adv = grpo_advantages(torch.full((16,), 0.1), group_size=16, eps=eps)
        assert torch.equal(adv, torch.zeros(16))


def test_bool_and_int_rewards() -> None:
    adv = grpo_advantages(torch.tensor([True, False]), group_size=2, eps=0.0)
    # mean .5, unbiased std of [1, 0] = sqrt(.5) -> +-.5 / sqrt(.5) = +-sqrt(.5)
    torch.testing.assert_close(adv, torch.tensor([math.sqrt(0.5), -math.sqrt(0.5)]), rtol=0, atol=1e-7)
    assert adv.dtype == torch.float32
    assert grpo_advantages(torch.tensor([2, 2]), group_size=2).tolist() == [0.0, 0.0]


def test_zero_spread_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    assert zero_spread_groups(rewards, 2).tolist() == [True, False, True, False]
    assert zero_spread_groups(rewards.reshape(2, 4), 4).tolist() == [False, False]


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(4), 1, "group_size=1"),
        (torch.zeros(5), 2, "multiple of group_size"),
        (torch.zeros(2, 3), 2, "second dimension"),
        (torch.zeros(2, 2, 2), 2, "dimensions"),
        (torch.zeros(0), 2, "multiple of group_size"),
    ],
)
def test_bad_layouts_raise(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size)
