"""Where the GPU waits for the host, from a torch.profiler Chrome trace (``bench/train_step.py --trace DIR``).

    python bench/trace_gaps.py TRACE.json [--top 20] [--min-us 20]

Device activity is the union of the trace's kernels, memcpys and memsets. Each idle stretch between them of at
least ``--min-us`` is a gap; it is charged to the host op that launched the work after it (the innermost and
the outermost ``cpu_op`` around that launch), and marked ``sync`` when a host synchronization (a
``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize`` or a blocking memcpy) returned
inside it: the host had waited for the device to drain and the device then waited for the host. Prints the
total idle time, the idle time by launching op, and the largest gaps.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_NAMES = ("Synchronize", "cudaMemcpy ", "cudaMemcpy\t")


def load(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def gaps(events: list[dict[str, Any]], min_us: float) -> list[tuple[float, float, dict[str, Any]]]:
    """(start, end, first device event after) of each idle stretch >= min_us, in time order."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    out = []
    busy_until = None
    for e in device:
        if busy_until is not None and e["ts"] - busy_until >= min_us:
            out.append((busy_until, e["ts"], e))
        end = e["ts"] + e["dur"]
        busy_until = end if busy_until is None else max(busy_until, end)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=20, help="largest gaps to list")
    parser.add_argument("--min-us", type=float, default=20.0, help="shortest idle stretch counted, us")
    args = parser.parse_args(argv)
    events = load(args.trace)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if not device:
        print(f"{args.trace}: no device events (a CPU trace?)")
        return 1
    span = max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)
    busy = sum(e["dur"] for e in device)
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in cpu_ops]
    syncs = sorted(
        e["ts"] + e["dur"]
        for e in events
        if e.get("cat") == "cuda_runtime" and any(s in e["name"] + " " for s in SYNC_NAMES)
    )

    def around(t: float) -> tuple[str, str]:
        """(innermost, outermost) cpu_op open at host time t."""
        open_ops = [e for e in cpu_ops[: bisect.bisect_right(starts, t)] if e["ts"] + e["dur"] >= t]
        if not open_ops:
            return "(no op)", "(no op)"
        inner = min(open_ops, key=lambda e: e["dur"])
        outer = max(open_ops, key=lambda e: e["dur"])
        return inner["name"], outer["name"]

    found = gaps(events, args.min_us)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    rows = []
    for start, end, nxt in found:
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        inner, outer = around(launch["ts"]) if launch else ("(launch not found)", "")
        synced = any(start <= t <= end for t in syncs[bisect.bisect_left(syncs, start) :][:1])
        key = f"{outer} > {inner}" if outer != inner else inner
        by_op[key][0] += end - start
        by_op[key][1] += 1
        rows.append((end - start, key, synced, nxt["name"]))
    idle = sum(r[0] for r in rows)
    print(
        f"{args.trace.name}: device span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms (kernels may overlap), "
        f"{len(rows)} gaps >= {args.min_us:g} us totalling {idle / 1e3:.2f} ms, "
        f"{sum(1 for r in rows if r[2])} after a host sync ({sum(r[0] for r in rows if r[2]) / 1e3:.2f} ms)"
    )
    print("idle ms by the host op that launched the next work (outermost > innermost):")
    for key, (us, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {us / 1e3:8.3f} ms {int(n):5d}x  {key[:110]}")
    print(f"largest {args.top} gaps:")
    for us, key, synced, name in sorted(rows, reverse=True)[: args.top]:
        print(f"  {us / 1e3:8.3f} ms {'sync' if synced else '    '}  {key[:70]}  -> {name[:50]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
