"""Rewards: math answer checking (math-verify, guarded by a killable worker) and the reward protocol."""

from infir2_rl.reward.math import MathReward, RewardStats, extract_final_answer, math_reward, reward_stats
from infir2_rl.reward.protocol import RewardFn, load_reward_fn, score_batch

__all__ = [
    "MathReward",
    "RewardFn",
    "RewardStats",
    "extract_final_answer",
    "load_reward_fn",
    "math_reward",
    "reward_stats",
    "score_batch",
]
