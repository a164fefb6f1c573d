"""This worker's membership in the job's worlds, as its launcher names them.

Under a Tidal launcher in live mode (`TIDAL_CONTROL_SOCKET` set) the launcher names each
generation's world over the control channel (`tidal.proto.control`): a `World` with this
worker's rank in it (rank -1: leave after the agreed step), or a `Stop` of the current
generation. `Membership` is the worker's side of that protocol, one state machine:

    phase     does, or waits for                                      then
    STANDBY   the launcher's first world (started ahead: TIDAL_STANDBY) FORMING, LEAVING
    FORMING   the peers arrive, the groups connect, the state agreed   FORMED, BROKEN
    FORMED    its first step commits (reported once: `first_step`)     TRAINING, BROKEN
    TRAINING  steps, until the ranks agree that the world changes      FORMING, LEAVING,
                                                                       BROKEN, FINISHED
    BROKEN    out of the broken world (`stopped`): the launcher's next FORMING, LEAVING
    LEAVING   named rank -1: the state written when asked, `left`, exit 0
    FINISHED  the job's last step committed (`finished`)

A world change is not waited for in a step: each rank that has heard of the next world
says so in its step's control all-reduce (`change_announced`), and after that step every
rank moves (`move_on`). While a change is on its way but not announced (`change_coming`:
its joiners are starting, or a SIGTERM came), the ranks vote a second time at the step's
end, so that a world announced during the step takes effect after it rather than after the
next. A failure breaks the step where it is (`WorldBroken`, caught by `guarded`), and the
rank waits for the next world (`recover`). Under NCCL the launcher's word that the
generation broke (`breakage`: a stop, or the next world sent at once) also aborts its
groups from the control channel's thread, since a collective blocked on a frozen peer
would otherwise wait out its timeout (`tidal.train.backend`). Outside a launcher (alone,
under torchrun, in restart mode) the world is fixed: formed once from the environment.

The decisions are pure (`decide`, `interruption`, `form_timeout_s`, `breakage`);
`Membership` carries them out. What the ranks do with the training state once they meet is the `agree`
callback's (`tidal.train.sync`); the step itself is `tidal.train.elastic`'s."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import enum
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import torch.distributed as dist

from tidal.proto.control import (
    Beat,
    Coming,
    Finished,
    FirstStep,
    Formed,
    LauncherToWorker,
    Left,
    Stop,
    Stopped,
    World,
)
from tidal.train.backend import abort_from_outside, aborts_from_outside
from tidal.train.backend import close_groups as close_groups_of
from tidal.train.channel import ChannelClosed, WorkerChannel
from tidal.train.errors import AccountingError, StateLost, StateMismatch, WorldBroken
from tidal.train.groups import Collectives, Groups, form_groups, next_fixed_world_store
from tidal.train.ledger import Ledger
from tidal.train.quick_exit import end_after_exit_handlers
from tidal.train.shard_group import ShardGroup
from tidal.train.state import Counters

log = structlog.get_logger("tidal.train.world")

# The generation's store answers at once while its launcher lives; past this, its host is gone.
STORE_TIMEOUT_S = 10.0
# Once every rank of a generation arrived, its process group connects within this (plus a
# little per rank). A member lost in that window (a node failing while a world forms) must
# not hold the others in gloo's connect for the whole process-group timeout, nor past
# their launcher's stop grace (10 s), which would kill them and their state with them.
FORM_TIMEOUT_S = 5.0
FORM_TIMEOUT_PER_RANK_S = 0.01
# While its peers arrive, a rank waits at the generation's store for the key the last one
# to arrive sets (one wait, on a thread of its own), and looks at its launcher's word (a
# stop, a newer world: no store operation) every ARRIVAL_LOOK_S meanwhile. Polling the count
# every 2 ms, as this did before, asked a store of 4,096 ranks 2 million times a second, and
# its ranks took 360 s to meet instead of 3.4 s (bench.world_scale). The wait is not cut into
# short timed waits: a wait that times out as its key is set cost a rank 5 s in testing.
ARRIVAL_LOOK_S = 0.002
# A worker started ahead (standby) waits this long for a world; its launcher ends it
# sooner if the unit leaves.
STANDBY_TIMEOUT_S = 7 * 24 * 3600.0
# A live worker's first SIGTERM is held this long ($TIDAL_TERM_WAIT_S): Slurm ending an
# allocation signals every process in it, and the launcher must first learn from the
# controller whether this unit holds the job's last copy of the state and saves it before
# leaving. A second SIGTERM (the launcher's own stop sends two) ends the worker at once.
TERM_WAIT_S = 3.0


class Phase(enum.Enum):
    """Where this worker stands in the job's worlds."""

    # Made, not yet in any world (`Membership.open` not run).
    STARTING = "starting"
    # Started ahead of any world (TIDAL_STANDBY=1): waiting for the launcher to name one.
    STANDBY = "standby"
    # Meeting the peers of a generation and agreeing on the training state.
    FORMING = "forming"
    # In a formed world; its first step not committed yet (that is reported once).
    FORMED = "formed"
    # In a formed world that has committed a step.
    TRAINING = "training"
    # Out of a broken world (a peer lost, a stop): waiting for the launcher's next one.
    BROKEN = "broken"
    # Told to leave: writing the state when asked, then exiting 0.
    LEAVING = "leaving"
    # Committed the job's last step: no world changes any more.
    FINISHED = "finished"


