"""Run report from synthetic metrics.jsonl files: stage order, resume handling, PNGs, summary numbers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from rich.console import Console

from infir2_rl.metrics import MetricsLogger, make_report, names, print_summary, summarize
from infir2_rl.metrics.report import load_run, make_comparison, stage_offsets


def write_jsonl(path: Path, records: list[dict], torn_tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)


@pytest.fixture
def pipeline_dir(tmp_path: Path) -> Path:
    """SFT (steps 1-4) then RL (steps 1-5, resumed once from step 2); RL sorts first by name, not by time."""
    sft = [
        {
            "step": s,
            "time": 100.0 + s,
            names.TRAIN_LOSS: 3.0 - 0.5 * s,
            names.PERF_TOKENS_PER_S: 1000.0,
            "time/train_s": 0.5,
        }
        for s in range(1, 5)
    ]
    sft[1][names.EVAL_ACCURACY] = 0.2
    sft.append({"step": 4, "time": 104.5, names.EVAL_ACCURACY: 0.3})  # eval logged separately, same step
    write_jsonl(tmp_path / "sft_stage1" / "metrics.jsonl", sft)

    def rl(step: int, t: float, reward: float, diff: float, k3: float | None) -> dict:
        record: dict[str, object] = {
            "step": step,
            "time": t,
            names.ROLLOUT_REWARD_MEAN: reward,
            names.ROLLOUT_RESPONSE_LEN_MEAN: 20.0 + step,
            names.ROLLOUT_TOKENS_PER_S: 50.0,
            names.MISMATCH_ABS_LOGP_DIFF_MEAN: diff,
            names.MISMATCH_K3: k3,
            "time/rollout_s": 2.0,
            "time/train_s": 1.0,
        }
        if k3 is None:
            record["nonfinite"] = {names.MISMATCH_K3: "nan"}
        return record

    first_attempt = [rl(1, 200.0, 0.1, 0.01, 1e-4), rl(2, 210.0, 0.2, 0.02, 0.0), rl(3, 220.0, 0.3, 0.9, 0.9)]
    # The run died after step 3 without checkpointing it, resumed from step 2 and re-ran step 3.
    resumed = [rl(3, 300.0, 0.35, 0.03, 3e-4), rl(4, 310.0, 0.4, 0.04, None), rl(5, 320.0, 0.5, 0.05, 5e-4)]
    resumed[-1][names.EVAL_ACCURACY] = 0.45
    write_jsonl(
        tmp_path / "rl_stage1" / "metrics.jsonl", first_attempt + resumed, torn_tail='{"step": 6, "ti'
    )
    return tmp_path


def test_stages_are_ordered_by_time_and_resumed_steps_replace_the_lost_attempt(pipeline_dir: Path) -> None:
    stages = load_run(pipeline_dir)
    assert [s.name for s in stages] == ["sft_stage1", "rl_stage1"]
    sft, rl = stages
    assert sft.steps == [1, 2, 3, 4]
    assert sft.records[3] == {
        names.TRAIN_LOSS: 1.0,
        names.PERF_TOKENS_PER_S: 1000.0,
        "time/train_s": 0.5,
        names.EVAL_ACCURACY: 0.3,
    }
    assert rl.steps == [1, 2, 3, 4, 5]
    assert rl.series(names.ROLLOUT_REWARD_MEAN) == ([1, 2, 3, 4, 5], [0.1, 0.2, 0.35, 0.4, 0.5])
    assert rl.series(names.MISMATCH_K3)[0] == [1, 2, 3, 5]  # the NaN step has no value
    assert stage_offsets(stages) == [0, 4]


def test_summary_numbers(pipeline_dir: Path) -> None:
    sft, rl = summarize(pipeline_dir)
    assert (sft.stage, sft.steps) == ("sft_stage1", 4)
    assert sft.first_reward is None and sft.last_reward is None
    # Its first eval is at step 2, not 0, and no stage ran before it: no starting accuracy.
    assert (sft.first_eval_accuracy, sft.last_eval_accuracy) == (None, 0.3)
    assert sft.mismatch_mean is None and sft.k3_mean is None
    assert sft.wall_time_s == pytest.approx(3.5)
    assert sft.phase_times_s == {"train": pytest.approx(2.0)}

    assert (rl.stage, rl.steps) == ("rl_stage1", 5)
    assert (rl.first_reward, rl.last_reward) == (0.1, 0.5)
    # No step-0 eval in RL: it started from SFT's final checkpoint, which SFT evaluated last (0.3).
    assert (rl.first_eval_accuracy, rl.last_eval_accuracy) == (0.3, 0.45)
    assert rl.mismatch_mean == pytest.approx((0.01 + 0.02 + 0.03 + 0.04 + 0.05) / 5)
    assert rl.k3_mean == pytest.approx((1e-4 + 0.0 + 3e-4 + 5e-4) / 4)
    assert rl.wall_time_s == pytest.approx(120.0)
    assert rl.phase_times_s == {"rollout": pytest.approx(10.0), "train": pytest.approx(5.0)}

    console = Console(record=True, width=200)
    print_summary([sft, rl], console=console)
    text = console.export_text()
    assert "sft_stage1" in text and "rl_stage1" in text
    assert "0.100 -> 0.500" in text and "0.450" in text


def test_report_writes_every_plot_with_data(pipeline_dir: Path) -> None:
    paths = make_report(pipeline_dir)
    assert sorted(p.name for p in paths) == sorted(
        ["reward.png", "accuracy.png", "response_length.png", "mismatch.png", "throughput.png", "loss.png"]
    )
    for path in paths:
        assert path.parent == pipeline_dir / "report"
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_report_skips_plots_without_data_and_reads_a_single_stage_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stage_dir = tmp_path / "sft_only"
    with MetricsLogger(stage_dir, tensorboard=False, ray_metrics=False) as logger:
        for step in range(1, 4):
            logger.log(step, {names.TRAIN_LOSS: 2.0 / step})
    with caplog.at_level(logging.INFO, logger="infir2_rl.metrics.report"):
        paths = make_report(stage_dir)
    assert [p.name for p in paths] == ["loss.png"]
    assert "no data for reward.png" in caplog.text
    (row,) = summarize(stage_dir)
    assert (row.stage, row.steps, row.last_reward) == ("sft_only", 3, None)


def test_run_dir_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty_stage").mkdir()
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        make_report(tmp_path)


def test_cli_report_compares_runs(pipeline_dir: Path, tmp_path: Path) -> None:
    import shutil

    from infir2_rl.cli import main

    other = tmp_path / "other_run"
    shutil.copytree(pipeline_dir, other)
    out = tmp_path / "cmp"
    assert main(["report", str(pipeline_dir), str(other), "--compare-out", str(out)]) == 0
    written = sorted(p.name for p in out.glob("*.png"))
    assert "compare_reward.png" in written and "compare_accuracy.png" in written
    assert "compare_mismatch.png" in written
    assert (other / "report" / "reward.png").exists()
    assert (
        main(["report", str(pipeline_dir), str(other)]) == 2
    )  # bad input: one line, exit 2 (tests/test_cli.py)
    with pytest.raises(ValueError, match="at least two"):
        make_comparison([pipeline_dir], out)


def test_a_run_without_a_readable_step_is_one_line_not_a_table_of_zeros(tmp_path: Path) -> None:
    from infir2_rl.metrics.report import load_run

    with pytest.raises(ValueError, match="no such directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "metrics.jsonl").write_text("not json\n{\n")
    for run in ("empty", "garbage"):
        with pytest.raises(ValueError, match="holds no readable step yet"):
            load_run(tmp_path / run)
