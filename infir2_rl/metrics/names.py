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
# RL: KL estimate of the policy against the frozen reference model (algorithm.kl_coef > 0).
TRAIN_KL = "train/kl"
# RL policy loss parts: clipped surrogate, fraction of tokens the PPO clip bound, mean importance ratio
# to the old policy, mean TIS weight; optimizer steps taken per rollout batch.
TRAIN_PG_LOSS = "train/pg_loss"
TRAIN_PG_CLIP_FRAC = "train/pg_clip_frac"
TRAIN_RATIO_MEAN = "train/ratio_mean"
TRAIN_TIS_WEIGHT_MEAN = "train/tis_weight_mean"
TRAIN_UPDATES_PER_ROLLOUT = "train/updates_per_rollout"

# Speed and memory of the trainer.
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_STEP_TIME_S = "perf/step_time_s"
PERF_PEAK_MEMORY_GB = "perf/peak_memory_gb"
# RL: memory of each phase of a step, GiB (``metrics.logger.memory_gb``), the largest process of the role:
# the engines' peak CUDA allocation during the rollout (native engines; SGLang's lives in its server), the
# trainer's during scoring (old log-probs of later mini-batches, reference and dense log-probs: with none of them, as
# at one update per rollout, what stays allocated), training and the weight push; and what each
# process's allocator holds reserved at the phase's end. On CPU the peak is the RSS high-water mark and
# reserved 0. (The counters restart at each phase, so in RL stages perf/peak_memory_gb is the train phase's.)
MEMORY_ROLLOUT_PEAK_GB = "memory/rollout_peak_gb"
MEMORY_ROLLOUT_RESERVED_GB = "memory/rollout_reserved_gb"
MEMORY_SCORE_PEAK_GB = "memory/score_peak_gb"
MEMORY_SCORE_RESERVED_GB = "memory/score_reserved_gb"
MEMORY_TRAIN_PEAK_GB = "memory/train_peak_gb"
MEMORY_TRAIN_RESERVED_GB = "memory/train_reserved_gb"
MEMORY_SYNC_PEAK_GB = "memory/sync_peak_gb"
MEMORY_SYNC_RESERVED_GB = "memory/sync_reserved_gb"
# Colocated on GPUs: 1 when, after this step's push, a trainer rank dropped its layer graphs so that the engine's
# KV cache for the next rollout fits (``TorchTrainer.make_room``; the next step captures them again), else 0.
MEMORY_TRAINER_GRAPHS_DROPPED = "memory/trainer_graphs_dropped"

# Rollout batch: rewards, lengths (tokens), fraction cut at the max length, sampling speed.
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_REWARD_STD = "rollout/reward_std"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len_mean"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
# KV-cache slots the rollout's rows wanted and an engine did not get for memory (largest engine; native engines):
# those rows took turns instead of decoding at once, and the rollout ran longer. 0 when every row fit.
ROLLOUT_KV_SLOTS_SHORT = "rollout/kv_slots_short"
# Longest response, fraction of samples aborted, reward over every sampled group (before dynamic sampling),
# groups kept / dropped (no reward spread) / filled (kept anyway to complete the batch) / left over, sampling
# rounds, and the seconds spent generating and scoring.
ROLLOUT_RESPONSE_LEN_MAX = "rollout/response_len_max"
ROLLOUT_ABORTED_FRAC = "rollout/aborted_frac"
ROLLOUT_REWARD_MEAN_ALL = "rollout/reward_mean_all"
ROLLOUT_KEPT_GROUPS = "rollout/kept_groups"
ROLLOUT_DROPPED_GROUPS = "rollout/dropped_groups"
ROLLOUT_FILLED_GROUPS = "rollout/filled_groups"
ROLLOUT_SURPLUS_GROUPS = "rollout/surplus_groups"
ROLLOUT_ROUNDS = "rollout/rounds"
ROLLOUT_GEN_TIME_S = "rollout/gen_time_s"
ROLLOUT_SCORE_TIME_S = "rollout/score_time_s"
# Seconds the engines spent capturing CUDA graphs of the decode step since the previous step's reading: the
# step's rollout and any evaluation after the previous step (largest engine; only engines that capture, the
# native one on a GPU). A colocated engine captures again after every release, without warm-ups for shapes its
# generate thread warmed up before (engines/native/cuda_graphs.py).
ROLLOUT_GRAPH_CAPTURE_S = "rollout/graph_capture_s"
# Mean |advantage| of the batch (0 when every group's rewards are equal).
ROLLOUT_ADVANTAGE_ABS_MEAN = "rollout/advantage_abs_mean"
# Rollout engines found dead and replaced, and rollouts retried after that, since this run of the stage started
# (``stages.recovery``).
ROLLOUT_ENGINE_RESTARTS = "rollout/engine_restarts"
ROLLOUT_STEP_RETRIES = "rollout/step_retries"
# Reward answers killed at the math-verify deadline during the step (a reward with counters:
# ``reward.protocol.counters``, the math reward's).
REWARD_TIMEOUTS = "reward/timeouts"
# Reward comparisons whose math-verify worker failed or died during the step (scored 0; as above).
REWARD_ERRORS = "reward/errors"

