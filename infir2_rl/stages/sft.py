"""The SFT stage: per-token cross-entropy on assistant tokens, epochs over shuffled chat data.

    python -m infir2_rl.stages.sft CONFIG [section.field=value ...]   # same as `infir2-rl run CONFIG`

One optimizer step per global batch of `trainer.global_batch_size` conversations (a partial batch at
the end of an epoch is dropped), split over the trainer ranks and into micro-batches. Held-out loss and
accuracy every `trainer.eval_every` steps and at the end; checkpoints every `checkpoint.save_every`
steps and at the end; the last weights go to RUN_DIR/final for the next stage. A stopped run resumes
from its newest complete checkpoint with the same weights, optimizer, lr schedule, data position and RNG.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from infir2_rl.actors.ray_runtime import ensure_ray
from infir2_rl.actors.trainer_group import placed_trainer_group
from infir2_rl.checkpoint import Checkpoint, CheckpointManager, save_checkpoint
from infir2_rl.config import SftStageConfig, validate_paths
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.scan import check_fills_batch
from infir2_rl.metrics import names
from infir2_rl.stages.common import (
    CHECKPOINTS_DIR,
    StageResult,
    final_from_checkpoint,
    is_due,
    metrics_logger,
    next_batch,
    progress_bar,
    publish_final,
    resume_state,
    stage_run_dir,
    train_metrics,
)
from infir2_rl.stages.guards import SkipStreak
from infir2_rl.stages.sft_eval import SftLossFn, evaluate, load_eval_set, num_target_tokens, to_token_batch

log = logging.getLogger(__name__)


def run_sft_stage(cfg: SftStageConfig) -> StageResult:
    """Run (or resume) one SFT stage to its last step; returns RUN_DIR/final and the last metrics."""
    from transformers import AutoTokenizer

    validate_paths(cfg)  # bad paths and data fail here, before any actor starts
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    d, t = cfg.data, cfg.trainer
    train, report = load_sft_examples(
        d.train_path, tokenizer, messages_key=d.messages_key, max_seq_len=d.max_seq_len, format=d.format
    )
    # A stage that would train nothing fails here, before Ray starts (it once exited 0 and handed on the
    # untouched input model).
    check_fills_batch(report, t.global_batch_size, "trainer.global_batch_size", loaded=True)
    eval_set = load_eval_set(d, tokenizer)
    steps_per_epoch = len(train) // t.global_batch_size
    last_step = min(t.epochs * steps_per_epoch, t.max_steps or sys.maxsize)
    with stage_run_dir(cfg) as run_dir:
        ckpts = CheckpointManager(run_dir / CHECKPOINTS_DIR, cfg.checkpoint.keep_last)
        state, resumed = resume_state(ckpts, cfg.checkpoint.resume, len(train))
        if state.step >= last_step:
            return _nothing_to_do(cfg, last_step, state.step, resumed)
        ensure_ray()
        summary: dict[str, float] = {}
        first = state.step + 1
        streak = SkipStreak(t.max_consecutive_skips)
        with placed_trainer_group(cfg, total_steps=last_step) as group:
            if resumed is not None:
                group.load(resumed.path)
            with metrics_logger(cfg, run_dir) as logger, progress_bar(cfg, last_step) as bar:
                bar.update(state.step)
                if eval_set is not None and state.step == 0 and t.eval_at_start:  # the starting point
                    logger.log(0, evaluate(group, eval_set, tokenizer))
                for step in range(first, last_step + 1):
                    indices, state.cursor = next_batch(
                        state.cursor, len(train), t.global_batch_size, cfg.seed, d.shuffle
                    )
                    batch = to_token_batch([train[i] for i in indices], tokenizer.pad_token_id)
                    start = time.perf_counter()
                    stats = group.train_step(batch, SftLossFn(), total_units=num_target_tokens(batch))
                    state.step, state.skipped_steps = step, state.skipped_steps + stats.skipped
                    metrics = train_metrics(stats, state.skipped_steps, time.perf_counter() - start)
                    if eval_set is not None and is_due(step, t.eval_every, last_step):
                        metrics |= evaluate(group, eval_set, tokenizer)
                    logger.log(step, metrics)
                    summary |= metrics
                    _show_progress(bar, step, last_step, metrics)
                    streak.update(
                        step=step, num_updates=1, num_skipped=int(stats.skipped), lr=stats.lr, stage=cfg.name
                    )
                    if is_due(step, cfg.checkpoint.save_every, last_step):
                        save_checkpoint(group, ckpts, state)
            final = publish_final(group.save_hf, run_dir, last_step)
    return StageResult(final, run_dir, steps_run=last_step - first + 1, last_step=last_step, summary=summary)


def _nothing_to_do(cfg: SftStageConfig, last_step: int, step: int, resumed: Checkpoint | None) -> StageResult:
    run_dir = Path(cfg.run_dir)
    assert resumed is not None  # state.step >= last_step >= 1 only comes from a checkpoint
    log.warning(
        "SFT stage %s: nothing to do: checkpoint %s is at step %d of %d; no step was run",
        cfg.name, resumed.path, step, last_step,
    )  # fmt: skip
    final = final_from_checkpoint(cfg, resumed, run_dir, total_steps=last_step)
    return StageResult(final, run_dir, steps_run=0, last_step=step, nothing_to_do=True)


def _show_progress(bar: Any, step: int, last_step: int, metrics: dict[str, float]) -> None:
    """Advance the bar; log a line about 20 times per stage and at every evaluation."""
    bar.update(1)
    bar.set_postfix(loss=f"{metrics[names.TRAIN_LOSS]:.4f}")
    if step == last_step or step % max(1, last_step // 20) == 0 or names.EVAL_LOSS in metrics:
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != names.PERF_PEAK_MEMORY_GB)
        log.info("step %d/%d %s", step, last_step, shown)


def main(argv: list[str] | None = None) -> int:
    from infir2_rl.config import load_stage_config

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m infir2_rl.stages.sft CONFIG [section.field=value ...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_stage_config(args[0], args[1:])
    if not isinstance(cfg, SftStageConfig):
        raise ValueError(f"{args[0]}: kind={cfg.kind!r}; this entry point runs kind 'sft' stages")
    result = run_sft_stage(cfg)
    print(f"final checkpoint: {result.final_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
