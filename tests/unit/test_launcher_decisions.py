"""A launcher's decisions, pure: a worker's exit, a signal and a tick, for the unit's leader
and a follower node alike, asserted on the actions they return."""

from __future__ import annotations

import dataclasses
import signal

from tidal.launcher.decisions import (
    CheckLiveStopped,
    ClearLiveStopDeadline,
    ExitAfterStop,
    Finish,
    ForgetBeatSamples,
    GiveUpLeader,
    KillWorker,
    Log,
    NodeView,
    NoteLeaveRequested,
    NoteSlowWorker,
    ReportLeft,
    ReportWorkerExit,
    RequestLeave,
    StopWorkers,
    WorkersGone,
    on_signal,
    on_tick,
    on_worker_exit,
)
from tidal.launcher.lifecycle import EXIT_OK, EXIT_UNREACHABLE, LauncherState
from tidal.launcher.liveness import Silence, Verdict, Watched

LEADER = NodeView(state=LauncherState.RUNNING, generation=3, answers_to_controller=True, stop_grace_s=10.0,
                  leave_timeout_s=20.0, group_generation=3, group_all_exited=False, group_alive=frozenset({0, 1}),
                  link_connected=True)
FOLLOWER = dataclasses.replace(LEADER, answers_to_controller=False, link_connected=False)
LIVE = dataclasses.replace(LEADER, live_mode=True)


def kinds(actions: tuple[object, ...]) -> list[type]:
    return [type(action) for action in actions]


# A worker's exit.


def test_a_workers_own_exit_is_reported_upward_by_leader_and_follower_alike() -> None:
    for view in (LEADER, FOLLOWER):
        assert on_worker_exit(view, 3, 1, 7) == (ReportWorkerExit(1, 7, 0, ""),)
        assert on_worker_exit(view, 3, 0, -signal.SIGKILL) == (ReportWorkerExit(0, 0, signal.SIGKILL, ""),)


def test_an_exit_of_an_older_group_or_one_being_stopped_is_no_failure() -> None:
    assert on_worker_exit(LEADER, 2, 1, 1) == ()
    assert on_worker_exit(dataclasses.replace(LEADER, group_stopping=True), 3, 1, -signal.SIGTERM) == ()
    assert on_worker_exit(dataclasses.replace(FOLLOWER, group_generation=None), 3, 1, 1) == ()


def test_a_worker_ended_by_slurms_sigterm_after_the_launchers_is_leaving_too() -> None:
    for view in (LEADER, FOLLOWER):
        leaving = dataclasses.replace(view, leave_requested_at=5.0)
        assert kinds(on_worker_exit(leaving, 3, 0, -signal.SIGTERM)) == [Log]
        # Any other death is still a failure.
        assert on_worker_exit(leaving, 3, 0, -signal.SIGKILL) == (ReportWorkerExit(0, 0, signal.SIGKILL, ""),)


def test_a_live_worker_that_left_as_asked_exits_quietly_and_the_last_one_ends_the_leave() -> None:
    left = dataclasses.replace(LIVE, left=frozenset({1}))
    assert on_worker_exit(left, 3, 1, 0) == ()
    leaving = dataclasses.replace(LIVE, state=LauncherState.LEAVING, group_all_exited=True)
    assert on_worker_exit(leaving, 3, 1, 0) == (WorkersGone(3),)


def test_a_leaving_live_worker_killed_on_its_way_out_is_reported_and_the_last_exit_still_ends_the_leave() -> None:
    """Seen on the mini cluster: a straggler's unit was asked to leave, its worker (stopped
    half the time from outside) was judged frozen as it left and killed, and the unit
    stayed until the controller called its leave overdue, 13 s later."""
    frozen = "frozen; killed by its launcher"
    leaving = dataclasses.replace(LIVE, state=LauncherState.LEAVING, silenced={1: frozen})
    assert on_worker_exit(leaving, 3, 1, -signal.SIGKILL) == (ReportWorkerExit(1, 0, signal.SIGKILL, frozen),)
    last = dataclasses.replace(leaving, group_all_exited=True)
    assert on_worker_exit(last, 3, 1, -signal.SIGKILL) == (
        ReportWorkerExit(1, 0, signal.SIGKILL, frozen), WorkersGone(3))


def test_a_silenced_workers_exit_carries_why_and_a_live_stop_checks_whether_it_is_done() -> None:
    stopping = dataclasses.replace(LIVE, state=LauncherState.STOPPING, silenced={1: "frozen; killed by its launcher"})
    assert on_worker_exit(stopping, 3, 1, -signal.SIGKILL) == (
        ReportWorkerExit(1, 0, signal.SIGKILL, "frozen; killed by its launcher"), CheckLiveStopped())


def test_once_training_finished_the_last_workers_exit_ends_the_unit() -> None:
    done = dataclasses.replace(LIVE, finished=frozenset({0, 1}), group_all_exited=True)
    actions = on_worker_exit(done, 3, 1, 0)
    assert kinds(actions) == [ReportWorkerExit, ReportLeft, Finish]
    # The controller must hear it (a controller away at that moment gets time to come back).
    assert actions[-1] == Finish(LauncherState.SUCCEEDED, EXIT_OK, "training finished", await_controller=True)


# A signal.


def test_the_first_sigterm_asks_the_controller_to_leave_or_leaves_alone_when_it_is_away() -> None:
    assert on_signal(LEADER, signal.SIGTERM, 7.0)[1:] == (NoteLeaveRequested(7.0), RequestLeave())
    away = dataclasses.replace(LEADER, link_connected=False)
    assert on_signal(away, signal.SIGTERM, 7.0)[1:] == (NoteLeaveRequested(7.0),
                                                        StopWorkers(LauncherState.LEAVING, 10.0))