# Decisions.


@dataclasses.dataclass(frozen=True)
class Join:
    """Form this world."""

    world: World


@dataclasses.dataclass(frozen=True)
class Leave:
    """Leave the job after the agreed step; `save`: write the state first (this unit
    holds the job's last copy)."""

    world: World
    save: bool


@dataclasses.dataclass(frozen=True)
class StandAside:
    """Out of this world, not out of the job: wait for the next one, keeping the state (a
    replica of several nodes that lost one waits for a node to take its place)."""

    world: World


def decide(phase: Phase, world: World) -> Join | Leave | StandAside:
    """What a worker in `phase` does with a world its launcher named: leave (rank -1),
    saving the state first when asked, unless it never joined a world (on standby it holds
    no state, so there is nothing to save); stand aside (rank -1, set aside); otherwise
    form it."""
    if world.set_aside:
        return StandAside(world)
    if world.leaves:
        return Leave(world, save=world.save and phase is not Phase.STANDBY)
    return Join(world)


def interruption(world: World, *, doing: str, stopped: bool, newer: World | None) -> str | None:
    """Why a rank `doing` something to form `world` gives up (None: it goes on): its
    launcher stopped that generation, or announced a newer one meanwhile. Then the peers
    may never come (they went straight to the newer one, or it replaced this one after a
    failure), so nothing is gained by waiting; the rank takes the newer one instead."""
    if stopped:
        return f"stopped while {doing} of generation {world.generation}"
    if newer is not None:
        return f"generation {newer.generation} was announced while generation {world.generation} formed"
    return None


def form_timeout_s(timeout_s: float, world_size: int) -> float:
    """How long a generation's groups may take to connect once every rank arrived."""
    return min(timeout_s, FORM_TIMEOUT_S + FORM_TIMEOUT_PER_RANK_S * world_size)


@dataclasses.dataclass(frozen=True)
class StrayWait:
    """An arrival given up (a stop, a newer world) while its wait at the store still runs
    on `thread`, blocked in the store's C++ call until `all_arrived` is set or its deadline.
    A wait the store's host breaks during the interpreter's shutdown throws in a daemon
    thread, and the worker dies by SIGABRT (after a completed job, say): `end_stray_wait`
    ends it before the process exits."""

    thread: threading.Thread
    generation: int
    address: tuple[str, int]


