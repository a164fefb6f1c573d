"""A replica's shard group that outlives its connections: the process group FSDP2 holds
for a worker's life, re-pointed at a new connection with every generation.

Under `HybridSharded` in live mode a replica is the K×P workers of its nodes and the model
is sharded over them with FSDP2. FSDP2 takes its process group once, at `fully_shard`
(`FSDPMeshInfo.shard_process_group`, read from the mesh and kept), and DTensor finds the
same group by its name for `full_tensor()` and the gradient norm. The group a replica needs,
though, changes: a node of the replica is lost and a fresh process on another node takes its
shard ranks. So the group FSDP2 holds is this `ShardGroup`, a `torch.distributed.ProcessGroup`
subclass whose collectives go to an inner process group that each generation connects anew
(`connect`) under the generation's rendezvous store, and that a broken generation aborts
(`disconnect`). The shard rank is the worker's for life (its node's place in the replica ×
P + its local rank): a replacement takes the lost rank's place and receives its shards.

How torch 2.13 lets this work (read in `torch/distributed/distributed_c10d.py` and
`device_mesh.py`):

- `init_process_group` with a backend registered by `Backend.register_backend` whose
  creator returns a `ProcessGroup` subclass uses that object as the group itself
  (`_new_process_group_helper`: "If the type is a subclass of ProcessGroup then return this
  process group immediately"). So the `ShardGroup` is the default group, and a 1-D
  `init_device_mesh` over the whole world takes it as the mesh's group.
- The c10d Python API calls the group's own methods by name (`group.all_gather_single`,
  `group.reduce_scatter_single`, `group.allreduce`, ... and their `_coalesced` forms), so a
  Python subclass receives them and passes them on; the functional collectives DTensor uses
  resolve the group by name and reach the same object.
- The group's name is kept by the subclass (`group_name`, `_set_group_name`), which the
  device mesh reads.

Nothing else in a worker holds the inner group: dropping it (after `abort` on a break) is
what closes a gloo group's connections, which is how peers still waiting on this rank learn
that it left. Measured on gloo, float64, 2 shard ranks: a process replaced after 3 AdamW
steps by a new one given the lost rank's shard, 3 more steps, full parameters within 1.4e-16
of a one-process run (tests/unit/test_shard_group.py repeats it)."""

from __future__ import annotations

import atexit
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tidal.train import backend as backends

# The backend name under which the default group is a ShardGroup.
BACKEND_NAME = "tidal_shard"

# How long a worker's exit waits for the shard group's connection to close
# (`close_before_teardown`).
TEARDOWN_WAIT_S = 5.0

# The ProcessGroup methods the c10d API and the functional collectives call, passed on to
# the connection of the current generation.
DELEGATED = (
    "all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
    "allreduce", "allreduce_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "alltoall", "alltoall_base", "all_to_all_single", "barrier", "broadcast", "gather", "reduce", "scatter",
    "send", "recv", "recv_anysource",
)


class NotConnected(RuntimeError):
    """A collective of the shard group while no generation connects it (between a broken
    world and the next one)."""


