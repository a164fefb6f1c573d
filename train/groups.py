"""The process groups of a generation, and the fixed ones that outlive it.

A generation's groups are built from its rendezvous store and used through their own
objects, never as torch.distributed's default group: they are made and thrown away as the
world changes, while the default group, under `HybridSharded`, is the unit's shard group,
which FSDP2 holds for the unit's life.

- the **world group**: every rank of the generation (the step's control all-reduce, the
  state check);
- the **replica group** of shard index k: the rank holding shard k in each replica (the
  cross-replica gradient all-reduce, the state transfer). Under `DataParallel` every
  worker is a whole replica and the replica group is the world group.

Under `HybridSharded` in live mode no world group is made: the world's collectives go in
two levels through the replica group and the replica's shard group (the control
all-reduce, the step's commit vote, ends in the replica's own group so that a replica's
ranks commit together: `start_world_allreduce`; the gathers of steps and digests:
`gather_world`). So
the largest group a world change connects has one rank per replica, not one per worker: at
16,384 GPUs in replicas of one 8-GPU node, 2,048 ranks instead of 16,384 (what an NCCL
communicator's set-up costs grows with its ranks; bench.world_scale cites the figures).

On a break the groups are aborted (`ProcessGroup.abort`), which returns at once and makes
peers still waiting in a collective with this rank fail, instead of waiting for it.
What differs between gloo and NCCL (how a group is made, closed and aborted, from which
thread) is `tidal.train.backend`'s; CI has no GPU, so the NCCL path is not exercised by
the tests."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tidal.train import backend as backends
from tidal.train.errors import WorldBroken

_fixed_store: Any = None


def fixed_world_store() -> Any:
    """The store of a fixed world (run alone, under torchrun, or in restart mode): what
    torch.distributed's env:// rendezvous gives (torchrun's agent store when it offers one,
    otherwise a store on rank 0 at MASTER_ADDR:MASTER_PORT). Made once per process."""
    global _fixed_store
    if _fixed_store is None:
        if dist.is_initialized():
            # The script formed the default group itself: meet at its store.
            _fixed_store = dist.distributed_c10d._get_default_store()
        elif int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            _fixed_store = dist.HashStore()
        else:
            store, _, _ = next(dist.rendezvous("env://"))
            _fixed_store = store
    return _fixed_store


# The fixed worlds this process formed groups in (`next_fixed_world_store`).
_fixed_worlds = 0


def next_fixed_world_store() -> Any:
    """Where this process's next fixed world forms its groups: a prefix of its own on
    `fixed_world_store()`, numbered in the order the process forms them (every rank forms
    the same ones, one per `train()` call, in the same order). Under the keys of the one
    before (a script that calls `train()` twice), a rank read a peer's previous, closed,
    address: gloo's connect failed with "Connection refused", or the peers waited for it."""
    global _fixed_worlds
    _fixed_worlds += 1
    return dist.PrefixStore(f"tidal/fixed/{_fixed_worlds}", fixed_world_store())


