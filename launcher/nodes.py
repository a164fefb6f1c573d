"""A unit that spans several nodes: where each node sits, and the channel between the
unit's launchers.

A K-node unit is one Slurm job; its batch script starts one launcher per node with
`srun`. The launcher on the job's first node (SLURM_NODEID 0, where the batch script
itself runs) is the unit's leader: it alone registers with the controller. The others,
followers, connect to it:

- where: the leader's address is SLURM_LAUNCH_NODE_IPADDR, the address srun was started
  from (the batch script's node, so the leader's; srun's own tasks reach it there), else
  the job's first node name; the port is the first free one of a short list derived from
  SLURM_JOB_ID (`leader_ports`). Each follower tries the list in order until a leader
  proves itself, so no shared file system and no extra rendezvous is needed, and a port
  taken by something else only moves the leader one place down the list.
- who: both sides prove they hold the job's secret (the file every launcher of the unit
  reads; never argv, never the wire): HMAC-SHA256 over both nonces, the role and the unit
  (`proof`). A connection that fails the proof is closed; the leader keeps serving.
- what: the leader relays each generation (`NodeStart`: the controller's Generation that
  names the unit, and Registered) and each stop; a follower starts and stops its own
  workers with the same machinery as the leader (`workers`), and reports their progress
  and exits.
- loss: a connection that breaks, or stays silent for `node_timeout_s`, loses the node
  and with it the replica. The leader reports it as a worker exit; a follower that loses
  its leader kills its workers and exits non-zero.

Decisions here are pure functions (`unit_nodes`, `leader_ports`, `node_placement`,
`proof`); `FollowerHub` is the leader's side of the channel, `connect_to_leader` the
follower's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import os
import secrets
import struct
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import structlog
from google.protobuf.message import DecodeError

from tidal.launcher.liveness import Now, Observations, Watched, liveness_verdicts
from tidal.launcher.workers import Placement
from tidal.proto import launcher_pb2
from tidal.slurm.hostlist import expand

log = structlog.get_logger("tidal.launcher.nodes")

DEFAULT_PORT_BASE = 20000
PORT_SPAN = 8000
PORT_CANDIDATES = 8
MAX_FRAME_BYTES = 4 << 20
HANDSHAKE_TIMEOUT_S = 5.0
BEAT_INTERVAL_S = 1.0

M = TypeVar("M", launcher_pb2.LeaderMessage, launcher_pb2.FollowerMessage)


@dataclasses.dataclass(frozen=True)
class UnitNodes:
    """This launcher's place in a multi-node unit."""

    nodes: tuple[str, ...]
    index: int
    leader_address: str
    ports: tuple[int, ...]

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def node(self) -> str:
        return self.nodes[self.index]


def leader_ports(slurm_job_id: int, base: int = DEFAULT_PORT_BASE, span: int = PORT_SPAN,
                 count: int = PORT_CANDIDATES) -> tuple[int, ...]:
    """The ports a unit's leader tries in order, the same on every node of the unit.
    Consecutive Slurm job ids get disjoint lists (within `span // count` jobs)."""
    return tuple(base + (slurm_job_id * count + i) % span for i in range(count))