def await_peers(prefix: Any, world: World, *, deadline: float, timeout_s: float,
                check_interrupted: Callable[[], None], look_s: float = ARRIVAL_LOOK_S,
                on_given_up: Callable[[threading.Thread], None] = lambda thread: None) -> None:
    """Count this rank in at the generation's store (`prefix`: the generation's prefix)
    and return once all `world.world_size` ranks are: the last to arrive sets `all_arrived`,
    the others wait for it on a thread (`tidal-peers`) while this one calls
    `check_interrupted` (it raises WorldBroken to give up) every `look_s`; WorldBroken past
    `deadline` (monotonic). A rank's store operations: one add and one wait. Given up while
    the wait runs, its thread goes to `on_given_up`: the wait ends at the deadline, when the
    store's host goes away, or by `end_stray_wait`; the store client it waits on must not be
    used again (the next generation connects anew)."""
    if prefix.add("arrived", 1) >= world.world_size:
        prefix.set("all_arrived", "1")
        return
    failed: list[RuntimeError] = []

    def wait() -> None:
        try:
            prefix.wait(["all_arrived"], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as error:
            failed.append(error)

    waiter = threading.Thread(target=wait, name="tidal-peers", daemon=True)
    waiter.start()
    try:
        while waiter.is_alive():
            check_interrupted()
            waiter.join(look_s)
    except BaseException:
        if waiter.is_alive():
            on_given_up(waiter)
        raise
    if failed:
        if isinstance(failed[0], dist.DistStoreError) and time.monotonic() >= deadline:
            raise WorldBroken(f"peers of generation {world.generation} did not arrive within {timeout_s:g} s")
        raise failed[0]


def end_stray_wait(stray: StrayWait, store: Any | None, join_s: float = 1.0) -> str | None:
    """End a given-up arrival's wait: set `all_arrived` of its generation through `store`
    (a client of its store's server with no operation in flight; None: the server did not
    answer) and join its thread. Only for a generation that is over: this rank formed a
    later one since, whose ranks all left this one, and the rest were told to stop or
    leave (one that never heard so would take the key for its peers' arrival, fail to
    connect its groups within `form_timeout_s` and recover). Returns why the wait could
    not be ended, or None; a wait that already ended (its store's host went away, its
    deadline passed) needs nothing."""
    if not stray.thread.is_alive():
        return None
    problem = f"the store at {stray.address[0]}:{stray.address[1]} does not answer"
    if store is not None:
        try:
            store.set_timeout(datetime.timedelta(seconds=join_s))
            dist.PrefixStore(f"gen/{stray.generation}", store).set("all_arrived", "1")
            problem = f"its wait did not end within {join_s:g} s"
        except RuntimeError as error:
            problem = str(error)
    stray.thread.join(join_s)
    return None if not stray.thread.is_alive() else problem


def check_kept_store(store: Any, timeout_s: float) -> None:
    """Raise RuntimeError unless the server behind a kept store client still answers (one
    read-only request, within `timeout_s`)."""
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    store.check(["tidal/alive"])


# A closed channel breaks every generation (its launcher is gone).
EVERY_GENERATION = 2**62


def breakage(message: LauncherToWorker | None) -> tuple[int, str] | None:
    """Which generations the launcher's `message` says are broken, as (every generation up
    to this one, why); None when it breaks none. A stop of G breaks G; a world of G sent at
    once (not at a step boundary: a failure's next generation) breaks those before G; the
    channel closing (None) breaks them all. A world at a step boundary breaks nothing: the
    old world finishes the step its ranks agree on."""
    if message is None:
        return EVERY_GENERATION, "the launcher closed the control channel"
    if isinstance(message, Coming):
        return None
    if isinstance(message, Stop):
        return message.generation, f"the launcher stopped generation {message.generation}"
    if not message.at_step_boundary:
        return message.generation - 1, f"generation {message.generation} replaced it after a failure"
    return None


def world_from_env(env: dict[str, str] | os._Environ[str]) -> World:
    """The world the environment names (the launcher's first one, torchrun's, or alone)."""
    return World(generation=int(env.get("TIDAL_GENERATION", "0")), rank=int(env.get("RANK", "0")),
                 world_size=int(env.get("WORLD_SIZE", "1")), master_addr=env.get("MASTER_ADDR", ""),
                 master_port=int(env.get("MASTER_PORT", "0") or 0),
                 target_step=int(env.get("TIDAL_TARGET_STEP", "0") or 0))


T = TypeVar("T")


def guarded(action: Callable[..., T], *args: Any) -> T | str:
    """`action(*args)`'s result, or the reason it broke the world (as a str), with the
    exception and everything its traceback holds already released. Recovery must run
    outside the except clause: the traceback holds the failed collective, and with it
    the old process group, whose connections must close for the peers to see this rank
    leave."""
    try:
        return action(*args)
    except WorldBroken as broken:
        return str(broken) or "the world broke"


# Carrying them out.

# Agrees on the training state in a world just met (its groups: None in a world of one);
# returns the first source replica and this rank's digest of its shard.
Agree = Callable[[Groups | None, World], tuple[int, str]]


class Membership:
    """This worker's membership: the world it is in, that world's groups, and the control
    channel to its launcher (None in a fixed world)."""

    def __init__(self, *, backend: str, shard_size: int, shard_rank: int, timeout_s: float, counters: Counters,
                 ledger: Ledger, agree: Agree, before_leaving: Callable[[bool], str],
                 collectives: Collectives | None = None, shard_group: ShardGroup | None = None) -> None:
        self.backend = backend
        self.shard_size = shard_size
        self.shard_rank = shard_rank
        # Live mode under HybridSharded: the replica's shard group (FSDP2's), connected anew
        # by every generation this worker forms, aborted when one breaks.
        self.shard_group = shard_group
        # The process groups' timeout (the backstop), and how long a rank waits for peers
        # or for its next world.
        self.timeout_s = timeout_s
        # Read only: the step reported in the messages.
        self.counters = counters
        self.ledger = ledger
        self._agree = agree
        # Waits for a checkpoint in flight, writes the state if asked; returns its folder or "".
        self._before_leaving = before_leaving
        self.phase = Phase.STARTING
        self.world: World | None = None
        self.channel: WorkerChannel | None = None
        self.groups: Groups | None = None
        # The waits on the groups' collectives (told when the groups are aborted from outside).
        self.collectives = collectives or Collectives()
        # Gloo's groups are not aborted from outside: its waits give up between slices.
        self.collectives.sliced = not aborts_from_outside(backend)
        # The generation `groups` belong to, and the newest generation the launcher said is
        # broken; the control channel's thread reads and writes them (under the lock) too.
        self._groups_generation: int | None = None
        self._broken_through = 0
        self._groups_lock = threading.Lock()
        # The generation's rendezvous store client, kept for the world's life, and its
        # address; `_store_settled` once a generation committed a step with it (no store
        # operation of this rank is left half-done on it): then the next generation, when
        # its store is at the same address, uses it again instead of connecting anew.
        self._store: Any = None
        self._store_address: tuple[str, int] | None = None
        self._store_settled = False
        # Arrivals this rank gave up while their waits still run (ended at close:
        # `end_stray_wait`), and the newest generation it formed.
        self._strays: list[StrayWait] = []
        self._strays_end_at_exit = False
        self._formed_generation = -1
        # Slurm's SIGTERM reached this worker and is held (`_on_sigterm`): its unit's leave
        # is on its way.
        self._sigterm_held = False
        self.log = log.bind(pid=os.getpid())

    @property
    def live(self) -> bool:
        return self.channel is not None

    # Entering the first world.

    def open(self, env: dict[str, str] | os._Environ[str], beat: Callable[[], Beat]) -> bool:
        """Connect to the launcher (live mode: `TIDAL_CONTROL_SOCKET`), start the beats, and
        learn the first world; on standby, wait until the launcher names it. Returns whether
        this worker joins a running world (its state then comes from the members: it skips
        the checkpoint)."""
        socket_path = env.get("TIDAL_CONTROL_SOCKET")
        if socket_path and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if socket_path:
            self.channel = WorkerChannel(socket_path, int(env.get("LOCAL_RANK", "0")), os.getpid(),
                                         on_word=self.on_launcher_word)
            self.channel.start_beats(beat)
        self.world = world_from_env(env)
        joining = env.get("TIDAL_JOINING") == "1"
        if self.channel is not None and env.get("TIDAL_STANDBY") == "1":
            # Started ahead of any world: wait until the launcher names one, and whether it
            # joins a running world.
            self.phase = Phase.STANDBY
            self.world = self.channel.wait_world(after_generation=0, timeout_s=STANDBY_TIMEOUT_S)
            joining = self.world.joining
            decision = decide(self.phase, self.world)
            if isinstance(decision, Leave):
                # Told to leave before it ever joined a world (the unit leaves, or gives its
                # node back).
                self.leave(decision)
        return joining

    def enter(self) -> None:
        """Form the first world: a fixed one at the world's store, or the launcher's."""
        assert self.world is not None
        if not self.live:
            groups = None
            if self.world.world_size > 1:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                groups = self._form_groups(next_fixed_world_store(), self.world, timeout, timeout)
            self.groups = groups
            self._agree(groups, self.world)
            self.phase = Phase.FORMED
            return
        broken = guarded(self.form, self.world)
        if isinstance(broken, str):
            self.recover(broken)

    # Forming a world.

    def form(self, world: World) -> None:
        """Join `world`'s process group (every member arrives first, so waiting stays
        interruptible by a stop) and agree on the training state."""
        assert self.channel is not None
        started = time.monotonic()
        self.phase = Phase.FORMING
        self.close_groups()
        self.world = world
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            kept = self._kept_store(world)
            store = kept if kept is not None else self._connect_store(world)
            store.set_timeout(timeout)
            self._store, self._store_address = store, (world.master_addr, world.master_port)
            # One store serves the launcher's life; each generation meets under its own prefix.
            prefix = dist.PrefixStore(f"gen/{world.generation}", store)
            await_peers(prefix, world, deadline=started + self.timeout_s, timeout_s=self.timeout_s,
                        check_interrupted=lambda: self._check_interrupted(world, "waiting for the peers"),
                        on_given_up=lambda thread: self._stray_wait(thread, world))
            # Formed, the groups' collectives (the state's transfer first) get the full
            # timeout, the backstop.
            connect = datetime.timedelta(seconds=form_timeout_s(self.timeout_s, world.world_size))
            self._adopt(self._form_groups(dist.PrefixStore("group", prefix), world, connect, timeout,
                                          shard=self.shard_group), world.generation)
            if self.shard_group is not None:
                # The replica's shard ranks meet under the replica's own prefix; FSDP2's
                # collectives go to this connection until the next generation's.
                replica = world.rank // self.shard_size
                self.shard_group.connect(self.backend, dist.PrefixStore(f"shard/{replica}", prefix),
                                         generation=world.generation, connect_timeout=connect, timeout=timeout)
            source, state_digest = self._agree(self.groups, world)
        except (RuntimeError, ValueError) as error:
            if isinstance(error, (StateMismatch, AccountingError, StateLost)):
                raise
            raise WorldBroken(f"forming generation {world.generation} failed: {error}") from error
        self.phase = Phase.FORMED
        self._formed_generation = world.generation
        seconds = time.monotonic() - started
        step = self.counters.step
        self.channel.send(Formed(generation=world.generation, step=step, digest=state_digest,
                                 replica_workers=self.shard_size))
        self.ledger.write("formed", generation=world.generation, rank=world.rank, world_size=world.world_size,
                          shard=self.shard_rank, step=step, digest=state_digest, source=source, seconds=seconds)
        self.log.info("world_formed", generation=world.generation, rank=world.rank, world_size=world.world_size,
                      step=step, state_source=source, seconds=round(seconds, 4),
                      store="kept" if kept is not None else "connected")

    def _stray_wait(self, thread: threading.Thread, world: World) -> None:
        self._strays.append(StrayWait(thread, world.generation, (world.master_addr, world.master_port)))
        if not self._strays_end_at_exit:
            # Also at the interpreter's exit, before its shutdown: a worker whose close()
            # is not reached (its script raised inside train()'s loop and the traceback
            # keeps the generator alive).
            atexit.register(self._end_stray_waits)
            self._strays_end_at_exit = True

    def _end_stray_waits(self) -> None:
        """End the waits of arrivals given up in generations older than one this rank
        formed since, through this rank's store client where it is a client of the same
        server (the host kept: the usual case), else through one connected for each
        server; a younger one is left to its deadline (another rank may still be on its
        way out of it, and would take `all_arrived` for its peers' arrival)."""
        strays, self._strays = self._strays, []
        # (Only a client no operation is left waiting on: a given-up wait's own client is
        # never settled, and a second operation on it would take the wait's reply.)
        clients: dict[tuple[str, int], Any] = {}
        if self._store is not None and self._store_address is not None and self._store_settled:
            clients[self._store_address] = self._store
        for stray in strays:
            if stray.generation >= self._formed_generation:
                self.log.info("stray_wait_left", generation=stray.generation, reason="no later generation formed")
                continue
            if stray.thread.is_alive() and stray.address not in clients:
                host, port = stray.address
                try:
                    clients[stray.address] = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                           timeout=datetime.timedelta(seconds=1))
                except RuntimeError as error:
                    clients[stray.address] = None
                    self.log.info("stray_wait_store_gone", generation=stray.generation, error=str(error))
            problem = end_stray_wait(stray, clients.get(stray.address))
            if problem is not None:
                self.log.warning("stray_wait_left", generation=stray.generation, reason=problem)

    def _check_interrupted(self, world: World, doing: str) -> None:
        assert self.channel is not None
        reason = interruption(world, doing=doing, stopped=self.channel.stop_requested(world.generation),
                              newer=self.channel.next_world(world.generation))
        if reason is not None:
            raise WorldBroken(reason)

    def _kept_store(self, world: World) -> Any:
        """The previous generation's store client, when `world`'s store is at the same
        address (its host launcher survived: the controller keeps rank 0's unit as host while
        it lives), that generation committed a step (`committed`: none of this rank's store
        operations was left waiting or timed out on it, after which a client's replies could
        be out of step) and the server still answers (a read-only `check`); else None, and a
        new client connects. At scale this is what spares the host a connect from every
        surviving rank at each world change (bench.world_scale, "connections kept")."""
        kept, settled = self._store, self._store_settled
        self._store, self._store_settled = None, False
        if kept is None or not settled or self._store_address != (world.master_addr, world.master_port):
            return None
        try:
            check_kept_store(kept, min(self.timeout_s, STORE_TIMEOUT_S))
        except RuntimeError as error:
            self.log.info("store_reconnect", generation=world.generation, reason=str(error))
            return None
        return kept

    def _connect_store(self, world: World) -> dist.TCPStore:
        """The generation's rendezvous store, on its host launcher. That host may be gone (it
        failed during the change): attempts of one second each, a stop between any two,
        and past STORE_TIMEOUT_S the world counts as broken."""
        deadline = time.monotonic() + min(self.timeout_s, STORE_TIMEOUT_S)
        while True:
            self._check_interrupted(world, "reaching the store")
            try:
                return dist.TCPStore(world.master_addr, world.master_port, is_master=False,
                                     timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
            except RuntimeError as error:
                if time.monotonic() > deadline:
                    raise WorldBroken(f"the store of generation {world.generation} at {world.master_addr}:"
                                      f"{world.master_port} does not answer: {error}") from error
                time.sleep(0.05)

    def _form_groups(self, store: Any, world: World, connect: datetime.timedelta,
                     timeout: datetime.timedelta, shard: Any = None) -> Groups | None:
        """The generation's groups; given the replica's shard group (`shard`, live mode), the
        world's collectives go through it and the replica group, and no group spans the world."""
        if world.world_size == 1:
            return None
        try:
            return form_groups(self.backend, store, rank=world.rank, world_size=world.world_size,
                               shard_size=self.shard_size, shard_rank=self.shard_rank,
                               connect_timeout=connect, timeout=timeout, shard=shard)
        except ValueError as error:
            # A world that does not fit the strategy's replicas is a planning bug, never retried.
            raise StateMismatch(f"generation {world.generation}: {error}") from error

    def _adopt(self, groups: Groups | None, generation: int) -> None:
        """Make `groups` this rank's, for `generation`. If the launcher already said that
        generation broke (its word came while the groups connected), they are aborted here
        and the world is broken: no collective of theirs would ever be aborted otherwise."""
        with self._groups_lock:
            self.groups, self._groups_generation = groups, generation
            self.collectives.broken = None
            self.collectives.interrupted = None
            late = groups is not None and generation <= self._broken_through
            aborted = abort_from_outside(self.backend, groups_generation=generation if groups else None,
                                         broken_through=self._broken_through)
            if aborted:
                self.collectives.broken = f"generation {generation} broke while its groups connected"
        if aborted and groups is not None:
            groups.abort()
        if late:
            raise WorldBroken(f"generation {generation} broke while its groups connected")

    def on_launcher_word(self, message: LauncherToWorker | None) -> None:
        """On the control channel's thread, for each world or stop the launcher sends (None:
        the channel closed): when it says the generation of this rank's groups broke and
        the backend aborts from outside (NCCL), the collectives are told first, then the
        groups are aborted on a thread of their own, so that a training thread blocked in
        one of their collectives returns and breaks the world. Gloo: the collectives are told
        (`Collectives.interrupted`), and a wait still blocked in one gives up at its next
        slice; the groups are closed once the training thread has left them."""
        broken = breakage(message)
        if broken is None:
            return
        through, why = broken
        with self._groups_lock:
            self._broken_through = max(self._broken_through, through)
            groups, generation = self.groups, self._groups_generation
            if groups is None or generation is None or generation > through:
                return
            if not aborts_from_outside(self.backend):
                if self.collectives.interrupted is None:
                    self.collectives.interrupted = f"generation {generation} broke: {why}"
                return
            reason = f"generation {generation}'s groups were aborted: {why}"
            # Before the abort: a wait it unblocks returns without raising.
            self.collectives.broken = reason
        self.log.warning("groups_aborted_from_outside", generation=generation, reason=why)
        shard_group = self.shard_group
        shard_connection = None
        if shard_group is not None and shard_group.generation <= through:
            # FSDP2's collectives of the replica wait on that generation's connection too
            # (a step abandoned for it is dropped at its end: the collectives are broken).
            # Aborted with the generation's groups, in one call: NCCL's communicators of one
            # device are aborted together (`tidal.train.backend.abort_groups`).
            shard_connection = shard_group.detach()
        also = [shard_connection] if shard_connection is not None else []

        def abort() -> None:
            groups.abort(also)
            close_groups_of(also, broken=True, aborted=True)

        threading.Thread(target=abort, name="tidal-abort", daemon=True).start()

    def close_groups(self, broken: bool = False) -> None:
        """Leave the generation's groups (aborted after a failure: a destroy would wait on
        collectives that will never finish). The replica's shard group stays connected
        after a planned change or the end of training (FSDP2's collectives after `train()`
        use it) and is aborted after a failure (a shard peer may be gone)."""
        with self._groups_lock:
            groups, self.groups, self._groups_generation = self.groups, None, None
        if groups is not None:
            groups.close(broken)
        if broken and self.shard_group is not None:
            self.shard_group.disconnect(broken=True)

    # During a step.

    def check_stop(self) -> None:
        """Raises WorldBroken once the launcher stopped this generation."""
        if self.channel is not None and self.world is not None and self.channel.stop_requested(self.world.generation):
            raise WorldBroken(f"the launcher stopped generation {self.world.generation}")

    def change_announced(self) -> bool:
        """The launcher named a newer world (this rank says so in its step's control
        all-reduce, so that all ranks learn together that the world changes after it)."""
        assert self.world is not None
        return self.channel is not None and self.channel.next_world(self.world.generation) is not None

    def change_coming(self) -> bool:
        """A world change is on its way but not announced yet: the launcher said so (its
        joiners are starting), or Slurm's SIGTERM reached this worker (its unit's leave
        follows). This rank says so in its step's vote, and the ranks then vote again at the
        step's end (`tidal.train.elastic`), so that a world announced during the step takes
        effect right after it."""
        if self.channel is None or self.world is None:
            return False
        return self._sigterm_held or self.channel.change_coming(self.world.generation)

    def committed(self, step: int) -> None:
        """A step committed in this world: the first one is reported."""
        assert self.world is not None
        if self.phase is Phase.FORMED:
            self.phase = Phase.TRAINING
            # The generation's store operations (arrival, the groups' connects, NCCL's at
            # their first collectives, the state's transfer) are done: the client is clean.
            self._store_settled = True
            if self.channel is not None:
                self.channel.send(FirstStep(generation=self.world.generation, step=step))

    def finish(self, generation: int) -> None:
        """The job's last step is committed: say so before the script's own code after
        train() runs and before anything is torn down, so that from here on an exit or a
        silence is not a failure and no new world forms."""
        assert self.channel is not None
        self.phase = Phase.FINISHED
        self.channel.send(Finished(generation=generation, step=self.counters.step))
        self.ledger.write("finished", generation=generation, step=self.counters.step)

    # Changing worlds.

    def recover(self, reason: str) -> None:
        """Out of the broken world; wait for the launcher to name the next one and join it
        (or leave). In a fixed world a break is the end."""
        if self.channel is None:
            raise RuntimeError(f"training failed in a fixed world: {reason}")
        assert self.world is not None
        while True:
            self.phase = Phase.BROKEN
            self.close_groups(broken=True)
            generation = self.world.generation
            self.log.warning("world_broken", generation=generation, step=self.counters.step, reason=reason)
            self.ledger.write("abandoned", generation=generation, step=self.counters.step, reason=reason)
            failed = self._wait_and_form(generation)
            if failed is None:
                return
            reason = failed

    def stand_aside(self, decision: StandAside) -> None:
        """Out of the world after the agreed step, not out of the job: leave the old world's
        groups and wait for the next world that names this rank, keeping the state."""
        self._out_after_agreed_step("set_aside", decision.world.generation)

    def _out_after_agreed_step(self, kind: str, named_in: int) -> None:
        """Out of the world after the agreed step (nothing broke, no step abandoned): leave
        the groups as for a planned change, record `kind`, and wait, keeping the state, for
        the next world after `named_in` that names this rank."""
        assert self.world is not None
        generation = self.world.generation
        self.phase = Phase.BROKEN
        self.close_groups()
        self.log.info(kind, generation=generation, named_in=named_in, step=self.counters.step)
        self.ledger.write(kind, generation=generation, step=self.counters.step)
        failed = self._wait_and_form(max(generation, named_in))
        if failed is not None:
            self.recover(failed)

    def _wait_and_form(self, generation: int) -> str | None:
        """Say this rank stopped with `generation`, wait for a later world that names it
        (leaving if told to) and form it: None once formed, or why forming broke."""
        assert self.channel is not None
        try:
            self.channel.send(Stopped(generation=generation, step=self.counters.step))
            after = max(generation, self.channel.stopped_generation)
            while True:
                # As long as the launcher lives: a job below min_replicas waits for nodes, for
                # minutes or hours, and this rank's memory is the training state meanwhile (a
                # launcher that dies closes the channel, and this wait ends).
                world = self.channel.wait_world(after_generation=after, timeout_s=STANDBY_TIMEOUT_S)
                decision = decide(self.phase, world)
                if isinstance(decision, Leave):
                    self.leave(decision)
                if not isinstance(decision, StandAside):
                    break
                after = world.generation
        except (ChannelClosed, TimeoutError) as error:
            raise RuntimeError(f"no world to join after generation {generation}: {error}") from error
        failed = guarded(self.form, world)
        return failed if isinstance(failed, str) else None

    def move_on(self) -> None:
        """The ranks agreed to change worlds after this step: wait for this rank's copy of
        the new world (it is on its way) and join it, or leave."""
        assert self.channel is not None and self.world is not None
        generation = self.world.generation
        try:
            world = self.channel.wait_world_or_stop(generation, timeout_s=self.timeout_s)
        except ChannelClosed as error:
            raise RuntimeError(f"peers agreed on a world change this rank never heard of: {error}") from error
        except TimeoutError:
            # Neither the world nor a stop within timeout_s: the controller is away (a
            # restart, an upgrade). The agreed step is committed and this rank's memory
            # holds the training state: it says it stopped and waits for the next world as
            # long as its launcher lives, as a rank of a world below min_replicas does. It
            # used to end here with the state (and with it, under HybridSharded, possibly
            # the last copy of its shards).
            self.log.warning("world_late", generation=generation, step=self.counters.step, waited_s=self.timeout_s)
            world = None
        if world is None:
            # (Or a stop:) the change was a peer's leave, and without it the world is below min_replicas:
            # the controller stops this rank's generation rather than name it a world. It
            # says it stopped, keeping the state, and waits for the next world; waiting for
            # a world of its own here held it until the launcher's stop timed out and killed
            # it, and its shards were lost (chaos, sharded, seed 301).
            self._out_after_agreed_step("stopped", generation)
            return
        decision = decide(self.phase, world)
        if isinstance(decision, Leave):
            self.leave(decision)
        if isinstance(decision, StandAside):
            self.stand_aside(decision)
            return
        broken = guarded(self.form, world)
        if isinstance(broken, str):
            self.recover(broken)

    def leave(self, decision: Leave) -> None:
        """Leave the job: out of the groups, the state written first when asked; exits 0."""
        assert self.channel is not None
        world = decision.world
        self.phase = Phase.LEAVING
        self.close_groups()
        saved_to = self._before_leaving(decision.save)
        self.log.info("leaving", generation=world.generation, step=self.counters.step, saved_to=saved_to or None)
        self.ledger.write("left", generation=world.generation, step=self.counters.step, saved_to=saved_to)
        self.channel.send(Left(generation=world.generation, step=self.counters.step, saved_to=saved_to))
        # The script's loop unwinds and its exit handlers run; the interpreter's teardown
        # (1.8 s with torch, measured here) does not keep the node allocated (`quick_exit`).
        end_after_exit_handlers(0)
        raise SystemExit(0)

    # Slurm's SIGTERM.

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """A first SIGTERM: wait (in a thread) for the launcher to say this unit leaves,
        saving the state if it holds the last copy; if it does not within TERM_WAIT_S, end
        as SIGTERM would have. Any later SIGTERM ends the process at once."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._sigterm_held = True
        wait_s = float(os.environ.get("TIDAL_TERM_WAIT_S", TERM_WAIT_S))

        def end_unless_leaving() -> None:
            # Logged here, not in the handler: the handler runs on the main thread wherever
            # it was, perhaps in the middle of writing a log line, holding the (not
            # reentrant) lock of structlog's output; logging there waited for it for ever.
            self.log.info("sigterm_held", wait_s=wait_s, step=self.counters.step)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.phase is Phase.LEAVING or self._leave_announced():
                    return
                time.sleep(0.05)
            if not (self.phase is Phase.LEAVING or self._leave_announced()):
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=end_unless_leaving, name="tidal-sigterm", daemon=True).start()

    def _leave_announced(self) -> bool:
        """The launcher named a world this worker leaves for (it goes at the next step's end)."""
        world, channel = self.world, self.channel
        if channel is None:
            return False
        announced = channel.next_world(world.generation if world is not None else 0)
        return announced is not None and announced.leaves

    def close(self) -> None:
        try:
            self._end_stray_waits()
        finally:
            self.close_groups()
            if self.channel is not None:
                self.channel.close()
