"""bench/gpu_idle.py on a hand-made trace: busy periods merged over streams, gaps attributed to the host ops
around the launch that ended them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_idle", Path(__file__).parents[1] / "bench" / "gpu_idle.py"
)
assert _SPEC is not None and _SPEC.loader is not None
gpu_idle = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_idle"] = gpu_idle  # (its dataclass looks its module up)
_SPEC.loader.exec_module(gpu_idle)


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


def test_gaps_are_merged_over_streams_and_attributed_to_the_launching_op(tmp_path: Path) -> None:
    gaps, busy, span = gpu_idle.idle_gaps(TRACE, min_us=5)
    assert span == pytest.approx(743 - 100)
    assert busy == pytest.approx(80 + 40 + 1)  # 100..180 merged, 700..740, 742..743
    assert len(gaps) == 1
    (gap,) = gaps
    assert (gap.start, gap.end, gap.us) == (180, 700, 520)
    assert gap.next_gpu == "adamw" and gap.launch == "cudaLaunchKernel"
    assert gap.chain == ("step", "Optimizer.step#FlatAdamW.step")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    assert gpu_idle.main([str(path), "--min-us", "1"]) == 0  # the 2 us gap counted too: prints, no error


def test_a_trace_without_gpu_activity_has_no_gaps() -> None:
    assert gpu_idle.idle_gaps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}) == ([], 0.0, 0.0)
