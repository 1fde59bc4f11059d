"""Where a profiled step leaves the GPU idle, and what the host was doing then (from torch.profiler's Chrome trace).

    python bench/train_step.py --cuda-graphs on --seq 2048 --profile --trace OUT   # OUT/<mode>.json per mode
    python bench/gpu_idle.py OUT/bf16+graphs.json OUT/fp8+graphs.json [--min-us 5] [--top 12]

Why: at 2,048 tokens per micro-batch the profiled steps' device kernels summed to 0.82-0.84 of the step time
(train_step.py's "the GPU waits for the host" line), and FP8 waited ~2 ms longer than BF16. A kernel sum cannot
say where. This script takes every GPU activity (kernels, copies, memsets) of the trace, merges them into busy
periods over all streams, and lists the idle gaps between the first and the last of them (at least
``--min-us``). Each gap ends with some launch; the host call that made it (matched by the trace's correlation
id) and the host ops enclosing that call say what the host was busy with while the GPU waited. Gaps are summed
by the outermost enclosing op and by the op that directly made the launch.

Runs anywhere (it reads a JSON file); the trace comes from a GPU run.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
HOST_OP_CATS = {"cpu_op", "user_annotation"}


@dataclass
class Gap:
    start: float  # us
    end: float
    next_gpu: str  # the GPU activity that ended it
    launch: str  # the host call that launched it ("?" when the trace has no match)
    chain: tuple[str, ...]  # host ops enclosing that call, outermost first

    @property
    def us(self) -> float:
        return self.end - self.start


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def idle_gaps(trace: dict[str, Any], min_us: float = 5.0) -> tuple[list[Gap], float, float]:
    """(gaps of at least ``min_us``, GPU busy us, span us from the first GPU activity to the end of the last)."""
    events = _events(trace)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return [], 0.0, 0.0
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    host_ops: dict[Any, list[dict[str, Any]]] = defaultdict(list)  # tid -> ops sorted by start
    for e in events:
        if e.get("cat") in HOST_OP_CATS:
            host_ops[e.get("tid")].append(e)
    for ops in host_ops.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in host_ops.items()}

    def chain(call: dict[str, Any]) -> tuple[str, ...]:
        ops, ts = host_ops.get(call.get("tid"), []), call["ts"]
        i = bisect.bisect_right(starts.get(call.get("tid"), []), ts)
        enclosing = [e for e in ops[:i] if e["ts"] <= ts and e["ts"] + e["dur"] >= ts + call["dur"]]
        return tuple(e["name"] for e in enclosing)  # sorted by start: outermost first

    gaps: list[Gap] = []
    busy = 0.0
    span_start, busy_end = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"]
    period_start = span_start
    for e in gpu[1:]:
        if e["ts"] > busy_end:
            busy += busy_end - period_start
            if e["ts"] - busy_end >= min_us:
                call = launches.get(e.get("args", {}).get("correlation"))
                gaps.append(
                    Gap(
                        busy_end,
                        e["ts"],
                        e["name"],
                        call["name"] if call else "?",
                        chain(call) if call else (),
                    )
                )
            period_start = e["ts"]
        busy_end = max(busy_end, e["ts"] + e["dur"])
    busy += busy_end - period_start
    return gaps, busy, busy_end - span_start


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report(path: Path, min_us: float, top: int) -> None:
    gaps, busy, span = idle_gaps(json.loads(path.read_text()), min_us)
    idle = sum(g.us for g in gaps)
    print(f"== {path.name}: GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({busy / max(span, 1):.1%}), "
          f"{len(gaps)} gaps >= {min_us:g} us totalling {idle / 1e3:.2f} ms")  # fmt: skip
    for title, key in (
        ("outermost host op", lambda g: g.chain[0] if g.chain else "(none)"),
        ("host op making the launch", lambda g: g.chain[-1] if g.chain else g.launch),
    ):
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for g in gaps:
            sums[key(g)][0] += g.us
            sums[key(g)][1] += 1
        print(f"  by {title}:")
        for name, (us, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {us / 1e3:8.3f} ms {int(n):5d} gaps  {_short(name, 90)}")
    print(f"  largest {min(top, len(gaps))} gaps:")
    for g in sorted(gaps, key=lambda g: -g.us)[:top]:
        where = " > ".join(_short(n, 40) for n in g.chain[-3:]) or g.launch
        print(f"    {g.us:9.1f} us at +{(g.start - (gaps[0].start if gaps else 0)) / 1e3:7.2f} ms  before "
              f"{_short(g.next_gpu, 40)}  [{where}]")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "traces", nargs="+", type=Path, help="Chrome traces (bench/train_step.py --trace DIR)"
    )
    parser.add_argument("--min-us", type=float, default=5.0, help="smallest gap counted (us)")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    args = parser.parse_args(argv)
    for path in args.traces:
        if not path.is_file():
            parser.error(f"{path}: no such trace file")
        report(path, args.min_us, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
