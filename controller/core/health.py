"""Health verdicts and rate bounds: pure functions of observations and a monotonic `now`.

A broken stream and a worker's exit are failures the moment they are seen (the job actor
acts on them directly); what needs a clock is judged here: heartbeats that stopped, a
worker that stopped making progress, a launcher that did not come back after a controller
restart. The reasons go into the event log as they are.

A live-mode worker whose liveness beats stop is not judged here: its own launcher judges
that silence, once, with the limit this controller sends it
(`Registered.worker_silence_timeout`), and kills the worker only if it is frozen (stopped,
or using no CPU); the kill comes back as a worker exit (cause `silent`). A silent worker
that is busy is left to the progress timeout below."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


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
