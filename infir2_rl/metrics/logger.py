"""One metrics logger fanning out to metrics.jsonl, TensorBoard and Ray's metrics API.

- `RUN_DIR/metrics.jsonl`: one JSON object per `log` call, `{"step", "time", <metrics>...}`, opened in
  append mode so a resumed run continues the same file (the report keeps the newest record of a
  step that was logged twice). Non-finite values are written as `null` and listed under
  `"nonfinite": {"name": "nan" | "inf" | "-inf"}` so they are never mistaken for missing data.
- `RUN_DIR/tensorboard/`: TensorBoard scalars, tag = metric name.
- `ray.util.metrics.Gauge` per metric name (only when Ray is initialized), tagged with the stage,
  so the numbers show on the Ray dashboard and its Prometheus endpoint. Prometheus names allow
  `[a-zA-Z0-9_]` only: `train/loss` becomes `infir2_train_loss` (Ray exports it as
  `ray_infir2_train_loss`). Non-finite values are not sent: a gauge stuck at NaN hides the last good value.
"""

from __future__ import annotations

import json
import math
import re
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from infir2_rl.metrics.names import TIME_PREFIX

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def prometheus_name(name: str, prefix: str = "infir2") -> str:
    """`train/loss` -> `infir2_train_loss`: Prometheus allows letters, digits and `_`, not a leading digit."""
    body = re.sub(r"[^a-zA-Z0-9_]+", "_", name).strip("_")
    full = f"{prefix}_{body}" if prefix else body
    full = re.sub(r"_+", "_", full)
    return full if re.match(r"[a-zA-Z_]", full) else f"_{full}"


class MetricsLogger:
    """Log scalar metrics per step to jsonl, TensorBoard and Ray gauges; use as a context manager or call close()."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        ray_metrics: bool = True,
        jsonl: bool = True,
        prefix: str = "infir2",
        stage: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        # The stage tag tells stages of one pipeline apart on the dashboard.
        self.stage = stage if stage is not None else self.run_dir.name
        self._jsonl = (self.run_dir / JSONL_NAME).open("a", encoding="utf-8") if jsonl else None
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        self._ray_metrics = ray_metrics
        self._gauges: dict[str, Any] = {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` at `step`; several calls for the same step are fine (e.g. train, then eval)."""
        values: dict[str, float | None] = {}
        nonfinite: dict[str, str] = {}
        for name, raw in metrics.items():
            value = float(raw)
            if math.isfinite(value):
                values[name] = value
            else:
                values[name] = None
                nonfinite[name] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        if self._jsonl is not None:
            record: dict[str, Any] = {"step": int(step), "time": time.time(), **values}
            if nonfinite:
                record["nonfinite"] = nonfinite
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()  # a crashed run keeps every step it logged
        if self._writer is not None:
            for name, raw in metrics.items():
                self._writer.add_scalar(name, float(raw), global_step=int(step))
            self._writer.flush()
        if self._ray_metrics:
            self._log_ray({name: value for name, value in values.items() if value is not None})

    def _log_ray(self, values: Mapping[str, float]) -> None:
        import ray

        if not ray.is_initialized():
            return
        from ray.util.metrics import Gauge

        for name, value in values.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(prometheus_name(name, self.prefix), description=name, tag_keys=("stage",))
                gauge.set_default_tags({"stage": self.stage})
                self._gauges[name] = gauge
            gauge.set(value)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class PhaseTimer:
    """Accumulate wall time per named phase: `with timer("rollout"): ...`, then `timer.as_metrics()`.

    A phase entered several times in one step (e.g. one weight push per engine) adds up.
    """

    def __init__(self) -> None:
        self.totals_s: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals_s[phase] += time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        """`{"time/<phase>_s": seconds}` for every phase timed since the last reset."""
        return {f"{TIME_PREFIX}{phase}_s": seconds for phase, seconds in self.totals_s.items()}

    def reset(self) -> None:
        self.totals_s.clear()


def peak_memory_gb() -> float:
    """Peak memory of this process in GiB: CUDA max allocated (since the last ``memory_gb(reset_peak=True)``)
    when CUDA is in use, else the RSS high-water mark."""
    return memory_gb()[0]


def memory_gb(reset_peak: bool = False) -> tuple[float, float]:
    """(peak, reserved) of this process in GiB. CUDA in use: the allocator's max allocated since its last
    reset, and what it holds reserved now (allocated plus cached blocks: what another process on the GPU
    cannot have); ``reset_peak`` then restarts the peak. Else the RSS high-water mark (it never restarts)
    and 0."""
    torch = sys.modules.get("torch")  # never import torch just to find out CUDA is unused
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = float(torch.cuda.max_memory_allocated()) / 2**30
        reserved = float(torch.cuda.memory_reserved()) / 2**30
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return peak, reserved
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is kilobytes on Linux, bytes on macOS.
    bytes_used = max_rss if sys.platform == "darwin" else max_rss * 1024
    return bytes_used / 2**30, 0.0


def progress(total: int, desc: str, enabled: bool | None = None) -> tqdm:
    """A tqdm bar for local runs; `enabled=None` shows it only on an interactive terminal (not in Ray job logs)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)
