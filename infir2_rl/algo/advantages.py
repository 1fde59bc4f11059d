"""GRPO advantages: each answer is scored against the other answers to the same prompt.

GRPO (DeepSeekMath, arXiv 2402.03300) drops the value network: the G answers sampled for one prompt
form a group, and an answer's advantage is its reward minus the group's mean reward, optionally
divided by the group's standard deviation. Every token of the answer gets that same advantage.

Conventions (chosen to match slime, on which InfiR2 runs, and verl / TRL):
- The standard deviation is the *unbiased* sample std (Bessel's correction, divide by G - 1),
  i.e. ``torch.std`` with its default. With binary rewards and G = 16 it is sqrt(16/15) times the
  population std, so normalised advantages are ~3% smaller than with ``unbiased=False``.
- ``adv = (r - mean) / (std + eps)``: eps guards tiny spreads, it is not a clamp.
- A group whose rewards are all equal carries no learning signal; its advantages are set to
  exactly 0 (not "almost 0" from rounding of the mean). Dynamic sampling drops such groups
  before training; ``zero_spread_groups`` tells which ones.
- Rewards are laid out group-major: rewards[g * G + i] is sample i of prompt g.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _as_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Reshape rewards to (num_groups, group_size) in float64, validating the layout."""
    if group_size < 2:
        raise ValueError(
            f"group_size={group_size}: GRPO needs at least 2 samples per prompt; set it to >= 2."
        )
    if rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(
                f"rewards has shape {tuple(rewards.shape)} but group_size={group_size}: "
                "the second dimension must equal group_size."
            )
    elif rewards.dim() != 1:
        raise ValueError(
            f"rewards has {rewards.dim()} dimensions: pass a flat (num_groups*G,) or (num_groups, G) tensor."
        )
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} elements: it must be a non-zero multiple of group_size={group_size}."
        )
    # float64 so that the mean of G equal rewards is computed without visible rounding.
    return rewards.detach().to(torch.float64).reshape(-1, group_size)


def zero_spread_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool tensor (num_groups,): True where every reward in the group is identical.

    These groups have zero advantage under GRPO, so dynamic sampling drops them and
    oversamples other prompts to refill the batch.
    """
    groups = _as_groups(rewards, group_size)
    return groups.amax(dim=1) == groups.amin(dim=1)


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages, one per sample, returned flat with shape (num_groups * G,).

    Args:
        rewards: (num_groups * G,) or (num_groups, G), group-major. Any real or bool dtype.
        group_size: G, the number of samples per prompt (>= 2).
        normalize_std: divide by the group's unbiased std (GRPO); False gives the
            "Dr. GRPO" mean-only baseline.
        eps: added to the std before dividing.

    Returns:
        float32 tensor (or the rewards' floating dtype), flat. Zero-spread groups get exactly 0.
    """
    if eps < 0:
        raise ValueError(f"eps={eps}: must be >= 0.")
    groups = _as_groups(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    flat = groups.amax(dim=1) == groups.amin(dim=1)
    adv = torch.where(flat[:, None], torch.zeros_like(centred), centred)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.reshape(-1).to(out_dtype)
