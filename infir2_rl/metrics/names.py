"""Metric names shared by the producers (SFT/RL stages, weight sync) and the run report.

A name is `group/what_unit`. The same string is the key in metrics.jsonl and the TensorBoard tag;
the Ray/Prometheus name is derived from it (`train/loss` -> `infir2_train_loss`, which Ray exports
as `ray_infir2_train_loss`).
"""

# Trainer: mean per-token loss of the step, global gradient norm before clipping, learning rate.
TRAIN_LOSS = "train/loss"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_LR = "train/lr"
# Steps whose gradient norm was NaN/inf and were skipped, cumulative.
TRAIN_SKIPPED_STEPS = "train/skipped_steps"
# Mean per-token entropy of the policy on the trained tokens.
TRAIN_ENTROPY = "train/entropy"

# Speed and memory of the trainer.
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_STEP_TIME_S = "perf/step_time_s"
PERF_PEAK_MEMORY_GB = "perf/peak_memory_gb"

# Rollout batch: rewards, lengths (tokens), fraction cut at the max length, sampling speed.
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_REWARD_STD = "rollout/reward_std"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len_mean"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
# Reward answers killed at the math-verify deadline during the step.
REWARD_TIMEOUTS = "reward/timeouts"

# Train/rollout mismatch of the same tokens: |logp_train - logp_rollout| mean and max, K3 estimate of
# KL(rollout || train), min/max of the importance ratio, fraction of tokens where TIS clipped the
# ratio, fraction of tokens (or sequences) MIS masked out.
MISMATCH_ABS_LOGP_DIFF_MEAN = "mismatch/abs_logp_diff_mean"
MISMATCH_ABS_LOGP_DIFF_MAX = "mismatch/abs_logp_diff_max"
MISMATCH_K3 = "mismatch/k3"
MISMATCH_IS_RATIO_MIN = "mismatch/is_ratio_min"
MISMATCH_IS_RATIO_MAX = "mismatch/is_ratio_max"
MISMATCH_TIS_CLIP_FRAC = "mismatch/tis_clip_frac"
MISMATCH_MIS_MASK_FRAC = "mismatch/mis_mask_frac"
# The same samples scored by the trainer with its FP8 linears off (metrics.dense_trainer_mismatch): the
# mismatch a bf16_train_fp8_rollout trainer would see against the same FP8 engine, measured in the same run.
MISMATCH_DENSE_ABS_LOGP_DIFF_MEAN = "mismatch_dense_trainer/abs_logp_diff_mean"
MISMATCH_DENSE_ABS_LOGP_DIFF_MAX = "mismatch_dense_trainer/abs_logp_diff_max"
MISMATCH_DENSE_K3 = "mismatch_dense_trainer/k3"

# Held-out evaluation: answer accuracy (math reward on greedy answers) and loss.
EVAL_ACCURACY = "eval/accuracy"
EVAL_LOSS = "eval/loss"

# Seconds to push the trainer's weights to every engine (including the read-back check).
WEIGHT_SYNC_PUSH_S = "weight_sync/push_s"

# Phase times from `PhaseTimer.as_metrics()`: `time/<phase>_s`, e.g. `time/rollout_s`.
TIME_PREFIX = "time/"
