"""The Grafana board (deploy/grafana/tidal.json) against a real Prometheus: Debian's
prometheus (tests/prometheus.py) scrapes a live controller every second, with the shipped
scrape job, while a job forms, is refused an intruder, loses a worker, stops and recovers;
then every query of every panel, evaluated through Prometheus' HTTP API, returns at least
one series with a number, and the board's job variable lists the job."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.dashboard import label_values_query, load, panel_queries, with_variables
from tests.integration.conftest import TidalRun, wait_until
from tests.integration.test_live_mode import example_command
from tests.integration.test_refusals import register, session_status
from tests.listening import listening_addresses
from tests.prometheus import PrometheusServer, PrometheusUnavailable, has_a_number, installed_binary, version
from tidal.proto import common_pb2

# Installing the package on a fresh machine downloads about 20 MB: more than the usual 300 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# How long the board may take to see the scenario's end (a scrape every second).
SETTLE_S = 30.0


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    try:
        return installed_binary()
    except PrometheusUnavailable as why:
        pytest.skip(f"no Prometheus to check the Grafana board against: {why}")


@pytest.fixture
def prometheus(prometheus_binary: str, tidal_run: TidalRun, tmp_path: Path) -> Iterator[PrometheusServer]:
    """A Prometheus of this test's own, scraping `tidal_run`'s controller; stopped by PID."""
    server = PrometheusServer(prometheus_binary, tmp_path / "prometheus",
                              f"127.0.0.1:{tidal_run.controller.ready['metrics_port']}")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def board_problems(prometheus: PrometheusServer, dashboard: dict[str, Any], values: dict[str, str]) -> list[str]:
    """Each query of each panel, its variables set to `values`, that Prometheus answers
    with no series, or with NaN only."""
    problems = []
    for title, expressions in panel_queries(dashboard).items():
        for expression in expressions:
            query = with_variables(expression, values)
            series = prometheus.query(query)
            if not series:
                problems.append(f"panel {title!r}: {query} returns no series")
            elif not has_a_number(series):
                problems.append(f"panel {title!r}: {query} returns NaN only ({len(series)} series)")
    return problems


def test_every_query_of_the_grafana_board_returns_series_from_a_real_prometheus(
        tidal_run: TidalRun, prometheus: PrometheusServer) -> None:
    scraping_since = time.monotonic()
    assert {host for host, _ in listening_addresses(prometheus.pid)} == {"127.0.0.1"}
    run = tidal_run
    # Live mode: the workers' beats carry their own compute (the Stragglers panel).
    run.submit(min_replicas=2, max_replicas=2, mode=common_pb2.JOB_MODE_LIVE,
               command=example_command(run.directory / "elastic.pt", run.directory / "ledger", 100_000))
    # An intruder's session is refused: tidal_refused_launcher_calls_total{code}.
    code, _ = session_status(run.controller.address, [register(run, "intruder", secret="not-the-secret")])
    assert code == grpc.StatusCode.UNAUTHENTICATED
    run.start_launcher("u1")
    run.start_launcher("u2")
    run.controller.wait_event(run.job_id, "world_formed", where=lambda e: e.generation == 1)
    run.controller.wait_event(run.job_id, "first_step", where=lambda e: e.generation == 1)
    # u2's worker killed: u1 alone is below min_replicas, so the world is stopped first (a
    # stop round: tidal_stop_duration_seconds) and the job waits, degraded.
    (victim,) = wait_until(lambda: run.launchers["u2"].worker_pids(), 10, "u2's worker pid")
    os.kill(victim, signal.SIGKILL)
    failure = run.controller.wait_event(run.job_id, "failure_detected")
    assert failure.unit_id == "u2" and failure.fields["cause"] == "worker_exit"
    run.controller.wait_event(run.job_id, "generation_stopped", timeout=30)
    # A third unit makes two again: the recovery ends (tidal_recovery_duration_seconds).
    run.start_launcher("u3")
    recovered = run.controller.wait_event(run.job_id, "world_formed", where=lambda e: e.generation > 1)
    assert recovered.fields["world_size"] == "2" and "u2" not in recovered.fields["members"].split(",")

    dashboard = load()
    (job_variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    metric, label = label_values_query(job_variable)
    jobs = wait_until(lambda: run.job_id in (listed := prometheus.label_values(label, metric)) and listed,
                      SETTLE_S, f"the board's job variable ({metric}, {label}) to list {run.job_id}")
    assert jobs == [run.job_id]
    # Grafana's values: the job variable as "All" (its default) and as this job picked; the
    # rate window spans everything Prometheus scraped, so each event of the scenario is in it.
    deadline = time.monotonic() + SETTLE_S
    while True:
        window = f"{math.ceil(time.monotonic() - scraping_since) + 5}s"
        problems = [problem for job in (job_variable["allValue"], run.job_id)
                    for problem in board_problems(prometheus, dashboard, {"job": job, "__rate_interval": window})]
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not problems, (f"{version(prometheus.binary)}, scraping the controller every second, answers the Grafana "
                          "board's queries with nothing:\n" + "\n".join(problems))
