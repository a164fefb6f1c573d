"""The unit's agent: the launcher on a unit's first node, one per Slurm allocation of a
replica. A one-node unit is the K = 1 case: a leader with no followers.

It registers with the controller using the job's secret (from a file or the environment,
never argv), heartbeats, starts the node's workers with a torchrun-compatible environment
when a generation starts, stops them when the controller says so, and turns SIGTERM
(Slurm's preemption notice) into a request to leave. Training goes on while the
controller is away. In a unit of several nodes it relays each generation and stop to its
followers (`nodes.FollowerHub`) and reports their workers as the unit's.

What every launcher of a unit does (one loop, the node's workers, the decisions on a
worker's exit, a signal and a tick) is `node.NodeAgent`; live mode is `live.LiveMode`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import structlog
from google.protobuf import timestamp_pb2

from tidal.launcher import decisions, worlds
from tidal.launcher.control import LauncherChannel, WorkerSaid
from tidal.launcher.events import SignalReceived, WorkersStopped
from tidal.launcher.lifecycle import (
    EXIT_REFUSED,
    EXIT_UNIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    TICK_INTERVAL_S,
    LauncherState,
)
from tidal.launcher.link import ControllerLink, ControllerSaid, LinkBroken, LinkDown, LinkRefused, LinkUp
from tidal.launcher.live import LIVE_TERM_REPEAT_S, LiveMode
from tidal.launcher.liveness import Now, Observations, WorkerWatch
from tidal.launcher.node import NodeAgent
from tidal.launcher.nodes import (
    FollowerHub,
    FollowerJoined,
    FollowerLost,
    FollowerSaid,
    UnitNodes,
    node_placement,
)
from tidal.launcher.rundirs import make_run_dir
from tidal.launcher.store import ServedStore, release_store_server, stop_store_server
from tidal.proto import common_pb2, launcher_pb2

log = structlog.get_logger("tidal.launcher")

# At exit the launcher stops its store server (the child process that imports torch and
# serves its rendezvous stores, `launcher/store.py`): SIGTERM, then SIGKILL after this long.
# Nothing waits for a store still being made: the child, not the launcher, is inside
# torch's import, and ending it there is harmless.
STORE_SERVER_STOP_S = 5.0


def process_started_at() -> timestamp_pb2.Timestamp | None:
    """When this process started, by the kernel's clock (Linux: /proc, 10 ms ticks), as
    wall-clock time; None where it cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            # The command name (field 2) may hold spaces: count fields after its ')'.
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        # Ticks since boot; the boot's own wall time (btime) is whole seconds, so the age is
        # taken from the boot clock instead.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        started = time.time() - age
    except (OSError, ValueError, IndexError):
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(started * 1e9))
    return stamp


@dataclasses.dataclass(frozen=True)
class LauncherOptions:
    controller: str
    job_id: str
    unit_id: str
    secret: str
    address: str
    nodes: tuple[str, ...]
    slurm_job_id: int = 0
    tls_ca: Path | None = None
    # After SIGTERM: how long to wait for a Generation listing this unit leaving before leaving alone.
    leave_timeout_s: float = 20.0
    # Give up when never registered after this long.
    connect_timeout_s: float = 600.0
    # SIGTERM-to-SIGKILL grace when the launcher itself ends its workers.
    stop_grace_s: float = 10.0
    # Live mode: a worker whose beats (every 0.5 s, from a thread of its own) stop for
    # this long is judged (`liveness.silence_verdict`): killed only if frozen (stopped, or
    # no CPU time through the silence), so that the failure is reported at once; a slow,
    # busy worker is left alone. The controller's Registered.worker_silence_timeout, when
    # set, wins. 0 disables (unless the controller sends a limit).
    worker_silence_timeout_s: float = 2.0
    # Live mode: start the workers as soon as the launcher registers, before any world
    # names it (they import torch, build the model and wait), so that joining a running
    # world costs the rendezvous and the state transfer, not the workers' start.
    prestart_workers: bool = True
    # A unit spanning several nodes: this launcher leads it (node 0 of `unit_nodes`); the
    # followers connect to it (`nodes`). None: a one-node unit.
    unit_nodes: UnitNodes | None = None
    # A follower silent this long (or whose connection breaks) is lost, and the replica with it.
    node_timeout_s: float = 10.0
    # Training finished while the controller is away (restarting): how long the launcher
    # waits for it to come back and take the unit's last reports (the last step, the
    # workers' exits) before exiting without them. Without those the controller would take
    # the silent unit for failed, and a job whose training ended would not complete.
    finish_report_timeout_s: float = 60.0


