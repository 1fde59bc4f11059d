"""The Grafana dashboard of our metrics, in the layout of Ray's own dashboards (so it sits beside them).

Ray's dashboards (ray/dashboard/modules/metrics/dashboards/*) are Grafana 7.5-era JSON: schemaVersion 27,
a hidden `datasource` variable (type datasource, query "prometheus") that every panel names as
`${datasource}`, a `SessionName` variable read from the series' labels, legacy "graph" panels laid out
two per row (w 12, h 8 on a 24-column grid), targets with `expr`, `legendFormat`, `refId`. Ours adds a
`stage` variable (the tag MetricsLogger puts on every gauge) and one row per concern. The queries are
built from `names.py` through `prometheus_name`, so a renamed metric cannot leave a dead panel.

    python -m infir2_rl.metrics.grafana > scripts/grafana/infir2_rl_dashboard.json   # regenerate
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from infir2_rl.metrics import names
from infir2_rl.metrics.logger import prometheus_name

UID = "infir2RlDashboard"
PANEL_W, PANEL_H, ROW_H = 12, 8, 1
# Ray prefixes every application metric with "ray_".
RAY_PREFIX = "ray_"


@dataclass(frozen=True)
class PanelSpec:
    title: str
    # Metric names (names.py); one query (one line per stage) each.
    metrics: tuple[str, ...]
    unit: str
    description: str


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Learning",
        (
            PanelSpec(
                "Rollout reward (mean)",
                (names.ROLLOUT_REWARD_MEAN,),
                "none",
                "Mean reward of the step's rollouts.",
            ),
            PanelSpec(
                "Held-out accuracy", (names.EVAL_ACCURACY,), "percentunit", "Greedy answers on the test set."
            ),
            PanelSpec(
                "Response length (mean)", (names.ROLLOUT_RESPONSE_LEN_MEAN,), "none", "Tokens per response."
            ),
            PanelSpec(
                "Truncated responses",
                (names.ROLLOUT_TRUNCATED_FRAC,),
                "percentunit",
                "Cut at the max length.",
            ),
            PanelSpec("Train loss", (names.TRAIN_LOSS,), "none", "Mean per-token loss of the step."),
            PanelSpec("Gradient norm", (names.TRAIN_GRAD_NORM,), "none", "Global norm before clipping."),
        ),
    ),
    (
        "Train/rollout mismatch",
        (
            PanelSpec(
                "|logp_train - logp_rollout|",
                (names.MISMATCH_ABS_LOGP_DIFF_MEAN, names.MISMATCH_ABS_LOGP_DIFF_MAX),
                "none",
                "Mean and max over the step's tokens (slime's CI gate: mean < 0.1).",
            ),
            PanelSpec(
                "K3 KL(rollout || train)",
                (names.MISMATCH_K3,),
                "none",
                "E[exp(r) - r - 1], r = logp_train - logp_rollout; dense models 1e-5..1e-3.",
            ),
            PanelSpec(
                "TIS clip / MIS mask fraction",
                (names.MISMATCH_TIS_CLIP_FRAC, names.MISMATCH_MIS_MASK_FRAC),
                "percentunit",
                "Tokens whose importance weight TIS clipped, or MIS masked out.",
            ),
            PanelSpec(
                "Importance ratio min / max",
                (names.MISMATCH_IS_RATIO_MIN, names.MISMATCH_IS_RATIO_MAX),
                "none",
                "exp(logp_train_old - logp_rollout) over the step's tokens.",
            ),
        ),
    ),
    (
        "Speed",
        (
            PanelSpec(
                "Tokens per second",
                (names.PERF_TOKENS_PER_S, names.ROLLOUT_TOKENS_PER_S),
                "none",
                "Trainer tokens/s of the step and rollout sampling tokens/s.",
            ),
            PanelSpec(
                "Weight sync time",
                (names.WEIGHT_SYNC_PUSH_S, names.WEIGHT_SYNC_CHECK_S),
                "s",
                "Push to every engine, and the self-check after it.",
            ),
            PanelSpec("Step time", (names.PERF_STEP_TIME_S,), "s", "Trainer step as the driver saw it."),
            PanelSpec(
                "Peak memory", (names.PERF_PEAK_MEMORY_GB,), "decgbytes", "CUDA max allocated, or peak RSS."
            ),
            PanelSpec(
                "Memory per RL phase",
                (
                    names.MEMORY_ROLLOUT_PEAK_GB,
                    names.MEMORY_SCORE_PEAK_GB,
                    names.MEMORY_TRAIN_PEAK_GB,
                    names.MEMORY_SYNC_PEAK_GB,
                    names.MEMORY_TRAIN_RESERVED_GB,
                ),
                "decgbytes",
                "Peak CUDA allocation of the engines (rollout) and the trainer (score, train, weight push), and"
                " the trainer allocator's reserved memory after training.",
            ),
        ),
    ),
)


def series_name(metric: str) -> str:
    """The Prometheus series Ray exports for one of our metric names: `train/loss` -> `ray_infir2_train_loss`."""
    return RAY_PREFIX + prometheus_name(metric)


def panel_query(metric: str) -> str:
    return f'{series_name(metric)}{{SessionName=~"$SessionName", stage=~"$stage"}}'


def _variable(name: str, label: str, description: str) -> dict[str, object]:
    query = f"label_values({series_name(names.TRAIN_LOSS)}, {label})"
    return {
        "name": name,
        "type": "query",
        "description": description,
        "datasource": "${datasource}",
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 2,
        "hide": 0,
        "includeAll": True,
        "multi": name == "stage",
        "allValue": ".+",
        "sort": 2,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def _panel(spec: PanelSpec, panel_id: int, x: int, y: int) -> dict[str, object]:
    many = len(spec.metrics) > 1
    return {
        "type": "graph",
        "title": spec.title,
        "description": spec.description,
        "id": panel_id,
        "datasource": "${datasource}",
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "targets": [
            {
                "expr": panel_query(metric),
                "legendFormat": f"{{{{stage}}}} {metric.split('/')[-1]}" if many else "{{stage}}",
                "refId": chr(ord("A") + i),
                "interval": "",
            }
            for i, metric in enumerate(spec.metrics)
        ],
        "lines": True,
        "linewidth": 1,
        "fill": 0,
        "points": False,
        "stack": False,
        "nullPointMode": "connected",
        "legend": {"show": True, "values": True, "current": True, "max": True, "alignAsTable": True},
        "tooltip": {"shared": True, "sort": 0, "value_type": "individual"},
        "xaxis": {"mode": "time", "show": True, "values": []},
        "yaxes": [
            {"format": spec.unit, "logBase": 1, "show": True},
            {"format": "short", "logBase": 1, "show": False},
        ],
        "yaxis": {"align": False},
        "fieldConfig": {"defaults": {"unit": spec.unit}, "overrides": []},
        "options": {"alertThreshold": True},
        "pluginVersion": "7.5.17",
    }


def dashboard() -> dict[str, object]:
    """The dashboard as a dict (json.dumps it for Grafana's import or provisioning folder)."""
    panels: list[dict[str, object]] = []
    y, panel_id = 0, 1
    for row_title, specs in ROWS:
        panels.append(
            {"type": "row", "title": row_title, "id": panel_id, "collapsed": False, "panels": [],
             "gridPos": {"h": ROW_H, "w": 2 * PANEL_W, "x": 0, "y": y}}
        )  # fmt: skip
        y, panel_id = y + ROW_H, panel_id + 1
        for i, spec in enumerate(specs):
            panels.append(_panel(spec, panel_id, PANEL_W * (i % 2), y + PANEL_H * (i // 2)))
            panel_id += 1
        y += PANEL_H * ((len(specs) + 1) // 2)
    return {
        "title": "infir2-rl",
        "uid": UID,
        "version": 1,
        "schemaVersion": 27,
        "style": "dark",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "tags": ["infir2-rl"],
        "rayMeta": ["supportsFullGrafanaView"],
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "hide": 2,
                    "refresh": 1,
                    "includeAll": False,
                    "multi": False,
                    "current": {"selected": False},
                    "description": "The Prometheus that scrapes the Ray cluster.",
                },
                _variable("SessionName", "SessionName", "The Ray session (one per cluster start)."),
                _variable("stage", "stage", "Pipeline stage (the stage tag of every infir2-rl metric)."),
            ]  # fmt: skip
        },
        "panels": panels,
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=2))
