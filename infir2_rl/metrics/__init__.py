"""Metrics: one logger (jsonl, TensorBoard, Ray gauges), phase timers, and the run report."""

from infir2_rl.metrics.logger import MetricsLogger, PhaseTimer, peak_memory_gb, progress, prometheus_name
from infir2_rl.metrics.report import StageSummary, make_report, print_summary, summarize, summary_table

__all__ = [
    "MetricsLogger",
    "PhaseTimer",
    "StageSummary",
    "make_report",
    "peak_memory_gb",
    "print_summary",
    "progress",
    "prometheus_name",
    "summarize",
    "summary_table",
]