class Agent(NodeAgent[LauncherOptions]):
    def __init__(self, options: LauncherOptions) -> None:
        super().__init__(options, run_dir=make_run_dir(options.unit_id),
                         log=log.bind(job=options.job_id, unit=options.unit_id))
        self.registered: launcher_pb2.Registered | None = None
        self.started_at = time.monotonic()
        self.heartbeat_sequence = 0
        self.last_heartbeat_at = 0.0
        # The generation this unit is a member of, held while the old workers still stop.
        self.pending_start: launcher_pb2.Generation | None = None
        self.pending_joining = False
        # The controller declared this unit failed: its workers go, the launcher exits 1.
        self.failed_self = False
        # Restart mode: the workers stop because the next Generation replaced theirs (its
        # STARTED is the one acknowledgment; no STOPPED is reported).
        self.stopping_for_start = False
        # Live mode: workers started ahead of any world, waiting to be named in one.
        self.standby = False
        # The store the next generation hosted here meets at (its port is what this unit
        # reports, `store_port`), and in restart mode the one the running generation's ranks use.
        self.store: ServedStore | None = None
        self.serving_store: ServedStore | None = None
        self.live = LiveMode(self, LauncherChannel(self.run_dir / "control.sock", post=self.events.put_nowait))
        self.link = ControllerLink(options.controller, register=self._register_message, post=self.events.put_nowait,
                                   tls_ca=options.tls_ca)
        self.link_task: asyncio.Task[None] | None = None
        # Since when the store server waits to import torch (None: not held, or released).
        self.store_held_since: float | None = None
        # A multi-node unit's followers (the leader registers once all of them joined), and
        # what each last reported of its workers, by node index.
        layout = options.unit_nodes
        self.hub = (FollowerHub(layout, job_id=options.job_id, unit_id=options.unit_id,
                                slurm_job_id=options.slurm_job_id, secret=options.secret,
                                post=self.events.put_nowait, node_timeout_s=options.node_timeout_s)
                    if layout is not None and len(layout.nodes) > 1 else None)
        self.node_progress: dict[int, list[launcher_pb2.WorkerProgress]] = {}
        self.stopping_nodes: asyncio.Task[None] | None = None

    # Setup and teardown.

    def _new_store(self, held: bool = False) -> None:
        """A fresh rendezvous store for the next generation hosted here, listening on this
        unit's address only (`ServedStore`: the port at once, the server once the store
        server process has imported torch, which holds up neither the registration nor
        the heartbeats). The store it replaces is closed unless a generation's ranks
        still meet at it (`serving_store`). Live mode serves one
        for the launcher's life: its workers meet under a prefix per generation (`gen/<n>`).
        Restart mode needs a fresh one per generation, as under torchrun: an unmodified
        script's env:// rendezvous writes the same keys in every generation and cannot be
        given a prefix. So once a generation starts on this unit's store, a spare is made at
        once and its port reported with STARTED: the controller can plan the next
        generation and send it in one message, without a stop round first. OSError when
        the address cannot be listened on (then `store` is None)."""
        previous, self.store = self.store, None
        if previous is not None and previous is not self.serving_store:
            previous.close()
        self.store = ServedStore(self.options.address, held=held)

    @property
    def store_port(self) -> int:
        """The port of the store the next generation hosted here meets at (0: none)."""
        return self.store.port if self.store is not None else 0

    def _register_message(self) -> launcher_pb2.Register:
        running = self.workers is not None and not self.workers.all_exited
        followers = [w.pid for workers in self.node_progress.values() for w in workers]
        return launcher_pb2.Register(
            job_id=self.options.job_id, unit_id=self.options.unit_id, secret=self.options.secret,
            nodes=list(self.options.nodes), address=self.options.address,
            slurm_job_id=self.options.slurm_job_id, last_generation=self.generation,
            worker_pids=(self.workers.pids if running and self.workers else []) + followers,
            store_port=self.store_port, started_at=process_started_at())

    async def _open(self) -> bool:
        try:
            # A one-node unit holds its store server's torch import while its workers start
            # (`decisions.store_server_release`).
            self.store_held_since = time.monotonic() if self.hub is None and self.options.prestart_workers else None
            self._new_store(held=self.store_held_since is not None)
        except OSError as error:
            self.log.error("store_not_served", address=self.options.address, error=str(error))
            print(f"tidal-launcher: cannot serve the rendezvous store on {self.options.address}: {error} "
                  "(--address must be an address of this node)", file=sys.stderr)
            self.finish(LauncherState.FAILED, EXIT_USAGE, "cannot serve the rendezvous store")
            return False
        await self.live.channel.start()
        if self.hub is None:
            self._open_link()
        else:
            # The unit registers once every node is there: the controller then sees whole
            # replicas only.
            try:
                await self.hub.start()
            except OSError as error:
                self.log.error("unit_channel_not_served", error=str(error))
                print(f"tidal-launcher: cannot serve the unit's other nodes: {error} (--node-port-base picks "
                      "other ports)", file=sys.stderr)
                self.finish(LauncherState.FAILED, EXIT_USAGE, "cannot serve the unit's other nodes")
                return False
        self.log.info("launcher_started", controller=self.options.controller, address=self.options.address,
                      store_port=self.store_port, pid=os.getpid(), nodes=list(self.options.nodes))
        return True

    async def _close(self) -> None:
        if self.hub is not None:
            await self.hub.close(self.exit_code, self.exit_reason)
        await self.live.channel.close()
        # The last reports: only the end of training waits for the controller to confirm
        # them (reconnecting if it is away, or if the session breaks first), and not once a
        # SIGTERM or SIGINT (scancel) has come, before now or during the wait.
        signalled_before = False
        while not self.events.empty():
            signalled_before = isinstance(self.events.get_nowait(), SignalReceived) or signalled_before
        deliver_s = (self.options.finish_report_timeout_s
                     if self.await_controller_on_exit and not signalled_before else 0.0)
        if deliver_s > 0 and (self.link.undelivered or not self.link.connected):
            self.log.warning("awaiting_controller", reports=self.link.undelivered, timeout_s=deliver_s)
        self.link.close(deliver_within_s=deliver_s)
        if self.link_task is not None and deliver_s > 0:
            # Until a session's end confirms them, the link gives up, or a SIGTERM or SIGINT
            # comes; then the session's end, as below.
            waits = {asyncio.create_task(self._next_signal()), asyncio.create_task(self.link.delivered.wait())}
            await asyncio.wait({self.link_task, *waits}, timeout=deliver_s + 2.0,
                               return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            if not self.link.delivered.is_set():
                self.link_task.cancel()
        if self.link_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self.link_task, timeout=2.0)
        if self.link.undelivered:
            # (Refused because the unit already left or the job is over, the controller had
            # them before: `controller_refused` says so.)
            refusal = self.link.refusal
            self.log.warning("reports_undelivered", reports=self.link.undelivered, waited_s=deliver_s,
                             reason=self.exit_reason,
                             controller_refused=f"{refusal.code.name}: {refusal.details}" if refusal else None)
        for store in (self.store, self.serving_store):
            if store is not None:
                store.close()
        stop_store_server(STORE_SERVER_STOP_S)

    async def _next_signal(self) -> None:
        """Once the loop is over: return when a signal's event arrives."""
        while not isinstance(await self.events.get(), SignalReceived):
            pass

    def _open_link(self) -> None:
        if self.link_task is None:
            self.link_task = asyncio.create_task(self.link.run(), name="link")

    # Events only the leader gets: the controller's, its workers' channel's, its followers'.

    def _on_event(self, event: object) -> None:
        match event:
            case LinkUp(registered):
                self._on_registered(registered)
            case LinkDown(error):
                self.log.warning("controller_lost", error=error, state=self.state.value)
            case LinkBroken(error):
                self.finish(LauncherState.FAILED, EXIT_UNREACHABLE, f"the link to the controller broke: {error}")
            case LinkRefused(code, details):
                self.finish(LauncherState.FAILED, EXIT_REFUSED, f"controller refused this launcher: {code.name}: "
                            f"{details}")
            case ControllerSaid(message):
                self._on_command(message)
            case WorkerSaid(local_rank, said):
                self.live.on_worker_said(local_rank, said)
            case FollowerJoined(index, node):
                self._on_follower_joined(index, node)
            case FollowerSaid(index, message):
                self._on_follower_said(index, message)
            case FollowerLost(index, node, reason):
                self._on_follower_lost(index, node, reason)

    @property
    def live_mode(self) -> bool:
        return self.registered is not None and self.registered.mode == common_pb2.JOB_MODE_LIVE

    @property
    def term_repeat_s(self) -> float | None:
        """How a stop SIGTERMs the workers: live mode twice, LIVE_TERM_REPEAT_S apart (the
        library takes a first SIGTERM alone as Slurm's notice); restart mode once."""
        return LIVE_TERM_REPEAT_S if self.live_mode else None

    @property
    def live_workers_running(self) -> bool:
        """Live-mode workers that can follow a world change in-process: all of them alive."""
        group = self.workers
        return (self.live_mode and group is not None and not group.stopping
                and not any(w.exited.done() for w in group.workers))

    def _on_registered(self, registered: launcher_pb2.Registered) -> None:
        self.registered = registered
        if self.hub is not None and registered.mode == common_pb2.JOB_MODE_LIVE:
            # The controller refuses such a job at submit; a launcher started by hand gets here.
            self.finish(LauncherState.FAILED, EXIT_REFUSED, "a unit spanning several nodes runs in restart mode only "
                        "(live mode is not supported there yet)")
            return
        if self.state is LauncherState.CONNECTING:
            self.state = LauncherState.WAITING
        self.log.info("registered", controller_generation=registered.current_generation, own_generation=self.generation,
                      state=self.state.value)
        if self.leave_requested_at is not None and self.state is not LauncherState.LEAVING:
            self._request_leave()
        elif (self.options.prestart_workers and self.live_mode and self.state is LauncherState.WAITING
              and self.workers is None):
            self._start_standby()

    def _start_standby(self) -> None:
        """Live mode: start the workers before any world names this unit; the library
        waits for the first world on the control channel (TIDAL_STANDBY=1)."""
        assert self.registered is not None
        procs = self.registered.procs_per_node or 1
        placeholder = launcher_pb2.Generation(generation=0, rank_table=common_pb2.RankTable(
            world_size=procs, groups=1, assignments=[common_pb2.RankAssignment(
                unit_id=self.options.unit_id, nodes=list(self.options.nodes), group_rank=0, first_rank=0,
                procs_per_node=procs)]))
        self._start(placeholder, joining=True, standby=True)

    def _on_command(self, message: launcher_pb2.ControllerMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "generation":
            self._maybe_release_store(named_host=message.generation.rendezvous.host_unit_id == self.options.unit_id)
            self.apply(worlds.on_generation(self.leader_view(), message.generation, self.options.unit_id))
        elif kind == "change_coming" and self.live_mode:
            self.live.tell_coming(message.change_coming.generation)

    def _maybe_release_store(self, named_host: bool = False) -> None:
        """Let the held store server import torch once `decisions.store_server_release`
        says so."""
        if self.store_held_since is None:
            return
        trained = any(phase == launcher_pb2.GENERATION_PHASE_FIRST_STEP for _, phase in self.live.workers.reported)
        held_s = time.monotonic() - self.store_held_since
        reason = decisions.store_server_release(
            live_mode=None if self.registered is None else self.live_mode, prestart=self.options.prestart_workers,
            trained=trained, named_host=named_host, held_s=held_s)
        if reason is None:
            return
        self.store_held_since = None
        if release_store_server():
            self.log.info("store_server_released", reason=reason, held_s=round(held_s, 3))

    # Workers.

    def _start(self, start: launcher_pb2.Generation, joining: bool = False, standby: bool = False) -> None:
        assert self.registered is not None
        placement = node_placement(start, self.options.unit_id)
        if placement is None:
            self.log.warning("not_in_rank_table", generation=start.generation)
            return
        serving = (self.store_port, self.serving_store.port if self.serving_store is not None else 0)
        if start.rendezvous.host_unit_id == self.options.unit_id and start.rendezvous.port not in serving:
            self.log.warning("rendezvous_port_mismatch", named=start.rendezvous.port, serving=self.store_port)
        extra = dict(self.registered.environment)
        if self.live_mode:
            self.live.reset(ready_generation=start.generation if joining else 0)
            extra.update({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": str(self.live.channel.path),
                          "TIDAL_JOINING": "1" if joining else "0", "TIDAL_STANDBY": "1" if standby else "0",
                          # Its place in a replica of several nodes (HybridSharded's shard
                          # ranks follow from it), as the controller assigned it.
                          "TIDAL_REPLICA": str(self.registered.replica),
                          "TIDAL_NODE_INDEX": str(self.registered.node_index),
                          "TIDAL_NODES_PER_REPLICA": str(max(1, self.registered.nodes_per_replica))})
        generation = start.generation
        try:
            self.workers = self.start_group(placement, self.registered, extra)
        except OSError as error:
            self.log.error("workers_not_started", generation=generation, error=str(error))
            self.generation = generation
            self.link.send(launcher_pb2.LauncherMessage(worker_exited=launcher_pb2.WorkerExited(
                generation=generation, local_rank=0, pid=0, exit_code=127)))
            self.state = LauncherState.WAITING
            return
        if self.hub is not None:
            # The other nodes of the unit start theirs from the same message.
            self.hub.send_all(launcher_pb2.LeaderMessage(start=launcher_pb2.NodeStart(registered=self.registered,
                                                                                      start=start)))
        if standby:
            self.standby = True
            self.log.info("workers_on_standby", pids=[w.pid for w in self.workers.workers])
            return
        self.generation = generation
        self.state = LauncherState.RUNNING
        # An exit 0 before this (restart mode) was not the end of training.
        self.link.release_hold()
        if not self.live_mode and start.rendezvous.host_unit_id == self.options.unit_id:
            # This generation's ranks meet at the store it named: keep it for them, and make
            # a fresh one for the next generation hosted here. The one the previous
            # generation's ranks used goes: they have stopped.
            if self.serving_store is not None:
                self.serving_store.close()
            self.serving_store = self.store
            try:
                self._new_store()
            except OSError as error:
                # Without a store for the next generation this unit could never host one
                # again: it fails, as when a store fails later (`_on_tick`).
                self.log.error("store_not_served", address=self.options.address, error=str(error))
                self.finish(LauncherState.FAILED, EXIT_UNIT_FAILED,
                            f"cannot serve the rendezvous store on {self.options.address}: {error}")
                return
        if not joining:
            self.report(generation, launcher_pb2.GENERATION_PHASE_STARTED, step=start.target_step,
                        store_port=self.store_port)
        self.log.info("generation_started", generation=generation, rank=placement.first_rank,
                      world_size=placement.world_size, master=f"{placement.master_addr}:{placement.master_port}")

    def stop_workers(self, next_state: LauncherState, grace_s: float) -> None:
        """Move to STOPPING or LEAVING; WorkersStopped follows once every worker is gone."""
        if self.state is LauncherState.LEAVING and next_state is LauncherState.STOPPING:
            return
        already_stopping = self.state in (LauncherState.STOPPING, LauncherState.LEAVING)
        self.state = next_state
        if self.hub is not None:
            self._stop_unit_workers(grace_s)
            return
        self.stop_group(grace_s, post_when_gone=not already_stopping)

    def _stop_unit_workers(self, grace_s: float) -> None:
        """A multi-node unit: stop this node's workers and every follower's, together;
        WorkersStopped follows once all are gone (or their nodes lost)."""
        hub = self.hub
        assert hub is not None
        if self.stopping_nodes is not None and not self.stopping_nodes.done():
            return
        group, generation = self.workers, self.generation

        async def stop() -> None:
            local = group is not None and not group.all_exited and not group.stopping
            await asyncio.gather(group.stop(grace_s) if local and group is not None else asyncio.sleep(0),
                                 hub.stop_workers(generation, grace_s))
            self.events.put_nowait(WorkersStopped(generation))

        self.stopping_nodes = asyncio.get_running_loop().create_task(stop())

    def _on_workers_stopped(self, generation: int) -> None:
        if self.state.is_final:
            return
        self.log.info("workers_stopped", generation=generation, state=self.state.value)
        self.apply(worlds.on_workers_stopped(self.leader_view()))

    # The decisions' inputs and the actions only the leader takes.

    def view(self) -> decisions.NodeView:
        group = self.workers
        live = self.live.workers
        return decisions.NodeView(
            state=self.state, generation=self.generation, answers_to_controller=True,
            stop_grace_s=self.options.stop_grace_s, leave_timeout_s=self.options.leave_timeout_s,
            group_generation=group.generation if group is not None else None,
            group_stopping=group is not None and group.stopping,
            group_all_exited=group is None or group.all_exited,
            group_alive=frozenset(w.local_rank for w in group.workers if not w.exited.done()) if group else frozenset(),
            live_mode=self.live_mode, link_connected=self.link.connected, leave_requested_at=self.leave_requested_at,
            left=frozenset(live.left), finished=frozenset(live.finished), silenced=dict(live.silenced),
            live_stop_deadline=live.stop_deadline)

    def leader_view(self) -> worlds.LeaderView:
        group = self.workers
        live = self.live.workers
        return worlds.LeaderView(
            state=self.state, generation=self.generation, stop_grace_s=self.options.stop_grace_s,
            live_mode=self.live_mode, live_workers_running=self.live_workers_running,
            workers_generation=group.generation if group is not None and not group.all_exited else None,
            workers_started=group is not None, standby=self.standby, failed_self=self.failed_self,
            finished=bool(live.finished),
            all_said_hello=group is not None and live.hello >= {w.local_rank for w in group.workers},
            stopping_for_start=self.stopping_for_start, pending_start=self.pending_start,
            pending_joining=self.pending_joining,
            saved=tuple(live.saved.values()))

    @property
    def worker_silence_limit_s(self) -> float:
        """The controller's limit when it sends one, else this launcher's option."""
        if self.registered is not None and self.registered.worker_silence_timeout.ToNanoseconds() > 0:
            return self.registered.worker_silence_timeout.ToNanoseconds() / 1e9
        return self.options.worker_silence_timeout_s

    def observe(self, now: Now) -> Observations:
        limit_s = self.worker_silence_limit_s
        group = self.workers
        watches: tuple[WorkerWatch, ...] = ()
        previous = 0.0
        if self.live_mode and limit_s > 0 and group is not None and not group.stopping:
            watches, previous = self.live.watch(now, limit_s)
        return Observations(
            registering_since=self.started_at if self.state is LauncherState.CONNECTING else None,
            connect_timeout_s=self.options.connect_timeout_s, workers=watches, worker_silence_limit_s=limit_s,
            previous_look_at=previous)

    def _on_tick(self, now: Now) -> None:
        failed = next((store for store in (self.store, self.serving_store) if store is not None and store.failed), None)
        if failed is not None:
            self.log.error("store_not_served", address=self.options.address, port=failed.port, error=failed.error)
            self.finish(LauncherState.FAILED, EXIT_UNIT_FAILED,
                        f"cannot serve the rendezvous store on {self.options.address}:{failed.port}: {failed.error}")
            return
        super()._on_tick(now)
        if self.state.is_final:
            return
        self._maybe_release_store()
        interval = (self.registered.heartbeat_interval.ToNanoseconds() / 1e9 if self.registered is not None else 1.0)
        if (self.link.connected
                and now.monotonic - self.last_heartbeat_at >= max(0.05, interval) - TICK_INTERVAL_S / 2):
            self.last_heartbeat_at = now.monotonic
            self.link.send(launcher_pb2.LauncherMessage(heartbeat=self._heartbeat()), reliable=False)

    def _apply_own(self, action: object) -> None:
        match action:
            case worlds.Enter(state, generation):
                self.state = state
                if generation is not None:
                    self.generation = generation
            case worlds.HoldStart(start, replacing, joining):
                self.pending_start, self.pending_joining = start, joining
                if replacing is not None:
                    self.stopping_for_start = replacing
            case worlds.StartWorkers(start, joining):
                self._start(start, joining=joining)
            case worlds.DeclaredFailed():
                self.failed_self = True
                self.link.close()
            case worlds.LiveStop(generation):
                self.live.stop(generation)
            case worlds.LeaveSavingState():
                self.live.leave_saving_state()
            case worlds.SendWorlds(generation, rank_table, rendezvous, joining, target_step, at_step_boundary,
                                   set_aside):
                self.live.send_worlds(generation, rank_table, rendezvous, joining=joining, target_step=target_step,
                                      at_step_boundary=at_step_boundary, set_aside=set_aside)
            case worlds.LeaveStandby():
                self.standby = False
            case worlds.AwaitReady(generation):
                self.live.workers.ready_generation = generation
            case worlds.Report(generation, phase, step, detail, once, with_store_port):
                if once:
                    self.live.report_once(generation, phase, step=step, detail=detail)
                else:
                    self.report(generation, phase, step=step, detail=detail,
                                store_port=self.store_port if with_store_port else 0)
            case decisions.CheckLiveStopped():
                self.live.check_stopped()
            case decisions.ReportLeft(detail):
                self.report(self.generation, launcher_pb2.GENERATION_PHASE_LEFT, detail=detail)
            case decisions.RequestLeave():
                self._request_leave()
            case decisions.ClearLiveStopDeadline():
                self.live.workers.stop_deadline = None
            case decisions.KillWorker():
                self.live.kill(action)
            case decisions.NoteSlowWorker():
                self.live.note_slow(action)
            case decisions.ForgetBeatSamples():
                self.live.workers.beat_samples.clear()
            case _:
                raise ValueError(f"not a leader's action: {action!r}")

    def _send_up(self, exited: launcher_pb2.WorkerExited) -> None:
        if exited.exit_code == 0 and exited.signal == 0:
            # A rank done training (restart mode's only sign of the end): this report and
            # what follows are held until the controller confirms it read them (`link`).
            self.link.hold_written()
        self.link.send(launcher_pb2.LauncherMessage(worker_exited=exited))

    def report(self, generation: int, phase: launcher_pb2.GenerationPhase, step: int = 0, store_port: int = 0,
               detail: str = "", replica_workers: int = 0) -> None:
        report = launcher_pb2.GenerationReport(generation=generation, phase=phase, step=step, store_port=store_port,
                                               detail=detail, replica_workers=replica_workers)
        report.at.GetCurrentTime()
        self.link.send(launcher_pb2.LauncherMessage(generation_report=report))

    def _request_leave(self) -> None:
        request = launcher_pb2.LeaveRequest(generation=self.generation, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED,
                                            detail="SIGTERM")
        self.link.send(launcher_pb2.LauncherMessage(leave_request=request))
        if self.live_mode:
            # The world this unit leaves for follows: its workers vote at each step's end
            # meanwhile, so that they leave right after the step in which it arrives.
            self.live.tell_coming(self.generation + 1)

    def _heartbeat(self) -> launcher_pb2.Heartbeat:
        self.heartbeat_sequence += 1
        beat = launcher_pb2.Heartbeat(sequence=self.heartbeat_sequence)
        beat.sent_at.GetCurrentTime()
        beat.workers.extend(self.progress_entries(self.live.workers.beats))
        per_node = self.registered.procs_per_node if self.registered is not None else 0
        for index, entries in sorted(self.node_progress.items()):
            for relayed in entries:
                entry = launcher_pb2.WorkerProgress()
                entry.CopyFrom(relayed)
                entry.local_rank = index * per_node + relayed.local_rank
                beat.workers.append(entry)
        return beat

    # The unit's other nodes (a multi-node unit's leader only).

    def _on_follower_joined(self, index: int, node: str) -> None:
        assert self.hub is not None
        self.log.info("node_joined", node=node, node_index=index)
        if self.hub.complete and self.state is LauncherState.CONNECTING:
            self.log.info("unit_nodes_complete", nodes=list(self.options.nodes))
            self._open_link()

    def _on_follower_said(self, index: int, message: launcher_pb2.FollowerMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "report":
            if self.stopping_nodes is None or self.stopping_nodes.done():
                self.node_progress[index] = list(message.report.workers)
        elif kind == "stopped":
            self.node_progress.pop(index, None)
        elif kind == "worker_exited":
            self._on_follower_worker_exit(index, message.worker_exited)

    def _on_follower_worker_exit(self, index: int, exited: launcher_pb2.WorkerExited) -> None:
        """A worker of a follower's node exited on its own: a worker exit of this unit (its
        local rank counted over the unit's nodes)."""
        if self.state.is_final or exited.generation != self.generation:
            return
        if self.stopping_nodes is not None and not self.stopping_nodes.done():
            return
        per_node = self.registered.procs_per_node if self.registered is not None else 0
        node = self.options.nodes[index]
        forwarded = launcher_pb2.WorkerExited()
        forwarded.CopyFrom(exited)
        forwarded.local_rank = index * per_node + exited.local_rank
        self.log.info("node_worker_exited", node=node, generation=exited.generation, local_rank=forwarded.local_rank,
                      pid=exited.pid, exit_code=exited.exit_code, signal=exited.signal)
        self._send_up(forwarded)

    def _on_follower_lost(self, index: int, node: str, reason: str) -> None:
        """A node of the unit is gone, and the replica with it: say so as a worker exit of
        the unit (the controller drops the replica, cancels its Slurm job and cools the
        nodes down), stop this node's workers and exit non-zero."""
        self.node_progress.pop(index, None)
        if self.state.is_final or self.state is LauncherState.LEAVING:
            return
        what = f"node {node} lost: {reason}"
        self.log.warning("node_lost", node=node, node_index=index, reason=reason, state=self.state.value)
        if self.state is LauncherState.CONNECTING:
            self.finish(LauncherState.FAILED, EXIT_UNIT_FAILED, f"{what} (before the unit registered)")
            return
        per_node = self.registered.procs_per_node if self.registered is not None else 0
        exited = launcher_pb2.WorkerExited(generation=self.generation, local_rank=index * per_node, pid=0,
                                           signal=signal.SIGKILL, detail=what)
        exited.exited_at.GetCurrentTime()
        self._send_up(exited)
        self.failed_self = True
        self.stop_workers(LauncherState.STOPPING, 1.0)
