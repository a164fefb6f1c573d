"""The worker's end of the launcher's control channel (wire format: `tidal.proto.control`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import structlog

from tidal.proto.control import (
    BEAT_INTERVAL_S,
    Beat,
    Coming,
    Hello,
    LauncherToWorker,
    Stop,
    WorkerToLauncher,
    World,
    decode,
    encode,
)

log = structlog.get_logger("tidal.train.channel")

# Called on the reader thread with each world or stop the launcher sent, once recorded
# (None: the channel closed). It must not block for long: it holds up the next message.
OnWord = Callable[[LauncherToWorker | None], None]

# How long a launcher's word that a change is coming (`Coming`) holds: past it, the ranks
# stop voting at each step's end (its world never came: the change was given up).
COMING_HOLDS_S = 300.0


class ChannelClosed(Exception):
    """The launcher went away."""


class WorkerChannel:
    """The worker's end: a reader thread keeps the newest world and stop the launcher sent,
    and hands each to `on_word` (on that thread: the training thread may be blocked)."""

    def __init__(self, path: str, local_rank: int, pid: int, on_word: OnWord | None = None) -> None:
        self.on_word = on_word
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(path)
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self.worlds: dict[int, World] = {}
        self.stopped_generation = 0
        # The newest generation the launcher said is coming (`Coming`), and when (monotonic).
        self.coming_generation = 0
        self.coming_at = 0.0
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
                    elif isinstance(message, Coming):
                        # Read by the training thread at its step's vote; nothing to wake.
                        if message.generation > self.coming_generation:
                            self.coming_generation, self.coming_at = message.generation, time.monotonic()
                        continue
                    else:
                        continue
                    self._changed.notify_all()
                self._tell(message)
        except OSError:
            pass
        finally:
            with self._changed:
                self.closed = True
                self._changed.notify_all()
            self._tell(None)

    def _tell(self, message: LauncherToWorker | None) -> None:
        if self.on_word is None:
            return
        try:
            self.on_word(message)
        except Exception as error:  # the reader must outlive a listener's bug
            log.error("control_listener_failed", error=repr(error))

    def stop_requested(self, generation: int) -> bool:
        return self.stopped_generation >= generation or self.closed

    def next_world(self, after_generation: int) -> World | None:
        """The newest world announced for a generation after `after_generation` and not stopped."""
        with self._changed:
            return self._next_world(after_generation)

    def _next_world(self, after_generation: int) -> World | None:
        generations = [g for g in self.worlds if g > after_generation and g > self.stopped_generation]
        return self.worlds[max(generations)] if generations else None

    def change_coming(self, after_generation: int) -> bool:
        """The launcher said, within COMING_HOLDS_S, that a generation after `after_generation`
        is coming, and it has not been stopped."""
        with self._changed:
            return (self.coming_generation > max(after_generation, self.stopped_generation)
                    and time.monotonic() - self.coming_at < COMING_HOLDS_S)

    def wait_world(self, after_generation: int, timeout_s: float) -> World:
        """Block until the launcher names a world after `after_generation`."""
        world = self._wait(after_generation, timeout_s, or_its_stop=False)
        assert world is not None
        return world

    def wait_world_or_stop(self, generation: int, timeout_s: float) -> World | None:
        """Block until the launcher names a world after `generation` (that world), or stops
        `generation` (None: a stop comes first, even with a later world known)."""
        return self._wait(generation, timeout_s, or_its_stop=True)

    def _wait(self, after_generation: int, timeout_s: float, *, or_its_stop: bool) -> World | None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if or_its_stop and self.stopped_generation >= after_generation:
                    return None
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
