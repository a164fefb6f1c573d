"""Is a silent worker frozen, or only slow? A live-mode worker beats every 0.5 s from a
thread of its own; when the beats stop for longer than the silence limit, its launcher
looks at the process itself (`/proc/<pid>/stat` and its threads') before it acts:

- stopped (SIGSTOP): frozen; stopped by a tracer (a debugger attached): left alone;
- CPU time advanced since the last beat, or a thread runnable but given no CPU: slow
  (busy, or starved on a loaded node), never killed for its silence; a true hang is the
  controller's progress timeout's;
- no CPU time through the whole silence, no thread runnable: frozen;
- a zombie, or gone: its exit is reported on the usual path, not here.

`read_process_sample` reads; `silence_verdict` decides, a pure function of two samples
and the silence (no clock read), with a reason for the log and the failure event."""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Iterable

# /proc/<pid>/stat fields after the ")" that ends the command name (field 2): field 3 is
# the state, fields 14 and 15 the user and system time in clock ticks (proc(5)).
_STATE_FIELD = 0
# Field 5, the process group.
_PGRP_FIELD = 2
_UTIME_FIELD = 11
_STIME_FIELD = 12


@dataclasses.dataclass(frozen=True)
class ProcessSample:
    """One look at a process: its state letter (R, S, D, T, t, Z, ...), the CPU time all
    its threads used so far, in seconds, when it was taken (time.monotonic), and how many
    of its threads were runnable (R: running, or ready and waiting for a CPU)."""

    state: str
    cpu_s: float
    taken_at: float
    runnable_threads: int = 0


def parse_process_stat(text: str, *, taken_at: float, ticks_per_s: int,
                       thread_stats: Iterable[str] = ()) -> ProcessSample:
    """Parse a `/proc/<pid>/stat` line, and its threads' (`/proc/<pid>/task/<tid>/stat`)
    for their states. The command name (in parentheses) may hold spaces and parentheses
    itself, so the fields are what follows the last ")". ValueError if a line is not one."""
    fields = _stat_fields(text)
    cpu_ticks = int(fields[_UTIME_FIELD]) + int(fields[_STIME_FIELD])
    runnable = sum(1 for line in thread_stats if _stat_fields(line)[_STATE_FIELD] == "R")
    return ProcessSample(state=fields[_STATE_FIELD], cpu_s=cpu_ticks / ticks_per_s, taken_at=taken_at,
                         runnable_threads=runnable)


def _stat_fields(text: str) -> list[str]:
    _, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) <= _STIME_FIELD:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:200]!r}")
    return fields


def read_process_sample(pid: int, *, threads: bool = True) -> ProcessSample | None:
    """The process's state and CPU time now (summed over its threads, as the kernel gives
    it) and, with `threads`, how many of its threads are runnable (one more read per
    thread; without, 0), or None when there is no such process (or /proc cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
        tids = os.listdir(f"/proc/{pid}/task") if threads else []
    except OSError:  # gone (ENOENT, ESRCH), or no /proc
        return None
    thread_stats = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                thread_stats.append(stat.read())
        except OSError:  # the thread ended meanwhile
            continue
    return parse_process_stat(text, taken_at=time.monotonic(), ticks_per_s=os.sysconf("SC_CLK_TCK"),
                              thread_stats=thread_stats)


def group_members(pid: int) -> tuple[int, ...]:
    """The other live processes in `pid`'s process group (a worker runs in a session of its
    own, so its group is what it started), found by one pass over /proc: for the silent
    looks only, never on the beat path."""
    try:
        entries = [name for name in os.listdir("/proc") if name.isdigit() and int(name) != pid]
    except OSError:
        return ()
    members = []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = _stat_fields(stat.read())
        except (OSError, ValueError):
            continue
        if int(fields[_PGRP_FIELD]) == pid and fields[_STATE_FIELD] not in ("Z", "X"):
            members.append(int(name))
    return tuple(members)


def read_group_sample(pid: int, members: Iterable[int] = (), *, threads: bool = True) -> ProcessSample | None:
    """`read_process_sample(pid)` with the CPU time and the runnable threads of `members`
    (its process group, from `group_members`) added, so that a worker started through a
    wrapper (`bash run.sh` without `exec`) is judged by the trainer under it, not by the idle
    shell. The state is the worker's own."""
    own = read_process_sample(pid, threads=threads)
    if own is None:
        return None
    cpu_s, runnable = own.cpu_s, own.runnable_threads
    for member_pid in members:
        member = read_process_sample(member_pid, threads=threads)
        if member is not None and member.state not in ("Z", "X"):
            cpu_s += member.cpu_s
            runnable += member.runnable_threads
    return dataclasses.replace(own, cpu_s=cpu_s, runnable_threads=runnable)


