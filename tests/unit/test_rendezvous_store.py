"""The rendezvous store a launcher serves listens on the launcher's address only, is
served from a child process (torch is never imported in the launcher), and does not hold
the launcher up while that child imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.listening import decode_address, listening_addresses
from tidal.launcher.leader import Agent, LauncherOptions
from tidal.launcher.lifecycle import EXIT_UNIT_FAILED, LauncherState
from tidal.launcher.link import ControllerSaid
from tidal.launcher.store import ServedStore, StoreNotServed, stop_store_server
from tidal.launcher.store_server import FAIL_ENV, HOLD_ENV
from tidal.proto import common_pb2, launcher_pb2


@pytest.fixture(autouse=True)
def fresh_store_server() -> Iterator[None]:
    """Each test starts its own store server (with its own environment) and stops it."""
    stop_store_server()
    yield
    stop_store_server()


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True  # exited; its parent (another process) has not reaped it yet
        time.sleep(0.05)
    return False


def _client(address: str, port: int, script: str, timeout_s: int = 60) -> subprocess.Popen[str]:
    """A TCPStore client in a process of its own (torch stays out of this one)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from datetime import timedelta; from torch.distributed import TCPStore; "
         f"s = TCPStore(sys.argv[1], {port}, is_master=False, wait_for_workers=False, "
         f"timeout=timedelta(seconds={timeout_s})); {script}", address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(client: subprocess.Popen[str], timeout_s: float = 60) -> tuple[int, str, str]:
    try:
        out, err = client.communicate(timeout=timeout_s)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    return client.returncode, out, err


def test_proc_net_addresses_are_decoded() -> None:
    assert decode_address("0200007F") == "127.0.0.2"
    assert decode_address("00000000000000000000000001000000") == "::1"


@pytest.mark.parametrize("address", ["127.0.0.2", "::1"])
def test_the_store_listens_on_the_address_it_is_given_and_serves_there(address: str) -> None:
    if ":" in address and not socket.has_ipv6:
        pytest.skip("no IPv6")
    store = ServedStore(address)
    assert store.wait(60)
    assert store.server_pid is not None and store.server_pid != os.getpid()
    bound = [host for host, listened in listening_addresses(store.server_pid) if listened == store.port]
    assert bound == [address]
    # This process handed its copy of the socket over.
    assert [port for _, port in listening_addresses(os.getpid()) if port == store.port] == []
    code, out, err = _finish(_client(address, store.port, "s.set('key', 'value'); print(s.get('key').decode())"))
    assert code == 0, err
    assert out.strip() == "value"


def test_a_client_that_connects_before_the_server_is_made_is_served(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is handed out at once; a worker may connect while the store server still
    imports torch: it waits in the backlog, then is served."""
    gate = tmp_path / "go"
    monkeypatch.setenv(HOLD_ENV, str(gate))
    store = ServedStore("127.0.0.1")
    client = _client("127.0.0.1", store.port, "s.set('early', 'yes'); print('set', flush=True)")
    try:
        with pytest.raises(TimeoutError):
            store.wait(3.0)  # the client has connected (or is connecting) to a server not yet made
        assert not store.failed
        gate.touch()
        assert store.wait(60)
        code, out, err = _finish(client)
        assert code == 0, err
        assert out.strip() == "set"
        code, out, err = _finish(_client("127.0.0.1", store.port, "print(s.get('early').decode())"))
        assert code == 0, err
        assert out.strip() == "yes"
    finally:
        gate.touch()
        if client.poll() is None:
            client.kill()
            client.wait()


def test_a_store_that_cannot_be_made_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAIL_ENV, "no store today")
    store = ServedStore("127.0.0.1")
    with pytest.raises(StoreNotServed, match="no store today"):
        store.wait(60)
    assert store.failed
    assert store.error is not None and "no store today" in store.error


def test_an_address_that_is_not_this_nodes_is_refused() -> None:
    with pytest.raises(OSError):
        ServedStore("no-such-host.invalid")


def test_a_closed_store_stops_serving() -> None:
    store = ServedStore("127.0.0.1")
    kept = ServedStore("127.0.0.1")
    assert store.wait(60) and kept.wait(60)
    assert store.server_pid == kept.server_pid  # one server for all of a process's stores
    store.close()
    deadline = time.monotonic() + 10.0
    while True:
        try:
            socket.create_connection(("127.0.0.1", store.port), timeout=1.0).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the closed store still accepts connections"
        time.sleep(0.05)
    assert store.server_pid is not None
    assert store.port not in [port for _, port in listening_addresses(store.server_pid)]
    # The others are still served.
    code, out, err = _finish(_client("127.0.0.1", kept.port, "s.set('k', 'v'); print(s.get('k').decode())"))
    assert code == 0, err
    assert out.strip() == "v"


def test_every_store_fails_when_the_store_server_dies() -> None:
    store = ServedStore("127.0.0.1")
    assert store.wait(60)
    assert store.server_pid is not None
    os.kill(store.server_pid, signal.SIGKILL)
    with pytest.raises(StoreNotServed, match="the store server was killed by signal 9"):
        deadline = time.monotonic() + 10.0
        while not store.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        store.wait(0)
    later = ServedStore("127.0.0.1")
    assert later.failed
    assert later.error == store.error


def test_torch_is_never_imported_in_the_process_that_serves_the_stores() -> None:
    """torch's import holds the GIL for long stretches: in the launcher it would stall the
    loop that sends the heartbeats. The store server imports it instead."""
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from tidal.launcher.store import ServedStore, stop_store_server
        store = ServedStore("127.0.0.1")
        store.wait(120)
        print("torch" in sys.modules, store.server_pid != __import__("os").getpid())
        store.close()
        stop_store_server()
        """)], capture_output=True, text=True, timeout=180)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["False", "True"]


