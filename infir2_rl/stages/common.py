"""Helpers shared by the stage loops: run directory, data order, resume, final export, step metrics."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infir2_rl.actors.ray_runtime import ensure_ray
from infir2_rl.actors.trainer_group import placed_trainer_group
from infir2_rl.checkpoint import Checkpoint, CheckpointManager, DataCursor, StageState
from infir2_rl.config import RlStageConfig, SftStageConfig
from infir2_rl.errors import describe
from infir2_rl.metrics import MetricsLogger, names, progress
from infir2_rl.metrics.watch import write_stage_plan
from infir2_rl.stages.guards import ConfigSegments
from infir2_rl.types import TrainStats

log = logging.getLogger(__name__)

FINAL_DIR = "final"
# Beside final/ (not in it: the cast and the next stage copy final/'s files): the step final/ was exported at.
FINAL_STEP_FILE = "final_step"
CHECKPOINTS_DIR = "checkpoints"
LOG_FILE = "logs/stage.log"


@dataclass
class StageResult:
    """What a stage hands to the pipeline."""

    # HF directory the next stage starts from (RUN_DIR/final; the input model when nothing was trained).
    final_checkpoint: Path
    run_dir: Path
    # Optimizer steps run by this call (0 when the stage found nothing to do).
    steps_run: int
    # Optimizer steps of the stage in total, including those of earlier (resumed) runs.
    last_step: int
    # True when the stage found nothing to do and trained nothing.
    nothing_to_do: bool = False
    # Last value of each metric logged by this call (e.g. "train/loss", "eval/accuracy").
    summary: dict[str, float] = field(default_factory=dict)


@contextmanager
def stage_run_dir(cfg: SftStageConfig | RlStageConfig) -> Iterator[Path]:
    """Create RUN_DIR, copy the log to RUN_DIR/logs/stage.log, check a resume against the config its
    checkpoints were trained with and record this run's config (guards.ConfigSegments: config.yaml and
    config_segments/). A failure inside ends stage.log with the one line the command prints (errors.py)."""
    run_dir = Path(cfg.run_dir)
    (run_dir / LOG_FILE).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / LOG_FILE)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("infir2_rl")
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        resuming = cfg.checkpoint.resume and bool(CheckpointManager(run_dir / CHECKPOINTS_DIR).complete())
        ConfigSegments(run_dir).begin(cfg, resuming=resuming, allow_change=cfg.checkpoint.allow_config_change)
        yield run_dir
    except BaseException as exc:
        _, line = describe(exc)  # the terminal gets the same line from the command (cli.py)
        handler.handle(
            log.makeRecord(log.name, logging.ERROR, __file__, 0, "stage failed: %s", (line,), None)
        )
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def epoch_order(num_examples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The example order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    if not shuffle:
        return list(range(num_examples))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=gen).tolist()


def next_batch(
    cursor: DataCursor, num_examples: int, batch_size: int, seed: int, shuffle: bool
) -> tuple[list[int], DataCursor]:
    """Indices of the next full batch and the cursor after it; a partial batch at an epoch's end is dropped."""
    if num_examples < batch_size:
        raise ValueError(f"{num_examples} examples cannot fill one batch of {batch_size}")
    epoch, position = cursor.epoch, cursor.position
    if position + batch_size > num_examples:
        epoch, position = epoch + 1, 0
    indices = epoch_order(num_examples, epoch, seed, shuffle)[position : position + batch_size]
    return indices, DataCursor(epoch=epoch, position=position + batch_size)


def resume_state(
    manager: CheckpointManager, resume: bool, num_examples: int
) -> tuple[StageState, Checkpoint | None]:
    """The state to start from: the newest complete checkpoint when resuming, else step 0."""
    latest = manager.latest() if resume else None
    if latest is None:
        if not resume and manager.complete():
            # Old checkpoints of higher steps would otherwise outrank the new run's on the next resume.
            log.warning(
                "checkpoint.resume=false: starting at step 0; deleting the checkpoints in %s", manager.root
            )
            manager.clear()
        return StageState(num_examples=num_examples), None
    state = latest.read_state()
    if state.num_examples != num_examples:
        raise ValueError(
            f"checkpoint {latest.path} was trained on {state.num_examples} examples, the data now has"
            f" {num_examples}: use the same data to resume, or a new run_dir / checkpoint.resume=false"
        )
    log.info("resuming from %s (step %d, epoch %d)", latest.path, state.step, state.cursor.epoch)
    return state, latest


