"""A silent worker is killed only when it is frozen: reading a process's state and CPU time
from /proc, and the pure verdict on constructed samples."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.waiting import wait_for
from tidal.launcher.liveness import (
    Now,
    Observations,
    ProcessSample,
    Silence,
    SilenceVerdict,
    Verdict,
    Watched,
    WorkerWatch,
    group_members,
    liveness_verdicts,
    parse_process_stat,
    read_group_sample,
    read_process_sample,
    silence_verdict,
)

# Recorded on this machine (Linux 6.18, CLK_TCK 100): `/proc/self/stat` of a python
# process that had used 0.33 s of CPU; then the same line with a command name holding
# spaces and parentheses (a process may name itself so with prctl(PR_SET_NAME)).
STAT_LINE = ("7460 (python) R 7458 7458 2878 0 -1 4194304 1328 0 0 0 13 20 0 0 20 0 1 0 33480 14331904 2692 "
             "18446744073709551615 94556179767296 94556179767637 140721532657584 0 0 0 0 16781312 2 0 0 0 17 1 0 "
             "0 0 0 0 94556179778992 94556179779608 94556265586688 140721532664420 140721532664551 "
             "140721532664551 140721532665831 0\n")
ODD_NAME_LINE = STAT_LINE.replace("(python)", "(tidal (rank 1) ) x)").replace(" R ", " T ", 1)


def test_parse_splits_at_the_last_parenthesis() -> None:
    assert parse_process_stat(STAT_LINE, taken_at=5.0, ticks_per_s=100) == ProcessSample("R", 0.33, 5.0)
    odd = parse_process_stat(ODD_NAME_LINE, taken_at=6.0, ticks_per_s=100)
    assert odd == ProcessSample("T", 0.33, 6.0)
    with pytest.raises(ValueError):
        parse_process_stat("4242 python3 S 1 2", taken_at=0.0, ticks_per_s=100)


def test_parse_counts_the_runnable_threads() -> None:
    # The process's line gives its CPU time; each thread's line only its state.
    threads = [STAT_LINE.replace(" R ", f" {state} ", 1) for state in ("S", "R", "S", "D", "R")]
    parsed = parse_process_stat(STAT_LINE.replace(" R ", " S ", 1), taken_at=1.0, ticks_per_s=100,
                                thread_stats=threads)
    assert parsed == ProcessSample("S", 0.33, 1.0, runnable_threads=2)


def test_read_process_sample_sees_this_process_use_cpu() -> None:
    first = read_process_sample(os.getpid())
    assert first is not None and first.state == "R"
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    second = read_process_sample(os.getpid())
    assert second is not None and second.runnable_threads >= 1  # this thread, reading
    assert second.cpu_s - first.cpu_s >= 0.1
    assert second.taken_at > first.taken_at


def in_state(pid: int, state: str, min_cpu_s: float = 0.0) -> ProcessSample | None:
    found = read_process_sample(pid)
    return found if found is not None and found.state == state and found.cpu_s >= min_cpu_s else None


def stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
    child.wait(10)


def test_read_process_sample_sees_a_stopped_child_and_a_gone_one() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wait_for("the child to use CPU", lambda: in_state(child.pid, "R", min_cpu_s=0.05), timeout_s=10,
                 interval_s=0.02)
        os.kill(child.pid, signal.SIGSTOP)
        stopped = wait_for("the child to stop", lambda: in_state(child.pid, "T"), timeout_s=5, interval_s=0.01)
        time.sleep(0.3)
        later = read_process_sample(child.pid)
        # Stopped: no CPU time while it stays so, but for at most a clock tick the kernel
        # may still add to what /proc reports once the stop shows (seen in a fresh clone's
        # make test: 0.06 s, then 0.07 s). A stopped process is frozen whatever its CPU time.
        tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        assert later is not None and later.state == "T"
        assert stopped.cpu_s <= later.cpu_s <= stopped.cpu_s + tick_s + 1e-9
        assert later.runnable_threads == 0
        judged = silence_verdict(silent_s=2.5, limit_s=2.0, sample_at_last_beat=stopped, sample_now=later)
        assert judged == SilenceVerdict(Silence.FROZEN, "no beat for 2.5 s: stopped (SIGSTOP)")
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
        wait_for("the child to be a zombie", lambda: in_state(child.pid, "Z"), timeout_s=5, interval_s=0.01)
    finally:
        stop_child(child)
    assert read_process_sample(child.pid) is None


def sample(state: str = "S", cpu_s: float = 10.0, at: float = 100.0) -> ProcessSample:
    return ProcessSample(state=state, cpu_s=cpu_s, taken_at=at)


def verdict(silent_s: float, before: ProcessSample | None, now: ProcessSample | None,
            limit_s: float = 2.0) -> SilenceVerdict:
    return silence_verdict(silent_s=silent_s, limit_s=limit_s, sample_at_last_beat=before, sample_now=now)


def test_not_silent_past_the_limit_is_alive_whatever_the_process_does() -> None:
    assert verdict(1.9, sample(), sample("T", at=101.9)) == SilenceVerdict(Silence.ALIVE,
                                                                         "beat 1.9 s ago (limit 2 s)")
    assert verdict(2.0, sample(), sample(at=102.0)).silence is Silence.ALIVE


def test_stopped_is_frozen_even_if_it_used_cpu_before_it_stopped_and_traced_is_left_alone() -> None:
    assert verdict(2.1, sample(), sample("T", cpu_s=11.0, at=102.1)) == SilenceVerdict(
        Silence.FROZEN, "no beat for 2.1 s: stopped (SIGSTOP)")
    # gdb or py-spy attached: someone is looking at it; it is not killed for that.
    assert verdict(2.1, sample(), sample("t", at=102.1)) == SilenceVerdict(
        Silence.SLOW, "no beat for 2.1 s: stopped by a tracer (a debugger?); left alone")


def test_cpu_time_since_the_last_beat_is_slow_not_frozen() -> None:
    # Busy in its own code, or starved on a loaded node: any CPU time at all since its
    # last beat, even one clock tick, and however long the silence.
    assert verdict(5.0, sample(cpu_s=10.0), sample("R", cpu_s=14.5, at=105.0)) == SilenceVerdict(
        Silence.SLOW, "no beat for 5.0 s but busy: 4.50 s of CPU in the last 5.0 s; left to the progress timeout")
    assert verdict(600.0, sample(cpu_s=10.0), sample("S", cpu_s=10.01, at=700.0)).silence is Silence.SLOW
    assert verdict(2.5, sample(cpu_s=10.0), sample("D", cpu_s=10.02, at=102.5)).silence is Silence.SLOW


def test_runnable_but_given_no_cpu_is_starved_not_frozen() -> None:
    assert verdict(2.3, sample(cpu_s=10.0), sample("R", cpu_s=10.0, at=102.3)) == SilenceVerdict(
        Silence.SLOW, "no beat for 2.3 s and runnable, but given no CPU in 2.3 s (a loaded node); left to the "
        "progress timeout")
    # The main thread asleep in a collective, the beat thread ready but given no CPU.
    waiting_for_a_cpu = ProcessSample("S", cpu_s=10.0, taken_at=102.3, runnable_threads=1)
    assert verdict(2.3, sample(cpu_s=10.0), waiting_for_a_cpu).silence is Silence.SLOW


def test_no_cpu_time_through_the_whole_silence_is_frozen() -> None:
    assert verdict(2.3, sample(cpu_s=10.0), sample("S", cpu_s=10.0, at=102.3)) == SilenceVerdict(
        Silence.FROZEN, "no beat and no CPU time for 2.3 s")
    assert verdict(2.3, sample(cpu_s=10.0), sample("D", cpu_s=10.0, at=102.3)).silence is Silence.FROZEN


def test_without_a_sample_from_the_last_beat_it_is_watched_for_the_limit_first() -> None:
    # No sample from its last beat: none to compare with yet...
    assert verdict(2.5, None, sample(at=200.0)) == SilenceVerdict(
        Silence.WATCHING, "no beat for 2.5 s; no CPU sample to compare with yet")
    # ...then the first silent look is the reference: still for less than the limit is
    # not enough to be frozen; busy since is slow.
    first = sample(cpu_s=10.0, at=200.0)
    assert verdict(3.0, first, sample(cpu_s=10.0, at=200.5)) == SilenceVerdict(
        Silence.WATCHING, "no beat for 3.0 s and no CPU time in the 0.5 s watched so far")
    assert verdict(3.0, first, sample(cpu_s=10.3, at=200.5)).silence is Silence.SLOW
    assert verdict(4.6, first, sample(cpu_s=10.0, at=202.1)) == SilenceVerdict(
        Silence.FROZEN, "no beat and no CPU time for 2.1 s")


def test_an_exited_process_is_not_judged() -> None:
    assert verdict(3.0, sample(), None) == SilenceVerdict(Silence.GONE, "exited; its exit is reported on its own")
    assert verdict(3.0, sample(), sample("Z", at=103.0)).silence is Silence.GONE


def test_a_wrappers_child_counts_in_the_workers_cpu_time() -> None:
    # `bash -c 'python busy.py'` without exec, in a session of its own as a worker runs:
    # the shell uses no CPU, its child does.
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'while True: pass'; true"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (members := group_members(shell.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert members, "the shell's child is in its process group"
        time.sleep(0.5)
        own = read_process_sample(shell.pid)
        grouped = read_group_sample(shell.pid, members)
        assert own is not None and grouped is not None
        assert grouped.cpu_s > own.cpu_s + 0.1 and grouped.state == own.state
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


# The launcher's one liveness verdict over everything it watches.

NOW = Now(monotonic=1000.0, wall=5000.0)


def test_nothing_watched_past_its_limit_is_no_verdict() -> None:
    observed = Observations(registering_since=990.0, connect_timeout_s=600.0, peers=((1, 995.0), (2, 999.9)),
                            node_timeout_s=10.0, workers=(WorkerWatch(0, 4999.0, None, None),),
                            worker_silence_limit_s=2.0, previous_look_at=999.75)
    assert liveness_verdicts(observed, NOW) == ()
    # A limit of 0 never expires.
    assert liveness_verdicts(Observations(registering_since=0.0, connect_timeout_s=0.0, peers=((1, 0.0),)), NOW) == ()


def test_a_launcher_not_registered_within_the_connect_timeout_finds_the_controller_unreachable() -> None:
    [verdict] = liveness_verdicts(Observations(registering_since=399.0, connect_timeout_s=600.0), NOW)
    assert verdict == Verdict(Watched.CONTROLLER, 0, True, "not registered within 600 s")
    # Once registered, the controller's absence is no verdict: training goes on without it.
    assert liveness_verdicts(Observations(registering_since=None, connect_timeout_s=600.0), NOW) == ()


def test_a_peer_node_silent_past_the_node_timeout_is_lost() -> None:
    observed = Observations(peers=((1, 985.0), (2, 995.0), (3, 989.9)), peer_kind=Watched.FOLLOWER,
                            node_timeout_s=10.0)
    verdicts = liveness_verdicts(observed, NOW)
    assert [(v.watched, v.key, v.lost) for v in verdicts] == [(Watched.FOLLOWER, 1, True), (Watched.FOLLOWER, 3, True)]
    assert verdicts[0].reason == "silent for 15.0 s"
    [leader] = liveness_verdicts(dataclasses.replace(observed, peers=((0, 980.0),), peer_kind=Watched.LEADER), NOW)
    assert (leader.watched, leader.lost, leader.reason) == (Watched.LEADER, True, "silent for 20.0 s")


def test_a_worker_silent_past_the_limit_is_judged_by_its_process() -> None:
    beat_at = NOW.wall - 3.0
    at_beat = ProcessSample("S", 1.0, NOW.monotonic - 3.0)
    frozen = WorkerWatch(0, beat_at, at_beat, ProcessSample("S", 1.0, NOW.monotonic))
    busy = WorkerWatch(1, beat_at, at_beat, ProcessSample("S", 2.5, NOW.monotonic))
    first_look = WorkerWatch(2, beat_at, None, ProcessSample("S", 1.0, NOW.monotonic))
    beating = WorkerWatch(3, NOW.wall - 0.5, None, None)
    observed = Observations(workers=(frozen, busy, first_look, beating), worker_silence_limit_s=2.0,
                            previous_look_at=NOW.monotonic - 0.25)
    verdicts = {v.key: v for v in liveness_verdicts(observed, NOW)}
    assert set(verdicts) == {0, 1, 2}
    assert verdicts[0].lost and verdicts[0].silence is Silence.FROZEN and verdicts[0].silent_s == 3.0
    assert not verdicts[1].lost and verdicts[1].silence is Silence.SLOW and "busy" in verdicts[1].reason
    assert not verdicts[2].lost and verdicts[2].silence is Silence.WATCHING


def test_a_held_up_launcher_judges_no_worker_until_its_next_look() -> None:
    frozen = WorkerWatch(0, NOW.wall - 5.0, ProcessSample("S", 1.0, NOW.monotonic - 5.0),
                         ProcessSample("S", 1.0, NOW.monotonic))
    observed = Observations(workers=(frozen,), worker_silence_limit_s=2.0, previous_look_at=NOW.monotonic - 4.0)
    [verdict] = liveness_verdicts(observed, NOW)
    assert (verdict.watched, verdict.lost) == (Watched.SELF, False) and "held up for 4.0 s" in verdict.reason
    # No silence limit: workers are not judged at all.
    assert liveness_verdicts(dataclasses.replace(observed, worker_silence_limit_s=0.0), NOW) == ()
