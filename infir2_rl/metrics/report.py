"""Run report: curves of a run as PNG files and a per-stage summary table.

A run directory is either one stage (it holds `metrics.jsonl`) or a pipeline (no `metrics.jsonl` of
its own; one sub-directory per stage, each with `metrics.jsonl`). Stages are ordered by the time of
their first record and laid end to end on one global step axis (stage k's step s is drawn at
s + the last steps of stages 0..k-1), with a dashed line where each stage starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from infir2_rl.metrics import names
from infir2_rl.metrics.logger import JSONL_NAME

log = logging.getLogger(__name__)

REPORT_DIR = "report"


@dataclasses.dataclass
class StageMetrics:
    """One stage's records: `steps[i]` is the step of `records[i]`, sorted, one record per step."""

    name: str
    steps: list[int]
    records: list[dict[str, float]]
    # Wall time from the first to the last record (seconds).
    wall_time_s: float

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that hold a finite value for `key`."""
        pairs = [(s, r[key]) for s, r in zip(self.steps, self.records) if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


def read_metrics_jsonl(path: Path, stage: str) -> StageMetrics:
    """Parse one metrics.jsonl: records of the same step are merged, a resumed run's re-logged steps win.

    When a step number goes backwards (the run resumed from an earlier checkpoint), records from that
    step on are dropped: they belong to the attempt that did not reach a checkpoint. A torn last line
    (run killed mid-write) is skipped with a warning.
    """
    by_step: dict[int, dict[str, float]] = {}
    first_time = last_time = None
    last_step: int | None = None
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("%s:%d: unreadable metrics line skipped", path, line_no)
            continue
        if last_step is not None and step < last_step:
            by_step = {s: r for s, r in by_step.items() if s < step}
        last_step = step
        if isinstance(record.get("time"), (int, float)):
            first_time = record["time"] if first_time is None else first_time
            last_time = record["time"]
        merged = by_step.setdefault(step, {})
        for key, value in record.items():
            if key in ("step", "time", "nonfinite"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                merged[key] = float(value)
    steps = sorted(by_step)
    wall = (last_time - first_time) if first_time is not None and last_time is not None else 0.0
    return StageMetrics(name=stage, steps=steps, records=[by_step[s] for s in steps], wall_time_s=wall)


class NoStepsYet(ValueError):
    """A run whose metrics hold no readable step yet (``load_run``): ``report`` refuses it, ``watch`` waits."""


def load_run(run_dir: str | Path) -> list[StageMetrics]:
    """The stages of a run directory, in the order they ran."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "a file, not a directory" if run_dir.exists() else "no such directory"
        raise ValueError(f"run_dir={str(run_dir)!r}: {what}; pass a stage or pipeline run directory")
    if (run_dir / JSONL_NAME).is_file():
        stage_files = [run_dir / JSONL_NAME]
        stages = [read_metrics_jsonl(run_dir / JSONL_NAME, run_dir.name)]
    else:
        stage_files = sorted(p for p in run_dir.glob(f"*/{JSONL_NAME}") if p.is_file())
        if not stage_files:
            raise ValueError(
                f"run_dir={str(run_dir)!r}: no {JSONL_NAME} in it or in its sub-directories; "
                "pass a stage or pipeline run directory."
            )
        stages = [read_metrics_jsonl(p, p.parent.name) for p in stage_files]
    if not any(stage.steps for stage in stages):  # empty, or only unreadable lines: nothing to draw
        raise NoStepsYet(
            f"run_dir={str(run_dir)!r}: its {JSONL_NAME} holds no readable step yet; "
            "report a run after its first logged step"
        )
    if len(stages) == 1:
        return stages

    def first_time(path: Path) -> float:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                return float(json.loads(line)["time"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return math.inf

    order = sorted(range(len(stages)), key=lambda i: (first_time(stage_files[i]), stages[i].name))
    return [stages[i] for i in order]


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    file_name: str
    title: str
    # Metric keys drawn on this plot, one line each; the plot is skipped when none has data.
    keys: tuple[str, ...]
    ylabel: str
    log_scale: bool = False


PLOTS = (
    PlotSpec("reward.png", "Rollout reward (mean)", (names.ROLLOUT_REWARD_MEAN,), "reward"),
    PlotSpec("accuracy.png", "Held-out accuracy", (names.EVAL_ACCURACY,), "accuracy"),
    PlotSpec("response_length.png", "Response length (mean)", (names.ROLLOUT_RESPONSE_LEN_MEAN,), "tokens"),
    PlotSpec(
        "mismatch.png",
        "Train/rollout mismatch",
        (
            names.MISMATCH_ABS_LOGP_DIFF_MEAN,
            names.MISMATCH_K3,
            names.MISMATCH_DENSE_ABS_LOGP_DIFF_MEAN,
            names.MISMATCH_DENSE_K3,
        ),
        "value (log scale)",
        log_scale=True,
    ),
    PlotSpec(
        "throughput.png", "Throughput", (names.PERF_TOKENS_PER_S, names.ROLLOUT_TOKENS_PER_S), "tokens/s"
    ),
    PlotSpec("loss.png", "Train loss", (names.TRAIN_LOSS,), "loss"),
)


def stage_offsets(stages: list[StageMetrics]) -> list[int]:
    """Global-step offset of each stage: the sum of the last steps of the stages before it."""
    offsets, total = [], 0
    for stage in stages:
        offsets.append(total)
        total += stage.steps[-1] if stage.steps else 0
    return offsets


def make_report(run_dir: str | Path) -> list[Path]:
    """Write the report PNGs into RUN_DIR/report/ and return their paths; plots without data are skipped (logged)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    stages = load_run(run_dir)
    offsets = stage_offsets(stages)
    out_dir = run_dir / REPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for spec in PLOTS:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        drawn = 0
        for key in spec.keys:
            for stage_index, (stage, offset) in enumerate(zip(stages, offsets)):
                steps, values = stage.series(key)
                if spec.log_scale:  # log axes cannot show 0 (a perfect match) or negatives
                    pairs = [(s, v) for s, v in zip(steps, values) if v > 0]
                    steps, values = [s for s, _ in pairs], [v for _, v in pairs]
                if not steps:
                    continue
                label = key if len(stages) == 1 else f"{key} [{stage.name}]"
                color = f"C{(spec.keys.index(key) * len(stages) + stage_index) % 10}"
                marker = "o" if len(steps) < 30 else None
                ax.plot([s + offset for s in steps], values, label=label, color=color, marker=marker, ms=3)
                drawn += 1
        if drawn == 0:
            plt.close(fig)
            log.info("report: no data for %s (%s); skipped", spec.file_name, ", ".join(spec.keys))
            continue
        written.append(_finish_plot(fig, ax, spec, stages if len(stages) > 1 else [], out_dir, legend_size=7))
    return written


def _finish_plot(
    fig: Any, ax: Any, spec: PlotSpec, stages: list[StageMetrics], out_dir: Path, legend_size: int
) -> Path:
    """Dashed stage starts (none when `stages` is empty), scale, labels, legend; save and close the figure."""
    import matplotlib.pyplot as plt

    for stage, offset in zip(stages, stage_offsets(stages)):
        ax.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
        ax.text(offset, 1.0, f" {stage.name}", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
    if spec.log_scale:
        ax.set_yscale("log")
    ax.set_title(spec.title)
    ax.set_xlabel("global step" if stages else "step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_size, loc="best")
    fig.tight_layout()
    path = out_dir / spec.file_name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


COMPARE_PLOTS = (
    PlotSpec("compare_reward.png", "Rollout reward (mean)", (names.ROLLOUT_REWARD_MEAN,), "reward"),
    PlotSpec("compare_accuracy.png", "Held-out accuracy", (names.EVAL_ACCURACY,), "accuracy"),
    PlotSpec(
        "compare_response_length.png", "Response length (mean)", (names.ROLLOUT_RESPONSE_LEN_MEAN,), "tokens"
    ),
    PlotSpec(
        "compare_mismatch.png",
        "Mean |logp_train - logp_rollout|",
        (names.MISMATCH_ABS_LOGP_DIFF_MEAN,),
        "value (log scale)",
        log_scale=True,
    ),
    PlotSpec(
        "compare_k3.png", "K3 KL(rollout || train)", (names.MISMATCH_K3,), "value (log scale)", log_scale=True
    ),
)


def make_comparison(run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None) -> list[Path]:
    """Overlay several runs of the same pipeline (one colour per run, global step axis, stage starts of
    the first run dashed) as ``compare_*.png`` in `out_dir`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(run_dirs) < 2:
        raise ValueError(f"a comparison needs at least two run directories, got {len(run_dirs)}")
    labels = labels or [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [load_run(d) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for spec in COMPARE_PLOTS:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        drawn = 0
        for run_index, (stages, label) in enumerate(zip(runs, labels)):
            xs: list[int] = []
            ys: list[float] = []
            for stage, offset in zip(stages, stage_offsets(stages)):
                steps, values = stage.series(spec.keys[0])
                for step, value in zip(steps, values):
                    if not spec.log_scale or value > 0:
                        xs.append(step + offset)
                        ys.append(value)
            if xs:
                ax.plot(
                    xs, ys, label=label, color=f"C{run_index}", marker="o" if len(xs) < 30 else None, ms=3
                )
                drawn += 1
        if drawn == 0:
            plt.close(fig)
            log.info("comparison: no data for %s; skipped", spec.file_name)
            continue
        written.append(_finish_plot(fig, ax, spec, runs[0], out_dir, legend_size=8))
    return written


@dataclasses.dataclass(frozen=True)
class StageSummary:
    """One row of the run summary; None where the stage did not log that metric."""

    stage: str
    # Distinct training steps logged (step 0, the evaluation before training, not counted).
    steps: int
    first_reward: float | None
    last_reward: float | None
    # Held-out accuracy at the stage's first and last evaluation (the first is before training).
    first_eval_accuracy: float | None
    last_eval_accuracy: float | None
    # Means over the stage's steps of mean |logp_train - logp_rollout| and of K3.
    mismatch_mean: float | None
    k3_mean: float | None
    # The same with the trainer's FP8 linears off (metrics.dense_trainer_mismatch), None when not measured.
    dense_mismatch_mean: float | None
    dense_k3_mean: float | None
    # Seconds from the stage's first record to its last.
    wall_time_s: float
    # Total seconds per phase (`time/<phase>_s` metrics summed over steps).
    phase_times_s: dict[str, float]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run_dir: str | Path) -> list[StageSummary]:
    """One `StageSummary` per stage of the run, in the order the stages ran."""
    rows: list[StageSummary] = []
    for stage in load_run(run_dir):
        _, rewards = stage.series(names.ROLLOUT_REWARD_MEAN)
        steps, accuracies = stage.series(names.EVAL_ACCURACY)
        first_accuracy = accuracies[0] if steps and steps[0] == 0 else None
        if steps and steps[0] > 0 and rows:
            # No step-0 eval (SFT's trainer.eval_at_start=false): the stage started from the previous
            # stage's final checkpoint, which that stage evaluated last. The first stage shows none.
            first_accuracy = rows[-1].last_eval_accuracy
        phases: dict[str, float] = {}
        for record in stage.records:
            for key, value in record.items():
                if key.startswith(names.TIME_PREFIX):
                    phase = key[len(names.TIME_PREFIX) :].removesuffix("_s")
                    phases[phase] = phases.get(phase, 0.0) + value
        rows.append(
            StageSummary(
                stage=stage.name,
                steps=sum(1 for step in stage.steps if step > 0),
                first_reward=rewards[0] if rewards else None,
                last_reward=rewards[-1] if rewards else None,
                first_eval_accuracy=first_accuracy,
                last_eval_accuracy=accuracies[-1] if accuracies else None,
                mismatch_mean=_mean(stage.series(names.MISMATCH_ABS_LOGP_DIFF_MEAN)[1]),
                k3_mean=_mean(stage.series(names.MISMATCH_K3)[1]),
                dense_mismatch_mean=_mean(stage.series(names.MISMATCH_DENSE_ABS_LOGP_DIFF_MEAN)[1]),
                dense_k3_mean=_mean(stage.series(names.MISMATCH_DENSE_K3)[1]),
                wall_time_s=stage.wall_time_s,
                phase_times_s=phases,
            )
        )
    return rows


def summary_table(rows: list[StageSummary], title: str = "Run summary") -> Table:
    """A rich Table of the summary rows ("-" where a stage has no such metric)."""

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = Table(title=title)
    columns = (
        "stage",
        "steps",
        "reward first -> last",
        "eval acc first -> last",
        "|dlogp| mean (dense trainer)",
        "K3 mean (dense trainer)",
        "wall s",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "stage" else "right")
    table.add_column("time per phase (s)", justify="left")
    for row in rows:
        phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(row.phase_times_s.items()))
        table.add_row(
            row.stage,
            str(row.steps),
            f"{fmt(row.first_reward, '.3f')} -> {fmt(row.last_reward, '.3f')}",
            f"{fmt(row.first_eval_accuracy, '.3f')} -> {fmt(row.last_eval_accuracy, '.3f')}",
            _with_dense(fmt(row.mismatch_mean, ".2e"), row.dense_mismatch_mean),
            _with_dense(fmt(row.k3_mean, ".2e"), row.dense_k3_mean),
            f"{row.wall_time_s:.1f}",
            phases or "-",
        )
    return table


def _with_dense(text: str, dense: float | None) -> str:
    return text if dense is None else f"{text} ({dense:.2e})"


def print_summary(
    rows: list[StageSummary], console: Console | None = None, title: str = "Run summary"
) -> None:
    """Print the summary table to `console` (stdout by default)."""
    if console is None:  # rich assumes 80 columns off a terminal (Ray job logs): too narrow for this table
        console = Console(width=max(Console().width, 170))
    console.print(summary_table(rows, title))
