"""Secrets, the admin token, and who is calling.

- A job's secret is made at submit time, stored in the database only as its SHA-256, and
  written to a file only the job's owner can read. Launchers present it on Register.
- Admin calls over TCP carry `authorization: Bearer <token>` (the token file is 0600).
- Admin calls over the Unix socket are identified by the kernel: gRPC does not expose
  SO_PEERCRED (grpc/grpc#15511), so the controller accepts on the Unix socket itself,
  reads the caller's uid with SO_PEERCRED, and relays the connection to a loopback-only
  gRPC port, remembering which relay connection belongs to which uid."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import os
import secrets
import socket
import struct
from pathlib import Path

import structlog

log = structlog.get_logger("tidal.controller.security")


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, digest: str) -> bool:
    return hmac.compare_digest(secret_digest(secret), digest)


def write_private_file(path: Path, content: str, *, owner_uid: int | None = None) -> None:
    """Write `content` to `path` readable by its owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, content.encode())
        if owner_uid is not None and owner_uid != os.geteuid():
            os.fchown(descriptor, owner_uid, -1)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


def load_or_create_admin_token(path: Path) -> str:
    """The admin token at `path`, made (0600) when the file does not exist."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        token = new_secret()
        write_private_file(path, token + "\n")
        log.info("admin_token_created", path=str(path))
    return token


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who makes an admin call."""

    uid: int
    # Root over the Unix socket, or anyone holding the admin token.
    is_admin: bool
    via: str

    def may_act_on(self, owner_uid: int) -> bool:
        return self.is_admin or self.uid == owner_uid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return int(uid)


class UnixSocketRelay:
    """Accepts CLI connections on a Unix socket, learns each caller's uid from the kernel,
    and relays the bytes to the controller's loopback-only admin port. The gRPC side asks
    `uid_for_peer(context.peer())` who is on the other end."""

    def __init__(self, socket_path: Path, target_port: int) -> None:
        self.socket_path = socket_path
        self.target_port = target_port
        self._uids: dict[str, int] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def uid_for_peer(self, peer: str) -> int | None:
        return self._uids.get(peer)

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))
        # Anyone may connect; what they may do is decided by their uid.
        os.chmod(self.socket_path, 0o666)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer_key = ""
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            uid = peer_uid(writer.get_extra_info("socket"))
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            local_host, local_port = upstream_writer.get_extra_info("sockname")[:2]
            peer_key = f"ipv4:{local_host}:{local_port}"
            self._uids[peer_key] = uid
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        except (OSError, asyncio.IncompleteReadError) as error:
            log.debug("admin_relay_closed", error=str(error))
        except asyncio.CancelledError:
            # Shutting down. asyncio's stream protocol reads this task's result when the
            # connection closes, and a CancelledError there is logged as an error.
            pass
        finally:
            self._uids.pop(peer_key, None)
            for closing in (writer, upstream_writer):
                if closing is not None:
                    closing.close()
            self._tasks.discard(task)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if sink.can_write_eof():
                sink.write_eof()
