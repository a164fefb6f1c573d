"""The launcher's end of its control channel with the live-mode workers: a Unix socket
server in the launcher's private run folder (mode 0700, so only the job's user reaches it),
named to the workers in `TIDAL_CONTROL_SOCKET`. The messages and their codec are
`tidal.proto.control`; the worker's end is `tidal.train.channel.WorkerChannel`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import structlog

from tidal.proto.control import MAX_LINE, Coming, Hello, LauncherToWorker, Stop, WorkerToLauncher, World, decode, encode

log = structlog.get_logger("tidal.launcher.control")


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
                if message is None or isinstance(message, (World, Stop, Coming)):
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
