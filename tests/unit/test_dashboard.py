"""The Grafana dashboard (deploy/grafana/tidal.json) is the one its generator makes, is
well formed, and queries only metrics the controller exports; its Grafana variables are
filled in as tests/integration/test_prometheus.py fills them."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping

import pytest
from prometheus_client import generate_latest

from tests.conftest import REPO_ROOT
from tests.dashboard import exported_metrics, label_values_query, load, panel_queries, queried_metrics, with_variables
from tidal.controller.metrics import ControllerMetrics


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("make_dashboard", REPO_ROOT / "deploy/grafana/make_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_what_its_generator_makes() -> None:
    generator = _generator()
    assert (REPO_ROOT / "deploy/grafana/tidal.json").read_text() == generator.render(), (  # type: ignore[attr-defined]
        "deploy/grafana/tidal.json was edited by hand or not regenerated: python deploy/grafana/make_dashboard.py")


def test_every_panel_has_a_place_a_query_and_the_datasource_variable() -> None:
    dashboard = load()
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "job"]
    ids = [each["id"] for each in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for each in dashboard["panels"]:
        assert each["datasource"]["uid"] == "${datasource}", each["title"]
        position = each["gridPos"]
        assert position["x"] >= 0 and position["x"] + position["w"] <= 24, each["title"]
        mine = {(x, y) for x in range(position["x"], position["x"] + position["w"])
                for y in range(position["y"], position["y"] + position["h"])}
        assert not mine & cells, f"panel {each['title']!r} overlaps another"
        cells |= mine
        references = [target["refId"] for target in each["targets"]]
        assert references and len(references) == len(set(references)), each["title"]
        assert all(target["expr"].strip() for target in each["targets"]), each["title"]
    titles = set(panel_queries(dashboard))
    # What the issue asks the board to show.
    assert {"Jobs by state", "World size", "Recoveries", "Recovery duration", "Failures by cause",
            "Heartbeat latency", "Launchers connected"} <= titles


class _Job:
    job_id = "j1"
    job_state = "RUNNING"
    unit_states: Iterable[str] = ("active", "active")
    world_size = 2
    generation_number = 3
    connected_launchers = 2
    unit_compute: Mapping[str, tuple[float, bool]] = {"u1": (1.7, True)}


def test_every_metric_the_dashboard_queries_is_in_the_controllers_registry() -> None:
    """The same registry the daemon serves (tests/integration/test_failures.py scrapes a
    running controller for the same set)."""
    metrics = ControllerMetrics()
    metrics.read_job_states(lambda: [_Job()], ["RUNNING"], ["active"])
    exported = exported_metrics(generate_latest(metrics.registry).decode())
    queried = queried_metrics(load())
    assert len(queried) >= 10
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"


def test_a_metric_the_controller_does_not_export_is_caught() -> None:
    metrics = ControllerMetrics()
    exported = exported_metrics(generate_latest(metrics.registry).decode())
    dashboard = {"panels": [{"title": "x", "targets": [{"expr": "rate(tidal_no_such_thing_total[5m])"}]}]}
    assert queried_metrics(dashboard) - exported == {"tidal_no_such_thing_total"}


def test_grafana_variables_are_replaced_and_an_unknown_one_is_named() -> None:
    values = {"job": "lm-1", "__rate_interval": "30s"}
    assert (with_variables('rate(x{job_id=~"$job"}[$__rate_interval]) + ${job} + [[job]]', values)
            == 'rate(x{job_id=~"lm-1"}[30s]) + lm-1 + lm-1')
    assert with_variables('x{job_id=~"a$"}', values) == 'x{job_id=~"a$"}'
    with pytest.raises(KeyError, match=r"\$__interval"):
        with_variables("rate(x[$__interval])", values)


def test_the_job_variable_lists_the_job_ids_of_the_world_size_gauge() -> None:
    (job,) = [v for v in load()["templating"]["list"] if v["name"] == "job"]
    assert label_values_query(job) == ("tidal_world_size", "job_id")
