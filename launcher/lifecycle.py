"""What every launcher of a unit shares, the unit's leader and a follower node alike: its
states and its exit codes. A one-node unit is the K = 1 case: a leader with no followers."""

from __future__ import annotations

import enum

# How the launcher process exits.
EXIT_OK = 0
EXIT_UNIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4



def exit_status(returncode: int) -> tuple[int, int]:
    """A worker's (exit_code, signal) as the protocol reports them, from its return code
    (negative: killed by that signal)."""
    return (0, -returncode) if returncode < 0 else (returncode, 0)


# How often a launcher looks at its workers and peers (the leader's heartbeats go every
# heartbeat_interval, a follower's reports every second).
TICK_INTERVAL_S = 0.25


class LauncherState(enum.StrEnum):
    """A launcher's lifecycle, on any node of its unit.

    CONNECTING: not admitted yet: the leader not registered with the controller (one that
    registered once never returns here; while the controller is away it stays in its
    state and keeps its workers), a follower not admitted by its leader.
    WAITING: admitted, no workers: a joiner, or between two generations.
    RUNNING: the workers of `generation` run.
    STOPPING: stopping the workers (a stop, or before a new generation).
    LEAVING: stopping the workers to exit afterwards (the leader: leaving the job, exit 0;
    a follower: after a second SIGTERM, its leave timeout, or its leader's end).
    SUCCEEDED, FAILED: final; the process exits (0, or the code saying why)."""

    CONNECTING = "connecting"
    WAITING = "waiting"
    RUNNING = "running"
    STOPPING = "stopping"
    LEAVING = "leaving"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (LauncherState.SUCCEEDED, LauncherState.FAILED)