class ShardGroup(ProcessGroup):
    """The shard group of one replica, as this worker sees it: `rank` of `size` for the
    worker's life; the connection is the current generation's."""

    def __init__(self, rank: int, size: int) -> None:
        # torch binds ProcessGroup(rank, size) too, though its stub names only (store, rank, size).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._shard_rank = rank
        self._shard_size = size
        self._inner: ProcessGroup | None = None
        # The backend object behind `_inner` (what is aborted or shut down).
        self._connection: Any = None
        self._backend_name = "gloo"
        self._name: str | None = None
        # The generation that connected it (0: none yet).
        self.generation = 0

    # What FSDP2, DTensor and the device mesh read.

    def rank(self) -> int:
        return self._shard_rank

    def size(self) -> int:
        return self._shard_size

    def getBackendName(self) -> str:
        return self._backend_name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        if self._name is None:
            raise RuntimeError("the shard group has no name yet")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _get_backend(self, device: torch.device) -> Any:
        return self.inner._get_backend(device)

    # The connection.

    @property
    def connected(self) -> bool:
        return self._inner is not None

    @property
    def inner(self) -> ProcessGroup:
        if self._inner is None:
            raise NotConnected("the shard group is not connected: its generation broke and the next one has not "
                               "formed")
        return self._inner

    def connect(self, backend: str, store: Any, *, generation: int, connect_timeout: datetime.timedelta,
                timeout: datetime.timedelta) -> None:
        """Connect the shard ranks of this replica under `store` (the generation's, prefixed
        for the replica); returns once every shard rank has connected. The previous
        connection, if any, is shut down first."""
        self.disconnect(broken=False)
        # Made as the generation's other groups are (`tidal.train.backend.new_group`), but with
        # waits that do not stop the host (NCCL): FSDP2 overlaps its collectives with compute.
        connection = backends.new_group(backend, store, self._shard_rank, self._shard_size, connect_timeout,
                                        host_waits=False)
        if backend == backends.NCCL:
            backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
        else:
            backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
        inner = ProcessGroup(store, self._shard_rank, self._shard_size)
        inner._register_backend(device, backend_type, connection)
        inner._set_default_backend(backend_type)
        setter = getattr(connection, "_set_default_timeout", None)
        if setter is not None:
            setter(timeout)
        self._connection = connection
        self._inner = inner
        self._backend_name = backend
        self.generation = generation

    def detach(self) -> Any | None:
        """Drop the connection without closing it and return it (None if there was none), for
        a caller that aborts it together with the generation's other groups; it must then
        close it (`tidal.train.backend.close_groups(..., aborted=True)`)."""
        connection, self._connection, self._inner = self._connection, None, None
        return connection

    def disconnect(self, broken: bool) -> None:
        """Drop the connection: aborted when its generation broke (a peer may be gone, and
        NCCL's communicators must not wait on it), shut down otherwise."""
        connection = self.detach()
        if connection is not None:
            # As the generation's other groups (`tidal.train.backend.close_groups`).
            backends.close_groups([connection], broken=broken)


def _delegate(name: str) -> Any:
    def method(self: ShardGroup, *args: Any) -> Any:
        return getattr(self.inner, name)(*args)

    method.__name__ = name
    method.__doc__ = f"`ProcessGroup.{name}` on the current generation's connection."
    return method


for _name in DELEGATED:
    setattr(ShardGroup, _name, _delegate(_name))


def install(rank: int, size: int) -> ShardGroup:
    """Make a `ShardGroup` of `rank` in `size` torch.distributed's default group (nothing
    connects yet: the first generation does). Once per process."""
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized: under a Tidal launcher in live mode, "
                           "HybridSharded.shard forms it (do not call init_process_group)")
    group = ShardGroup(rank, size)

    def create(store: Any, group_rank: int, group_size: int, timeout: datetime.timedelta) -> ShardGroup:
        return group

    dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=size)
    # Handlers the script registers after this (they may still gather the model) run
    # before it: `atexit` runs the last registered first.
    atexit.register(close_before_teardown, group)
    return group


def close_before_teardown(group: ShardGroup) -> None:
    """Shut the connection down while the interpreter still runs. A gloo group's worker
    thread lets go of a finished collective's tensors after the caller has its result, and
    letting go of a tensor that a Python object shares takes the GIL. Left to the
    interpreter's teardown, that thread can be the last holder while the interpreter
    finalizes: asking for the GIL then ends the thread by a forced unwind through a
    `noexcept` destructor, and the process dies of SIGABRT ("terminate called without an
    active exception") after its training completed (seen in 2 runs of 30 of
    tests/integration/shard_group_worker.py's three processes, and at the end of
    HybridSharded chaos runs). Dropping the last reference here destroys the group with
    the GIL released (torch's `IntrusivePtrNoGilDestructor`), which joins its threads.

    On a thread of its own, waited for at most `TEARDOWN_WAIT_S`: a script that fails in
    the middle of a step can leave a collective waiting on a peer, and the join would wait
    with it (up to the group's timeout); the process then ends as it did before."""
    closing = threading.Thread(target=group.disconnect, kwargs={"broken": False}, name="tidal-shard-close",
                               daemon=True)
    closing.start()
    closing.join(TEARDOWN_WAIT_S)
