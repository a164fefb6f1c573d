"""Failure handling in restart mode with three launchers and real gloo workers: a worker
killed, a launcher frozen, a launcher told to leave by SIGTERM."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.dashboard import exported_metrics, queried_metrics
from tests.dashboard import load as load_dashboard
from tests.integration.conftest import TidalRun, alive, wait_until
from tidal.proto import admin_pb2

pytestmark = pytest.mark.integration

HEARTBEAT_INTERVAL_S = 1.0  # the controller's default, which these tests run with


def start_three(run: TidalRun) -> list[str]:
    """A job of min 2 / max 3 replicas on three launchers, trained until world size 3 has
    logged a few steps; returns the unit ids in group-rank order."""
    run.submit(min_replicas=2, max_replicas=3)
    for unit in ("u1", "u2", "u3"):
        run.start_launcher(unit)
    formed = run.controller.wait_event(run.job_id, "world_formed", where=lambda e: e.generation == 1)
    assert formed.fields["world_size"] == "3"
    run.wait_steps(6, world_size=3)
    return formed.fields["members"].split(",")


def generation_pids(run: TidalRun, world_size: int) -> dict[int, int]:
    """rank -> pid of the workers that logged steps at `world_size`."""
    return {r["rank"]: r["pid"] for r in run.steps() if r["world_size"] == world_size}


def test_killed_worker_stops_every_rank_and_the_world_reforms_at_two(tidal_run: TidalRun) -> None:
    members = start_three(tidal_run)
    first_pids = wait_until(lambda: len(pids := generation_pids(tidal_run, 3)) == 3 and pids, 30, "3 ranks logging")
    victim_unit = members[1]
    os.kill(first_pids[1], signal.SIGKILL)

    failure = tidal_run.controller.wait_event(tidal_run.job_id, "failure_detected")
    assert failure.unit_id == victim_unit and failure.fields["cause"] == "worker_exit"
    assert "SIGKILL" in failure.reason
    # One message to each survivor: generation 2, formed in the same decision (its launcher
    # stops the old workers, then starts the new ones); no stop round.
    formed = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 2)
    assert formed.fields["world_size"] == "2" and victim_unit not in formed.fields["members"].split(",")
    assert float(formed.fields["detection_to_started_s"]) < 0.1
    # Every rank of generation 1 is gone.
    wait_until(lambda: not any(alive(pid) for pid in first_pids.values()), 5, "generation-1 workers to exit")
    assert not any(e.kind.startswith("generation_stop") for e in tidal_run.controller.events(tidal_run.job_id))
    resumed = tidal_run.wait_steps(3, world_size=2)
    last_step_at_3 = max(r["step"] for r in tidal_run.steps() if r["world_size"] == 3)
    # Resumed from the script's own snapshot (every 5 steps), not from step 0.
    assert resumed[0]["restart_count"] == 1
    assert last_step_at_3 - 5 <= resumed[0]["step"] - 1 <= last_step_at_3

    victim = tidal_run.launchers[victim_unit]
    assert victim.process is not None and victim.process.wait(10) == 1  # its unit failed
    job = tidal_run.job()
    assert job.state == admin_pb2.JOB_STATE_RUNNING and job.generation == 2 and job.world_size == 2
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{tidal_run.controller.ready['metrics_port']}/metrics",
                                     timeout=5).read().decode()
    assert 'tidal_failures_total{cause="worker_exit"} 1.0' in metrics
    assert "tidal_recovery_duration_seconds_count 1.0" in metrics
    # The Grafana dashboard (deploy/grafana/tidal.json) queries nothing this controller
    # does not export.
    queried, exported = queried_metrics(load_dashboard()), exported_metrics(metrics)
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"


def test_frozen_launcher_is_detected_by_missing_heartbeats(tidal_run: TidalRun) -> None:
    members = start_three(tidal_run)
    # Freeze the launcher of group rank 0: it hosts generation 1's rendezvous store.
    frozen_unit = members[0]
    frozen = tidal_run.launchers[frozen_unit]
    frozen_at = time.time()
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        failure = tidal_run.controller.wait_event(tidal_run.job_id, "failure_detected", timeout=20)
        assert failure.unit_id == frozen_unit and failure.fields["cause"] == "heartbeat"
        detected_after = failure.time.ToNanoseconds() / 1e9 - frozen_at
        assert 2.0 < detected_after < 3.0 + 1.5, f"detected {detected_after:.2f} s after the freeze"
        formed = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 2)
        assert float(formed.fields["detection_to_started_s"]) < 0.1
        assert formed.fields["world_size"] == "2"
        # The new generation meets at a store on a live unit: the frozen one hosted generation 1's.
        assert frozen_unit not in formed.fields["members"].split(",")
        tidal_run.wait_steps(3, world_size=2)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # Thawed, it learns it was removed, kills its worker and exits non-zero.
    assert frozen.process is not None
    code = frozen.process.wait(20)
    assert code in (1, 3)
    for pid in frozen.worker_pids():
        wait_until(lambda pid=pid: not alive(pid), 10, f"frozen unit's worker {pid} to exit")
    assert tidal_run.job().world_size == 2


def test_sigterm_makes_a_launcher_leave_cleanly_and_the_job_goes_on(tidal_run: TidalRun) -> None:
    members = start_three(tidal_run)
    leaving = tidal_run.launchers[members[2]]
    leaving_workers = leaving.worker_pids()
    leaving.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert leaving.process.wait(15) == 0  # type: ignore[union-attr]
    for pid in leaving_workers:
        assert not alive(pid)
    formed = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 2)
    assert formed.fields["world_size"] == "2"
    tidal_run.wait_steps(3, world_size=2)
    kinds = [(e.kind, e.unit_id) for e in tidal_run.controller.events(tidal_run.job_id)]
    assert ("unit_leaving", members[2]) in kinds and ("unit_left", members[2]) in kinds
    assert not any(kind == "failure_detected" for kind, _ in kinds)
    leave = next(e for e in tidal_run.controller.events(tidal_run.job_id) if e.kind == "unit_leaving")
    assert leave.fields["cause"] == "preempted"


def test_a_launcher_killed_with_sigkill_takes_its_workers_along(tidal_run: TidalRun) -> None:
    tidal_run.submit(min_replicas=1, max_replicas=2, procs_per_node=2)
    for unit in ("u1", "u2"):
        tidal_run.start_launcher(unit)
    formed = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    assert formed.fields["world_size"] == "4"
    tidal_run.wait_steps(4, world_size=4)
    ranks = {r["rank"] for r in tidal_run.steps() if r["world_size"] == 4}
    assert ranks == {0, 1, 2, 3}
    victim_unit = formed.fields["members"].split(",")[1]
    victim = tidal_run.launchers[victim_unit]
    orphans = victim.worker_pids()
    assert len(orphans) == 2
    os.kill(victim.pid, signal.SIGKILL)
    # No orphan: its workers die with it (PR_SET_PDEATHSIG).
    for pid in orphans:
        wait_until(lambda pid=pid: not alive(pid), 3, f"worker {pid} of the killed launcher to die")
    failure = tidal_run.controller.wait_event(tidal_run.job_id, "failure_detected")
    assert failure.unit_id == victim_unit and failure.fields["cause"] == "stream"
    formed = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 2)
    assert formed.fields["world_size"] == "2"
    tidal_run.wait_steps(3, world_size=2)
    # The job's secret never reaches a log.
    secret = Path(tidal_run.secret_path).read_text().strip()
    for log in tidal_run.directory.glob("*.log"):
        assert secret not in log.read_text(errors="replace"), log