@dataclasses.dataclass
class Groups:
    """One generation's groups, as this rank sees them."""

    # Every rank of the generation; None when the world's collectives go in two levels
    # through `shard` and `replica` (HybridSharded in live mode).
    world: Any
    # The cross-replica group of this rank's shard index (the world group under DataParallel).
    replica: Any
    rank: int
    world_size: int
    # Workers per replica (the shard group's size) and this rank's shard index.
    shard_size: int
    shard_rank: int
    # The replica's shard group (a `ShardGroup`, connected by the generation after these
    # groups), set when `world` is None. Not one of the generation's groups: its connection
    # is aborted and closed with them by `Membership`, never here.
    shard: Any = None

    @property
    def replica_index(self) -> int:
        return self.rank // self.shard_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    # Held while the groups are aborted or closed: the control channel's thread may abort
    # them (`abort`) while the training thread closes them.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _aborted: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def _unique(self) -> list[Any]:
        return list({id(g): g for g in (self.replica, self.world) if g is not None}.values())

    def abort(self, also: Sequence[Any] = ()) -> None:
        """From any thread, once: abort the groups, with `also` (the replica's shard
        connection of the same generation) in the same call (`tidal.train.backend.abort_groups`:
        NCCL's communicators of one device aborted together), so that a collective blocked on
        them returns and later ones fail. They stay referenced until `close`."""
        with self._lock:
            if self._aborted:
                backends.abort_groups(list(also))
                return
            self._aborted = True
            groups = [*self._unique(), *also]
            backends.abort_groups(groups)
            groups.clear()

    def close(self, broken: bool) -> None:
        """Leave the groups (`tidal.train.backend.close_groups`): after a failure they are
        aborted first (a destroy could wait on collectives that will never finish), unless
        `abort` already did. A gloo group closes its connections, which is what tells peers
        still waiting on this rank that it left, only when its last reference goes: nothing
        else may hold one (the strategy drops its own at the end of every step, finished or
        abandoned)."""
        with self._lock:
            groups = self._unique()
            self.world = None
            self.replica = None
            backends.close_groups(groups, broken=broken, aborted=self._aborted)


