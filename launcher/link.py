"""The launcher's session with the controller: one bidirectional stream, reopened with
exponential backoff and jitter whenever it breaks. Messages that matter (a worker's exit,
a generation's report, a leave request) wait while the controller is away and go out after
the next registration; heartbeats sent while away are dropped. Once training has finished
(`hold_written`), a report written to a session only counts as delivered when the
controller ends that session after reading to its end and handling what it read (its job
wrote what it decided to SQLite): a session that breaks first (its controller died before
that) hands its reports back to be sent again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from tidal.controller.ratelimit import TokenBucket
from tidal.proto import launcher_pb2, launcher_pb2_grpc

log = structlog.get_logger("tidal.launcher.link")

# Refusals that retrying cannot fix: the launcher reports them and exits.
FATAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.INVALID_ARGUMENT})


@dataclasses.dataclass(frozen=True)
class LinkUp:
    registered: launcher_pb2.Registered


@dataclasses.dataclass(frozen=True)
class LinkDown:
    error: str


@dataclasses.dataclass(frozen=True)
class LinkRefused:
    code: grpc.StatusCode
    details: str


@dataclasses.dataclass(frozen=True)
class LinkBroken:
    """The link itself failed (a fault of this process: a certificate it can no longer
    read, a bug): it does not reconnect. Said, where it ended unseen and the launcher
    waited out its connect timeout."""

    error: str


@dataclasses.dataclass(frozen=True)
class ControllerSaid:
    message: launcher_pb2.ControllerMessage


LinkEvent = LinkUp | LinkDown | LinkRefused | LinkBroken | ControllerSaid


# What a session writes stays under the controller's default bound on a launcher's
# messages (`launcher_messages_per_s` 50, `launcher_message_burst` 100; over it the
# controller ends the session): a unit of many workers reporting all their exits at once,
# or a backlog sent again after a break, is paced instead of refused over and over.
WRITE_BURST = 80
WRITES_PER_S = 40.0


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.1
    maximum_s: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter over an exponentially growing ceiling."""
        ceiling = min(self.maximum_s, self.initial_s * (2 ** min(attempt, 20)))
        return rng.uniform(ceiling / 2, ceiling)


