"""The controller killed with SIGKILL mid-training and started again: training never
stops, no worker restarts, state and events are intact, launchers are back in seconds."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.integration.conftest import TidalRun, alive, wait_until
from tidal.proto import admin_pb2

pytestmark = pytest.mark.integration


def test_controller_sigkill_and_restart_leaves_training_untouched(tidal_run: TidalRun) -> None:
    tidal_run.submit(min_replicas=3, max_replicas=3)
    for unit in ("u1", "u2", "u3"):
        tidal_run.start_launcher(unit)
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    tidal_run.wait_steps(5, world_size=3)
    workers_before = tidal_run.all_worker_pids()
    assert len(workers_before) == 3
    events_before = tidal_run.controller.events(tidal_run.job_id)

    tidal_run.controller.kill()
    killed_at = time.time()
    time.sleep(3.0)  # longer than the heartbeat timeout: launchers must not act on their own
    tidal_run.controller.start()
    restarted_at = time.time()

    def reattached() -> list[admin_pb2.Event]:
        found = [e for e in tidal_run.controller.events(tidal_run.job_id) if e.kind == "launcher_reattached"]
        return found if len(found) == 3 else []

    back = wait_until(reattached, 10, "three launchers to reattach", interval=0.1)
    last_back = max(e.time.ToNanoseconds() / 1e9 for e in back)
    assert last_back - restarted_at < 5.0, f"launchers back {last_back - restarted_at:.1f} s after the restart"

    # No worker restarted: the same PIDs run, and no launcher started new ones.
    assert tidal_run.all_worker_pids() == workers_before
    assert all(alive(pid) for pid in workers_before)
    # Training went on meanwhile: steps were logged while the controller was down, with no gap.
    rank0 = [r for r in tidal_run.steps() if r["rank"] == 0]
    during = [r for r in rank0 if killed_at < r["time"] < restarted_at]
    assert len(during) >= 10, f"only {len(during)} steps while the controller was down"
    times = [r["time"] for r in rank0 if r["time"] > killed_at - 1]
    assert max(b - a for a, b in itertools.pairwise(times)) < 1.0
    assert {r["restart_count"] for r in rank0} == {0}

    # State and events are intact; nothing failed.
    job = tidal_run.job()
    assert job.state == admin_pb2.JOB_STATE_RUNNING and job.generation == 1 and job.world_size == 3
    events_after = tidal_run.controller.events(tidal_run.job_id)
    assert [(e.sequence, e.kind) for e in events_after[:len(events_before)]] == \
        [(e.sequence, e.kind) for e in events_before]
    assert not any(e.kind in ("failure_detected", "generation_stopping") for e in events_after)
    tidal_run.wait_steps(len(rank0) + 5, world_size=3)

    # A graceful stop (SIGTERM, as systemd does) and start: the same, and exit status 0.
    tidal_run.controller.stop()
    assert tidal_run.controller.process is not None and tidal_run.controller.process.returncode == 0
    tidal_run.controller.start()
    wait_until(lambda: len([e for e in tidal_run.controller.events(tidal_run.job_id)
                            if e.kind == "launcher_reattached"]) == 6, 10, "three more reattachments")
    assert tidal_run.all_worker_pids() == workers_before and all(alive(pid) for pid in workers_before)


def test_a_restart_mode_job_that_finishes_while_the_controller_is_away_completes_without_running_again(
        tidal_run: TidalRun) -> None:
    """Every worker exits 0 while the controller is down. Each launcher, back with no
    workers, has its exit reports queued behind its registration: the restarted controller
    must wait for them and complete the job, not send the generation again (which ran the
    script once more before the reports were read)."""
    tidal_run.submit(min_replicas=2, max_replicas=2, steps=60, step_time=0.05)
    for unit in ("u1", "u2"):
        tidal_run.start_launcher(unit)
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    tidal_run.wait_steps(5, world_size=2)
    workers = tidal_run.all_worker_pids()
    assert len(workers) == 2

    tidal_run.controller.kill()
    assert any(alive(pid) for pid in workers), "training ended before the controller was killed"
    wait_until(lambda: not any(alive(pid) for pid in workers), 60, "both workers to finish and exit")
    tidal_run.controller.start()

    tidal_run.controller.wait_event(tidal_run.job_id, "job_completed", timeout=30)
    assert tidal_run.all_worker_pids() == workers, "a launcher started its script again"
    events = tidal_run.controller.events(tidal_run.job_id)
    assert not any(e.kind in ("generation_start_resent", "failure_detected", "generation_stopping") for e in events)
    # The first back waits for its reports; its exit 0 finishes the job, so the second may
    # be back after that.
    assert any(e.kind == "launcher_reconnected" and "waiting for its reports" in e.reason for e in events)
    assert tidal_run.job().state == admin_pb2.JOB_STATE_COMPLETED