def test_the_store_server_exits_when_its_launcher_dies() -> None:
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from tidal.launcher.store import ServedStore
        store = ServedStore("127.0.0.1")
        store.wait(120)
        print(store.server_pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child, 0)
        parent.kill()
        parent.wait()
        assert _gone(child, 10.0), "the store server outlived its launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_the_launcher_registers_without_importing_torch() -> None:
    """Importing torch takes seconds; the launcher's own modules must not."""
    probe = subprocess.run([sys.executable, "-c", "import sys, tidal.launcher.agent, tidal.launcher.follower; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False"


def _has_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_held_store_server_imports_torch_and_serves_only_once_released() -> None:
    """A live unit's launcher holds its store server's torch import while its workers start
    (launcher/store.py): the ports are handed out at once, the stores asked for meanwhile
    (and one closed meanwhile) are made in order once it is released."""
    from tidal.launcher.store import release_store_server

    store = ServedStore("127.0.0.1", held=True)
    closed = ServedStore("127.0.0.1")
    closed.close()
    later = ServedStore("127.0.0.1")
    assert store.server_pid is not None
    with pytest.raises(TimeoutError):
        store.wait(2.0)
    assert not _has_torch(store.server_pid)
    assert release_store_server()
    assert not release_store_server(), "released once"
    assert store.wait(60) and later.wait(60)
    assert _has_torch(store.server_pid)
    served = [port for _, port in listening_addresses(store.server_pid)]
    assert store.port in served and later.port in served and closed.port not in served
    code, out, err = _finish(_client("127.0.0.1", later.port, "s.set('k', 'v'); print(s.get('k').decode())"))
    assert code == 0, err
    assert out.strip() == "v"


def test_a_held_store_server_ends_with_its_launcher_before_it_was_released() -> None:
    store = ServedStore("127.0.0.1", held=True)
    pid = store.server_pid
    assert pid is not None
    stop_store_server(5.0)
    assert _gone(pid, 10)
    with pytest.raises(StoreNotServed):
        store.wait(10)


def test_a_launcher_that_cannot_make_its_next_store_fails_the_unit_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restart mode: a generation hosted on this unit starts, and the launcher makes a
    fresh store for the next one at once (`Agent._new_store`). When that cannot be made
    (its address no longer resolves, here, or no socket can be had), the unit fails with
    the reason, as when a store fails later. It went on with no store, the error left in
    a handler's traceback: no STARTED report, and the unit could never host again (a job
    of one unit could form no next generation)."""
    run_root = Path(tempfile.mkdtemp(prefix="tst-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(run_root))

    async def scenario() -> tuple[LauncherState, int, str, bool]:
        # The address stopped resolving after the launcher opened (its first store is held:
        # no torch import here).
        agent = Agent(LauncherOptions(controller="127.0.0.1:9", job_id="j", unit_id="u1", secret="s",
                                      address="no-such-host.invalid", nodes=("n1",)))
        agent.store = ServedStore("127.0.0.1", held=True)
        agent.registered = launcher_pb2.Registered(mode=common_pb2.JOB_MODE_RESTART, procs_per_node=1,
                                                   command=[sys.executable, "-c", "import time; time.sleep(60)"])
        agent.state = LauncherState.WAITING
        start = launcher_pb2.Generation(
            generation=1, rank_table=common_pb2.RankTable(world_size=1, groups=1, assignments=[
                common_pb2.RankAssignment(unit_id="u1", nodes=["n1"], group_rank=0, first_rank=0, procs_per_node=1)]),
            rendezvous=common_pb2.Rendezvous(host="127.0.0.1", port=agent.store.port, host_unit_id="u1"))
        try:
            agent._handle(ControllerSaid(launcher_pb2.ControllerMessage(generation=start)))
            return agent.state, agent.exit_code, agent.exit_reason, agent.workers is not None
        finally:
            if agent.workers is not None:
                for worker in agent.workers.workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(worker.pid, signal.SIGKILL)
                await agent.workers.stop(grace_s=0.1)
            shutil.rmtree(agent.run_dir, ignore_errors=True)

    try:
        state, code, reason, started = asyncio.run(scenario())
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    assert started, "the generation's workers were started before the next store was made"
    assert (state, code) == (LauncherState.FAILED, EXIT_UNIT_FAILED)
    assert "cannot serve the rendezvous store on no-such-host.invalid" in reason
