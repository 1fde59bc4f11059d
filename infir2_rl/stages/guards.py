"""What keeps a stage from training on bad input, resuming into a different run, or publishing a diverged model.

* ``check_stage_data`` (before Ray starts): the training file has enough usable rows for one batch.
* ``ConfigSegments`` (at the start of every run of a stage): a resume whose resolved config differs from
  the one the checkpoints were trained with, in a field that changes the training trajectory, is refused
  in one line listing the fields (``checkpoint.allow_config_change=true`` lets it through, and says so).
  Every run of a stage (a "segment") leaves its resolved config in ``RUN_DIR/config_segments/`` beside
  ``RUN_DIR/config.yaml`` (the newest), so a run resumed with other settings keeps a record of each.
* ``SkipStreak``: N optimizer steps in a row skipped for a non-finite gradient norm stop the stage with
  ``RunFailed`` before anything is published (a diverged run; e.g. ``optimizer.lr=1e30``).

Not trajectory-relevant (a resume may change them freely): where files are and where actors run, what is
logged, evaluated and checkpointed, memory knobs that only regroup the same sums (micro-batch size), and
the stage length (``rollout.num_steps``, ``trainer.max_steps``, ``trainer.epochs``: a run may be
extended; with a decaying lr schedule the lr from the resume point on follows the new length).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infir2_rl.config import RlStageConfig, SftStageConfig, dump_config
from infir2_rl.errors import BadInput, RunFailed

log = logging.getLogger(__name__)

SEGMENTS_DIR = "config_segments"
CONFIG_FILE = "config.yaml"
# Dotted config keys (or key prefixes ending in ".") a resume may change; see the module docstring.
NOT_TRAJECTORY = (
    "name",
    "run_dir",
    "metrics.",
    "checkpoint.",
    "placement.",
    "model.path",
    "data.train_path",
    "data.test_path",
    "data.num_eval_examples",
    "data.format",
    "rollout.fp8_checkpoint",
    "rollout.num_steps",
    "rollout.eval_every",
    "trainer.max_steps",
    "trainer.epochs",
    "trainer.eval_every",
    "trainer.eval_at_start",
    "trainer.micro_batch_size",
    "trainer.max_tokens_per_gpu",
    "weight_sync.timeout_s",
    "weight_sync.bucket_size_mb",
    "weight_sync.self_check_layers",
    "weight_sync.transport",
)


def check_stage_data(cfg: SftStageConfig | RlStageConfig) -> None:
    """Refuse (ValueError, one line) a training file without one batch of usable rows; no tokenizer, no Ray."""
    from infir2_rl.data.scan import check_fills_batch, scan_prompt_rows, scan_sft_rows

    d = cfg.data
    if isinstance(cfg, SftStageConfig):
        report = scan_sft_rows(d.train_path, messages_key=cfg.data.messages_key, format=d.format)
        check_fills_batch(report, cfg.trainer.global_batch_size, "trainer.global_batch_size")
    else:
        report = scan_prompt_rows(
            d.train_path, input_key=cfg.data.input_key, label_key=cfg.data.label_key, format=d.format
        )
        check_fills_batch(report, cfg.rollout.prompts_per_step, "rollout.prompts_per_step")


def check_reward(cfg: SftStageConfig | RlStageConfig) -> None:
    """Refuse (ValueError, one line) an RL stage whose ``rollout.reward`` does not import, before Ray starts: a
    pipeline would otherwise find it only when its first RL stage starts, after the SFT stages."""
    if isinstance(cfg, RlStageConfig):
        from infir2_rl.reward.protocol import load_reward_fn

        load_reward_fn(cfg.rollout.reward)


def check_prompts_fill_step(cfg: RlStageConfig, num_prompts: int) -> None:
    """After loading (token lengths known): enough prompts for one step without repeating any."""
    need = cfg.rollout.prompts_per_step
    if num_prompts < need:
        raise BadInput(
            f"data.train_path={cfg.data.train_path!r}: {num_prompts} usable prompts after loading, fewer than one"
            f" step of rollout.prompts_per_step={need}: a step would repeat prompts; add rows or lower"
            " rollout.prompts_per_step (or raise data.max_prompt_tokens if rows were too long)"
        )


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out |= _flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: data}


def trajectory_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``field: old -> new`` for every trajectory-relevant field that differs (module docstring)."""
    a, b = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in NOT_TRAJECTORY):
            continue
        if a.get(key) != b.get(key):
            changes.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return changes


@dataclass
class ConfigSegments:
    """The resolved config of each run ("segment") of one stage directory (module docstring)."""

    run_dir: Path

    @property
    def folder(self) -> Path:
        return self.run_dir / SEGMENTS_DIR

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("segment_*.yaml")) if self.folder.is_dir() else []

    def previous(self) -> dict[str, Any] | None:
        """The config the newest segment ran with (RUN_DIR/config.yaml for runs from before segments)."""
        files = self.files()
        source = files[-1] if files else self.run_dir / CONFIG_FILE
        if not source.is_file():
            return None
        data = yaml.safe_load(source.read_text())
        return data if isinstance(data, dict) else None

    def begin(self, cfg: SftStageConfig | RlStageConfig, *, resuming: bool, allow_change: bool) -> None:
        """Check a resume against the previous segment, then record this one and write RUN_DIR/config.yaml."""
        text = dump_config(cfg)
        if resuming:
            previous = self.previous()
            changes = trajectory_changes(previous, yaml.safe_load(text)) if previous is not None else []
            if changes and not allow_change:
                raise BadInput(
                    f"resume of {self.run_dir} refused: the config differs from the one its checkpoints were"
                    f" trained with in {len(changes)} field(s) that change training ({'; '.join(changes)});"
                    " restore them, or set checkpoint.allow_config_change=true to continue with the new values,"
                    " or use a new run_dir"
                )
            if changes:
                log.warning(
                    "resuming %s with a changed config (checkpoint.allow_config_change=true): %s",
                    self.run_dir,
                    "; ".join(changes),
                )
        else:
            for old in self.files():  # a fresh start: earlier segments describe checkpoints that are gone
                old.unlink()
        self.folder.mkdir(parents=True, exist_ok=True)
        index = len(self.files())
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        header = f"# segment {index}: {'resumed' if resuming else 'started'} {stamp}\n"
        (self.folder / f"segment_{index:03d}.yaml").write_text(header + text)
        (self.run_dir / CONFIG_FILE).write_text(text)


@dataclass
class SkipStreak:
    """Counts consecutive steps whose optimizer updates were all skipped (non-finite gradient norm)."""

    # Steps in a row that stop the stage; 0 never stops it.
    limit: int
    count: int = 0

    def update(self, *, step: int, num_updates: int, num_skipped: int, lr: float, stage: str) -> None:
        """Record a step; raise RunFailed when ``limit`` steps in a row skipped every update."""
        self.count = self.count + 1 if num_updates and num_skipped == num_updates else 0
        if self.limit and self.count >= self.limit:
            raise RunFailed(
                f"stage {stage}: {self.count} steps in a row (up to step {step}) had a non-finite gradient"
                f" norm and were skipped, so training has diverged; nothing was published. Lower optimizer.lr"
                f" (now {lr:g}) or fix the data, then rerun with a new run_dir or checkpoint.resume=false"
                " (or raise trainer.max_consecutive_skips)"
            )