def unit_nodes(env: Mapping[str, str], count: int, port_base: int = DEFAULT_PORT_BASE) -> UnitNodes:
    """Where this launcher sits in a `count`-node unit, from what srun sets; ValueError
    saying what is missing or inconsistent."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist or "SLURM_NODEID" not in env or not env.get("SLURM_JOB_ID"):
        raise ValueError(f"a {count}-node unit needs SLURM_JOB_NODELIST, SLURM_NODEID and SLURM_JOB_ID (start "
                         "one launcher per node with srun inside the unit's Slurm job)")
    nodes = expand(nodelist)
    if len(nodes) != count:
        raise ValueError(f"the unit asks for {count} nodes, but its Slurm job has {len(nodes)} ({nodelist})")
    index = int(env["SLURM_NODEID"])
    if not 0 <= index < count:
        raise ValueError(f"SLURM_NODEID {index} is outside the unit's {count} nodes")
    leader_address = env.get("SLURM_LAUNCH_NODE_IPADDR") or nodes[0]
    return UnitNodes(nodes=nodes, index=index, leader_address=leader_address,
                     ports=leader_ports(int(env["SLURM_JOB_ID"]), port_base))


def node_placement(start: launcher_pb2.Generation, unit_id: str, node_index: int = 0) -> Placement | None:
    """Where the workers of node `node_index` of unit `unit_id` sit in `start`'s world, or
    None when the unit is not in it. The unit's ranks are laid out node by node: node i's
    workers take first_rank + i * procs_per_node + local_rank. GROUP_RANK / GROUP_WORLD_SIZE
    are torchrun's node rank and node count; for a one-node unit, the unit's group rank and
    the number of units, as before."""
    mine = next((a for a in start.rank_table.assignments if a.unit_id == unit_id), None)
    if mine is None:
        return None
    per_node = mine.procs_per_node
    if len(mine.nodes) > 1:
        group_rank = mine.first_rank // max(1, per_node) + node_index
        group_world_size = start.rank_table.world_size // max(1, per_node)
    else:
        group_rank = mine.group_rank
        group_world_size = start.rank_table.groups or len(start.rank_table.assignments)
    return Placement(generation=start.generation, first_rank=mine.first_rank + node_index * per_node,
                     group_rank=group_rank, group_world_size=group_world_size, procs_per_node=per_node,
                     world_size=start.rank_table.world_size, master_addr=start.rendezvous.host,
                     master_port=start.rendezvous.port, target_step=start.target_step)


def proof(secret: str, role: str, hello: launcher_pb2.FollowerHello, leader_nonce: bytes) -> bytes:
    """What a side sends to show it holds the job's secret: an HMAC of its role ("leader" or
    "follower"), the unit, the follower's node and both nonces."""
    context = b"\0".join([b"tidal-unit-nodes-v1", role.encode(), hello.job_id.encode(), hello.unit_id.encode(),
                          str(hello.slurm_job_id).encode(), str(hello.node_index).encode(), hello.nonce,
                          leader_nonce])
    return hmac.new(secret.encode(), context, hashlib.sha256).digest()


# Framing.

async def write_frame(writer: asyncio.StreamWriter, message: launcher_pb2.LeaderMessage | launcher_pb2.FollowerMessage
                      ) -> None:
    data = message.SerializeToString()
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, kind: type[M]) -> M:
    """One message; EOFError when the peer closed, ValueError for a malformed frame."""
    try:
        header = await reader.readexactly(4)
        (size,) = struct.unpack(">I", header)
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {size} bytes")
        data = await reader.readexactly(size)
    except asyncio.IncompleteReadError as error:
        raise EOFError("connection closed") from error
    message = kind()
    try:
        message.ParseFromString(data)
    except DecodeError as error:
        raise ValueError(f"malformed frame: {error}") from error
    return message


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


# The leader's side.

@dataclasses.dataclass(frozen=True)
class FollowerJoined:
    index: int
    node: str


@dataclasses.dataclass(frozen=True)
class FollowerLost:
    index: int
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FollowerSaid:
    index: int
    message: launcher_pb2.FollowerMessage


NodeEvent = FollowerJoined | FollowerLost | FollowerSaid


@dataclasses.dataclass
class _Follower:
    index: int
    node: str
    writer: asyncio.StreamWriter
    last_heard: float
    lost: bool = False


