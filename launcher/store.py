"""The rendezvous stores a launcher serves: torch TCPStore servers on the launcher's
address only, whose ports are known before torch is imported, served from a child process.

The launcher itself never needs torch but for these servers. Importing torch takes
seconds (2.3–3.5 s on a 2-core host): made inline, it delayed the launcher's registration,
hence the start of a joining unit's workers (which import torch again), by that much. Made
on a thread of the launcher, it still held up the launcher's asyncio loop, which sends the
heartbeats: loading torch's C extensions holds the GIL (loop gaps of 157 ms idle and
0.5–1 s under load were measured, against a 3 s heartbeat timeout). So torch is never
imported in the launcher: each listening socket is bound here at once (its port goes into
the registration and the workers' environment) and handed over (SCM_RIGHTS) to one child
process per launcher, `store_server`, which imports torch once and makes a server on
each socket it is given. A client that connects before its server is made waits in the
socket's backlog, within its own connect timeout.

Held (`ServedStore(held=True)` for the first store): the child starts at once but imports
torch only once the launcher says so (`release_store_server`). A live unit's launcher
holds it while its own workers start, import torch too, join their world and take their
state, until they commit a step or the unit is named the host of a generation's store
(`decisions.store_server_release`): on a node whose cores that start saturates (several
units starting at once, a host shared by simulated nodes), the store server's import
(about 1.8 CPU-s) would only slow it, and most units never host a generation's store.

The child is started through `deathsig`, so it dies with the launcher, and it exits when
its control socket reaches EOF. It is started by the thread that makes the first store
(PR_SET_PDEATHSIG fires when that thread ends: the launcher's loop thread, which lives as
long as the process). Answers are read on one thread, which blocks in recv (blocking I/O
releases the GIL). If the child exits, every store not closed fails, and so does every
later one."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading


class StoreNotServed(RuntimeError):
    """The TCPStore server could not be made on the bound socket (torch missing or broken,
    or the store server gone)."""


class ServedStore:
    """A TCPStore server listening on `address` only (a host name is resolved; the first
    address it resolves to, as a peer resolving it tries first), on a free port.
    torch 2.13's TCPStore binds every interface; handed a socket already bound
    (`master_listen_fd`), it listens on that one and owns it. Raises OSError when
    `address` is not one of this node's. The server is made in the store server process
    (see the module); `close` drops it there."""

    def __init__(self, address: str, held: bool = False) -> None:
        family, kind, protocol, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, protocol)
        try:
            listener.bind(where)
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        self.address = address
        self.port = int(listener.getsockname()[1])
        self.error: str | None = None
        self.closed = False
        self._answered = threading.Event()
        self._host: _StoreServer | None = None
        try:
            self._host = _store_server(held)
        except OSError as error:
            listener.close()
            self._fail(f"cannot start the store server: {error}")
            return
        self._host.serve(self, listener)

    @property
    def server_pid(self) -> int | None:
        """The pid of the process serving this store (None if it could not be started)."""
        return self._host.pid if self._host is not None else None

    def _fail(self, error: str) -> None:
        if self.error is None:
            self.error = error
        self._answered.set()

    def _served(self) -> None:
        self._answered.set()

    def settle(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the store server's answer."""
        self._answered.wait(timeout_s)

    @property
    def failed(self) -> bool:
        return self._answered.is_set() and self.error is not None

    def wait(self, timeout_s: float) -> bool:
        """True once the server is made; raises StoreNotServed if it could not be (or the
        store server is gone), or TimeoutError if it is not made within `timeout_s`."""
        if not self._answered.wait(timeout_s):
            raise TimeoutError(f"the store on {self.address}:{self.port} was not made within {timeout_s:g} s")
        if self.error is not None:
            raise StoreNotServed(self.error)
        return True

    def close(self) -> None:
        """Drop the server: the store server stops serving this port. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._host is not None:
            self._host.close(self)


class _StoreServer:
    """The child process serving this process's stores, and the reader of its answers."""

    def __init__(self, held: bool = False) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            command = [sys.executable, "-m", "tidal.launcher.deathsig", str(os.getpid()),
                       sys.executable, "-m", "tidal.launcher.store_server", str(theirs.fileno()),
                       *(["--held"] if held else [])]
            # A session of its own, as the workers have: a terminal's ^C goes to the launcher only.
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._socket = ours
        self._lock = threading.Lock()
        # Stores sent and not yet answered, by port, in the order sent (a closed store's
        # port may be bound again once the child has dropped it, before its answer is read).
        self._unanswered: dict[int, list[ServedStore]] = {}
        # Stores that are served or waiting to be, not closed: they fail if the child exits.
        self._open: set[ServedStore] = set()
        self._stopping = False
        # Started held: torch is imported (and the stores made) once `go` is sent.
        self.held = held
        self.exit_error: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"store-server-{self.pid}", daemon=True)
        self._reader.start()

    def serve(self, store: ServedStore, listener: socket.socket) -> None:
        """Send the listening socket to the child, and close this process's copy of it."""
        try:
            with self._lock:
                if self.exit_error is not None:
                    store._fail(self.exit_error)
                    return
                self._unanswered.setdefault(store.port, []).append(store)
                self._open.add(store)
                try:
                    socket.send_fds(self._socket, [f"serve {store.port} {store.address}\n".encode()],
                                    [listener.fileno()])
                except OSError as error:
                    self._unanswered[store.port].remove(store)
                    self._open.discard(store)
                    store._fail(f"cannot reach the store server: {error}")
        finally:
            listener.close()

    def go(self) -> bool:
        """Let a held server import torch and make its stores; whether this call did."""
        with self._lock:
            if not self.held:
                return False
            self.held = False
            if self.exit_error is None:
                with contextlib.suppress(OSError):
                    self._socket.sendall(b"go\n")
            return True

    def close(self, store: ServedStore) -> None:
        with self._lock:
            self._open.discard(store)
            if self.exit_error is None:
                with contextlib.suppress(OSError):
                    self._socket.sendall(f"close {store.port}\n".encode())

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                data = self._socket.recv(65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                self._on_answer(line.decode(errors="replace"))
        self._on_exit()

    def _on_answer(self, line: str) -> None:
        what, _, rest = line.partition(" ")
        port_text, _, error = rest.partition(" ")
        if what not in ("served", "failed") or not port_text.isdigit():
            return
        with self._lock:
            waiting = self._unanswered.get(int(port_text))
            if not waiting:
                return
            store = waiting.pop(0)
            if not waiting:
                del self._unanswered[int(port_text)]
            if what == "failed":
                self._open.discard(store)
        if what == "served":
            store._served()
        else:
            store._fail(error or "the store server gave no reason")

    def _on_exit(self) -> None:
        if self._stopping:
            error = "the store server was stopped"
        else:
            try:
                status = self.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                error = "the store server closed its control socket"
            else:
                error = (f"the store server was killed by signal {-status}" if status < 0
                         else f"the store server exited with status {status}")
        with self._lock:
            self.exit_error = error
            failing = list(self._open)
            self._open.clear()
            self._unanswered.clear()
        for store in failing:
            store._fail(error)

    def stop(self, timeout_s: float) -> None:
        """Stop the child: its control socket's EOF, then SIGTERM, SIGKILL after `timeout_s`."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait()
        self._reader.join(timeout_s)
        self._socket.close()


_server: _StoreServer | None = None
_server_lock = threading.Lock()


def _store_server(held: bool = False) -> _StoreServer:
    global _server
    with _server_lock:
        if _server is None:
            _server = _StoreServer(held)
        return _server


def release_store_server() -> bool:
    """Let this process's store server, started held, import torch and make its stores;
    whether it was held."""
    with _server_lock:
        server = _server
    return server is not None and server.go()


def stop_store_server(timeout_s: float = 5.0) -> None:
    """Stop this process's store server, if started (by its pid: terminate, wait at most
    `timeout_s`, kill). Every store not closed fails; a later store starts a new server."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.stop(timeout_s)


atexit.register(stop_store_server, 2.0)
