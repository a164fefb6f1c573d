"""Liveness, judged once: pure functions of what was observed and a monotonic `now`.

A broken stream and a worker's exit are failures the moment they are seen (the core acts
on them as inputs); everything that needs a clock is judged here, in `judge`: heartbeats
that stopped, a worker that stopped making progress, a launcher that did not come back
after a controller restart, a stop or a live change past its deadline, a unit asked to
leave that is still there, a unit out of touch after the last step. The reasons go into
the event log as they are.

A live-mode worker whose liveness beats stop is not judged here: its own launcher judges
that silence, once, with the limit this controller sends it
(`Registered.worker_silence_timeout`), and kills the worker only if it is frozen (stopped,
or using no CPU); the kill comes back as a worker exit (cause `silent`). A silent worker
that is busy is left to the progress timeout below."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tidal.controller.model import JobState, UnitRecord, UnitState

if TYPE_CHECKING:
    from tidal.controller.core.state import State


@dataclasses.dataclass(frozen=True)
class UnitHealth:
    """What the controller last saw of one member of the running generation (monotonic times)."""

    unit_id: str
    connected: bool
    # Last heartbeat received, or when the session opened.
    last_heartbeat_at: float | None
    # Per global rank: when the worker last made progress, if it ever reported any.
    progress_at: Mapping[int, float] = dataclasses.field(default_factory=dict)
    # Live mode, per global rank: the worker's last liveness beat, and whether it was
    # blocked in a collective (waiting for its peers) at that beat. Only what the progress
    # verdict needs: silence itself is the launcher's to judge.
    beat_at: Mapping[int, float] = dataclasses.field(default_factory=dict)
    waiting: Mapping[int, bool] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HealthPolicy:
    heartbeat_timeout_s: float
    progress_timeout_s: float


@dataclasses.dataclass(frozen=True)
class Failure:
    unit_id: str
    reason: str
    # Short machine name of the cause, for metrics: heartbeat, progress, reconnect.
    cause: str


def health_verdicts(units: Sequence[UnitHealth], *, now: float, policy: HealthPolicy,
                    generation_started_at: float, reconnect_deadline: float) -> list[Failure]:
    """Failures among the members of a running generation.

    - connected, but no heartbeat for longer than `heartbeat_timeout_s`: hung or cut off;
    - not connected past `reconnect_deadline` (only after a controller restart does a
      member have no session; a session that breaks is a failure at once, elsewhere);
    - a worker that reported progress in this generation and then none for `progress_timeout_s`,
      unless it is blocked in a collective: when one rank hangs, all the others wait for
      it and stop progressing too, and only the one not waiting is the cause. A rank's
      "waiting" counts only while its beats are fresh (its last within
      `heartbeat_timeout_s`): one that stopped beating is not known to wait, so a hung,
      silent worker its launcher left alone (busy, not frozen) still meets this timeout.
      Workers that never report (unmodified torchrun scripts) are judged by heartbeats and
      exits only.

    Beat silence is not judged here (the launcher judges it; see the module's docstring)."""
    failures: list[Failure] = []
    for unit in units:
        if not unit.connected:
            if now > reconnect_deadline:
                failures.append(Failure(unit.unit_id, "launcher did not reconnect after the controller restarted",
                                        "reconnect"))
            continue
        if unit.last_heartbeat_at is not None:
            silent = now - unit.last_heartbeat_at
            if silent > policy.heartbeat_timeout_s:
                failures.append(Failure(unit.unit_id, f"no heartbeat for {silent:.1f} s "
                                        f"(timeout {policy.heartbeat_timeout_s:g} s)", "heartbeat"))
                continue
        waiting = {rank for rank, waits in unit.waiting.items()
                   if waits and now - unit.beat_at.get(rank, now) <= policy.heartbeat_timeout_s}
        stalled = {rank: now - at for rank, at in unit.progress_at.items()
                   if at >= generation_started_at and now - at > policy.progress_timeout_s and rank not in waiting}
        if stalled:
            rank, age = max(stalled.items(), key=lambda item: item[1])
            failures.append(Failure(unit.unit_id, f"rank {rank} made no progress for {age:.1f} s "
                                    f"(timeout {policy.progress_timeout_s:g} s)", "progress"))
    return failures


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """Every liveness verdict on one job at one `now` (`judge`): who failed, who is gone,
    who is overdue. Each names the generation (or stop, or change) it was judged against,
    so that a verdict about a world the same tick already replaced is not applied."""

    # Members of the running generation whose heartbeats, progress or reconnect failed.
    members: tuple[Failure, ...] = ()
    members_of: int = 0
    # Live members back after a controller restart with no workers, saying nothing of them
    # within heartbeat_timeout_s.
    back_without_workers: tuple[Failure, ...] = ()
    # The stop in flight is past its deadline (its generation and deadline, to know it
    # again): these units never confirmed it.
    stop_overdue: tuple[int, float] | None = None
    stop_unconfirmed: tuple[Failure, ...] = ()
    # The live change in flight is past its deadline: these units did not reach it.
    change_overdue_of: int = 0
    change_late: tuple[Failure, ...] = ()
    # While FINISHING: units out of touch past their grace, or whose open session has been
    # silent as long (they count as left).
    out_of_touch: tuple[str, ...] = ()
    # Otherwise: joining units out of touch past their grace (registered, not in a world
    # yet; nothing else would ever end one whose launcher died with its node).
    joiners_out_of_touch: tuple[Failure, ...] = ()
    # Units asked to leave and still there past the grace a stop gets (unit, since).
    leave_overdue: tuple[tuple[str, float], ...] = ()


def judge(state: State, now: float) -> Verdicts:
    """The one place the controller judges liveness: a pure function of the job's records
    (their phases and facts), the heartbeats as of the last tick, and `now`. The tick
    (`tick.on_tick`) applies the verdicts in order."""
    config = state.config
    job_state = state.job.state
    units = state.units
    overdue_s = config.restart_grace_s + config.heartbeat_timeout_s
    leave_overdue = tuple((u, unit.facts.leaving_since) for u, unit in units.items()
                          if unit.state is UnitState.LEAVING and unit.facts.leaving_since is not None
                          and now - unit.facts.leaving_since > overdue_s)
    if job_state.is_final:
        return Verdicts(leave_overdue=leave_overdue)
    back = tuple(Failure(u, "came back after a controller restart with no workers left, and said nothing of them",
                         "worker_exit")
                 for u, unit in units.items()
                 if unit.facts.back_without_workers_at is not None and not unit.state.is_final
                 and now - unit.facts.back_without_workers_at > config.heartbeat_timeout_s)

    def out_of_touch(unit: UnitRecord) -> bool:
        """Not connected for longer than reconnect_grace_s (since its session closed, or
        since this controller started)."""
        if unit.facts.connected:
            return False
        since = unit.facts.disconnected_at
        return now - since > config.reconnect_grace_s if since is not None else now > state.reconnect_deadline

    # A pause of the judge is not the silence of the judged: when this tick comes more
    # than a heartbeat interval after the previous one, this controller was held up (a
    # slow disk under its SQLite, no CPU) and heartbeats may be waiting unread; silence is
    # judged again at the next tick, once they are read. (A broken stream or a worker's
    # exit is an input, seen whatever the clock.)
    held_up = state.last_tick_at is not None and now - state.last_tick_at > config.heartbeat_interval_s

    def silent(unit_id: str, unit: UnitRecord) -> bool:
        """Its session open but no heartbeat on it past heartbeat_timeout_s, and then a
        closed session's reconnect_grace_s (its launcher stuck, say on a hung file
        system): after the last step nothing else would ever end it."""
        link = state.links.get(unit_id)
        return (unit.facts.connected and link is not None and not held_up
                and now - link.last_heartbeat_at > config.heartbeat_timeout_s + config.reconnect_grace_s)

    if job_state is JobState.FINISHING:
        gone = tuple(u for u, unit in units.items()
                     if not unit.state.is_final and (out_of_touch(unit) or silent(u, unit)))
        return Verdicts(out_of_touch=gone, leave_overdue=leave_overdue, back_without_workers=back)
    joiners = tuple(Failure(u, f"joining launcher out of touch for more than {config.reconnect_grace_s:g} s",
                            "stream")
                    for u, unit in units.items() if unit.state is UnitState.JOINING and out_of_touch(unit))
    stop = state.stopping
    stop_overdue = (stop.generation, stop.deadline) if stop is not None and now > stop.deadline else None
    unconfirmed = tuple(Failure(u, f"did not confirm the stop of generation {stop.generation} in time", "stop")
                        for u in sorted(stop.waiting_for)) if stop is not None and stop_overdue else ()
    members: tuple[Failure, ...] = ()
    generation = state.generation
    if job_state is JobState.RUNNING and generation is not None:
        observed = []
        for member in generation.members:
            if units[member.unit_id].state is not UnitState.ACTIVE:
                continue
            connected = units[member.unit_id].facts.connected
            link = state.links.get(member.unit_id)
            observed.append(UnitHealth(
                unit_id=member.unit_id, connected=connected,
                last_heartbeat_at=(link.last_heartbeat_at if link else now) if connected else None,
                progress_at=link.progress_at if link else {}, beat_at=link.beat_at if link else {},
                waiting=link.waiting if link else {}))
        members = tuple(failure for failure in health_verdicts(
            observed, now=now, policy=HealthPolicy(config.heartbeat_timeout_s, config.progress_timeout_s),
            generation_started_at=state.generation_started_at, reconnect_deadline=state.reconnect_deadline)
            if not (held_up and failure.cause == "heartbeat"))
    change = state.changing
    late: tuple[Failure, ...] = ()
    if change is not None and now > change.deadline:
        waiting = change.joiners_waiting if not change.told_old_members else change.waiting_for
        late = tuple(Failure(u, f"did not reach generation {change.generation} within "
                             f"{config.reconfigure_timeout_s:g} s", "reconfigure") for u in sorted(waiting))
    return Verdicts(members=members, members_of=generation.number if generation is not None else 0,
                    back_without_workers=back, stop_overdue=stop_overdue, stop_unconfirmed=unconfirmed,
                    change_overdue_of=change.generation if change is not None and now > change.deadline else 0,
                    change_late=late, leave_overdue=leave_overdue, joiners_out_of_touch=joiners)
