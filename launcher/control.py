"""The channel between a launcher and its live-mode workers: JSON lines over a Unix socket.

The launcher serves the socket in its private run folder (mode 0700, so only the job's
user reaches it) and names it in `TIDAL_CONTROL_SOCKET`. Each worker connects once and
says `hello`. Each message is a frozen dataclass below (`World`, `Stop`, `Hello`, ...),
written by `encode` and read by `decode`, the one codec, as one line:

launcher -> worker:
  {"op": "world", "generation": G, "rank": r, "world_size": n, "master_addr": h, "master_port": p,
   "joining": j, "target_step": t, "save": v}
      the world of generation G. A running worker moves into it at the next step boundary
      its peers agree on (rank -1: leave after that step); an idle one joins it at once.
      With "save": true (rank -1, the unit holds the job's last copy of the state), the
      worker writes its state to disk before it leaves; the next world resumes from it.
      The world's state must be at step t (the job's committed step) or later: when no
      rank holds it, each loads its newest checkpoint, or they refuse to train.
  {"op": "stop", "generation": G}
      abandon the step in flight, leave generation G's process group, wait for the next world.

worker -> launcher:
  {"op": "hello", "local_rank": l, "pid": p}
  {"op": "formed", "generation": G, "step": s, "digest": d} in generation G's world, state verified
  {"op": "first_step", "generation": G, "step": s}          first step of generation G committed
  {"op": "stopped", "generation": G, "step": s}             out of the process group, idle
  {"op": "left", "generation": G, "step": s, "saved_to": p} left the job after step s; exits 0
                                                            (p: where it saved the state, or "")
  {"op": "finished", "generation": G, "step": s}            committed the job's last step s;
                                                            sent before tearing down and before
                                                            the script's code after train()
  {"op": "resumed", "generation": G, "step": s, "target_step": t, "detail": d}
                                                            no rank held step t: resumed from a
                                                            checkpoint at step s (s..t-1 redone)
  {"op": "state_lost", "generation": G, "target_step": t, "detail": d}
                                                            no rank held step t and there is no
                                                            checkpoint: refuses to train, exits
  {"op": "beat", "step": s, "samples": n, "waiting": w}    every BEAT_INTERVAL_S from a thread
                                                            of its own: alive, samples trained
                                                            so far, and whether blocked in a
                                                            collective
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("tidal.launcher.control")

MAX_LINE = 64 * 1024
BEAT_INTERVAL_S = 0.5
# A live worker that refuses to train because the job's state is lost (no rank holds the
# target step, no checkpoint) exits with this code, after saying `state_lost`; the
# controller fails the job on it, never the unit.
EXIT_STATE_LOST = 75


@dataclasses.dataclass(frozen=True)
class World:
    """One generation's world as a worker sees it."""

    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    # Joining a running world (its state comes from the members), as opposed to a world
    # formed afresh (a replica without state loads the newest checkpoint first).
    joining: bool = False
    # The job's committed step (its progress watermark) when the generation was decided.
    target_step: int = 0
    # Leaving (rank -1) as the last holder of the job's state: write it to disk first.
    save: bool = False

    @property
    def leaves(self) -> bool:
        return self.rank < 0



@dataclasses.dataclass(frozen=True)
class Stop:
    """Abandon the step in flight, leave that generation's group, wait for the next."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Hello:
    local_rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class Formed:
    """In that generation's world at `step`, its state verified (`digest`)."""

    generation: int
    step: int
    digest: str = ""


@dataclasses.dataclass(frozen=True)
class FirstStep:
    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Stopped:
    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Left:
    generation: int
    step: int
    # Where this worker wrote the state before leaving (its shard of it), or "".
    saved_to: str = ""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Committed the job's last step `step`: training is over for this worker."""

    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Resumed:
    """No rank held `target_step`; resumed from a checkpoint at `step`."""

    generation: int
    step: int
    target_step: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class StateLost:
    """No rank held `target_step` and there was no checkpoint: refuses to train."""

    generation: int
    target_step: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Beat:
    """Alive; samples trained so far; whether blocked in a collective; the loss of the
    last committed step (None before the first)."""

    step: int
    samples: int = 0
    waiting: bool = False
    loss: float | None = None


LauncherToWorker = World | Stop
WorkerToLauncher = Hello | Formed | FirstStep | Stopped | Left | Finished | Resumed | StateLost | Beat
Message = LauncherToWorker | WorkerToLauncher

# The one codec: each message type and its "op" on the wire.
_OPS: dict[str, type[Any]] = {"world": World, "stop": Stop, "hello": Hello, "formed": Formed,
                              "first_step": FirstStep, "stopped": Stopped, "left": Left, "finished": Finished,
                              "resumed": Resumed, "state_lost": StateLost, "beat": Beat}
_OP_OF = {kind: op for op, kind in _OPS.items()}
# Field types, for checking what a peer sent (annotations are strings under `annotations`).
_TYPES: dict[str, type[Any]] = {"int": int, "str": str, "bool": bool, "float": float}
# (type, whether None is allowed), by field, by message kind.
_FIELD_TYPES = {kind: {f.name: (_TYPES[str(f.type).removesuffix(" | None")], str(f.type).endswith(" | None"))
                       for f in dataclasses.fields(kind)}
                for kind in _OPS.values()}
MAX_DETAIL = 2000


def encode(message: Message) -> bytes:
    """One JSON line: {"op": ..., **fields}. A generation goes out under its former name
    "epoch" too, so that a peer of an earlier version still reads it."""
    body = dataclasses.asdict(message)
    if "generation" in body:
        body["epoch"] = body["generation"]
    return (json.dumps({"op": _OP_OF[type(message)], **body}) + "\n").encode()


