"""RL and SFT algorithm pieces: small pure torch functions, unit-tested against hand-computed values."""

from infir2_rl.algo.advantages import grpo_advantages, zero_spread_groups
from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.logprobs import entropy_from_logits, token_logprobs
from infir2_rl.algo.losses import PolicyLossStats, kl_estimate, policy_loss
from infir2_rl.algo.mismatch import MismatchStats, mismatch_metrics
from infir2_rl.algo.sft_loss import sft_loss

__all__ = [
    "AlgorithmConfig",
    "MismatchStats",
    "PolicyLossStats",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_estimate",
    "mismatch_metrics",
    "policy_loss",
    "sft_loss",
    "token_logprobs",
    "zero_spread_groups",
]
