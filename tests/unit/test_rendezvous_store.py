"""The rendezvous store a launcher serves listens on the launcher's address only, and
does not hold the launcher up while torch is imported."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from tests.listening import decode_address, listening_addresses
from tidal.launcher.store import ServedStore, StoreNotServed


def test_proc_net_addresses_are_decoded() -> None:
    assert decode_address("0200007F") == "127.0.0.2"
    assert decode_address("00000000000000000000000001000000") == "::1"


@pytest.mark.parametrize("address", ["127.0.0.2", "::1"])
def test_the_store_listens_on_the_address_it_is_given_and_serves_there(address: str) -> None:
    if ":" in address and not socket.has_ipv6:
        pytest.skip("no IPv6")
    from torch.distributed import TCPStore

    store = ServedStore(address)
    server = store.wait(60)
    bound = [host for host, listened in listening_addresses(os.getpid()) if listened == store.port]
    assert bound == [address]
    client = TCPStore(address, store.port, is_master=False, wait_for_workers=False)
    client.set("key", "value")
    assert server.get("key") == b"value"


def test_a_client_that_connects_before_the_server_is_made_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is handed out at once; a worker may connect while the launcher still
    imports torch: it waits in the backlog, then is served."""
    import torch.distributed

    gate = threading.Event()
    made = torch.distributed.TCPStore

    def held_back(*args: object, **kwargs: object) -> object:
        assert gate.wait(60)
        return made(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "TCPStore", held_back)
    store = ServedStore("127.0.0.1")
    client = subprocess.Popen(
        [sys.executable, "-c", "import sys; from datetime import timedelta; from torch.distributed import TCPStore; "
         f"s = TCPStore('127.0.0.1', {store.port}, is_master=False, wait_for_workers=False, "
         "timeout=timedelta(seconds=60)); s.set('early', 'yes'); print('set', flush=True)"],
        stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(TimeoutError):
            store.wait(3.0)  # the client has connected (or is connecting) to a server not yet made
        gate.set()
        server = store.wait(60)
        assert client.communicate(timeout=60)[0].strip() == "set"
        assert server.get("early") == b"yes"
    finally:
        gate.set()
        if client.poll() is None:
            client.kill()
            client.wait()


def test_a_store_that_cannot_be_made_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no store today")

    monkeypatch.setattr(torch.distributed, "TCPStore", broken)
    store = ServedStore("127.0.0.1")
    with pytest.raises(StoreNotServed, match="no store today"):
        store.wait(60)
    assert store.failed


def test_an_address_that_is_not_this_nodes_is_refused() -> None:
    with pytest.raises(OSError):
        ServedStore("no-such-host.invalid")


def test_the_launcher_registers_without_importing_torch() -> None:
    """Importing torch takes seconds; the launcher's own modules must not: only the
    store's thread does."""
    probe = subprocess.run([sys.executable, "-c", "import sys, tidal.launcher.agent, tidal.launcher.follower; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False"
