"""bench/trace_gaps.py on a hand-made trace: device activity merged over streams, idle gaps charged to the host
op around the launch that ended them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "trace_gaps", Path(__file__).parents[1] / "bench" / "trace_gaps.py"
)
assert _SPEC is not None and _SPEC.loader is not None
trace_gaps = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_gaps)


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": {}}
    if corr is not None:
        event["args"]["correlation"] = corr
    return event


TRACE = {
    "traceEvents": [
        _x("step", "user_annotation", 0, 1000),
        _x("Optimizer.step#FlatAdamW.step", "user_annotation", 500, 300),
        _x("aten::mm", "cpu_op", 10, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 12, 5, corr=1),
        _x("cudaLaunchKernel", "cuda_runtime", 600, 5, corr=2),
        _x("cudaGraphLaunch", "cuda_runtime", 40, 5, corr=3),
        _x("gemm", "kernel", 100, 50, tid=7, corr=1),
        _x("graph kernel", "kernel", 120, 60, tid=8, corr=3),  # overlaps the gemm on another stream
        _x("adamw", "kernel", 700, 40, tid=7, corr=2),  # a 520 us gap after 180
        _x("memset", "gpu_memset", 742, 1, tid=7),  # a 2 us gap: below min_us
        {"ph": "i", "name": "marker", "cat": "kernel", "ts": 900, "tid": 7, "pid": 0},  # not a duration event
    ]
}


def test_gaps_are_merged_over_streams_and_charged_to_the_launching_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [e for e in TRACE["traceEvents"] if e.get("ph") == "X"]
    found = trace_gaps.gaps(events, min_us=5)
    assert [(start, end, nxt["name"]) for start, end, nxt in found] == [(180, 700, "adamw")]
    assert [(s, e) for s, e, _ in trace_gaps.gaps(events, min_us=1)] == [(180, 700), (740, 742)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    assert trace_gaps.main([str(path), "--min-us", "5"]) == 0
    out = capsys.readouterr().out
    assert "1 gaps >= 5 us totalling 0.52 ms" in out
    # Only cpu_op events are charged: no cpu_op is open at the launch at 600 (annotations are not ops).
    assert "1x  (no op)" in out and "Optimizer.step" not in out


def test_a_trace_without_device_activity_says_so(tmp_path: Path) -> None:
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}))
    assert trace_gaps.main([str(path)]) == 1