class FollowerHub:
    """The leader's end of the unit's channel: it serves on the first free port of
    `layout.ports`, admits each follower that proves it holds the secret (once per node),
    relays messages to them, and posts `NodeEvent`s: joined, said, lost (a broken
    connection or `node_timeout_s` of silence; each follower is lost at most once)."""

    def __init__(self, layout: UnitNodes, *, job_id: str, unit_id: str, slurm_job_id: int, secret: str,
                 post: Callable[[NodeEvent], None], node_timeout_s: float = 10.0, bind_host: str | None = None) -> None:
        self.layout = layout
        self.job_id = job_id
        self.unit_id = unit_id
        self.slurm_job_id = slurm_job_id
        self._secret = secret
        self._post = post
        self.node_timeout_s = node_timeout_s
        self._bind_host = bind_host
        self.followers: dict[int, _Follower] = {}
        self.port = 0
        self._server: asyncio.Server | None = None
        self._beater: asyncio.Task[None] | None = None
        self._stopped: dict[int, asyncio.Future[None]] = {}
        self._closing = False
        self.refused = 0

    @property
    def expected(self) -> frozenset[int]:
        return frozenset(range(1, len(self.layout.nodes)))

    @property
    def complete(self) -> bool:
        """Every follower has joined (and none was lost)."""
        return set(self.followers) == self.expected and not any(f.lost for f in self.followers.values())

    async def start(self) -> int:
        """Serve on the first port of the list that is free; OSError if none is."""
        error: OSError | None = None
        for port in self.layout.ports:
            try:
                # All addresses: followers reach the node at whatever address srun names.
                self._server = await asyncio.start_server(self._admit, host=self._bind_host, port=port,
                                                          reuse_address=True)
            except OSError as failure:
                error = failure
                continue
            self.port = port
            break
        if self._server is None:
            raise OSError(f"no free port among {list(self.layout.ports)}: {error}")
        self._beater = asyncio.get_running_loop().create_task(self._beat_forever())
        log.info("unit_channel_serving", port=self.port, followers=len(self.expected))
        return self.port

    def send_all(self, message: launcher_pb2.LeaderMessage) -> None:
        for follower in list(self.followers.values()):
            self._send(follower, message)

    def _send(self, follower: _Follower, message: launcher_pb2.LeaderMessage) -> None:
        if follower.lost:
            return
        data = message.SerializeToString()
        try:
            follower.writer.write(struct.pack(">I", len(data)) + data)
        except (OSError, RuntimeError) as error:
            self._lose(follower, f"cannot write to it: {error}")

    async def stop_workers(self, generation: int, grace_s: float) -> None:
        """Stop every follower's workers and wait for each to confirm, or to be lost (a
        follower that does not confirm within the grace and the node timeout is lost)."""
        waiting: list[asyncio.Future[None]] = []
        stop = launcher_pb2.LeaderMessage(stop=launcher_pb2.NodeStop(generation=generation))
        stop.stop.grace.FromNanoseconds(int(grace_s * 1e9))
        loop = asyncio.get_running_loop()
        for follower in self.followers.values():
            if follower.lost:
                continue
            future = self._stopped.get(follower.index)
            if future is None or future.done():
                future = self._stopped[follower.index] = loop.create_future()
            waiting.append(future)
            self._send(follower, stop)
        if not waiting:
            return
        _, late = await asyncio.wait(waiting, timeout=grace_s + self.node_timeout_s)
        for follower in list(self.followers.values()):
            if self._stopped.get(follower.index) in late:
                self._lose(follower, f"did not confirm the stop within {grace_s + self.node_timeout_s:g} s")

    async def close(self, exit_code: int, reason: str) -> None:
        """Tell every follower the leader is done (they stop their workers and exit with
        `exit_code`), then stop serving."""
        self._closing = True
        self.send_all(launcher_pb2.LeaderMessage(done=launcher_pb2.NodeDone(exit_code=exit_code, reason=reason)))
        for follower in self.followers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(follower.writer.drain(), timeout=2.0)
            _close(follower.writer)
        if self._beater is not None:
            self._beater.cancel()
        if self._server is not None:
            self._server.close()

    def _lose(self, follower: _Follower, reason: str) -> None:
        if follower.lost:
            return
        follower.lost = True
        _close(follower.writer)
        waiter = self._stopped.get(follower.index)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if not self._closing:
            log.warning("follower_lost", node=follower.node, node_index=follower.index, reason=reason)
            self._post(FollowerLost(follower.index, follower.node, reason))

    async def _beat_forever(self) -> None:
        beat = launcher_pb2.LeaderMessage(beat=launcher_pb2.NodeBeat())
        while True:
            await asyncio.sleep(BEAT_INTERVAL_S)
            observed = Observations(peers=tuple((f.index, f.last_heard) for f in self.followers.values() if not f.lost),
                                    peer_kind=Watched.FOLLOWER, node_timeout_s=self.node_timeout_s)
            for verdict in liveness_verdicts(observed, Now(monotonic=time.monotonic(), wall=time.time())):
                self._lose(self.followers[verdict.key], verdict.reason)
            for follower in list(self.followers.values()):
                self._send(follower, beat)

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> launcher_pb2.FollowerHello:
        """The follower's hello once it proved itself; ValueError saying why not."""
        first = await read_frame(reader, launcher_pb2.FollowerMessage)
        if first.WhichOneof("body") != "hello":
            raise ValueError("the first message is not a hello")
        hello = first.hello
        if (hello.job_id, hello.unit_id, hello.slurm_job_id) != (self.job_id, self.unit_id, self.slurm_job_id):
            raise ValueError(f"hello for another unit ({hello.job_id}/{hello.unit_id}, Slurm job {hello.slurm_job_id})")
        if hello.node_index not in self.expected:
            raise ValueError(f"node index {hello.node_index} is not a follower's")
        if hello.node_index in self.followers:
            raise ValueError(f"node {hello.node_index} has joined already")
        if len(hello.nonce) < 16:
            raise ValueError("nonce too short")
        nonce = secrets.token_bytes(32)
        await write_frame(writer, launcher_pb2.LeaderMessage(challenge=launcher_pb2.LeaderChallenge(
            nonce=nonce, proof=proof(self._secret, "leader", hello, nonce))))
        answer = await read_frame(reader, launcher_pb2.FollowerMessage)
        if answer.WhichOneof("body") != "proof" or not hmac.compare_digest(
                answer.proof.proof, proof(self._secret, "follower", hello, nonce)):
            raise ValueError("wrong proof: the follower does not hold the job's secret")
        if hello.node_index in self.followers:
            raise ValueError(f"node {hello.node_index} has joined already")
        return hello

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(self._handshake(reader, writer), timeout=HANDSHAKE_TIMEOUT_S)
            await write_frame(writer, launcher_pb2.LeaderMessage(accepted=launcher_pb2.NodeAccepted()))
        except (ValueError, EOFError, OSError, TimeoutError) as error:
            self.refused += 1
            log.warning("follower_refused", peer=str(peer), reason=str(error) or type(error).__name__)
            _close(writer)
            return
        if self._closing:
            _close(writer)
            return
        node = self.layout.nodes[hello.node_index]
        if hello.node and hello.node != node:
            log.warning("follower_node_name_differs", expected=node, said=hello.node)
        follower = _Follower(index=hello.node_index, node=node, writer=writer, last_heard=time.monotonic())
        self.followers[follower.index] = follower
        log.info("follower_joined", node=node, node_index=follower.index, peer=str(peer))
        self._post(FollowerJoined(follower.index, node))
        try:
            while not follower.lost:
                message = await read_frame(reader, launcher_pb2.FollowerMessage)
                follower.last_heard = time.monotonic()
                if message.WhichOneof("body") == "stopped":
                    waiter = self._stopped.get(follower.index)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                self._post(FollowerSaid(follower.index, message))
        except EOFError:
            self._lose(follower, "connection closed")
        except (ValueError, OSError) as error:
            self._lose(follower, f"connection failed: {error}")