def decode(line: bytes) -> Message | None:
    """The message on one line, or None (logged) for a line that is not one (not JSON, an
    unknown op, a field missing or of the wrong type): garbage never ends a channel.
    Unknown fields are ignored, so a newer peer's additions do not break an older one."""
    try:
        raw = json.loads(line)
        kind = _OPS[raw["op"]]
        if "generation" not in raw and "epoch" in raw:
            # Written by a peer of an earlier version, which called it the epoch.
            raw["generation"] = raw["epoch"]
        fields: dict[str, Any] = {}
        for name, (expected, optional) in _FIELD_TYPES[kind].items():
            if name not in raw:
                continue
            value = raw[name]
            if value is None and optional:
                fields[name] = None
                continue
            if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} is not an integer")
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if expected is float and isinstance(value, float) and not math.isfinite(value):
                # (A beat is liveness: a loss that is not a number is dropped, not the beat.)
                if not optional:
                    raise ValueError(f"{name} is not a finite number")
                fields[name] = None
                continue
            if not isinstance(value, expected):
                raise TypeError(f"{name} is not a {expected.__name__}")
            fields[name] = value[:MAX_DETAIL] if isinstance(value, str) else value
        message: Message = kind(**fields)
        return message
    except (ValueError, KeyError, TypeError, OverflowError) as error:
        log.warning("control_message_garbled", line=line[:200], error=str(error))
        return None


class ChannelClosed(Exception):
    """The launcher went away."""


class WorkerChannel:
    """The worker's end: a reader thread keeps the newest world and stop the launcher sent."""

    def __init__(self, path: str, local_rank: int, pid: int) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(path)
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self.worlds: dict[int, World] = {}
        self.stopped_generation = 0
        self.closed = False
        self.send(Hello(local_rank=local_rank, pid=pid))
        self._reader = threading.Thread(target=self._read, name="tidal-control", daemon=True)
        self._reader.start()

    def send(self, message: WorkerToLauncher) -> None:
        line = encode(message)
        with self._send_lock:
            try:
                self._socket.sendall(line)
            except OSError as error:
                raise ChannelClosed(f"launcher channel closed: {error}") from error

    def _read(self) -> None:
        stream = self._socket.makefile("rb")
        try:
            for line in stream:
                message = decode(line)
                with self._changed:
                    if isinstance(message, World):
                        self.worlds[message.generation] = message
                    elif isinstance(message, Stop):
                        self.stopped_generation = max(self.stopped_generation, message.generation)
                    else:
                        continue
                    self._changed.notify_all()
        except OSError:
            pass
        finally:
            with self._changed:
                self.closed = True
                self._changed.notify_all()

    def stop_requested(self, generation: int) -> bool:
        return self.stopped_generation >= generation or self.closed

    def next_world(self, after_generation: int) -> World | None:
        """The newest world announced for a generation after `after_generation` and not stopped."""
        with self._changed:
            return self._next_world(after_generation)

    def _next_world(self, after_generation: int) -> World | None:
        generations = [g for g in self.worlds if g > after_generation and g > self.stopped_generation]
        return self.worlds[max(generations)] if generations else None

    def wait_world(self, after_generation: int, timeout_s: float) -> World:
        """Block until the launcher names a world after `after_generation`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                world = self._next_world(after_generation)
                if world is not None:
                    return world
                if self.closed:
                    raise ChannelClosed("the launcher closed the control channel")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no world after generation {after_generation} within {timeout_s:g} s")
                self._changed.wait(remaining)

    def start_beats(self, status: Callable[[], Beat], interval_s: float = BEAT_INTERVAL_S) -> None:
        """Send the Beat `status()` gives every `interval_s` from a daemon thread. It runs
        while the training thread waits in a collective (torch releases the GIL there),
        and stops when the process is frozen: that is what tells a hang's cause from its
        victims."""

        def beat() -> None:
            while not self.closed:
                try:
                    self.send(status())
                except ChannelClosed:
                    return
                time.sleep(interval_s)

        threading.Thread(target=beat, name="tidal-beat", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


@dataclasses.dataclass(frozen=True)
class WorkerSaid:
    """A message from one of this launcher's workers."""

    local_rank: int
    message: WorkerToLauncher


class LauncherChannel:
    """The launcher's end: a Unix socket server; messages to a worker that has not said
    hello yet wait for it."""

    def __init__(self, path: Path, post: Callable[[WorkerSaid], None]) -> None:
        self.path = path
        self.post = post
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.pending: dict[int, list[LauncherToWorker]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)

    def reset(self) -> None:
        """Forget the workers of a group that is gone."""
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
        self.pending.clear()

    def send(self, local_rank: int, message: LauncherToWorker) -> None:
        writer = self.writers.get(local_rank)
        if writer is None or writer.is_closing():
            self.pending.setdefault(local_rank, []).append(message)
            return
        writer.write(encode(message))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local_rank: int | None = None
        try:
            while line := await reader.readline():
                message = decode(line)
                if message is None or isinstance(message, (World, Stop)):
                    continue
                if isinstance(message, Hello):
                    local_rank = message.local_rank
                    self.writers[local_rank] = writer
                    for queued in self.pending.pop(local_rank, []):
                        writer.write(encode(queued))
                if local_rank is not None:
                    self.post(WorkerSaid(local_rank, message))
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as error:
            log.warning("worker_channel_error", local_rank=local_rank, error=str(error))
        finally:
            if local_rank is not None and self.writers.get(local_rank) is writer:
                del self.writers[local_rank]
            writer.close()

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        self.path.unlink(missing_ok=True)
