"""The live view (`report --watch`): per-stage progress and ETA from a run's files; the Grafana dashboard JSON."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from infir2_rl.metrics import names
from infir2_rl.metrics.grafana import dashboard, series_name
from infir2_rl.metrics.watch import run_stages, stage_progress, watch, write_stage_plan

REPO = Path(__file__).resolve().parents[1]


def write_records(stage_dir: Path, records: list[dict[str, float]]) -> None:
    stage_dir.mkdir(parents=True, exist_ok=True)
    with (stage_dir / "metrics.jsonl").open("a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def test_progress_and_eta_from_metrics_and_plan(tmp_path: Path) -> None:
    stage = tmp_path / "sft_stage1"
    # step 0 (eval before training) took 50 s; then 2 s per step from step 1 to step 4
    write_records(stage, [{"step": 0, "time": 1000.0, names.EVAL_ACCURACY: 0.1}])
    write_records(
        stage, [{"step": s, "time": 1050.0 + 2 * (s - 1), names.TRAIN_LOSS: 3.0 - s} for s in range(1, 5)]
    )
    (stage / "progress.json").write_text(json.dumps({"total_steps": 10, "started": 990.0}))
    row = stage_progress(stage, now=1060.0)
    assert (row.step, row.total_steps, row.finished) == (4, 10, False)
    assert row.eta_s == pytest.approx(6 * 2.0)  # 6 steps left at 2 s each; step 0's eval not counted
    assert row.elapsed_s == pytest.approx(70.0)  # since the loop started
    assert row.latest == {names.EVAL_ACCURACY: 0.1, names.TRAIN_LOSS: -1.0}


def test_eta_after_one_step_and_plan_written_by_the_stage(tmp_path: Path) -> None:
    stage = tmp_path / "sft"
    write_stage_plan(stage.parent, 7)  # a stage writes its plan into its own run dir
    plan = json.loads((stage.parent / "progress.json").read_text())
    assert plan["total_steps"] == 7 and abs(plan["started"] - time.time()) < 60
    write_records(stage, [{"step": 1, "time": 130.0}])
    (stage / "progress.json").write_text(json.dumps({"total_steps": 7, "started": 100.0}))
    assert stage_progress(stage, now=131.0).eta_s == pytest.approx(6 * 30.0)


def test_resumed_attempt_replaces_the_old_and_final_marks_done(tmp_path: Path) -> None:
    stage = tmp_path / "rl_stage1"
    write_records(stage, [{"step": s, "time": 100.0 + 10 * s} for s in range(1, 6)])  # 10 s/step, died at 5
    write_records(
        stage, [{"step": s, "time": 500.0 + 4 * (s - 3)} for s in range(3, 6)]
    )  # resumed at 3: 4 s/step
    (stage / "config.yaml").write_text("kind: rl\nrollout: {num_steps: 20}\ntrainer: {max_steps: 8}\n")
    row = stage_progress(stage, now=520.0)
    assert (row.step, row.total_steps) == (5, 8)  # RL without progress.json: min(num_steps, max_steps)
    assert row.eta_s == pytest.approx(3 * 4.0)
    (stage / "final").mkdir()
    done = stage_progress(stage, now=9999.0)
    assert done.finished and done.eta_s is None and done.elapsed_s == pytest.approx(508.0 - 500.0)


def test_restart_from_the_last_checkpoint_counts_only_the_new_attempt(tmp_path: Path) -> None:
    stage = tmp_path / "rl"
    write_records(stage, [{"step": s, "time": 100.0 + 10 * s} for s in range(1, 6)])  # killed after step 5
    # resumed from step 5's checkpoint at t=900: no step goes back, the plan's restart time tells
    (stage / "progress.json").write_text(json.dumps({"total_steps": 10, "started": 900.0}))
    write_records(stage, [{"step": s, "time": 900.0 + 3 * (s - 5)} for s in range(6, 8)])
    row = stage_progress(stage, now=907.0)
    assert (row.step, row.eta_s, row.elapsed_s) == (7, pytest.approx(3 * 3.0), pytest.approx(7.0))


def test_pipeline_stages_in_start_order_and_watch_writes_pngs(tmp_path: Path) -> None:
    write_records(tmp_path / "b_first", [{"step": 1, "time": 10.0, names.TRAIN_LOSS: 2.0}])
    write_records(tmp_path / "a_second", [{"step": 1, "time": 20.0, names.ROLLOUT_REWARD_MEAN: 0.5}])
    assert [d.name for d in run_stages(tmp_path)] == ["b_first", "a_second"]
    rows = watch(tmp_path, interval_s=0.0, max_updates=1)
    assert [r.name for r in rows] == ["b_first", "a_second"]
    assert {p.name for p in (tmp_path / "report").glob("*.png")} >= {"loss.png", "reward.png"}


def test_grafana_dashboard_is_generated_and_covers_the_issue_metrics() -> None:
    board = dashboard()
    committed = json.loads((REPO / "scripts" / "grafana" / "infir2_rl_dashboard.json").read_text())
    assert committed == board, (
        "regenerate: python -m infir2_rl.metrics.grafana > scripts/grafana/infir2_rl_dashboard.json"
    )
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]  # type: ignore[attr-defined]
    queried = {re.match(r"[a-z0-9_]+", e).group(0) for e in exprs}  # type: ignore[union-attr]
    wanted = (
        names.ROLLOUT_REWARD_MEAN, names.EVAL_ACCURACY, names.ROLLOUT_RESPONSE_LEN_MEAN,
        names.MISMATCH_ABS_LOGP_DIFF_MEAN, names.MISMATCH_K3, names.MISMATCH_TIS_CLIP_FRAC,
        names.PERF_TOKENS_PER_S, names.ROLLOUT_TOKENS_PER_S, names.WEIGHT_SYNC_PUSH_S,
    )  # fmt: skip
    assert {series_name(m) for m in wanted} <= queried
    assert all('stage=~"$stage"' in e for e in exprs)  # every panel splits and filters by stage
    ids = [p["id"] for p in board["panels"]]  # type: ignore[index]
    assert len(ids) == len(set(ids))


def test_watch_of_a_run_without_metrics_says_nothing_was_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert watch(tmp_path, interval_s=0.0, max_updates=1) == []
    out = capsys.readouterr().out
    assert "nothing drawn" in out and "report PNGs" not in out
