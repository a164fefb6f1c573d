"""The controller's metrics follow Prometheus' conventions
(https://prometheus.io/docs/practices/naming/): one `tidal_` prefix, counters' samples end
in `_total`, histograms measure durations in seconds and say so (`_seconds`), and no label
is one Prometheus attaches to every scraped series itself (`job`, `instance`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tidal.controller.metrics import ControllerMetrics

TARGET_LABELS = {"job", "instance"}


class _Job:
    job_id = "j1"
    job_state = "running"
    unit_states: Iterable[str] = ("active",)
    world_size = 1
    generation_number = 1
    connected_launchers = 1
    unit_compute: Mapping[str, tuple[float, bool]] = {"u1": (1.7, True)}


def exported_families() -> list[Metric]:
    """Every family the controller exports, each labelled one with a child."""
    metrics = ControllerMetrics()
    metrics.read_job_states(lambda: [_Job()], ["running"], ["active"])
    metrics.generations_formed.labels(job_id="j1").inc()
    metrics.failures.labels(cause="worker_exit").inc()
    metrics.refused_calls.labels(code="UNAUTHENTICATED").inc()
    return list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))


def test_metric_names_labels_and_units_follow_prometheus_conventions() -> None:
    families = exported_families()
    assert len(families) >= 12
    for family in families:
        assert re.fullmatch(r"tidal_[a-z0-9_]+", family.name), family.name
        labels = {name for sample in family.samples for name in sample.labels} - {"le"}
        assert not labels & TARGET_LABELS, f"{family.name} has a label Prometheus attaches itself: {labels}"
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {f"{family.name}_total", f"{family.name}_created"}, family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), f"{family.name}: a duration in seconds is named _seconds"
        assert family.type in ("counter", "gauge", "histogram"), (family.name, family.type)
