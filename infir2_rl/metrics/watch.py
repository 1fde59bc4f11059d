"""`infir2-rl report RUN_DIR --watch`: a live view of a local run from its files alone (no server).

Every `interval_s` it re-reads each stage's `metrics.jsonl`, redraws the report PNGs (RUN_DIR/report/)
and shows one progress bar per stage with its ETA above the run summary table. A stage's planned step
count and start time come from `RUN_DIR/<stage>/progress.json`, written when its training loop (re)starts
(`write_stage_plan`, called by `stages.common.progress_bar`); an RL stage written before that file
existed is read from its config.yaml (`rollout.num_steps`, capped by `trainer.max_steps`). The ETA is the
stage's mean seconds per step since its latest (re)start times the steps left; step 0 (the evaluation
before training) is not counted as a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from infir2_rl.metrics import names
from infir2_rl.metrics.logger import JSONL_NAME

PLAN_FILE = "progress.json"
FINAL_DIR = "final"  # the stage's published checkpoint (stages/common.py): present once it finished


def write_stage_plan(run_dir: Path, total_steps: int) -> None:
    """Record how many steps the stage will run and when its loop (re)started, for the watcher's progress
    bar and clock (one small atomic write)."""
    tmp = run_dir / f".{PLAN_FILE}.tmp"
    tmp.write_text(json.dumps({"total_steps": int(total_steps), "started": time.time()}))
    tmp.replace(run_dir / PLAN_FILE)


@dataclasses.dataclass(frozen=True)
class StageProgress:
    name: str
    # Last training step logged and the planned last step (None when unknown).
    step: int
    total_steps: int | None
    finished: bool
    # Seconds since the stage's latest (re)start, and the estimated seconds left (None before the first step).
    elapsed_s: float
    eta_s: float | None
    # Newest value of a few headline metrics (loss, reward, accuracy) where logged.
    latest: dict[str, float]


HEADLINE = (names.TRAIN_LOSS, names.ROLLOUT_REWARD_MEAN, names.EVAL_ACCURACY)


def _read_plan(stage_dir: Path) -> dict[str, float]:
    plan = stage_dir / PLAN_FILE
    return {k: float(v) for k, v in json.loads(plan.read_text()).items()} if plan.is_file() else {}


def _planned_steps(stage_dir: Path, plan: dict[str, float]) -> int | None:
    if "total_steps" in plan:
        return int(plan["total_steps"])
    config = stage_dir / "config.yaml"
    if config.is_file():
        cfg: dict[str, Any] = yaml.safe_load(config.read_text()) or {}
        if cfg.get("kind") == "rl":
            num_steps = int(cfg["rollout"]["num_steps"])
            max_steps = (cfg.get("trainer") or {}).get("max_steps")
            return min(num_steps, int(max_steps)) if max_steps else num_steps
    return None


def stage_progress(stage_dir: Path, now: float | None = None) -> StageProgress:
    """Progress of one stage directory from its metrics.jsonl (records of a resumed attempt replace the old)."""
    now = time.time() if now is None else now
    times: dict[int, float] = {}  # first record time of each step of the latest attempt
    attempt_start = 0  # first step after the last time the step count went back (a resume)
    latest: dict[str, float] = {}
    plan = _read_plan(stage_dir)
    restarted = plan.get("started", -math.inf)
    for line in (stage_dir / JSONL_NAME).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            step, when = int(record["step"]), float(record["time"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line while the stage writes
        if times and step < max(times):  # resumed from an earlier checkpoint: a new attempt
            times = {s: t for s, t in times.items() if s < step}
            attempt_start = step
        if (
            step not in times or times[step] < restarted <= when
        ):  # a step re-logged after a restart counts anew
            times[step] = when
        latest |= {k: float(record[k]) for k in HEADLINE if isinstance(record.get(k), (int, float))}
    trained = sorted(s for s in times if s > 0)
    step = trained[-1] if trained else 0
    total = _planned_steps(stage_dir, plan)
    finished = (stage_dir / FINAL_DIR).is_dir()
    # The loop's latest (re)start as the stage recorded it, else the first record of the latest attempt.
    start = plan.get("started", min((t for s, t in times.items() if s >= attempt_start), default=now))
    timed = sorted(s for s, t in times.items() if s > 0 and t >= start)  # steps of the latest attempt
    eta = None
    if timed and total is not None and not finished:
        if len(timed) >= 2:  # steady state: from the attempt's first step to its last
            seconds_per_step = (times[timed[-1]] - times[timed[0]]) / (timed[-1] - timed[0])
        else:  # one step so far: its time since the loop started (a step-0 evaluation included)
            seconds_per_step = times[timed[0]] - start
        eta = max(total - step, 0) * seconds_per_step
    elapsed = (max(times.values()) if finished and times else now) - start
    return StageProgress(stage_dir.name, step, total, finished, elapsed, eta, latest)


def run_stages(run_dir: Path) -> list[Path]:
    """The stage directories of a run (the run itself for a one-stage run), in the order they started."""
    if (run_dir / JSONL_NAME).is_file():
        return [run_dir]
    return sorted((p.parent for p in run_dir.glob(f"*/{JSONL_NAME}")), key=lambda d: (_first_time(d), d.name))


def _first_time(stage_dir: Path) -> float:
    with (stage_dir / JSONL_NAME).open(encoding="utf-8") as f:
        try:
            return float(json.loads(f.readline())["time"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            return 0.0


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_table(rows: list[StageProgress]) -> Table:
    """One line per stage: bar, step/total, elapsed, ETA, headline metrics."""
    table = Table(title="Progress", title_justify="left")
    for column in ("stage", "", "step", "elapsed", "ETA", "latest"):
        table.add_column(column, justify="right" if column in ("step", "elapsed", "ETA") else "left")
    for row in rows:
        total = row.total_steps or max(row.step, 1)
        bar = ProgressBar(total=total, completed=min(row.step, total), width=30)
        status = "done" if row.finished else _clock(row.eta_s)
        latest = ", ".join(f"{k.split('/')[-1]} {v:.3g}" for k, v in row.latest.items())
        step = f"{row.step}/{row.total_steps if row.total_steps is not None else '?'}"
        table.add_row(row.name, bar, step, _clock(row.elapsed_s), status, latest)
    return table


def watch(
    run_dir: str | Path, interval_s: float = 15.0, max_updates: int | None = None
) -> list[StageProgress]:
    """Refresh the PNGs, progress and summary of RUN_DIR every `interval_s` until Ctrl-C, until a one-stage
    run has finished, or after `max_updates` refreshes; returns the last progress rows."""
    from infir2_rl.metrics.report import NoStepsYet, make_report, summarize, summary_table

    run_dir = Path(run_dir)
    console = Console()
    # make_report logs each plot it skips for lack of data: once is enough, not every refresh
    logging.getLogger("infir2_rl.metrics.report").setLevel(logging.WARNING)
    rows: list[StageProgress] = []
    updates = 0
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                stages = run_stages(run_dir)
                if stages:
                    rows = [stage_progress(d) for d in stages]
                    try:
                        make_report(run_dir)
                        summary = summary_table(summarize(run_dir), title=f"Run summary: {run_dir}")
                        live.update(Group(progress_table(rows), summary), refresh=True)
                    except NoStepsYet:  # its metrics.jsonl holds no step yet: the table alone
                        live.update(progress_table(rows), refresh=True)
                else:
                    live.update(f"waiting for {run_dir}/**/{JSONL_NAME} ...", refresh=True)
                updates += 1
                one_stage_done = stages == [run_dir] and rows and rows[0].finished
                if one_stage_done or (max_updates is not None and updates >= max_updates):
                    break
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass
    drawn = sorted((run_dir / "report").glob("*.png")) if (run_dir / "report").is_dir() else []
    console.print(
        f"report PNGs in {run_dir / 'report'}" if drawn else f"no metrics in {run_dir} yet: nothing drawn"
    )
    return rows
