"""One launcher's open session, as the job actor sees it: an outbox the gRPC handler
drains, and what the launcher last reported."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from tidal.controller.core.stragglers import Totals
from tidal.proto import launcher_pb2


@dataclasses.dataclass(frozen=True)
class SessionClose:
    """Ends the session with this status after the messages queued before it."""

    code: grpc.StatusCode
    details: str


@dataclasses.dataclass(frozen=True)
class SessionEnded:
    """The launcher's side of the stream ended (closed, or the read failed)."""

    reason: str


@dataclasses.dataclass(eq=False)
class LauncherSession:
    job_id: str
    unit_id: str
    opened_at: float
    last_heartbeat_at: float
    store_port: int
    worker_pids: tuple[int, ...]
    outbox: asyncio.Queue[launcher_pb2.ControllerMessage | SessionClose | SessionEnded] = dataclasses.field(
        default_factory=asyncio.Queue)
    # Per global rank: when the worker last made progress (controller's monotonic clock).
    progress_at: dict[int, float] = dataclasses.field(default_factory=dict)
    # Live mode, per global rank: the worker's last beat (monotonic) and whether it was
    # blocked in a collective then.
    beat_at: dict[int, float] = dataclasses.field(default_factory=dict)
    waiting: dict[int, bool] = dataclasses.field(default_factory=dict)
    # Per global rank: last completed step.
    steps: dict[int, int] = dataclasses.field(default_factory=dict)
    # Live mode: samples the job had trained on, as this unit's workers last said, and
    # the loss of the last step they committed (None before one, or where not reported).
    samples: int = 0
    loss: float | None = None
    # Live mode, per local rank: the worker's own compute this generation (stragglers).
    compute: dict[int, Totals] = dataclasses.field(default_factory=dict)
    # The newest heartbeat's sequence number taken from this session (0: none yet).
    heartbeat_sequence: int = 0
    closed: bool = False

    def send(self, message: launcher_pb2.ControllerMessage) -> None:
        if not self.closed:
            self.outbox.put_nowait(message)

    def close(self, code: grpc.StatusCode, details: str) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(SessionClose(code, details))

    def end(self, reason: str) -> None:
        """The reading side is done: the writing side stops after what is queued."""
        self.outbox.put_nowait(SessionEnded(reason))
