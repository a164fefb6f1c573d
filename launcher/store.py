"""The rendezvous store a launcher serves: a torch TCPStore server on the launcher's
address only, whose port is known before torch is imported.

The launcher itself never needs torch but for this server, and importing torch takes
seconds (2.3–3.5 s on a 2-core host): made inline, it delayed the launcher's registration,
hence the start of a joining unit's workers (which import torch again), by that much. So
the listening socket is bound at once (its port goes into the registration and the
workers' environment) and the server is made on a thread: a client that connects before
the server accepts waits in the socket's backlog, within its own connect timeout."""

from __future__ import annotations

import socket
import threading
from typing import Any


class StoreNotServed(RuntimeError):
    """The TCPStore server could not be made on the bound socket (torch missing or broken)."""


class ServedStore:
    """A TCPStore server listening on `address` only (a host name is resolved; the first
    address it resolves to, as a peer resolving it tries first), on a free port.
    torch 2.13's TCPStore binds every interface; handed a socket already bound
    (`master_listen_fd`), it listens on that one and owns it. Raises OSError when
    `address` is not one of this node's. The server is made on a thread (see the module)."""

    def __init__(self, address: str) -> None:
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
        self._served = threading.Event()
        self._server: Any = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, args=(listener,), name=f"store-{self.port}", daemon=True)
        self._thread.start()

    def _serve(self, listener: socket.socket) -> None:
        try:
            from torch.distributed import TCPStore

            self._server = TCPStore(host_name=self.address, port=self.port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=listener.detach())
        except BaseException as error:
            listener.close()
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self._served.set()

    def settle(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the thread to finish making the server: a process
        that exits while another thread is inside torch's import can abort at shutdown."""
        self._thread.join(timeout_s)

    @property
    def failed(self) -> bool:
        return self._served.is_set() and self.error is not None

    def wait(self, timeout_s: float) -> Any:
        """The TCPStore server, once made; raises StoreNotServed if it could not be, or
        TimeoutError if it is not made within `timeout_s`."""
        if not self._served.wait(timeout_s):
            raise TimeoutError(f"the store on {self.address}:{self.port} was not made within {timeout_s:g} s")
        if self.error is not None:
            raise StoreNotServed(self.error)
        return self._server
