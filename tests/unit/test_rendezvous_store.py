"""The rendezvous store a launcher serves listens on the launcher's address only."""

from __future__ import annotations

import os
import socket

import pytest

from tests.listening import decode_address, listening_addresses
from tidal.launcher.agent import serve_store


def test_proc_net_addresses_are_decoded() -> None:
    assert decode_address("0200007F") == "127.0.0.2"
    assert decode_address("00000000000000000000000001000000") == "::1"


@pytest.mark.parametrize("address", ["127.0.0.2", "::1"])
def test_the_store_listens_on_the_address_it_is_given_and_serves_there(address: str) -> None:
    if ":" in address and not socket.has_ipv6:
        pytest.skip("no IPv6")
    from torch.distributed import TCPStore

    store = serve_store(address)
    port = int(store.port)
    bound = [host for host, listened in listening_addresses(os.getpid()) if listened == port]
    assert bound == [address]
    client = TCPStore(address, port, is_master=False, wait_for_workers=False)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_an_address_that_is_not_this_nodes_is_refused() -> None:
    with pytest.raises(OSError):
        serve_store("no-such-host.invalid")
