"""Writes deploy/grafana/tidal.json, the Grafana dashboard over the controller's
Prometheus metrics (controller/metrics.py). Run it after changing a panel:

    python deploy/grafana/make_dashboard.py

tests/unit/test_dashboard.py checks the written file is what this makes,
tests/integration/test_failures.py that every metric a panel queries is exported by a
running controller, and tests/integration/test_prometheus.py that a real Prometheus
scraping a live controller answers every query of every panel with data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "tidal.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The board's variable $job picks Tidal jobs by the metrics' job_id label (Prometheus'
# own job label is the scrape job).
JOB_FILTER = 'job_id=~"$job"'


def panel(title: str, kind: str, targets: list[tuple[str, str]], *, x: int, y: int, w: int = 12, h: int = 8,
          unit: str = "short", description: str = "", stacked: bool = False) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stacked else 0,
                              "showPoints": "never", "lineInterpolation": "stepAfter" if kind == "timeseries" else
                              "linear", "stacking": {"mode": "normal" if stacked else "none", "group": "A"}}
    result: dict[str, Any] = {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit, **({"custom": custom} if kind == "timeseries" else {})},
                        "overrides": []},
        "options": ({"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                     "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else
                    {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "value", "graphMode": "area", "textMode": "auto"}),
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + index),
                     "range": True} for index, (expr, legend) in enumerate(targets)],
    }
    return result


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[$__rate_interval])))", f"p{int(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


def dashboard() -> dict[str, Any]:
    panels = [
        panel("Jobs by state", "timeseries", [("sum by (state) (tidal_jobs)", "{{state}}")], x=0, y=0, w=8,
              stacked=True,
              description="Jobs the controller knows, by state (pending, running, degraded, finishing, …)."),
        panel("Units by state", "timeseries", [("sum by (state) (tidal_units)", "{{state}}")], x=8, y=0, w=8,
              stacked=True, description="Units (replicas, each a Slurm job) by state: submitted, joining, "
                                        "active, leaving, left, failed."),
        panel("Launchers connected", "stat", [("tidal_launchers_connected", "launchers")], x=16, y=0, w=8,
              description="Launcher sessions open on the controller: one per unit whose launcher registered."),
        panel("World size", "timeseries", [(f"tidal_world_size{{{JOB_FILTER}}}", "{{job_id}}")], x=0, y=8, w=12,
              description="Ranks in each job's current world: it breathes as units join, leave and fail."),
        panel("World changes", "timeseries",
              [(f"sum by (job_id) (increase(tidal_generations_formed_total{{{JOB_FILTER}}}[$__rate_interval]))",
                "{{job_id}}"),
               (f"tidal_generation{{{JOB_FILTER}}}", "{{job_id}} generation")], x=12, y=8, w=12,
              description="Worlds formed (grows, shrinks, recoveries) per interval, and each job's generation."),
        panel("Failures by cause", "timeseries",
              [("sum by (cause) (increase(tidal_failures_total[$__rate_interval]))", "{{cause}}")], x=0, y=16,
              w=12, stacked=True, description="Failures detected (worker exit, heartbeat, silent worker, lost node, "
                                              "…) per interval."),
        panel("Recoveries", "timeseries",
              [("sum(increase(tidal_recovery_duration_seconds_count[$__rate_interval]))", "recoveries"),
               ("sum(increase(tidal_stop_duration_seconds_count[$__rate_interval]))", "stop rounds")],
              x=12, y=16, w=12, description="Recoveries (failure detected → next world started) and stop rounds "
                                            "per interval."),
        panel("Recovery duration", "timeseries", quantiles("tidal_recovery_duration_seconds"), x=0, y=24, w=8,
              unit="s", description="Failure detection to the next world started."),
        panel("Stop duration", "timeseries", quantiles("tidal_stop_duration_seconds"), x=8, y=24, w=8, unit="s",
              description="Failure detection to every rank of the world stopped."),
        panel("Heartbeat latency", "timeseries", quantiles("tidal_heartbeat_latency_seconds"), x=16, y=24, w=8,
              unit="s", description="Launcher send to controller receipt (the clocks of the nodes may differ)."),
        panel("Refused and stale launcher calls", "timeseries",
              [("sum by (code) (increase(tidal_refused_launcher_calls_total[$__rate_interval]))", "refused {{code}}"),
               ("sum(increase(tidal_stale_messages_total[$__rate_interval]))", "stale messages")],
              x=0, y=32, w=24, h=6, description="Launcher calls refused (a wrong secret, an unknown job) by gRPC "
                                                "status, and messages of an old generation ignored."),
        panel("Stragglers", "timeseries",
              [(f"max by (job_id, unit_id) (tidal_unit_compute_ratio{{{JOB_FILTER}}})", "{{job_id}} {{unit_id}}"),
               (f"sum by (job_id) (tidal_unit_straggler{{{JOB_FILTER}}})", "{{job_id}} stragglers")],
              x=0, y=38, w=24, h=8,
              description="Live mode: each unit's slowest worker's own compute per sample over its peers' median "
                          "(1: as fast; a straggler from straggler_ratio, 1.5 by default, held), and how many units "
                          "have a straggler now."),
    ]
    for index, each in enumerate(panels, start=1):
        each["id"] = index
    return {
        "title": "Tidal", "uid": "tidal-controller", "tags": ["tidal", "slurm", "pytorch"], "editable": True,
        "description": "Tidal's controller: jobs, world sizes, failures, recoveries, heartbeats, launchers. "
                       "Scrape the controller's metrics_listen (deploy/prometheus/tidal-scrape.yml).",
        "schemaVersion": 39, "version": 1, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "timezone": "", "graphTooltip": 1, "links": [], "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "job", "label": "Tidal job", "type": "query", "datasource": DATASOURCE,
             "query": {"query": "label_values(tidal_world_size, job_id)", "refId": "jobs"},
             "definition": "label_values(tidal_world_size, job_id)", "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "hide": 0, "sort": 1},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
