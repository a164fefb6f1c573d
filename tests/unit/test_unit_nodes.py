"""A unit spanning several nodes: where each node sits (pure), and the leader/follower
channel on loopback (real sockets): only a follower holding the job's secret gets in,
and the leader stays up for the right one after refusing a wrong one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tidal.launcher.follower import Follower, FollowerOptions
from tidal.launcher.lifecycle import EXIT_UNREACHABLE
from tidal.launcher.nodes import (
    FollowerHub,
    FollowerJoined,
    FollowerLost,
    FollowerSaid,
    LeaderRefused,
    NodeEvent,
    UnitNodes,
    connect_to_leader,
    leader_ports,
    node_placement,
    read_frame,
    unit_nodes,
    write_frame,
)
from tidal.launcher.workers import worker_environment
from tidal.proto import common_pb2, launcher_pb2


def test_the_leaders_ports_derive_from_the_slurm_job_id_and_neighbouring_jobs_do_not_share_any() -> None:
    ports = leader_ports(41, base=20000, span=8000, count=8)
    assert ports == leader_ports(41, base=20000, span=8000, count=8) and len(set(ports)) == 8
    assert all(20000 <= p < 28000 for p in ports)
    assert not set(ports) & set(leader_ports(42, base=20000, span=8000, count=8))


def test_a_launcher_finds_its_node_and_its_leader_in_what_srun_sets() -> None:
    env = {"SLURM_JOB_NODELIST": "n[2-3]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "7",
           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.2"}
    layout = unit_nodes(env, 2, port_base=20000)
    assert layout == UnitNodes(nodes=("n2", "n3"), index=1, leader_address="10.0.0.2",
                               ports=leader_ports(7, base=20000))
    assert not layout.is_leader and layout.node == "n3"
    assert unit_nodes({**env, "SLURM_NODEID": "0"}, 2).is_leader
    # Without srun's address, the job's first node.
    assert unit_nodes({k: v for k, v in env.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}, 2).leader_address == "n2"
    with pytest.raises(ValueError, match="asks for 3 nodes, but its Slurm job has 2"):
        unit_nodes(env, 3)
    with pytest.raises(ValueError, match="with srun"):
        unit_nodes({"SLURM_JOB_ID": "7"}, 2)


def generation(unit_nodes_: list[str], first_rank: int, world_size: int, procs: int = 2) -> launcher_pb2.Generation:
    return launcher_pb2.Generation(
        generation=3, target_step=40,
        rank_table=common_pb2.RankTable(world_size=world_size, groups=2, assignments=[common_pb2.RankAssignment(
            unit_id="u2", nodes=unit_nodes_, group_rank=1, first_rank=first_rank, procs_per_node=procs)]),
        rendezvous=common_pb2.Rendezvous(host="hostA", port=1234, host_unit_id="u1"))


def test_a_two_node_units_ranks_are_laid_out_node_by_node_with_torchruns_node_rank() -> None:
    # Two units of 2 nodes x 2 processes: u2 holds ranks 4..7, node n3 the first two.
    start = generation(["n3", "n4"], first_rank=4, world_size=8)
    leader, follower = node_placement(start, "u2", 0), node_placement(start, "u2", 1)
    assert leader is not None and follower is not None
    assert (leader.first_rank, leader.group_rank, leader.group_world_size) == (4, 2, 4)
    assert (follower.first_rank, follower.group_rank, follower.group_world_size) == (6, 3, 4)
    assert node_placement(start, "u9", 0) is None
    envs = [worker_environment({"TIDAL_SECRET_FILE": "/s", "PATH": "/bin"}, {}, placement=follower, local_rank=local,
                               job_id="j", unit_id="u2", progress_file=Path("/p"), error_file=Path("/e"))
            for local in (0, 1)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) for e in envs] == [
        ("6", "0", "2", "8"), ("7", "1", "2", "8")]
    assert all(e["MASTER_ADDR"] == "hostA" and e["MASTER_PORT"] == "1234" and e["GROUP_RANK"] == "3"
               and "TIDAL_SECRET_FILE" not in e for e in envs)
    # A one-node unit keeps the unit's group rank and the number of units, as before.
    single = node_placement(generation(["n3"], first_rank=2, world_size=4), "u2")
    assert single is not None and (single.first_rank, single.group_rank, single.group_world_size) == (2, 1, 2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def layout(index: int, port: int) -> UnitNodes:
    return UnitNodes(nodes=("n1", "n2"), index=index, leader_address="127.0.0.1", ports=(port,))


IDENTITY = {"job_id": "lm-1", "unit_id": "u3", "slurm_job_id": 12}


def test_a_follower_without_the_jobs_secret_is_refused_and_the_leader_then_admits_the_right_one() -> None:
    async def scenario() -> None:
        events: list[NodeEvent] = []
        port = free_port()
        hub = FollowerHub(layout(0, port), secret="right", post=events.append, bind_host="127.0.0.1",
                          node_timeout_s=5.0, **IDENTITY)
        await hub.start()
        try:
            # A peer that does not hold the secret answers the challenge with a wrong proof.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            hello = launcher_pb2.FollowerHello(node_index=1, node="n2", nonce=os.urandom(32), **IDENTITY)
            await write_frame(writer, launcher_pb2.FollowerMessage(hello=hello))
            challenge = await read_frame(reader, launcher_pb2.LeaderMessage)
            assert challenge.WhichOneof("body") == "challenge" and len(challenge.challenge.proof) == 32
            await write_frame(writer, launcher_pb2.FollowerMessage(proof=launcher_pb2.NodeProof(proof=b"x" * 32)))
            with pytest.raises(EOFError):
                await read_frame(reader, launcher_pb2.LeaderMessage)
            writer.close()
            assert hub.refused == 1 and not hub.followers and not events
            # A follower with a wrong secret does not take the leader for its own, and finds none.
            with pytest.raises(TimeoutError, match="no leader of unit u3"):
                await connect_to_leader(layout(1, port), secret="wrong", timeout_s=0.2, **IDENTITY)
            # A hello for another unit is refused before any proof.
            with pytest.raises(TimeoutError):
                await connect_to_leader(layout(1, port), secret="right", timeout_s=0.2,
                                        **{**IDENTITY, "unit_id": "u4"})
            assert hub.refused >= 3 and not hub.followers

            # The leader is still up: the right follower gets in, hears the leader, and its
            # reports reach the leader.
            reader, writer = await connect_to_leader(layout(1, port), secret="right", timeout_s=5.0, **IDENTITY)
            await asyncio.sleep(0.05)
            assert events == [FollowerJoined(1, "n2")] and hub.complete
            hub.send_all(launcher_pb2.LeaderMessage(stop=launcher_pb2.NodeStop(generation=4)))
            relayed = await read_frame(reader, launcher_pb2.LeaderMessage)
            assert relayed.WhichOneof("body") == "stop" and relayed.stop.generation == 4
            await write_frame(writer, launcher_pb2.FollowerMessage(stopped=launcher_pb2.NodeStopped(generation=4)))
            await asyncio.sleep(0.05)
            assert isinstance(events[-1], FollowerSaid) and events[-1].message.stopped.generation == 4
            # The same node cannot join twice.
            with pytest.raises((LeaderRefused, TimeoutError)):
                await connect_to_leader(layout(1, port), secret="right", timeout_s=0.2, **IDENTITY)

            # Its connection breaking loses the node, once.
            writer.close()
            await asyncio.sleep(0.1)
            assert events[-1] == FollowerLost(1, "n2", "connection closed") and not hub.complete
            assert sum(isinstance(e, FollowerLost) for e in events) == 1
        finally:
            await hub.close(0, "test over")

    asyncio.run(scenario())


def test_a_silent_follower_is_lost_after_the_node_timeout() -> None:
    async def scenario() -> None:
        events: list[NodeEvent] = []
        port = free_port()
        hub = FollowerHub(layout(0, port), secret="s", post=events.append, bind_host="127.0.0.1",
                          node_timeout_s=1.5, **IDENTITY)
        await hub.start()
        try:
            _, writer = await connect_to_leader(layout(1, port), secret="s", timeout_s=5.0, **IDENTITY)
            await asyncio.sleep(3.5)
            lost = [e for e in events if isinstance(e, FollowerLost)]
            assert len(lost) == 1 and lost[0].reason.startswith("silent for"), events
            writer.close()
        finally:
            await hub.close(0, "test over")

    asyncio.run(scenario())



def test_a_follower_signalled_while_its_leader_is_not_there_leaves_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader never came up (or died before this node reached it): scancel's SIGTERM
    (or ^C) ends the follower at once. It was queued unread until the connect timeout
    (600 s by default), or until srun's --wait killed the follower."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    layout = UnitNodes(nodes=("n1", "n2"), index=1, leader_address="127.0.0.1", ports=(free_port(),))
    follower = Follower(FollowerOptions(job_id="j", unit_id="u", secret="s", layout=layout, slurm_job_id=3,
                                        connect_timeout_s=8.0))

    async def scenario() -> float:
        asyncio.get_running_loop().call_later(0.5, os.kill, os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        await follower.run()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 3.0
    assert (follower.exit_code, follower.exit_reason) == (EXIT_UNREACHABLE,
                                                          "SIGTERM while connecting to the unit's leader")


def test_a_leader_done_with_a_failure_gives_the_followers_workers_their_grace_and_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader ends with a non-zero code (say the controller was unreachable) and closes
    the connection right after its `done`: the follower's workers get their stop grace and
    it exits with the leader's code and reason. The close was taken for the leader's loss:
    the workers got 1 s (a save on SIGTERM cut short) and the reason was lost."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    port = free_port()
    ident = {"job_id": "j", "unit_id": "u", "slurm_job_id": 3}
    cleaned = tmp_path / "cleaned-up"

    def layout(index: int) -> UnitNodes:
        return UnitNodes(nodes=("n1", "n2"), index=index, leader_address="127.0.0.1", ports=(port,))

    follower = Follower(FollowerOptions(secret="s", layout=layout(1), connect_timeout_s=5.0, stop_grace_s=8.0,
                                        **ident))  # type: ignore[arg-type]
    worker = f'trap "sleep 2; touch {cleaned}; exit 0" TERM; while :; do sleep 0.2; done'

    async def scenario() -> None:
        hub = FollowerHub(layout(0), secret="s", post=lambda _: None, bind_host="127.0.0.1",
                          **ident)  # type: ignore[arg-type]
        await hub.start()
        run = asyncio.create_task(follower.run())
        await wait_until(lambda: hub.complete)
        table = common_pb2.RankTable(world_size=2, groups=1, assignments=[common_pb2.RankAssignment(
            unit_id="u", nodes=["n1", "n2"], group_rank=0, first_rank=0, procs_per_node=1)])
        hub.send_all(launcher_pb2.LeaderMessage(start=launcher_pb2.NodeStart(
            registered=launcher_pb2.Registered(command=["sh", "-c", worker], working_dir=str(tmp_path)),
            start=launcher_pb2.Generation(generation=1, rank_table=table,
                                          rendezvous=common_pb2.Rendezvous(host="127.0.0.1", port=1)))))
        await wait_until(lambda: follower.workers is not None)
        await asyncio.sleep(0.5)
        await hub.close(4, "controller unreachable")
        await asyncio.wait_for(run, 20)

    asyncio.run(scenario())
    assert cleaned.exists(), "the worker had its grace"
    assert (follower.exit_code, follower.exit_reason) == (4, "the leader exited: controller unreachable")


async def wait_until(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)


def test_a_leader_that_finds_none_of_its_ports_free_says_so_in_one_line_with_exit_2(tmp_path: Path) -> None:
    """Every port of the leader's list is taken (another service, a neighbouring job's
    leader on a base that overlaps): the leader exits 2 with one line naming the ports and
    --node-port-base. The OSError went out of the loop: a traceback, exit 1, after a
    'launcher_exited' line that said exit_code 0."""
    taken: list[socket.socket] = []
    try:
        for base in range(31000, 60000, 97):
            try:
                for port in leader_ports(0, base=base):
                    listener = socket.socket()
                    taken.append(listener)
                    listener.bind(("", port))
                    listener.listen()
                break
            except OSError:
                for listener in taken:
                    listener.close()
                taken.clear()
        assert taken, "no run of 8 free ports to take"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "SLURM_"))}
        env.update({"TIDAL_JOB_SECRET": "s", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0",
                    "SLURM_JOB_ID": "0", "TMPDIR": str(tmp_path)})
        result = subprocess.run(
            [sys.executable, "-m", "tidal.launcher.agent", "--controller", "127.0.0.1:1", "--job", "j",
             "--address", "127.0.0.1", "--unit-nodes", "2", "--node-port-base", str(base), "--connect-timeout", "60"],
            capture_output=True, text=True, timeout=120, env=env)
    finally:
        for listener in taken:
            listener.close()
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"cannot serve the unit's other nodes: no free port among [{base}," in result.stderr
    assert "--node-port-base" in result.stderr