class ControllerLink:
    def __init__(self, target: str, *, register: Callable[[], launcher_pb2.Register],
                 post: Callable[[LinkEvent], None], tls_ca: Path | None = None, max_message_bytes: int = 1 << 20,
                 backoff: Backoff | None = None, first_reply_timeout_s: float = 10.0) -> None:
        self.target = target
        self._register = register
        self._post = post
        self._tls_ca = tls_ca
        self._max_message_bytes = max_message_bytes
        self._backoff = backoff or Backoff()
        self._first_reply_timeout_s = first_reply_timeout_s
        self._rng = random.Random()
        self._backlog: list[launcher_pb2.LauncherMessage] = []
        self._queue: asyncio.Queue[tuple[launcher_pb2.LauncherMessage, bool] | None] | None = None
        self._closing = False
        # While closing: reconnect until this monotonic time to deliver what is queued.
        self._deliver_until = 0.0
        self._was_registered = False
        # Keep each reliable message written until the controller confirms the session (set
        # once training has finished: `hold_written`).
        self._holding = False
        # What the current session holds (`_session`'s list).
        self._held: list[launcher_pb2.LauncherMessage] = []
        self.connected = False
        # Why the controller refused the last registration, if it did (the link stopped).
        self.refusal: LinkRefused | None = None
        # Set once the controller ended a session closed by `close` after reading all that
        # was written to it.
        self.delivered = asyncio.Event()

    def send(self, message: launcher_pb2.LauncherMessage, *, reliable: bool = True) -> None:
        """Queue a message; a reliable one waits for the next session if there is none."""
        if self.connected and self._queue is not None:
            self._queue.put_nowait((message, reliable))
        elif reliable:
            self._backlog.append(message)

    def hold_written(self) -> None:
        """From now on a reliable message written to a session stays held until the
        controller ends that session cleanly after the launcher's `close`; if the session
        breaks first, every message it held is queued again, ahead of the rest. For the
        end of training: the controller takes such reports more than once without harm."""
        self._holding = True

    def release_hold(self) -> None:
        """The exit that started holding was not the end of training after all (a new
        generation's workers start): what was held counts as sent, and nothing more is."""
        self._holding = False
        self._held.clear()

    @property
    def undelivered(self) -> int:
        """Reliable messages waiting for a session (the controller is away)."""
        return len(self._backlog)

    def close(self, deliver_within_s: float = 0.0) -> None:
        """End the current session after what is queued. Without a session, stop
        reconnecting, unless reliable messages wait and `deliver_within_s` allows: then keep
        reconnecting that long, deliver them in the first session, and end it. (Held
        messages of a session that breaks before its clean end wait so too.)"""
        self._closing = True
        self._deliver_until = time.monotonic() + deliver_within_s
        if self._queue is not None:
            self._queue.put_nowait(None)

    def _reconnecting(self) -> bool:
        return not self._closing or (bool(self._backlog) and time.monotonic() < self._deliver_until)

    def _channel(self) -> grpc.aio.Channel:
        options = [("grpc.max_receive_message_length", self._max_message_bytes),
                   ("grpc.max_send_message_length", self._max_message_bytes),
                   ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.enable_retries", 0)]
        if self._tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_ca.read_bytes())
            return grpc.aio.secure_channel(self.target, credentials, options=options)
        return grpc.aio.insecure_channel(self.target, options=options)

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as error:  # said (LinkBroken), not left in a task nobody reads
            log.exception("controller_link_broken", target=self.target)
            self._post(LinkBroken(f"{type(error).__name__}: {error}"))

    async def _run(self) -> None:
        attempt = 0
        while self._reconnecting():
            error = await self._session()
            if error is None or not self._reconnecting():
                return
            if isinstance(error, LinkRefused):
                self.refusal = error
                self._post(error)
                return
            self._post(LinkDown(error))
            attempt = 0 if self._was_registered else attempt + 1
            delay = self._backoff.delay(attempt, self._rng)
            log.info("controller_unreachable", target=self.target, error=error, retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)

    async def _session(self) -> str | LinkRefused | None:
        """One session; None when it ended because the launcher closed it."""
        self._was_registered = False
        channel = self._channel()
        queue: asyncio.Queue[tuple[launcher_pb2.LauncherMessage, bool] | None] = asyncio.Queue()
        writer: asyncio.Task[None] | None = None
        # Reliable messages written (or being written) while holding, in order.
        self._held = []
        confirmed = False
        # A session lives as long as the launcher, so it has no deadline; liveness comes
        # from heartbeats and keepalive, the first reply has a timeout.
        call = launcher_pb2_grpc.LauncherServiceStub(channel).Session()
        try:
            await call.write(launcher_pb2.LauncherMessage(register=self._register()))
            first = await asyncio.wait_for(call.read(), timeout=self._first_reply_timeout_s)
            if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
                return "controller ended the session without registering it"
            for message in self._backlog:
                queue.put_nowait((message, True))
            self._backlog.clear()
            self._queue = queue
            self.connected = True
            self._was_registered = True
            if self._closing:
                queue.put_nowait(None)
            self._post(LinkUp(first.registered))
            writer = asyncio.create_task(self._write(call, queue))
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    if not self._closing:
                        return "controller closed the session"
                    # The controller reads to the end of the stream, and its job handles
                    # all of it, before it ends the session.
                    confirmed = True
                    self.delivered.set()
                    return None
                self._post(ControllerSaid(message))
        except grpc.aio.AioRpcError as failure:
            if failure.code() in FATAL_CODES:
                return LinkRefused(failure.code(), failure.details() or "")
            return f"{failure.code().name}: {failure.details()}"
        except TimeoutError:
            return f"no reply to register within {self._first_reply_timeout_s:g} s"
        except (grpc.RpcError, OSError, asyncio.InvalidStateError) as failure:
            return f"session failed: {failure}"
        finally:
            self.connected = False
            self._queue = None
            # Reliable messages still queued go out with the next session.
            while not queue.empty():
                item = queue.get_nowait()
                if item is not None and item[1]:
                    self._backlog.append(item[0])
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            if self._held and not confirmed:
                # Perhaps never read (the controller died with them unread): sent again.
                log.warning("reports_requeued", reports=len(self._held),
                            reason="the session ended before the controller confirmed it")
                self._backlog[:0] = self._held
                self._held = []
            call.cancel()
            await channel.close(grace=None)

    async def _write(self, call: grpc.aio.StreamStreamCall,
                     queue: asyncio.Queue[tuple[launcher_pb2.LauncherMessage, bool] | None]) -> None:
        pacer = TokenBucket(WRITES_PER_S, WRITE_BURST, time.monotonic())
        while True:
            item = await queue.get()
            if item is None:
                with contextlib.suppress(Exception):
                    await call.done_writing()
                return
            message, reliable = item
            holding = reliable and self._holding
            if holding:
                self._held.append(message)
            try:
                if (wait_s := pacer.wait(time.monotonic())) > 0:
                    await asyncio.sleep(wait_s)
                await call.write(message)
            except BaseException:
                # (A write cancelled when the session is torn down as well.)
                if reliable and not holding:
                    self._backlog.insert(0, message)
                raise