def test_a_follower_waits_for_its_leader_on_the_first_sigterm() -> None:
    assert on_signal(FOLLOWER, signal.SIGTERM, 7.0)[1:] == (NoteLeaveRequested(7.0),)


def test_a_second_signal_leaves_now() -> None:
    again = dataclasses.replace(LEADER, leave_requested_at=1.0)
    assert on_signal(again, signal.SIGINT, 7.0)[1:] == (StopWorkers(LauncherState.LEAVING, 1.0),)
    # A leader not registered yet, or leaving already, leaves at the first.
    for state in (LauncherState.CONNECTING, LauncherState.LEAVING):
        assert on_signal(dataclasses.replace(LEADER, state=state), signal.SIGTERM, 7.0)[1:] == (
            StopWorkers(LauncherState.LEAVING, 1.0),)
    follower = dataclasses.replace(FOLLOWER, leave_requested_at=1.0)
    assert on_signal(follower, signal.SIGTERM, 7.0)[1:] == (
        ExitAfterStop(LauncherState.SUCCEEDED, EXIT_OK, "SIGTERM twice"), StopWorkers(LauncherState.LEAVING, 1.0))


# A tick.


def test_an_unreachable_controller_or_a_lost_leader_ends_the_launcher_at_once() -> None:
    unreachable = Verdict(Watched.CONTROLLER, 0, True, "not registered within 600 s")
    assert on_tick(LEADER, (unreachable,), 100.0) == (
        Finish(LauncherState.FAILED, EXIT_UNREACHABLE, "not registered within 600 s"),)
    lost = Verdict(Watched.LEADER, 0, True, "silent for 10.2 s")
    assert on_tick(FOLLOWER, (lost,), 100.0) == (GiveUpLeader("silent for 10.2 s"),)


def test_a_quiet_tick_does_nothing() -> None:
    assert on_tick(LEADER, (), 100.0) == ()
    assert on_tick(dataclasses.replace(LEADER, leave_requested_at=90.0), (), 100.0) == ()


def test_past_the_leave_timeout_the_unit_leaves_without_its_controller_or_leader() -> None:
    waited = dataclasses.replace(LEADER, leave_requested_at=79.0)
    assert on_tick(waited, (), 100.0)[1:] == (StopWorkers(LauncherState.LEAVING, 10.0),)
    follower = dataclasses.replace(FOLLOWER, leave_requested_at=79.0)
    assert on_tick(follower, (), 100.0)[1:] == (ExitAfterStop(LauncherState.SUCCEEDED, EXIT_OK, "left after SIGTERM"),
                                                StopWorkers(LauncherState.LEAVING, 10.0))
    # Leaving already: nothing more.
    assert on_tick(dataclasses.replace(waited, state=LauncherState.LEAVING), (), 100.0) == ()


def test_a_live_stop_past_its_deadline_stops_the_workers_unless_all_left_finished() -> None:
    late = dataclasses.replace(LIVE, state=LauncherState.STOPPING, live_stop_deadline=99.0)
    assert on_tick(late, (), 100.0)[1:] == (ClearLiveStopDeadline(), StopWorkers(LauncherState.STOPPING, 10.0))
    leaving = dataclasses.replace(late, state=LauncherState.LEAVING)
    assert on_tick(leaving, (), 100.0)[-1] == StopWorkers(LauncherState.LEAVING, 10.0)
    # Past the last step a worker runs the script's own code: no deadline cuts it short.
    finished = dataclasses.replace(late, finished=frozenset({0, 1}))
    assert on_tick(finished, (), 100.0) == (ClearLiveStopDeadline(),)
    assert on_tick(late, (), 98.0) == ()


def test_worker_verdicts_kill_the_frozen_note_the_slow_and_a_held_up_loop_forgets_its_samples() -> None:
    frozen = Verdict(Watched.WORKER, 1, True, "no beat for 3.0 s: stopped (SIGSTOP)", Silence.FROZEN, 3.0)
    slow = Verdict(Watched.WORKER, 0, False, "no beat for 3.0 s but busy", Silence.SLOW, 3.0)
    watching = Verdict(Watched.WORKER, 2, False, "no sample yet", Silence.WATCHING, 3.0)
    kill, note = on_tick(LIVE, (frozen, slow, watching), 100.0)
    assert kill == KillWorker(1, frozen.reason, 3.0) and isinstance(kill, KillWorker)
    assert kill.detail == "no beat for 3.0 s: stopped (SIGSTOP); killed by its launcher"
    assert note == NoteSlowWorker(0, slow.reason, 3.0)
    held_up = Verdict(Watched.SELF, 0, False, "held up")
    assert on_tick(LIVE, (held_up,), 100.0) == (ForgetBeatSamples(),)


def test_a_held_store_server_is_released_when_its_stores_are_needed_or_the_workers_are_up() -> None:
    from tidal.launcher.decisions import STORE_HOLD_MAX_S, store_server_release

    def release(**facts: object) -> str | None:
        given: dict[str, object] = {"live_mode": True, "prestart": True, "trained": False,
                                    "named_host": False, "held_s": 1.0, **facts}
        return store_server_release(**given)  # type: ignore[arg-type]

    # Live mode, workers starting: held, even before registering.
    assert release() is None and release(live_mode=None) is None
    assert release(trained=True) == "the workers trained"
    assert release(named_host=True) == "this unit hosts a generation's rendezvous"
    assert release(live_mode=None, named_host=True) == "this unit hosts a generation's rendezvous"
    assert release(held_s=STORE_HOLD_MAX_S) == f"held {STORE_HOLD_MAX_S:g} s"
    assert release(live_mode=False) == "restart mode: the workers start with their generation"
    assert release(prestart=False) == "no workers started ahead"