class Silence(enum.Enum):
    """What a worker's silence means, and so what its launcher does."""

    # Beating, or silent for no longer than the limit: nothing to do.
    ALIVE = "alive"
    # Silent past the limit but using CPU: left alone (logged), the progress timeout's.
    SLOW = "slow"
    # Stopped, or silent with no CPU time through the silence: killed.
    FROZEN = "frozen"
    # Silent past the limit with no CPU time yet, but watched for less than the limit
    # (no sample from its last beat to compare with): judged at a later look.
    WATCHING = "watching"
    # Exited (a zombie) or gone: its exit is reported elsewhere.
    GONE = "gone"


@dataclasses.dataclass(frozen=True)
class SilenceVerdict:
    silence: Silence
    reason: str


def silence_verdict(*, silent_s: float, limit_s: float, sample_at_last_beat: ProcessSample | None,
                    sample_now: ProcessSample | None) -> SilenceVerdict:
    """Judge a worker that last beat `silent_s` ago. `sample_at_last_beat` is the sample
    taken when its last beat arrived (or, without one, at the first look once it fell
    silent); `sample_now` the current one, None if the process is gone.

    FROZEN only for a process that is stopped, or with no runnable thread and whose CPU
    time stood still for the whole silence, watched for at least `limit_s`; a process
    that used any CPU since its last beat, or with a thread runnable (R) but given none,
    is SLOW, never FROZEN."""
    if silent_s <= limit_s:
        return SilenceVerdict(Silence.ALIVE, f"beat {silent_s:.1f} s ago (limit {limit_s:g} s)")
    if sample_now is None or sample_now.state in ("Z", "X"):
        return SilenceVerdict(Silence.GONE, "exited; its exit is reported on its own")
    if sample_now.state == "T":
        return SilenceVerdict(Silence.FROZEN, f"no beat for {silent_s:.1f} s: stopped (SIGSTOP)")
    if sample_now.state == "t":
        # A debugger or a profiler (gdb, py-spy) holds it: someone is looking at it.
        return SilenceVerdict(Silence.SLOW, f"no beat for {silent_s:.1f} s: stopped by a tracer (a debugger?); "
                              "left alone")
    if sample_at_last_beat is None:
        return SilenceVerdict(Silence.WATCHING, f"no beat for {silent_s:.1f} s; no CPU sample to compare with yet")
    cpu_s = sample_now.cpu_s - sample_at_last_beat.cpu_s
    watched_s = sample_now.taken_at - sample_at_last_beat.taken_at
    if cpu_s > 0:
        return SilenceVerdict(Silence.SLOW, f"no beat for {silent_s:.1f} s but busy: {cpu_s:.2f} s of CPU in the "
                              f"last {watched_s:.1f} s; left to the progress timeout")
    if sample_now.state == "R" or sample_now.runnable_threads:
        # A thread ready to run (its beat thread, say) yet given no CPU: starved on a
        # loaded node, not frozen.
        return SilenceVerdict(Silence.SLOW, f"no beat for {silent_s:.1f} s and runnable, but given no CPU in "
                              f"{watched_s:.1f} s (a loaded node); left to the progress timeout")
    if watched_s < limit_s:
        return SilenceVerdict(Silence.WATCHING, f"no beat for {silent_s:.1f} s and no CPU time in the "
                              f"{watched_s:.1f} s watched so far")
    return SilenceVerdict(Silence.FROZEN, f"no beat and no CPU time for {min(silent_s, watched_s):.1f} s")


# One verdict over everything a launcher watches.


@dataclasses.dataclass(frozen=True)
class Now:
    """The injected clock: `monotonic` for deadlines and the peers' silence, `wall` for the
    workers' beats (they carry the worker's wall time)."""

    monotonic: float
    wall: float