def publish_final(write: Callable[[Path], object], run_dir: Path, step: int) -> Path:
    """Write RUN_DIR/final through `write(temp_dir)` (e.g. `group.save_hf`) and one rename: complete or absent.
    RUN_DIR/final_step then names the step it holds; a run killed before that leaves none, which
    `final_from_checkpoint` takes as unknown."""
    final, tmp, marker = run_dir / FINAL_DIR, run_dir / f".tmp_{FINAL_DIR}", run_dir / FINAL_STEP_FILE
    shutil.rmtree(tmp, ignore_errors=True)
    marker.unlink(missing_ok=True)
    write(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    marker_tmp = run_dir / f".tmp_{FINAL_STEP_FILE}"
    marker_tmp.write_text(f"{step}\n")
    os.replace(marker_tmp, marker)
    log.info("final checkpoint: %s (step %d)", final, step)
    return final


def final_step(run_dir: Path) -> int | None:
    """The step RUN_DIR/final was exported at, or None when unknown (no final_step: an older run, or one killed
    between the export and the marker)."""
    marker = run_dir / FINAL_STEP_FILE
    text = marker.read_text().strip() if marker.is_file() else ""
    return int(text) if text.isdigit() and (run_dir / FINAL_DIR).is_dir() else None


def final_from_checkpoint(
    cfg: SftStageConfig | RlStageConfig, ckpt: Checkpoint, run_dir: Path, *, total_steps: int
) -> Path:
    """RUN_DIR/final for a stage whose last step is already checkpointed (killed before the export), unless
    final/ already holds that step (`final_step`): a final/ of an earlier last step (the stage since extended
    by trainer.max_steps or rollout.num_steps and killed before its export) was handed on as it was before.

    A trainer loads the checkpoint and exports it as the uninterrupted run did: in the compute dtype. A copy of
    the checkpoint's ``hf/`` would hand on its FP32 master weights where the uninterrupted run hands on BF16
    (on GPUs), so the next stage and the FP8 cast would depend on when this one was stopped.
    """
    final = run_dir / FINAL_DIR
    # Absent, or older: a finished stage extended, then killed before its export.
    if final_step(run_dir) != ckpt.step:
        ensure_ray()
        with placed_trainer_group(cfg, total_steps=total_steps) as group:
            group.load(ckpt.path)
            publish_final(group.save_hf, run_dir, ckpt.step)
    return final


def metrics_logger(cfg: SftStageConfig | RlStageConfig, run_dir: Path) -> MetricsLogger:
    """metrics.jsonl, TensorBoard and Ray gauges of a stage, as its `metrics` section asks."""
    m = cfg.metrics
    return MetricsLogger(run_dir, tensorboard=m.tensorboard, ray_metrics=m.ray_metrics, stage=cfg.name)


def progress_bar(cfg: SftStageConfig | RlStageConfig, total_steps: int) -> Any:
    """A tqdm bar on interactive terminals (never in Ray job logs); off when metrics.progress_bar is false.
    The step count is also written to RUN_DIR/progress.json for `infir2-rl report RUN_DIR --watch`."""
    write_stage_plan(Path(cfg.run_dir), total_steps)
    return progress(total_steps, cfg.name, None if cfg.metrics.progress_bar else False)


def train_metrics(stats: TrainStats, skipped_steps: int, wall_s: float) -> dict[str, float]:
    """The per-step trainer metrics (names.py) of one TrainStats; `wall_s` is the step as the driver saw it."""
    return {
        names.TRAIN_LOSS: stats.loss,
        names.TRAIN_GRAD_NORM: stats.grad_norm,
        names.TRAIN_LR: stats.lr,
        names.TRAIN_SKIPPED_STEPS: float(skipped_steps),
        names.PERF_STEP_TIME_S: wall_s,
        names.PERF_TOKENS_PER_S: stats.num_tokens / max(wall_s, 1e-9),
        **stats.metrics,
    }


def is_due(step: int, every: int, last_step: int) -> bool:
    """True every `every` steps (0 = never in between) and always at the last step."""
    return step == last_step or (every > 0 and step % every == 0)
