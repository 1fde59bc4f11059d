"""The GRPO RL stage: generate -> score -> advantages -> train -> sync -> log -> checkpoint.

    infir2-rl run configs/demo/rl_stage1.yaml

Each step the engines sample `n_samples_per_prompt` answers for `prompts_per_step` prompts with the
FP8 weights they were last sent (dynamic sampling drops groups with no reward spread and samples more).
The trainer then takes ``updates_per_rollout`` optimizer steps on consecutive slices of the rollout batch
(one when `trainer.global_batch_size` is the whole batch, the recipe's setting). Each needs the "old"
log-probs of its tokens: the trainer's, at the rollout temperature, in its own precision flow, under the
weights that sampled the batch. The first update runs on exactly those weights, so its own forward gives
them (the same bits a separate scoring pass gives, which it therefore skips); the rows of later updates
are scored before the first. Their gap to the engine's log-probs is the train/rollout mismatch, logged
every step and corrected by TIS in the loss. The new weights go to every engine (version = step) and a
few layers are read back and compared.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace

import torch

from infir2_rl.actors.ray_runtime import ensure_ray
from infir2_rl.algo.advantages import grpo_advantages
from infir2_rl.algo.loss_fns import GrpoLoss
from infir2_rl.algo.mismatch import mismatch_metrics
from infir2_rl.checkpoint import CheckpointManager, save_checkpoint
from infir2_rl.config import RlStageConfig, validate_paths
from infir2_rl.metrics import MetricsLogger, PhaseTimer, names
from infir2_rl.reward.protocol import load_reward_fn
from infir2_rl.rollout.batch import RolloutBatch, to_token_batches
from infir2_rl.stages.common import (
    CHECKPOINTS_DIR,
    StageResult,
    final_from_checkpoint,
    is_due,
    progress_bar,
    publish_final,
    resume_state,
    stage_run_dir,
    train_metrics,
)
from infir2_rl.stages.guards import SkipStreak, check_prompts_fill_step
from infir2_rl.stages.recovery import EngineRecovery
from infir2_rl.stages.rl_setup import RlActors, load_rl_data, start_rl_actors
from infir2_rl.types import PushStats, TokenBatch, TrainStats

log = logging.getLogger(__name__)


def run_rl_stage(cfg: RlStageConfig) -> StageResult:
    """Run (or resume) one RL stage to its last step; returns RUN_DIR/final and the last metrics."""
    validate_paths(cfg)  # bad paths and data fail here, before any actor starts
    reward_fn = load_reward_fn(cfg.rollout.reward)  # and a reward that does not import
    data = load_rl_data(cfg)
    check_prompts_fill_step(cfg, len(data.train))
    last_step = min(cfg.rollout.num_steps, cfg.trainer.max_steps or sys.maxsize)
    with stage_run_dir(cfg) as run_dir:
        ckpts = CheckpointManager(run_dir / CHECKPOINTS_DIR, cfg.checkpoint.keep_last)
        state, resumed = resume_state(ckpts, cfg.checkpoint.resume, len(data.train))
        if state.step >= last_step:
            assert resumed is not None
            log.warning(
                "RL stage %s: nothing to do: checkpoint at step %d of %d", cfg.name, state.step, last_step
            )
            final = final_from_checkpoint(
                cfg, resumed, run_dir, total_steps=last_step * cfg.updates_per_rollout
            )
            return StageResult(final, run_dir, steps_run=0, last_step=state.step, nothing_to_do=True)
        ensure_ray()  # after every check of the input: bad input fails in seconds, without Ray
        actors = start_rl_actors(
            cfg, data, reward_fn, total_steps=last_step * cfg.updates_per_rollout, resume_from=resumed,
            state=state,
        )  # fmt: skip
        loss_fn = GrpoLoss(cfg.algorithm, cfg.rollout.temperature)
        timer, summary, first = PhaseTimer(), dict[str, float](), state.step + 1
        recovery, streak = EngineRecovery(cfg, actors), SkipStreak(cfg.trainer.max_consecutive_skips)
        m = cfg.metrics
        try:
            with (
                MetricsLogger(
                    run_dir, tensorboard=m.tensorboard, ray_metrics=m.ray_metrics, stage=cfg.name
                ) as logger,
                progress_bar(cfg, last_step) as bar,
            ):
                bar.update(state.step)
                if resumed is None and data.test:  # the starting point of the accuracy curve
                    logger.log(0, recovery.run(lambda: actors.evaluate(data.test), "evaluation"))
                for step in range(first, last_step + 1):
                    timer.reset()
                    with timer("rollout"):
                        batch = recovery.run(lambda: actors.manager.generate(actors.prompts), f"step {step}")
                    result = rl_step(cfg, actors, batch, loss_fn, step, timer)
                    metrics = result.metrics
                    state.step, state.skipped_steps = step, state.skipped_steps + result.num_skipped_updates
                    state.cursor.epoch, state.cursor.position = actors.prompts.epoch, actors.prompts.cursor
                    metrics[names.TRAIN_SKIPPED_STEPS] = float(state.skipped_steps)
                    if is_due(step, cfg.rollout.eval_every, last_step):
                        with timer("eval"):
                            metrics |= recovery.run(lambda: actors.evaluate(data.test), "evaluation")
                    if is_due(step, cfg.checkpoint.save_every, last_step):
                        with timer("checkpoint"):
                            save_checkpoint(actors.checkpointable(), ckpts, state)
                    metrics |= timer.as_metrics() | recovery.metrics()
                    logger.log(step, metrics)
                    summary |= metrics
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics[names.ROLLOUT_REWARD_MEAN]:.3f}")
                    log.info("step %d/%d %s", step, last_step, _brief(metrics))
                    updates = int(metrics[names.TRAIN_UPDATES_PER_ROLLOUT])
                    skipped, lr = result.num_skipped_updates, metrics[names.TRAIN_LR]
                    streak.update(step=step, num_updates=updates, num_skipped=skipped, lr=lr, stage=cfg.name)
            final = publish_final(actors.trainer.save_hf, run_dir, last_step)
        finally:
            actors.shutdown()
    return StageResult(final, run_dir, steps_run=last_step - first + 1, last_step=last_step, summary=summary)


@dataclass
class RlStepResult:
    """What one RL step did (phase times are in the caller's ``PhaseTimer``)."""

    # Every metric of the step (names.py keys): rollout batch, trainer, mismatch, weight sync.
    metrics: dict[str, float]
    # Optimizer updates of this step skipped for a non-finite gradient norm.
    num_skipped_updates: int
    push: PushStats


def rl_step(
    cfg: RlStageConfig, actors: RlActors, batch: RolloutBatch, loss_fn: GrpoLoss, step: int, timer: PhaseTimer
) -> RlStepResult:
    """Advantages, old log-probs and mismatch, the optimizer step(s), weight push."""
    advantages = grpo_advantages(batch.rewards_tensor(), batch.group_size, cfg.algorithm.normalize_std)
    (tokens,) = to_token_batches(batch, advantages, actors.pad_id, micro_batch_size=batch.num_samples)
    memory = actors.memory(names.MEMORY_ROLLOUT_PEAK_GB, names.MEMORY_ROLLOUT_RESERVED_GB, engines=True)
    # The rollout's decode-graph captures and whether its rows all fit in the KV cache at once (GPU engines).
    engine_stats = actors.graph_capture_s() | actors.kv_slots_short()
    actors.trainer.memory()  # restarts the ranks' peak counters: the scoring phase starts here
    actors.engines_sleep()
    temperature, size, rows = cfg.rollout.temperature, cfg.global_batch_size, tokens.num_sequences
    # The old log-probs, B x L. The first update's rows get theirs from its own training forward (_train_on);
    # only rows that later updates train on, after the weights moved, are scored here.
    old = torch.zeros(tokens.input_ids.shape, dtype=torch.float32)
    if rows > size:
        with timer("old_logprobs"):
            old[size:] = actors.trainer.forward_logprobs(tokens.rows(size, rows), temperature)
    tokens.old_logprobs = old
    if cfg.algorithm.needs_reference:
        with timer("ref_logprobs"):
            tokens.ref_logprobs = actors.trainer.forward_ref_logprobs(tokens, temperature)
    assert tokens.rollout_logprobs is not None
    mask, rollout_logp = tokens.loss_mask[:, 1:], tokens.rollout_logprobs[:, 1:]
    tis = (cfg.algorithm.tis_low, cfg.algorithm.tis_high)
    dense: dict[str, float] = {}
    if cfg.metrics.dense_trainer_mismatch and cfg.train_fp8:
        with timer("dense_logprobs"):
            dense_logp = actors.trainer.forward_logprobs(tokens, temperature, fp8=False)
        dense = mismatch_metrics(dense_logp[:, 1:], rollout_logp, mask, *tis).as_metrics(names.MISMATCH_DENSE)
    memory |= actors.memory(names.MEMORY_SCORE_PEAK_GB, names.MEMORY_SCORE_RESERVED_GB)
    with timer("train"):
        all_stats = _train_on(cfg, actors, tokens, loss_fn)
    memory |= actors.memory(names.MEMORY_TRAIN_PEAK_GB, names.MEMORY_TRAIN_RESERVED_GB)
    first = all_stats[0].logprobs
    assert first is not None, "the first update keeps its log-probs (_train_on)"
    old[:size] = first
    mismatch = mismatch_metrics(old[:, 1:], rollout_logp, mask, *tis).as_metrics(names.MISMATCH) | dense
    stats = _mean_stats(all_stats)
    actors.engines_wake()
    with timer("weight_sync"):
        push = actors.sync.push_from(actors.trainer, cfg.rollout_fp8, version=step)
    memory |= actors.memory(names.MEMORY_SYNC_PEAK_GB, names.MEMORY_SYNC_RESERVED_GB)
    if actors.colocated_gpu:
        with timer("make_room"):  # for the next rollout's KV cache
            memory |= actors.make_room_for_rollout()
    metrics = {
        **batch.metrics,
        **train_metrics(stats, 0, stats.step_time_s),
        **mismatch,
        **memory,
        **engine_stats,
        names.TRAIN_UPDATES_PER_ROLLOUT: float(len(all_stats)),
        names.WEIGHT_SYNC_PUSH_S: push.seconds,
        names.WEIGHT_SYNC_CHECK_S: push.check_seconds,
        names.WEIGHT_SYNC_BYTES: float(push.bytes),
        names.ROLLOUT_ADVANTAGE_ABS_MEAN: float(torch.as_tensor(advantages).abs().mean()),
    }
    return RlStepResult(metrics, num_skipped_updates=sum(s.skipped for s in all_stats), push=push)


def _train_on(
    cfg: RlStageConfig, actors: RlActors, tokens: TokenBatch, loss_fn: GrpoLoss
) -> list[TrainStats]:
    """``cfg.updates_per_rollout`` optimizer steps on consecutive row slices of the rollout batch (groups stay
    whole when the global batch is a multiple of the group size); old log-probs are the pre-update ones.

    The first update trains on the weights that sampled the batch, so its old log-probs are its own forward's
    (``GrpoLoss.old_from_scores``, the same bits a scoring pass would give: tests/test_old_logprobs_gpu.py); its
    TrainStats.logprobs holds them for the mismatch metrics. Later slices carry ``tokens.old_logprobs``."""
    size = cfg.global_batch_size
    all_stats = []
    for start in range(0, tokens.num_sequences, size):
        part, fn, first = tokens.rows(start, start + size), loss_fn, start == 0
        if first:
            part, fn = replace(part, old_logprobs=None), replace(loss_fn, old_from_scores=True)
        # The units each micro-batch's GrpoLoss counts (trained positions t >= 1), so the means add up exactly.
        units = part.num_targets if cfg.algorithm.loss_reduction == "token_mean" else part.num_sequences
        all_stats.append(actors.trainer.train_step(part, fn, total_units=units, keep_logprobs=first))
    return all_stats


def _mean_stats(all_stats: list[TrainStats]) -> TrainStats:
    """One TrainStats for the step: the last update's step and lr, means of loss, grad norm and metrics,
    totals of tokens, sequences and time."""
    last = all_stats[-1]
    n = len(all_stats)
    return TrainStats(
        step=last.step,
        loss=sum(s.loss for s in all_stats) / n,
        grad_norm=sum(s.grad_norm for s in all_stats) / n,
        lr=last.lr,
        num_tokens=sum(s.num_tokens for s in all_stats),
        num_sequences=sum(s.num_sequences for s in all_stats),
        skipped=any(s.skipped for s in all_stats),
        step_time_s=sum(s.step_time_s for s in all_stats),
        metrics={k: sum(s.metrics.get(k, 0.0) for s in all_stats) / n for k in last.metrics},
    )


def _brief(metrics: dict[str, float]) -> str:
    keys = (
        names.ROLLOUT_REWARD_MEAN,
        names.ROLLOUT_RESPONSE_LEN_MEAN,
        names.TRAIN_LOSS,
        names.MISMATCH_ABS_LOGP_DIFF_MEAN,
        names.MISMATCH_K3,
        names.MISMATCH_DENSE_K3,
        names.EVAL_ACCURACY,
    )
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def main(argv: list[str] | None = None) -> int:
    from infir2_rl.config import load_stage_config

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m infir2_rl.stages.rl CONFIG [section.field=value ...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_stage_config(args[0], args[1:])
    if not isinstance(cfg, RlStageConfig):
        raise ValueError(f"{args[0]}: kind={cfg.kind!r}; this entry point runs kind 'rl' stages")
    ensure_ray()
    print(f"final checkpoint: {run_rl_stage(cfg).final_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