class Watched(enum.Enum):
    """What a launcher judges the liveness of."""

    # The launcher itself, not registered yet: the controller unreachable past the limit.
    CONTROLLER = "controller"
    # A follower's leader, or the leader's followers: silent past the node timeout.
    LEADER = "leader"
    FOLLOWER = "follower"
    # A live-mode worker whose beats stopped: `silence_verdict`.
    WORKER = "worker"
    # The launcher's own loop, held up longer than the silence limit: its workers' beats
    # waited unread, so their silence says nothing yet.
    SELF = "self"


@dataclasses.dataclass(frozen=True)
class WorkerWatch:
    """One live-mode worker as seen at a look: when its last beat was sent (wall time), the
    sample taken at its last beat (or at the first silent look), and one taken now (None
    if it is gone, or not taken because it was not silent past the limit)."""

    local_rank: int
    last_beat_at: float
    sample_at_last_beat: ProcessSample | None
    sample_now: ProcessSample | None


@dataclasses.dataclass(frozen=True)
class Observations:
    """What a launcher knows of the things it watches at one look.

    `registering_since`: when the launcher started, while it is not registered (None once
    it is). `peers`: when each peer (a follower by node index, or the leader as 0) was
    last heard from (monotonic). `workers`: the live-mode workers to judge (neither
    exited, finished nor killed already) and `previous_look_at` the look before this one
    (monotonic; 0: none)."""

    registering_since: float | None = None
    connect_timeout_s: float = 0.0
    peers: tuple[tuple[int, float], ...] = ()
    peer_kind: Watched = Watched.FOLLOWER
    node_timeout_s: float = 0.0
    workers: tuple[WorkerWatch, ...] = ()
    worker_silence_limit_s: float = 0.0
    previous_look_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the launcher does about one watched thing: `key` is the follower's node index
    or the worker's local rank (0 otherwise); `silence` for a worker (ALIVE otherwise)."""

    watched: Watched
    key: int
    lost: bool
    reason: str
    silence: Silence = Silence.ALIVE
    # A worker's: how long its beats have been silent.
    silent_s: float = 0.0


def silent_past(last_at: float, now: float, limit_s: float) -> bool:
    """Whether something last heard at `last_at` is silent for longer than `limit_s` (the one
    comparison every liveness rule makes; a limit of 0 or less never expires)."""
    return limit_s > 0 and now - last_at > limit_s


def liveness_verdicts(observed: Observations, now: Now) -> tuple[Verdict, ...]:
    """The launcher's one liveness judgement, pure: every watched thing that is not simply
    alive, with what to do about it (`lost`: the peer, or the controller, is given up on;
    a worker's `silence` says whether it is killed) and a reason for the log.

    - the controller: unreachable when the launcher is still not registered
      `connect_timeout_s` after it started;
    - a peer node: lost when silent for longer than `node_timeout_s`;
    - a worker: judged by `silence_verdict` when its beats stopped for longer than the
      silence limit, unless the launcher itself was held up for longer than that since
      its previous look (then one SELF verdict: judge from fresh samples next time)."""
    verdicts: list[Verdict] = []
    if (observed.registering_since is not None
            and silent_past(observed.registering_since, now.monotonic, observed.connect_timeout_s)):
        verdicts.append(Verdict(Watched.CONTROLLER, 0, True,
                                f"not registered within {observed.connect_timeout_s:g} s"))
    for key, last_heard in observed.peers:
        if silent_past(last_heard, now.monotonic, observed.node_timeout_s):
            verdicts.append(Verdict(observed.peer_kind, key, True, f"silent for {now.monotonic - last_heard:.1f} s"))
    limit_s = observed.worker_silence_limit_s
    if observed.workers and limit_s > 0:
        if observed.previous_look_at and now.monotonic - observed.previous_look_at > limit_s:
            verdicts.append(Verdict(Watched.SELF, 0, False, f"this launcher was held up for "
                                    f"{now.monotonic - observed.previous_look_at:.1f} s; its workers' beats "
                                    "waited unread"))
            return tuple(verdicts)
        for worker in observed.workers:
            if not silent_past(worker.last_beat_at, now.wall, limit_s):
                continue
            silent_s = now.wall - worker.last_beat_at
            verdict = silence_verdict(silent_s=silent_s, limit_s=limit_s,
                                      sample_at_last_beat=worker.sample_at_last_beat, sample_now=worker.sample_now)
            verdicts.append(Verdict(Watched.WORKER, worker.local_rank, verdict.silence is Silence.FROZEN,
                                    verdict.reason, verdict.silence, silent_s))
    return tuple(verdicts)