# Train/rollout mismatch of the same tokens (``algo.mismatch.MismatchStats.as_metrics(MISMATCH)``): |logp_train - logp_rollout| mean and max, K3 estimate of
# KL(rollout || train), min/max of the importance ratio, fraction of tokens where TIS clipped the
# ratio, fraction of tokens (or sequences) MIS masked out.
MISMATCH = "mismatch"
MISMATCH_ABS_LOGP_DIFF_MEAN = f"{MISMATCH}/abs_logp_diff_mean"
MISMATCH_ABS_LOGP_DIFF_MAX = f"{MISMATCH}/abs_logp_diff_max"
MISMATCH_K3 = f"{MISMATCH}/k3"
MISMATCH_IS_RATIO_MIN = f"{MISMATCH}/is_ratio_min"
MISMATCH_IS_RATIO_MAX = f"{MISMATCH}/is_ratio_max"
MISMATCH_IS_RATIO_MEAN = f"{MISMATCH}/is_ratio_mean"
MISMATCH_TIS_CLIP_FRAC = f"{MISMATCH}/tis_clip_frac"
MISMATCH_MIS_MASK_FRAC = f"{MISMATCH}/mis_mask_frac"
# The same samples scored by the trainer with its FP8 linears off (metrics.dense_trainer_mismatch): the
# mismatch a bf16_train_fp8_rollout trainer would see against the same FP8 engine, measured in the same run.
MISMATCH_DENSE = "mismatch_dense_trainer"
MISMATCH_DENSE_ABS_LOGP_DIFF_MEAN = f"{MISMATCH_DENSE}/abs_logp_diff_mean"
MISMATCH_DENSE_ABS_LOGP_DIFF_MAX = f"{MISMATCH_DENSE}/abs_logp_diff_max"
MISMATCH_DENSE_K3 = f"{MISMATCH_DENSE}/k3"

# Held-out evaluation: answer accuracy (math reward on greedy answers) and loss.
EVAL_ACCURACY = "eval/accuracy"
EVAL_LOSS = "eval/loss"
# Mean length of the greedy held-out answers (RL evaluation), tokens.
EVAL_RESPONSE_LEN_MEAN = "eval/response_len_mean"
# RL held-out evaluation: the fraction of greedy answers cut at rollout.max_response_len (unscored endings).
EVAL_TRUNCATED_FRAC = "eval/truncated_frac"

# Seconds to push the trainer's weights to every engine (the transfer; not the self-check after it).
WEIGHT_SYNC_PUSH_S = "weight_sync/push_s"
# Seconds of the post-push self-check (weight versions of every engine, digests of a few layers of one).
WEIGHT_SYNC_CHECK_S = "weight_sync/check_s"
# Bytes one push sent (each engine receives all of them).
WEIGHT_SYNC_BYTES = "weight_sync/bytes"

# Phase times from `PhaseTimer.as_metrics()`: `time/<phase>_s`, e.g. `time/rollout_s`.
TIME_PREFIX = "time/"
