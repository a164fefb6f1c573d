"""The controller killed with SIGKILL mid-training and started again: training never
stops, no worker restarts, state and events are intact, launchers are back in seconds.
And a job whose training ends while the controller is away (restarting, or frozen and then
killed with the launchers' last reports unread) completes once it is back."""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import TidalRun, alive, wait_until
from tests.integration.test_live_mode import (
    assert_parameters_match_a_fixed_run,
    example_command,
    highest_step,
    worker_pid,
)
from tidal.proto import admin_pb2, common_pb2

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
    """Every worker exits 0 while the controller is frozen (SIGSTOP), their exits written to
    its session and unread; it is then killed and started again. Each launcher, back with
    no workers, sends its exit reports again behind its registration (held since the exit
    0): the restarted controller must wait for them and complete the job, not send the
    generation again (which ran the script once more before the reports were read). (A
    controller killed before the exits, so that they wait for a session, takes the same
    path at the controller; the live-mode test below covers that launcher side.)"""
    tidal_run.submit(min_replicas=2, max_replicas=2, steps=60, step_time=0.05)
    for unit in ("u1", "u2"):
        tidal_run.start_launcher(unit)
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    controller = tidal_run.controller
    assert controller.process is not None
    # Near the end: the exits come before keepalive could break the session (5 s at the
    # soonest).
    tidal_run.wait_steps(45, world_size=2)
    controller.process.send_signal(signal.SIGSTOP)
    workers = tidal_run.all_worker_pids()
    assert len(workers) == 2
    assert any(alive(pid) for pid in workers), "training ended before the controller went away"
    wait_until(lambda: not any(alive(pid) for pid in workers), 60, "both workers to finish and exit")
    time.sleep(1.0)
    controller.kill()
    controller.start()

    controller.wait_event(tidal_run.job_id, "job_completed", timeout=30)
    assert tidal_run.all_worker_pids() == workers, "a launcher started its script again"
    events = controller.events(tidal_run.job_id)
    assert not any(e.kind in ("generation_start_resent", "failure_detected", "generation_stopping") for e in events)
    # The first back waits for its reports; its exit 0 finishes the job, so the second may
    # be back after that.
    assert any(e.kind == "launcher_reconnected" and "waiting for its reports" in e.reason for e in events)
    assert tidal_run.job().state == admin_pb2.JOB_STATE_COMPLETED
    assert all(any(r.get("event") == "reports_requeued" for r in tidal_run.launchers[u].log_records())
               for u in ("u1", "u2")), "the exits were not written to the frozen controller's session"


def test_training_that_ends_while_the_controller_is_away_completes_once_it_is_back(tidal_run: TidalRun,
                                                                                 tmp_path: Path) -> None:
    """The job's last step is committed while the controller is down (found by chaos seed
    38: a controller restart in the last steps). The launchers, whose workers have all
    exited, wait for it to come back and hand over their last reports; the job then
    completes once, with no unit taken for failed."""
    steps = 120
    ledger, pids = start_two_units(tidal_run, tmp_path, steps, freeze_at=10)
    tidal_run.controller.kill()
    assert highest_step(ledger) < steps - 1, "training ended before the controller was killed"
    assert_launchers_wait_after_their_workers(tidal_run, pids, "while the controller was away, its last reports unsent")
    for unit in "ab":
        assert any(r.get("event") == "awaiting_controller" for r in tidal_run.launchers[unit].log_records())
    assert highest_step(ledger) == steps - 1

    tidal_run.controller.start()
    assert_completed_once_with_no_failure(tidal_run, tmp_path, steps)


def test_last_reports_written_to_a_controller_that_dies_unread_are_sent_again(tidal_run: TidalRun,
                                                                              tmp_path: Path) -> None:
    """The job's last step is committed while the controller is frozen (SIGSTOP): each
    launcher writes its last reports into a session that still looks alive, and closes it.
    The controller is then killed with them unread. The launchers must not count them as
    delivered: they wait, reconnect to the restarted controller and send them again."""
    steps = 120
    # Frozen near the end: the last step must come before gRPC's keepalive (a ping every
    # 10 s, 5 s for its answer) could break the session, at 5 s at the soonest.
    ledger, pids = start_two_units(tidal_run, tmp_path, steps, freeze_at=steps - 40)
    controller = tidal_run.controller
    assert controller.process is not None
    controller.process.send_signal(signal.SIGSTOP)
    assert highest_step(ledger) < steps - 1, "training ended before the controller was frozen"
    assert_launchers_wait_after_their_workers(tidal_run, pids, "though the controller never confirmed its last reports")
    controller.kill()
    # Written to the frozen controller's session (had keepalive broken it first, they
    # would have waited for a session instead, and not been taken back).
    wait_until(lambda: all(any(r.get("event") == "reports_requeued" for r in tidal_run.launchers[u].log_records())
                           for u in "ab"), 30, "both launchers to take their reports back")
    assert highest_step(ledger) == steps - 1

    controller.start()
    assert_completed_once_with_no_failure(tidal_run, tmp_path, steps, against_a_fixed_run=False)


def start_two_units(tidal_run: TidalRun, tmp_path: Path, steps: int, freeze_at: int) -> tuple[Path, list[int]]:
    """A live job of units a and b, `steps` steps: (its ledger, their workers' pids) once
    it committed step `freeze_at`."""
    ledger = tmp_path / "ledger"
    tidal_run.submit(min_replicas=2, max_replicas=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=example_command(tmp_path / "elastic.pt", ledger, steps))
    for unit in "ab":
        tidal_run.start_launcher(unit)
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed")
    wait_until(lambda: highest_step(ledger) >= freeze_at, 60, f"{freeze_at} steps")
    return ledger, [worker_pid(tidal_run, unit) for unit in "ab"]


def assert_launchers_wait_after_their_workers(tidal_run: TidalRun, pids: list[int], otherwise: str) -> None:
    wait_until(lambda: not any(alive(pid) for pid in pids), 60, "both workers to finish and exit")
    time.sleep(2.0)
    for unit in "ab":
        launcher = tidal_run.launchers[unit]
        assert launcher.process is not None and launcher.process.poll() is None, f"launcher {unit} exited {otherwise}"


def assert_completed_once_with_no_failure(tidal_run: TidalRun, tmp_path: Path, steps: int,
                                          against_a_fixed_run: bool = True) -> None:
    """Completed once, nothing failed, and the final parameters saved at the last step;
    with `against_a_fixed_run`, equal to a fixed run's (the controller-away test checks
    that; the frozen-controller one, whose training takes the same path, leaves the fixed
    run out to keep make test short)."""
    controller = tidal_run.controller
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=30)
    for unit in "ab":
        process = tidal_run.launchers[unit].process
        assert process is not None and process.wait(15) == 0
    events = controller.events(tidal_run.job_id)
    assert [e.kind for e in events].count("job_completed") == 1
    assert not any(e.kind in ("failure_detected", "unit_lost", "generation_stopping") for e in events)
    assert tidal_run.job().state == admin_pb2.JOB_STATE_COMPLETED
    if against_a_fixed_run:
        assert_parameters_match_a_fixed_run(tmp_path, steps)
    else:
        assert torch.load(tmp_path / "elastic.pt")["step"] == steps
