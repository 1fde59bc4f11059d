"""MetricsLogger fan-out (jsonl, TensorBoard, real Ray metrics endpoint), timers, memory, progress bar."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from infir2_rl.metrics import MetricsLogger, PhaseTimer, names, peak_memory_gb, progress, prometheus_name


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_steps_appends_on_resume_and_flags_nonfinite(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, ray_metrics=False) as logger:
        logger.log(1, {names.TRAIN_LOSS: 2.5, names.TRAIN_LR: 1e-5})
        logger.log(2, {names.TRAIN_LOSS: 2.0, names.TRAIN_GRAD_NORM: math.nan})
    # A resumed run opens the same file again and continues it.
    with MetricsLogger(tmp_path, tensorboard=False, ray_metrics=False) as logger:
        logger.log(3, {names.TRAIN_LOSS: 1.5, names.TRAIN_GRAD_NORM: -math.inf})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0][names.TRAIN_LOSS] == 2.5 and records[0][names.TRAIN_LR] == 1e-5
    assert all(isinstance(r["time"], float) for r in records)
    assert "nonfinite" not in records[0]
    assert records[1][names.TRAIN_GRAD_NORM] is None
    assert records[1]["nonfinite"] == {names.TRAIN_GRAD_NORM: "nan"}
    assert records[2]["nonfinite"] == {names.TRAIN_GRAD_NORM: "-inf"}


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, ray_metrics=False, jsonl=False) as logger:
        for step, loss in [(1, 3.0), (2, 2.25), (3, 1.75)]:
            logger.log(step, {names.TRAIN_LOSS: loss})
    assert not (tmp_path / "metrics.jsonl").exists()
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert names.TRAIN_LOSS in accumulator.Tags()["scalars"]
    events = accumulator.Scalars(names.TRAIN_LOSS)
    assert [(e.step, e.value) for e in events] == [(1, 3.0), (2, 2.25), (3, 1.75)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("train/loss", "infir2_train_loss"),
        ("mismatch/abs_logp_diff_mean", "infir2_mismatch_abs_logp_diff_mean"),
        ("perf/tokens-per.s", "infir2_perf_tokens_per_s"),
        ("//odd  name//", "infir2_odd_name"),
    ],
)
def test_prometheus_name_follows_prometheus_rules(name: str, expected: str) -> None:
    assert prometheus_name(name) == expected
    assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prometheus_name("3d/x", prefix=""))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape_until(port: int, pattern: re.Pattern[str], deadline_s: float) -> re.Match[str] | None:
    """Scrape Ray's Prometheus endpoint until `pattern` matches; Ray exports on a timer."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                match = pattern.search(response.read().decode())
            if match:
                return match
        except OSError:
            pass  # the exporter comes up a moment after ray.init returns
        time.sleep(0.5)
    return None


def test_metrics_reach_rays_prometheus_endpoint(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    # Ray exports every max(metrics_report_interval_ms, 1 s) (default 10 s); 1 s keeps the test short.
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        with MetricsLogger(tmp_path, tensorboard=False, stage="sft_demo") as logger:
            logger.log(1, {names.TRAIN_LOSS: 4.0, names.TRAIN_GRAD_NORM: math.inf})
            logger.log(2, {names.TRAIN_LOSS: 1.5, names.TRAIN_GRAD_NORM: math.nan})
            # Ray prefixes its exported names with "ray_"; the stage is a label.
            pattern = re.compile(r'^ray_infir2_train_loss\{[^}]*stage="sft_demo"[^}]*\} (\S+)$', re.MULTILINE)
            match = _scrape_until(port, pattern, deadline_s=30)
        assert match is not None, "infir2_train_loss never appeared on Ray's metrics endpoint"
        assert float(match.group(1)) == 1.5
        # Non-finite values are never sent, so the grad-norm gauge was never even created.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert "infir2_train_grad_norm" not in response.read().decode()
    finally:
        ray.shutdown()


def test_phase_timer_accumulates_named_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    monkeypatch.setattr("infir2_rl.metrics.logger.time.perf_counter", lambda: next(clock))
    timer = PhaseTimer()
    with timer("rollout"):
        pass
    with timer("train"):
        pass
    with pytest.raises(RuntimeError), timer("rollout"):  # time is recorded even when the phase fails
        raise RuntimeError("boom")
    assert timer.as_metrics() == {"time/rollout_s": 2.75, "time/train_s": 1.0}
    timer.reset()
    assert timer.as_metrics() == {}


def test_peak_memory_is_a_plausible_number_of_gib() -> None:
    # This test process has imported torch and pytest: well over 50 MiB, well under 1 TiB.
    assert 0.05 < peak_memory_gb() < 1024
    from infir2_rl.metrics.logger import memory_gb

    peak, reserved = memory_gb(reset_peak=True)  # CPU: the RSS high-water mark, which never restarts
    assert memory_gb()[0] >= peak > 0.05 and reserved == 0.0


def test_progress_bar_counts_and_can_be_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    with progress(total=3, desc="sft steps", enabled=True) as bar:
        for _ in range(3):
            bar.update(1)
        assert bar.n == 3
    assert "sft steps" in capsys.readouterr().err
    with progress(total=3, desc="quiet", enabled=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