def form_groups(backend: str, store: Any, *, rank: int, world_size: int, shard_size: int, shard_rank: int,
                connect_timeout: datetime.timedelta, timeout: datetime.timedelta, shard: Any = None) -> Groups:
    """Build the generation's groups under `store` (already prefixed for the generation):
    each must connect within `connect_timeout`; formed, their collectives get `timeout`.
    Given the replica's shard group (`shard`, replicas of more than one worker), no world
    group is made: the world's collectives go through `shard` and the replica group."""
    if world_size % shard_size:
        raise ValueError(f"a world of {world_size} ranks is not whole replicas of {shard_size} workers")
    if rank % shard_size != shard_rank:
        raise ValueError(f"rank {rank} is not shard {shard_rank} of its replica (replicas of {shard_size} workers "
                         "take consecutive ranks)")
    two_levels = shard is not None and shard_size > 1
    world = None if two_levels else backends.new_group(backend, dist.PrefixStore("world", store), rank, world_size,
                                                       connect_timeout)
    replica = world
    if shard_size > 1:
        replica = backends.new_group(backend, dist.PrefixStore(f"replica/{shard_rank}", store), rank // shard_size,
                            world_size // shard_size, connect_timeout)
    for group in {id(g): g for g in (world, replica) if g is not None}.values():
        _set_timeout(group, timeout)
    return Groups(world=world, replica=replica, rank=rank, world_size=world_size, shard_size=shard_size,
                  shard_rank=shard_rank, shard=shard if two_levels else None)


def start_world_allreduce(groups: Groups, collectives: Collectives, tensor: torch.Tensor) -> Any:
    """Start summing `tensor` over every rank of the world, in place; returns the work to
    wait for. Called within `collectives.waiting_in()`. With a world group, one all-reduce.
    Without one, two levels: over the replica group of this rank's shard index (waited for
    here: the sum of shard k's part over the replicas), then over the replica's shard group
    (the sum over the shard indices): every rank ends with the world's sum.

    The replica's own group goes last because this sum is the step's commit vote: a rank
    commits once its vote returns. Last, the shard group's all-reduce returns on a rank only
    once every shard rank of its replica finished the first level, so the ranks of a live
    replica commit a step together or not at all, wherever a rank of another replica stops
    (its replica is lost as a whole). In the other order each shard index's replica group
    would end the vote on its own: a rank of another replica stopping between the levels
    leaves this replica's shards at two steps, and the job's state lost
    (tests/unit/test_groups.py).

    On NCCL the shard group's waits do not stop the host (`ShardGroup`), so the work
    returned makes its wait stop the host too (`HostWaited`): a vote read before its
    collective finished (or after the launcher's word aborted it) would be garbage."""
    if groups.world is not None:
        return groups.world.allreduce([tensor])
    collectives.wait_work(groups.replica.allreduce([tensor]))
    return HostWaited(groups.shard.allreduce([tensor]), tensor)


class HostWaited:
    """A collective's work whose `wait` returns once `tensor`, its output, is ready for the
    host: after the work's own wait, the current CUDA stream is synchronized when `tensor`
    is on a GPU (a wait on a group that does not stop the host only orders the stream).
    Waited as any work (`Collectives.wait_work`)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor

    def wait(self, *timeout: datetime.timedelta) -> bool:
        self.work.wait(*timeout)
        if self.tensor.is_cuda:
            torch.cuda.current_stream(self.tensor.device).synchronize()
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def gather_world(groups: Groups, collectives: Collectives, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (of one shape on every rank), by world rank. With a world
    group, one all-gather; without one, two: the replica's over its shard group, then those
    rows over the replica group (the rank holding shard k of replica r is world rank
    r × shard_size + k)."""
    if groups.world is not None:
        gathered = [torch.zeros_like(tensor) for _ in range(groups.world_size)]
        collectives.wait(groups.world.allgather([gathered], [tensor]))
        return gathered
    in_replica = [torch.zeros_like(tensor) for _ in range(groups.shard_size)]
    collectives.wait(groups.shard.allgather([in_replica], [tensor]))
    row = torch.stack(in_replica)
    rows = [torch.zeros_like(row) for _ in range(groups.replicas)]
    collectives.wait(groups.replica.allgather([rows], [row]))
    return [part for replica_row in rows for part in replica_row.unbind(0)]


# How long a wait on a gloo collective blocks before the rank looks at its launcher's word
# again (`Collectives.wait_work`); a completed collective returns at once, whatever this is.
WAIT_SLICE = datetime.timedelta(milliseconds=100)


class Collectives:
    """Waits on a generation's collectives. While a rank waits in one, `waiting` is True
    (its beat thread says so to the launcher: when one rank hangs, the others wait for it,
    and that tells a hang's cause from its victims); a collective that fails breaks the
    world (`WorldBroken`), and so does one that returned because its groups were aborted
    from outside (`broken`, set before the abort: an NCCL wait unblocked by an abort
    returns without raising, its output unfinished).

    Gloo's groups are not aborted from outside (`tidal.train.backend.aborts_from_outside`),
    and a gloo collective can wait on a peer that is alive but has left it (its own wait
    failed on a lost rank; its group's connections close only once its work threads are
    done) until the group's timeout: the ranks of one broken world then wait on each other
    for minutes (seen on the mini cluster: 120 s, a replica's node killed). So a gloo wait
    is cut into slices (`sliced`), and between two the rank gives up once its launcher
    said the generation broke (`interrupted`)."""

    def __init__(self) -> None:
        self.waiting = False
        # Why the current groups were aborted from outside (None: they were not).
        self.broken: str | None = None
        # Waits in slices (gloo), and why the launcher said the current groups' generation
        # broke (None: it did not), which a wait still blocked gives up for.
        self.sliced = False
        self.interrupted: str | None = None

    @contextlib.contextmanager
    def waiting_in(self) -> Iterator[None]:
        """Around a wait for this generation's collectives."""
        self.waiting = True
        try:
            yield
        except RuntimeError as error:
            raise WorldBroken(f"a collective failed: {error}") from error
        finally:
            self.waiting = False
        if self.broken is not None:
            raise WorldBroken(self.broken)

    def wait(self, work: Any) -> None:
        with self.waiting_in():
            self.wait_work(work)

    def wait_work(self, work: Any) -> None:
        """Wait for `work` (within `waiting_in`): at once, or (`sliced`) a slice at a time,
        raising WorldBroken between two once `interrupted` says why. A slice that ends with
        the work unfinished raises in torch ("Operation timed out!") and leaves the work as
        it was; a work that completed, failed or not, answers a plain wait at once."""
        if not self.sliced:
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # It failed (its error raised again), or completed as the slice ended.
                    work.wait()
                    return
            if self.interrupted is not None:
                raise WorldBroken(self.interrupted)


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    setter = getattr(group, "set_timeout", None) or getattr(group, "_set_default_timeout", None)
    if setter is not None:
        setter(timeout)
