"""The launcher's store server: `python -m tidal.launcher.store_server CONTROL_FD [--held]`.

One per launcher, started (through `deathsig`) on the first rendezvous store it needs; it
imports torch once, at its start (with `--held`, once the launcher says `go`), and serves
every store of the launcher as a torch TCPStore on a listening socket the launcher bound
and hands over (`launcher/store.py` says why torch stays out of the launcher). It reads
commands, one line each, from the control socket CONTROL_FD (one end of a Unix socket
pair; the other is the launcher's):

- `serve <port> <address>`, with the listening socket's fd passed alongside
  (SCM_RIGHTS): make the server on it; answers `served <port>` or `failed <port> <error>`.
- `close <port>`: drop that server (it stops listening); no answer.
- `go`: import torch now (held only; commands before it wait for it, in order).

It exits when the control socket reaches EOF (the launcher closed it, or died).

For tests only: TIDAL_STORE_SERVER_HOLD=<path> holds the start (before torch's import)
until that path exists; TIDAL_STORE_SERVER_FAIL=<message> fails every store with it."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import sys
import time
from typing import Any

HOLD_ENV = "TIDAL_STORE_SERVER_HOLD"
FAIL_ENV = "TIDAL_STORE_SERVER_FAIL"


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _receive(control: socket.socket, fds: collections.deque[int]) -> bytes:
    """The next bytes from the launcher (b"": it closed the socket or is gone); the fds
    that came with them go to the end of `fds`."""
    while True:
        try:
            data, received, _, _ = socket.recv_fds(control, 65536, 16)
        except InterruptedError:
            continue
        except OSError:
            return b""
        fds.extend(received)
        return data


def _until_go(control: socket.socket, fds: collections.deque[int]) -> bytes | None:
    """Held: read until the launcher says `go`; the commands before it (and their fds)
    are kept, in order, for when the stores can be made. None: the launcher went first."""
    pending = b""
    while True:
        lines = pending.split(b"\n")
        if b"go" in lines[:-1]:
            at = lines.index(b"go")
            return b"".join(line + b"\n" for line in lines[:at]) + b"\n".join(lines[at + 1:])
        data = _receive(control, fds)
        if not data:
            return None
        pending += data


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or not argv[0].isdigit() or argv[1:] not in ([], ["--held"]):
        print("usage: python -m tidal.launcher.store_server CONTROL_FD [--held]", file=sys.stderr)
        return 2
    control = socket.socket(fileno=int(argv[0]))
    # The fds received, oldest first: each arrives with the bytes of the `serve` line it
    # was sent with, so a whole line's fd has always arrived by the time the line has.
    fds: collections.deque[int] = collections.deque()
    pending = b""
    if argv[1:] == ["--held"]:
        before_go = _until_go(control, fds)
        if before_go is None:
            return 0
        pending = before_go
    hold = os.environ.get(HOLD_ENV)
    while hold and not os.path.exists(hold):
        time.sleep(0.05)
    make: Any = None
    import_error: str | None = None
    try:
        from torch.distributed import TCPStore

        make = TCPStore
    except BaseException as error:  # every store says why it failed
        import_error = _one_line(error)
    failing = os.environ.get(FAIL_ENV)

    stores: dict[int, Any] = {}
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command = line.decode(errors="replace").split()
            if len(command) == 3 and command[0] == "serve" and command[1].isdigit():
                port, address = int(command[1]), command[2]
                if not fds:
                    _answer(control, f"failed {port} no listening socket came with the command")
                    continue
                fd = fds.popleft()
                try:
                    if import_error is not None:
                        raise RuntimeError(f"cannot import torch: {import_error}")
                    if failing:
                        raise RuntimeError(failing)
                    stores[port] = make(host_name=address, port=port, is_master=True, wait_for_workers=False,
                                        master_listen_fd=fd)
                except Exception as error:  # the launcher is told why
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    _answer(control, f"failed {port} {_one_line(error)}")
                else:
                    _answer(control, f"served {port}")
            elif len(command) == 2 and command[0] == "close" and command[1].isdigit():
                stores.pop(int(command[1]), None)
            elif command != ["go"]:
                print(f"store_server: unknown command {line!r}", file=sys.stderr)
        data = _receive(control, fds)
        if not data:
            break
        pending += data
    stores.clear()
    return 0


def _answer(control: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):
        control.sendall(f"{line}\n".encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
