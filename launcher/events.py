"""What a launcher's event loop reacts to, for both kinds of launcher: the unit's own
(`agent`) and a follower node's (`follower`)."""

from __future__ import annotations

import dataclasses

from tidal.launcher.workers import Worker


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    generation: int
    worker: Worker
    returncode: int


@dataclasses.dataclass(frozen=True)
class WorkersStopped:
    generation: int


@dataclasses.dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclasses.dataclass(frozen=True)
class Tick:
    pass