# The follower's side.

class LeaderRefused(Exception):
    """The leader refused this follower's proof: its secret differs (retrying cannot help)."""


async def connect_to_leader(layout: UnitNodes, *, job_id: str, unit_id: str, slurm_job_id: int, secret: str,
                            timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the unit's leader that proved itself and admitted this follower:
    each port of the list in turn, again until `timeout_s`. TimeoutError when no leader
    answered; LeaderRefused when the leader refused this follower's proof."""
    deadline = time.monotonic() + timeout_s
    tried: list[str] = []
    while True:
        for port in layout.ports:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(layout.leader_address, port), timeout=HANDSHAKE_TIMEOUT_S)
            except (OSError, TimeoutError) as error:
                tried.append(f"{port}: {error}")
                continue
            try:
                if await asyncio.wait_for(_prove(reader, writer, layout, job_id=job_id, unit_id=unit_id,
                                                 slurm_job_id=slurm_job_id, secret=secret),
                                          timeout=HANDSHAKE_TIMEOUT_S):
                    return reader, writer
                tried.append(f"{port}: not this unit's leader")
            except (ValueError, OSError, TimeoutError) as error:
                tried.append(f"{port}: {error}")
            except EOFError:
                tried.append(f"{port}: closed")
            _close(writer)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no leader of unit {unit_id} at {layout.leader_address} within {timeout_s:g} s "
                               f"({'; '.join(tried[-len(layout.ports):])})")
        tried.clear()
        await asyncio.sleep(0.5)


async def _prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, layout: UnitNodes, *, job_id: str,
                 unit_id: str, slurm_job_id: int, secret: str) -> bool:
    """The follower's half of the handshake: whether the peer is the unit's leader and
    admitted us."""
    hello = launcher_pb2.FollowerHello(job_id=job_id, unit_id=unit_id, slurm_job_id=slurm_job_id,
                                       node_index=layout.index, node=layout.node, nonce=os.urandom(32))
    await write_frame(writer, launcher_pb2.FollowerMessage(hello=hello))
    challenge = await read_frame(reader, launcher_pb2.LeaderMessage)
    if challenge.WhichOneof("body") != "challenge" or not hmac.compare_digest(
            challenge.challenge.proof, proof(secret, "leader", hello, challenge.challenge.nonce)):
        return False
    await write_frame(writer, launcher_pb2.FollowerMessage(proof=launcher_pb2.NodeProof(
        proof=proof(secret, "follower", hello, challenge.challenge.nonce))))
    try:
        accepted = await read_frame(reader, launcher_pb2.LeaderMessage)
    except EOFError as error:
        raise LeaderRefused(f"the leader at {layout.leader_address} refused this follower's proof") from error
    return accepted.WhichOneof("body") == "accepted"
