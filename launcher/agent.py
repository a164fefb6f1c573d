"""tidal-launcher: the per-unit agent, one per Slurm allocation of a replica.

It registers with the controller using the job's secret (from a file or the environment,
never argv), heartbeats, starts the node's workers with a torchrun-compatible environment
when a generation starts, stops them when the controller says so, and turns SIGTERM (Slurm's
preemption notice) into a request to leave. Training goes on while the controller is away.

One state machine (`AgentState`) and one loop (`Agent.run`); every input, from the
controller, the workers, signals or the clock, is an event on one queue.

In live mode (scripts using `tidal.train`) workers outlive generations: a world
change or a failure elsewhere reaches them over the control channel (`control`) and they
re-form in-process; only a worker of a failed unit, or one that does not stop in time,
is killed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import structlog

from tidal.controller.logs import configure_logging
from tidal.launcher.control import LauncherChannel, WorkerSaid
from tidal.launcher.events import SignalReceived, Tick, WorkerExit, WorkersStopped
from tidal.launcher.follower import Follower, FollowerOptions
from tidal.launcher.link import ControllerLink, ControllerSaid, LinkDown, LinkEvent, LinkRefused, LinkUp
from tidal.launcher.liveness import ProcessSample, Silence, group_members, read_group_sample, silence_verdict
from tidal.launcher.nodes import (
    DEFAULT_PORT_BASE,
    FollowerHub,
    FollowerJoined,
    FollowerLost,
    FollowerSaid,
    NodeEvent,
    UnitNodes,
    node_placement,
    unit_nodes,
)
from tidal.launcher.store import ServedStore
from tidal.launcher.workers import (
    Worker,
    WorkerGroup,
    error_files,
    exit_status,
    read_progress,
    read_worker_error,
    start_workers,
    worker_environment,
)
from tidal.proto import common_pb2, launcher_pb2
from tidal.proto.control import (
    Beat,
    Finished,
    FirstStep,
    Formed,
    Hello,
    Left,
    Resumed,
    StateLost,
    Stop,
    Stopped,
    WorkerToLauncher,
    World,
)

log = structlog.get_logger("tidal.launcher")

EXIT_OK = 0
EXIT_UNIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
# How often the launcher looks at its workers (heartbeats go every heartbeat_interval).
TICK_INTERVAL_S = 0.25
# Live mode: a stop SIGTERMs the workers twice, this far apart (the library takes a first
# SIGTERM alone for Slurm's notice, see tidal.train.elastic's TERM_WAIT_S).
LIVE_TERM_REPEAT_S = 0.3
# A launcher that ends early (refused, unreachable) waits this long at most for its store's
# thread to finish importing torch before the process exits (ServedStore.settle).
STORE_SETTLE_S = 15.0


class AgentState(enum.StrEnum):
    """The launcher's lifecycle.

    CONNECTING: not registered yet (a launcher that was registered once never returns
    here; while the controller is away it stays in its state and keeps its workers).
    WAITING: registered, no workers: a joiner, or between two generations.
    RUNNING: the workers of `generation` run.
    STOPPING: stopping the workers (the controller's STOP, or before a new generation).
    LEAVING: stopping the workers to leave the job; exits 0 afterwards.
    SUCCEEDED, FAILED: final; the process exits (0, or the code saying why)."""

    CONNECTING = "connecting"
    WAITING = "waiting"
    RUNNING = "running"
    STOPPING = "stopping"
    LEAVING = "leaving"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (AgentState.SUCCEEDED, AgentState.FAILED)


AgentEvent = LinkEvent | WorkerExit | WorkersStopped | SignalReceived | Tick | WorkerSaid | NodeEvent


def left_detail(saved: dict[int, tuple[str, int]]) -> str:
    """The LEFT report's detail: where the unit's workers wrote the job's state, if they did."""
    if not saved:
        return "left"
    steps = sorted({step for _, step in saved.values()})
    folders = sorted({folder for folder, _ in saved.values()})
    return f"left after saving the training state at step {','.join(map(str, steps))} to {', '.join(folders)}"


@dataclasses.dataclass
class LiveWorkers:
    """What live-mode workers told the launcher, by local rank."""

    hello: set[int] = dataclasses.field(default_factory=set)
    idle: set[int] = dataclasses.field(default_factory=set)
    left: set[int] = dataclasses.field(default_factory=set)
    # Where each worker that left as the state's last holder wrote it, and at which step.
    saved: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    formed: dict[int, int] = dataclasses.field(default_factory=dict)
    # (generation, GenerationPhase) reports already sent: STARTED (a joiner's workers ready),
    # RECONFIGURED, FIRST_STEP; each goes once.
    reported: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # A joiner reports its workers ready (GENERATION_PHASE_STARTED) once all said hello.
    ready_generation: int = 0
    stop_deadline: float | None = None
    # Each worker's last beat: (when, waiting in a collective, samples trained so far,
    # the last committed step's loss or None).
    beats: dict[int, tuple[float, bool, int, float | None]] = dataclasses.field(default_factory=dict)
    # Each worker's process (state, CPU time) when its last beat arrived, or at the first
    # look once it fell silent: a silent worker that used CPU since is slow, not frozen.
    beat_samples: dict[int, ProcessSample] = dataclasses.field(default_factory=dict)
    # Workers found silent but busy in their current silent spell (logged once a spell).
    slow: set[int] = dataclasses.field(default_factory=set)
    # Other processes in each worker's process group, found at its first silent look.
    group_members: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Workers the launcher killed for falling silent: local rank -> why.
    silenced: dict[int, str] = dataclasses.field(default_factory=dict)
    # Workers that committed the job's last step (said "finished"): training is over for
    # them, and their exit or silence is no failure.
    finished: set[int] = dataclasses.field(default_factory=set)


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
    # After SIGTERM: how long to wait for the controller's Leave before leaving alone.
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


class Agent:
    def __init__(self, options: LauncherOptions) -> None:
        self.options = options
        self.state = AgentState.CONNECTING
        self.events: asyncio.Queue[AgentEvent] = asyncio.Queue()
        self.generation = 0
        self.workers: WorkerGroup | None = None
        self.registered: launcher_pb2.Registered | None = None
        self.exit_code = EXIT_OK
        self.exit_reason = ""
        self.pending_start: launcher_pb2.StartGeneration | None = None
        self.failed_self = False
        self.leave_requested_at: float | None = None
        self.started_at = time.monotonic()
        self.heartbeat_sequence = 0
        # When the silence of the workers was last judged (monotonic; 0: never).
        self.last_silence_look_at = 0.0
        self.last_heartbeat_at = 0.0
        # Live mode: workers started ahead of any world, waiting to be named in one.
        self.standby = False
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"tidal-{options.unit_id}-"))
        # The store the next generation hosted here meets at (its port is what this unit
        # reports), and in restart mode the one the running generation's ranks use.
        self.store: ServedStore | None = None
        self.store_port = 0
        self.serving_store: ServedStore | None = None
        # Restart mode: the workers stop because a StartGeneration replaced their generation (its
        # STARTED is the one acknowledgment; no STOPPED is reported).
        self.stopping_for_start = False
        self.live = LiveWorkers()
        self.channel = LauncherChannel(self.run_dir / "control.sock", post=self.events.put_nowait)
        self.log = log.bind(job=options.job_id, unit=options.unit_id)
        self.link = ControllerLink(options.controller, register=self._register_message, post=self.events.put_nowait,
                                   tls_ca=options.tls_ca)
        self.link_task: asyncio.Task[None] | None = None
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

    def _new_store(self) -> None:
        """A fresh rendezvous store for the next generation hosted here, listening on this
        unit's address only (`ServedStore`: the port at once, the server once torch is
        imported, which does not hold up the registration). Live mode serves one
        for the launcher's life: its workers meet under a prefix per generation (`gen/<n>`).
        Restart mode needs a fresh one per generation, as under torchrun: an unmodified
        script's env:// rendezvous writes the same keys in every generation and cannot be
        given a prefix. So once a generation starts on this unit's store, a spare is made at
        once and its port reported with STARTED: the controller can plan the next
        generation and send it in one message, without a stop round first."""
        self.store = None
        self.store = ServedStore(self.options.address)
        self.store_port = self.store.port

    def _register_message(self) -> launcher_pb2.Register:
        running = self.workers is not None and not self.workers.all_exited
        followers = [w.pid for workers in self.node_progress.values() for w in workers]
        return launcher_pb2.Register(
            job_id=self.options.job_id, unit_id=self.options.unit_id, secret=self.options.secret,
            nodes=list(self.options.nodes), address=self.options.address,
            slurm_job_id=self.options.slurm_job_id, last_generation=self.generation,
            worker_pids=(self.workers.pids if running and self.workers else []) + followers,
            store_port=self.store_port)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.events.put_nowait, SignalReceived(signum))
        try:
            self._new_store()
        except OSError as error:
            self.log.error("store_not_served", address=self.options.address, error=str(error))
            print(f"tidal-launcher: cannot serve the rendezvous store on {self.options.address}: {error} "
                  "(--address must be an address of this node)", file=sys.stderr)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return EXIT_USAGE
        await self.channel.start()
        if self.hub is None:
            self._open_link()
        else:
            # The unit registers once every node is there: the controller then sees whole
            # replicas only.
            await self.hub.start()
        ticker = asyncio.create_task(self._tick_forever(), name="ticker")
        self.log.info("launcher_started", controller=self.options.controller, address=self.options.address,
                      store_port=self.store_port, pid=os.getpid(), nodes=list(self.options.nodes))
        try:
            while not self.state.is_final:
                event = await self.events.get()
                try:
                    self._handle(event)
                except Exception:
                    # A bug in one handler must not take the replica (and its workers) down.
                    self.log.exception("launcher_event_failed", event_type=type(event).__name__)
        finally:
            ticker.cancel()
            if self.workers is not None and not self.workers.all_exited:
                await self.workers.stop(grace_s=1.0,
                                        repeat_term_after_s=self._term_repeat_s)
            if self.hub is not None:
                await self.hub.close(self.exit_code, self.exit_reason)
            await self.channel.close()
            self.link.close()
            if self.link_task is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self.link_task, timeout=2.0)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            for store in (self.store, self.serving_store):
                if store is not None:
                    store.settle(STORE_SETTLE_S)
        self.log.info("launcher_exited", state=self.state.value, exit_code=self.exit_code, reason=self.exit_reason)
        return self.exit_code

    def _open_link(self) -> None:
        if self.link_task is None:
            self.link_task = asyncio.create_task(self.link.run(), name="link")

    async def _tick_forever(self) -> None:
        # Ticks come faster than heartbeats, so that a silent worker is found within a
        # quarter second of its timeout.
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self.events.put_nowait(Tick())

    # The one place transitions happen.

    def _handle(self, event: AgentEvent) -> None:
        match event:
            case LinkUp(registered):
                self._on_registered(registered)
            case LinkDown(error):
                self.log.warning("controller_lost", error=error, state=self.state.value)
            case LinkRefused(code, details):
                self._finish(AgentState.FAILED, EXIT_REFUSED, f"controller refused this launcher: {code.name}: "
                             f"{details}")
            case ControllerSaid(message):
                self._on_command(message)
            case WorkerExit(generation, worker, returncode):
                self._on_worker_exit(generation, worker, returncode)
            case WorkersStopped(generation):
                self._on_workers_stopped(generation)
            case SignalReceived(signum):
                self._on_signal(signum)
            case Tick():
                self._on_tick()
            case WorkerSaid(local_rank, said):
                self._on_worker_said(local_rank, said)
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
    def _term_repeat_s(self) -> float | None:
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
            self._finish(AgentState.FAILED, EXIT_REFUSED, "a unit spanning several nodes runs in restart mode only "
                         "(live mode is not supported there yet)")
            return
        if self.state is AgentState.CONNECTING:
            self.state = AgentState.WAITING
        self.log.info("registered", controller_generation=registered.current_generation, own_generation=self.generation,
                      state=self.state.value)
        if self.leave_requested_at is not None and self.state is not AgentState.LEAVING:
            self._request_leave()
        elif (self.options.prestart_workers and self.live_mode and self.state is AgentState.WAITING
              and self.workers is None):
            self._start_standby()

    def _start_standby(self) -> None:
        """Live mode: start the workers before any world names this unit; the library
        waits for the first world on the control channel (TIDAL_STANDBY=1)."""
        assert self.registered is not None
        procs = self.registered.procs_per_node or 1
        placeholder = launcher_pb2.StartGeneration(generation=0, rank_table=common_pb2.RankTable(
            world_size=procs, groups=1, assignments=[common_pb2.RankAssignment(
                unit_id=self.options.unit_id, nodes=list(self.options.nodes), group_rank=0, first_rank=0,
                procs_per_node=procs)]))
        self._start(placeholder, joining=True, standby=True)

    def _on_command(self, message: launcher_pb2.ControllerMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "start_generation":
            self._on_start_generation(message.start_generation)
        elif kind == "stop_generation":
            stop = message.stop_generation
            if stop.failed_unit_id == self.options.unit_id:
                self.failed_self = True
                self.link.close()
            if stop.generation < self.generation:
                self.log.info("stale_stop_ignored", stop_generation=stop.generation, generation=self.generation)
                return
            self.log.info("generation_stop_ordered", generation=stop.generation, reason=stop.reason)
            self.pending_start = None
            self.stopping_for_start = False
            if self.live.finished and not self.failed_self:
                # Training is over here (a rank committed the last step): the workers run the
                # script's own code and exit by themselves; nothing to stop.
                self.log.info("stop_after_finish_ignored", generation=stop.generation)
                return
            if self.live_workers_running and not self.failed_self and self.state is not AgentState.LEAVING:
                self._stop_live(stop.generation)
                return
            grace_s = stop.grace.ToNanoseconds() / 1e9 if stop.HasField("grace") else self.options.stop_grace_s
            if self.failed_self and self.live_mode:
                # Live mode: the survivors wait in a collective until this unit's workers
                # are gone (a hung rank must become a dead one), and nothing here is kept.
                grace_s = 0.0
            self._stop_workers(AgentState.STOPPING, grace_s)
        elif kind == "leave":
            leave = message.leave
            self.log.info("leave_ordered", generation=leave.generation, reason=leave.reason,
                          save_state=leave.save_state)
            if leave.save_state and self.live_workers_running and self.state is not AgentState.LEAVING:
                self._leave_saving_state()
            else:
                self._stop_workers(AgentState.LEAVING, self.options.stop_grace_s)
        elif kind == "reconfigure":
            self._on_reconfigure(message.reconfigure)

    def _on_start_generation(self, start: launcher_pb2.StartGeneration) -> None:
        if self.state is AgentState.LEAVING or self.state.is_final:
            return
        if self.live.finished:
            # Training is over here: no worker of this unit starts again.
            self.log.warning("start_after_finish_ignored", generation=start.generation)
            return
        if self.live_workers_running and self.state is not AgentState.STOPPING:
            # Live mode: the workers that stopped in-process (or wait on standby) join the
            # new world. One still training in an older generation (a failure is this one
            # message) is not stopped: a rank in a collective with the lost one sees it fail
            # and takes the new world; the others move at the end of the step, none of which
            # is lost; a rank still forming the older world gives it up for the newer one.
            self.standby = False
            self.generation = max(self.generation, start.generation)
            self._send_worlds(start.generation, start.rank_table, start.rendezvous, target_step=start.resume_step)
            self.state = AgentState.RUNNING
            self._report(start.generation, launcher_pb2.GENERATION_PHASE_STARTED, step=start.resume_step)
            return
        if self.workers is not None and not self.workers.all_exited:
            if self.workers.generation == start.generation:
                return
            # Restart mode: one message is the whole change; the old workers go first (with
            # the grace it names: short after a failure), then the new generation starts.
            self.pending_start = start
            self.stopping_for_start = True
            grace_s = (start.stop_grace.ToNanoseconds() / 1e9 if start.HasField("stop_grace")
                       else self.options.stop_grace_s)
            self._stop_workers(AgentState.STOPPING, grace_s)
            return
        if self.state is AgentState.STOPPING:
            self.pending_start = start
            return
        self._start(start)

    def _start(self, start: launcher_pb2.StartGeneration, joining: bool = False, standby: bool = False) -> None:
        assert self.registered is not None
        mine = next((a for a in start.rank_table.assignments if a.unit_id == self.options.unit_id), None)
        placement = node_placement(start, self.options.unit_id)
        if mine is None or placement is None:
            self.log.warning("not_in_rank_table", generation=start.generation)
            return
        serving = (self.store_port, self.serving_store.port if self.serving_store is not None else 0)
        if start.rendezvous.host_unit_id == self.options.unit_id and start.rendezvous.port not in serving:
            self.log.warning("rendezvous_port_mismatch", named=start.rendezvous.port, serving=self.store_port)
        progress = [self.run_dir / f"progress-{local}" for local in range(mine.procs_per_node)]
        errors = error_files(self.run_dir, start.generation, mine.procs_per_node)
        extra = dict(self.registered.environment)
        if self.live_mode:
            self.channel.reset()
            self.live = LiveWorkers(ready_generation=start.generation if joining else 0)
            extra.update({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": str(self.channel.path),
                          "TIDAL_JOINING": "1" if joining else "0", "TIDAL_STANDBY": "1" if standby else "0",
                          # The unit's workers form their own fixed group (HybridSharded's shard
                          # group) at this launcher's store, which lives as long as the unit;
                          # the name is new for every set of workers started.
                          "TIDAL_UNIT_STORE": f"{self.options.address}:{self.store_port}",
                          "TIDAL_UNIT_GROUP": f"{self.options.unit_id}/{start.generation}/{int(time.time() * 1000)}"})
        environments = [worker_environment(os.environ, extra, placement=placement,
                                           local_rank=local, job_id=self.options.job_id,
                                           unit_id=self.options.unit_id, progress_file=progress[local],
                                           error_file=errors[local])
                        for local in range(mine.procs_per_node)]
        generation = start.generation
        try:
            self.workers = start_workers(
                list(self.registered.command), environments, generation=generation, first_rank=mine.first_rank,
                working_dir=self.registered.working_dir, progress_files=progress, error_files=errors,
                on_exit=lambda worker, code: self.events.put_nowait(WorkerExit(generation, worker, code)))
        except OSError as error:
            self.log.error("workers_not_started", generation=generation, error=str(error))
            self.generation = generation
            self.link.send(launcher_pb2.LauncherMessage(worker_exited=launcher_pb2.WorkerExited(
                generation=generation, local_rank=0, pid=0, exit_code=127)))
            self.state = AgentState.WAITING
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
        self.state = AgentState.RUNNING
        if not self.live_mode and start.rendezvous.host_unit_id == self.options.unit_id:
            # This generation's ranks meet at the store it named: keep it for them, and make
            # a fresh one for the next generation hosted here.
            self.serving_store = self.store
            self._new_store()
        if not joining:
            self._report(generation, launcher_pb2.GENERATION_PHASE_STARTED, step=start.resume_step,
                         store_port=self.store_port)
        self.log.info("generation_started", generation=generation, rank=mine.first_rank,
                      world_size=placement.world_size, master=f"{placement.master_addr}:{placement.master_port}")

    def _stop_workers(self, next_state: AgentState, grace_s: float) -> None:
        """Move to STOPPING or LEAVING; WorkersStopped follows once every worker is gone."""
        if self.state is AgentState.LEAVING and next_state is AgentState.STOPPING:
            return
        already_stopping = self.state in (AgentState.STOPPING, AgentState.LEAVING)
        self.state = next_state
        group = self.workers
        generation = self.generation
        if self.hub is not None:
            self._stop_unit_workers(group, generation, grace_s)
            return
        if group is None or group.all_exited:
            if not already_stopping:
                self.events.put_nowait(WorkersStopped(generation))
            return
        if group.stopping:
            return

        repeat = self._term_repeat_s

        async def stop() -> None:
            await group.stop(grace_s, repeat_term_after_s=repeat)
            self.events.put_nowait(WorkersStopped(generation))

        asyncio.get_running_loop().create_task(stop())

    def _stop_unit_workers(self, group: WorkerGroup | None, generation: int, grace_s: float) -> None:
        """A multi-node unit: stop this node's workers and every follower's, together;
        WorkersStopped follows once all are gone (or their nodes lost)."""
        hub = self.hub
        assert hub is not None
        if self.stopping_nodes is not None and not self.stopping_nodes.done():
            return

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
        if self.state is AgentState.LEAVING:
            # The step the state was saved at, if it was (the job's committed step).
            report = launcher_pb2.GenerationReport(generation=self.generation, phase=launcher_pb2.GENERATION_PHASE_LEFT,
                                              detail=left_detail(self.live.saved),
                                              step=max((step for _, step in self.live.saved.values()), default=0))
            report.at.GetCurrentTime()
            self.link.send(launcher_pb2.LauncherMessage(generation_report=report))
            self._finish(AgentState.SUCCEEDED, EXIT_OK, "left the job")
            return
        if self.failed_self:
            self._finish(AgentState.FAILED, EXIT_UNIT_FAILED, "the controller declared this unit failed")
            return
        self.live.stop_deadline = None
        self.state = AgentState.WAITING
        replaced, self.stopping_for_start = self.stopping_for_start, False
        if not replaced:
            self._report(self.generation, launcher_pb2.GENERATION_PHASE_STOPPED, store_port=self.store_port)
        if self.pending_start is not None:
            start, self.pending_start = self.pending_start, None
            self._start(start)

    def _on_worker_exit(self, generation: int, worker: Worker, returncode: int) -> None:
        group = self.workers
        if group is None or group.generation != generation or group.stopping:
            return
        exit_code, signum = exit_status(returncode)
        if self.live_mode and returncode == 0 and (worker.local_rank in self.live.left
                                                   or self.state is AgentState.LEAVING):
            # Left the world after its last step, as the controller asked.
            if group.all_exited and self.state is AgentState.LEAVING:
                self.events.put_nowait(WorkersStopped(generation))
            return
        if self.leave_requested_at is not None and signum == signal.SIGTERM:
            # Slurm signals the whole allocation; a worker ended by that SIGTERM is leaving too.
            self.log.info("worker_terminated_with_launcher", generation=generation, rank=worker.rank, pid=worker.pid)
            return
        error = read_worker_error(worker.error_file) if returncode != 0 else None
        self.log.info("worker_exited", generation=generation, rank=worker.rank, pid=worker.pid, exit_code=exit_code,
                      signal=signum, error=error.message if error is not None else None)
        exited = launcher_pb2.WorkerExited(generation=self.generation, local_rank=worker.local_rank, pid=worker.pid,
                                           exit_code=exit_code, signal=signum,
                                           detail=self.live.silenced.get(worker.local_rank, ""),
                                           error=error.message if error is not None else "",
                                           traceback=error.traceback if error is not None else "")
        exited.exited_at.GetCurrentTime()
        self.link.send(launcher_pb2.LauncherMessage(worker_exited=exited))
        if self.live_mode and self.state is AgentState.STOPPING:
            self._maybe_live_stopped()
        if self.live.finished and group.all_exited:
            # Training is over and every worker of this unit has exited: the unit is done,
            # whether or not the controller is there to say so.
            self._report(self.generation, launcher_pb2.GENERATION_PHASE_LEFT,
                         detail="training finished; every worker exited")
            self._finish(AgentState.SUCCEEDED, EXIT_OK, "training finished")

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.leave_requested_at is not None or self.state in (AgentState.LEAVING, AgentState.CONNECTING):
            self.log.warning("leaving_now", signal=name)
            self._stop_workers(AgentState.LEAVING, 1.0)
            return
        self.log.info("leave_requested", signal=name)
        self.leave_requested_at = time.monotonic()
        if self.link.connected:
            self._request_leave()
        else:
            self._stop_workers(AgentState.LEAVING, self.options.stop_grace_s)

    def _request_leave(self) -> None:
        request = launcher_pb2.LeaveRequest(generation=self.generation, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED,
                                            detail="SIGTERM")
        self.link.send(launcher_pb2.LauncherMessage(leave_request=request))

    def _on_tick(self) -> None:
        now = time.monotonic()
        failed = next((store for store in (self.store, self.serving_store) if store is not None and store.failed), None)
        if failed is not None:
            self.log.error("store_not_served", address=self.options.address, port=failed.port, error=failed.error)
            self._finish(AgentState.FAILED, EXIT_UNIT_FAILED,
                         f"cannot serve the rendezvous store on {self.options.address}:{failed.port}: {failed.error}")
            return
        if self.state is AgentState.CONNECTING and now - self.started_at > self.options.connect_timeout_s:
            self._finish(AgentState.FAILED, EXIT_UNREACHABLE,
                         f"not registered within {self.options.connect_timeout_s:g} s")
            return
        if (self.live.stop_deadline is not None and now > self.live.stop_deadline and self.workers is not None
                and {w.local_rank for w in self.workers.workers if not w.exited.done()} <= self.live.finished):
            # Past the last step, a worker runs the script's own code (saving the model):
            # no stop or leave deadline cuts that short.
            self.live.stop_deadline = None
        if self.live.stop_deadline is not None and now > self.live.stop_deadline:
            self.log.warning("live_stop_timed_out", generation=self.generation, idle=sorted(self.live.idle))
            self.live.stop_deadline = None
            self._stop_workers(self.state if self.state is AgentState.LEAVING else AgentState.STOPPING,
                               self.options.stop_grace_s)
        if (self.leave_requested_at is not None and self.state is not AgentState.LEAVING
                and now - self.leave_requested_at > self.options.leave_timeout_s):
            self.log.warning("leaving_without_controller", waited_s=self.options.leave_timeout_s)
            self._stop_workers(AgentState.LEAVING, self.options.stop_grace_s)
        self._kill_silent_workers()
        interval = (self.registered.heartbeat_interval.ToNanoseconds() / 1e9 if self.registered is not None else 1.0)
        if self.link.connected and now - self.last_heartbeat_at >= max(0.05, interval) - TICK_INTERVAL_S / 2:
            self.last_heartbeat_at = now
            self.link.send(launcher_pb2.LauncherMessage(heartbeat=self._heartbeat()), reliable=False)

    def _kill_silent_workers(self) -> None:
        """Live mode: judge each worker whose beats stopped for longer than the silence
        limit (the controller's, else this launcher's option) and SIGKILL it only if it is
        frozen: stopped, or no CPU time through the silence (`liveness.silence_verdict`).
        Its exit then goes the usual way (WorkerExited, the controller stops the generation),
        with the reason attached. A slow worker (busy, or starved of CPU) is logged once
        per silent spell and left to the controller's progress timeout; a worker that said
        `finished` is never judged."""
        limit_s = self.options.worker_silence_timeout_s
        if self.registered is not None and self.registered.worker_silence_timeout.ToNanoseconds() > 0:
            limit_s = self.registered.worker_silence_timeout.ToNanoseconds() / 1e9
        group = self.workers
        if not self.live_mode or limit_s <= 0 or group is None or group.stopping:
            return
        now = time.time()
        live = self.live
        looked_at, self.last_silence_look_at = self.last_silence_look_at, time.monotonic()
        if looked_at and self.last_silence_look_at - looked_at > limit_s:
            # This launcher itself was held up (a stalled event loop, the unit suspended):
            # its workers' beats waited unread, so their silence says nothing yet. Judge
            # from fresh samples at the next look.
            live.beat_samples.clear()
            return
        for worker in group.workers:
            local_rank = worker.local_rank
            last = live.beats.get(local_rank)
            if (worker.exited.done() or last is None or local_rank in live.silenced
                    or local_rank in live.finished):
                continue
            silent_s = now - last[0]
            if silent_s <= limit_s:
                continue
            if local_rank not in live.group_members:
                # At its first silent look: what else runs in its process group (a wrapper's child).
                live.group_members[local_rank] = group_members(worker.pid)
            sample = read_group_sample(worker.pid, live.group_members[local_rank])
            reference = live.beat_samples.get(local_rank)
            if reference is None and sample is not None:
                # No sample from its last beat: this first silent look is the reference.
                live.beat_samples[local_rank] = sample
            verdict = silence_verdict(silent_s=silent_s, limit_s=limit_s, sample_at_last_beat=reference,
                                      sample_now=sample)
            if verdict.silence is Silence.FROZEN:
                detail = f"{verdict.reason}; killed by its launcher"
                live.silenced[local_rank] = detail
                self.log.warning("worker_frozen", rank=worker.rank, pid=worker.pid, silent_s=round(silent_s, 3),
                                 reason=verdict.reason)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
            elif verdict.silence is Silence.SLOW:
                if sample is not None and reference is not None and sample.cpu_s > reference.cpu_s:
                    # The reference slides with the CPU time: a worker that was busy and then
                    # stops using any is judged frozen one limit later, not never.
                    live.beat_samples[local_rank] = sample
                if local_rank not in live.slow:
                    live.slow.add(local_rank)
                    self.log.warning("worker_slow", rank=worker.rank, pid=worker.pid, silent_s=round(silent_s, 3),
                                     reason=verdict.reason)

    def _heartbeat(self) -> launcher_pb2.Heartbeat:
        self.heartbeat_sequence += 1
        beat = launcher_pb2.Heartbeat(sequence=self.heartbeat_sequence)
        beat.sent_at.GetCurrentTime()
        if self.workers is not None:
            for worker in self.workers.workers:
                if worker.exited.done():
                    continue
                entry = launcher_pb2.WorkerProgress(local_rank=worker.local_rank, rank=worker.rank, pid=worker.pid)
                progress = read_progress(worker.progress_file)
                if progress is not None:
                    entry.step = progress.step
                    entry.progress_time.FromNanoseconds(int(progress.at * 1e9))
                last_beat = self.live.beats.get(worker.local_rank)
                if last_beat is not None:
                    entry.beat_time.FromNanoseconds(int(last_beat[0] * 1e9))
                    entry.waiting = last_beat[1]
                    entry.samples = last_beat[2]
                    if last_beat[3] is not None:
                        entry.loss = last_beat[3]
                beat.workers.append(entry)
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
        if self.hub.complete and self.state is AgentState.CONNECTING:
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
        self.link.send(launcher_pb2.LauncherMessage(worker_exited=forwarded))

    def _on_follower_lost(self, index: int, node: str, reason: str) -> None:
        """A node of the unit is gone, and the replica with it: say so as a worker exit of
        the unit (the controller drops the replica, cancels its Slurm job and cools the
        nodes down), stop this node's workers and exit non-zero."""
        self.node_progress.pop(index, None)
        if self.state.is_final or self.state is AgentState.LEAVING:
            return
        what = f"node {node} lost: {reason}"
        self.log.warning("node_lost", node=node, node_index=index, reason=reason, state=self.state.value)
        if self.state is AgentState.CONNECTING:
            self._finish(AgentState.FAILED, EXIT_UNIT_FAILED, f"{what} (before the unit registered)")
            return
        per_node = self.registered.procs_per_node if self.registered is not None else 0
        exited = launcher_pb2.WorkerExited(generation=self.generation, local_rank=index * per_node, pid=0,
                                           signal=signal.SIGKILL, detail=what)
        exited.exited_at.GetCurrentTime()
        self.link.send(launcher_pb2.LauncherMessage(worker_exited=exited))
        self.failed_self = True
        self._stop_workers(AgentState.STOPPING, 1.0)

    # Live mode.

    def _report(self, generation: int, phase: launcher_pb2.GenerationPhase, step: int = 0, store_port: int = 0,
                detail: str = "") -> None:
        report = launcher_pb2.GenerationReport(generation=generation, phase=phase, step=step, store_port=store_port,
                                          detail=detail)
        report.at.GetCurrentTime()
        self.link.send(launcher_pb2.LauncherMessage(generation_report=report))

    def _report_once(self, generation: int, phase: launcher_pb2.GenerationPhase, step: int = 0,
                     detail: str = "") -> None:
        if (generation, phase) not in self.live.reported:
            self.live.reported.add((generation, phase))
            self._report(generation, phase, step=step, detail=detail)

    def _send_worlds(self, generation: int, table: common_pb2.RankTable, rendezvous: common_pb2.Rendezvous,
                     joining: bool = False, target_step: int = 0) -> None:
        """Name generation `generation`'s world to each worker (rank -1: leave after the agreed step)."""
        assert self.workers is not None
        mine = next((a for a in table.assignments if a.unit_id == self.options.unit_id), None)
        self.generation = generation
        for worker in self.workers.workers:
            rank = mine.first_rank + worker.local_rank if mine is not None else -1
            if rank >= 0:
                worker.rank = rank
            self.live.idle.discard(worker.local_rank)
            self.channel.send(worker.local_rank, World(
                generation=generation, rank=rank, world_size=table.world_size, master_addr=rendezvous.host,
                master_port=rendezvous.port, joining=joining, target_step=target_step))
        if mine is None:
            self.state = AgentState.LEAVING
            self.live.stop_deadline = time.monotonic() + self.options.leave_timeout_s
        self.log.info("world_sent", generation=generation, in_world=mine is not None, world_size=table.world_size)

    def _leave_saving_state(self) -> None:
        """This unit holds the job's last copy of the training state: its workers write it
        to disk after the step they agree on, then leave (a world they are not in, marked
        `save`). Past the leave timeout they are stopped like any leaving worker."""
        assert self.workers is not None
        for worker in self.workers.workers:
            self.live.idle.discard(worker.local_rank)
            # A generation after any they know, never formed: it only says "leave".
            self.channel.send(worker.local_rank, World(generation=self.generation + 1, rank=-1, world_size=0,
                                                       master_addr="", master_port=0, save=True))
        self.state = AgentState.LEAVING
        self.live.stop_deadline = time.monotonic() + self.options.leave_timeout_s
        self.log.info("leaving_with_state", generation=self.generation)

    def _on_reconfigure(self, reconfigure: launcher_pb2.Reconfigure) -> None:
        if (self.state.is_final or self.state is AgentState.LEAVING
                or (reconfigure.generation <= self.generation and self.workers is not None)):
            return
        if self.live.finished:
            self.log.warning("reconfigure_after_finish_ignored", generation=reconfigure.generation)
            return
        if self.live_workers_running and self.standby:
            # A joiner whose workers wait on standby: ready as soon as all said hello.
            self.standby = False
            self.generation = reconfigure.generation
            self.state = AgentState.RUNNING
            self.live.ready_generation = reconfigure.generation
            self._send_worlds(reconfigure.generation, reconfigure.rank_table, reconfigure.rendezvous, joining=True,
                              target_step=reconfigure.target_step)
            if self.workers is not None and self.live.hello >= {w.local_rank for w in self.workers.workers}:
                self._report_once(reconfigure.generation, launcher_pb2.GENERATION_PHASE_STARTED,
                                  detail="workers ready to join (started ahead)")
            return
        if self.live_workers_running:
            self._send_worlds(reconfigure.generation, reconfigure.rank_table, reconfigure.rendezvous,
                              target_step=reconfigure.target_step)
            return
        if self.state in (AgentState.WAITING, AgentState.CONNECTING):
            # A joiner: start the workers; they wait at the new world's rendezvous.
            self._start(launcher_pb2.StartGeneration(generation=reconfigure.generation,
                                                     rank_table=reconfigure.rank_table,
                                                rendezvous=reconfigure.rendezvous,
                                                resume_step=reconfigure.target_step), joining=True)

    def _stop_live(self, generation: int) -> None:
        """Live mode: the workers abandon the step in flight and wait, in-process."""
        assert self.workers is not None
        self.state = AgentState.STOPPING
        self.generation = max(self.generation, generation)
        self.live.stop_deadline = time.monotonic() + self.options.stop_grace_s
        for worker in self.workers.workers:
            self.channel.send(worker.local_rank, Stop(generation=generation))
        self._maybe_live_stopped()

    def _maybe_live_stopped(self) -> None:
        group = self.workers
        if group is None or self.state is not AgentState.STOPPING or self.live.stop_deadline is None:
            return
        alive = {w.local_rank for w in group.workers if not w.exited.done()}
        # A worker that never formed a world (a joiner still starting, or waiting on
        # standby) is in no process group and holds no state: nothing to stop. It reads the
        # next world when it gets to it; killing it would only cost another start.
        never_formed = alive - set(self.live.formed)
        if alive <= self.live.idle | never_formed | self.live.finished:
            self.live.stop_deadline = None
            self.events.put_nowait(WorkersStopped(self.generation))

    def _on_worker_said(self, local_rank: int, said: WorkerToLauncher) -> None:
        live = self.live
        group = self.workers
        if group is None:
            return
        everyone = {w.local_rank for w in group.workers}
        match said:
            case Hello():
                live.hello.add(local_rank)
                if live.ready_generation and live.hello >= everyone:
                    self._report_once(live.ready_generation, launcher_pb2.GENERATION_PHASE_STARTED,
                                      detail="workers ready to join")
            case Formed(generation=generation, step=step):
                live.formed[local_rank] = generation
                live.idle.discard(local_rank)
                if all(live.formed.get(r) == generation for r in everyone):
                    self._report_once(generation, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=step)
            case FirstStep(generation=generation, step=step):
                self._report_once(generation, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=step)
            case Stopped():
                live.idle.add(local_rank)
                self._maybe_live_stopped()
            case Left(step=step, saved_to=saved_to):
                live.left.add(local_rank)
                if saved_to:
                    live.saved[local_rank] = (saved_to, step)
            case Finished(generation=generation, step=step):
                live.finished.add(local_rank)
                self._report_once(generation, launcher_pb2.GENERATION_PHASE_FINISHED, step=step,
                                  detail="committed the last step")
                self._maybe_live_stopped()
            case Resumed(generation=generation, step=step, detail=detail):
                self._report_once(generation, launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT, step=step,
                                  detail=detail)
            case StateLost(generation=generation, target_step=target_step, detail=detail):
                self._report_once(generation, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=target_step, detail=detail)
            case Beat(samples=samples, waiting=waiting, loss=loss):
                live.beats[local_rank] = (time.time(), waiting, max(0, samples), loss)
                live.slow.discard(local_rank)
                beating = next((w for w in group.workers if w.local_rank == local_rank), None)
                # The CPU reference only (one /proc read per process, no thread scan): this
                # runs twice a second per worker.
                sample = (read_group_sample(beating.pid, live.group_members.get(local_rank, ()), threads=False)
                          if beating is not None else None)
                if sample is not None:
                    live.beat_samples[local_rank] = sample
                else:
                    live.beat_samples.pop(local_rank, None)

    def _finish(self, state: AgentState, exit_code: int, reason: str) -> None:
        self.state = state
        self.exit_code = exit_code
        self.exit_reason = reason


def read_secret(secret_file: str | None) -> str:
    """The job's secret: from --secret-file / $TIDAL_SECRET_FILE, else $TIDAL_JOB_SECRET."""
    path = secret_file or os.environ.get("TIDAL_SECRET_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("TIDAL_JOB_SECRET", "").strip()


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="tidal-launcher", description="Tidal's per-unit agent. The job's secret comes from --secret-file, "
        "$TIDAL_SECRET_FILE or $TIDAL_JOB_SECRET, never from the command line.")
    parser.add_argument("--controller", default=env("TIDAL_CONTROLLER"), help="host:port ($TIDAL_CONTROLLER)")
    parser.add_argument("--job", default=env("TIDAL_JOB_ID"), help="job id ($TIDAL_JOB_ID)")
    parser.add_argument("--unit", default=env("TIDAL_UNIT_ID"),
                        help="unit id ($TIDAL_UNIT_ID; default <host>-<Slurm job id or pid>)")
    parser.add_argument("--secret-file", default=None, help="file holding the job's secret ($TIDAL_SECRET_FILE)")
    parser.add_argument("--address", default=env("TIDAL_ADDRESS"),
                        help="address other nodes reach this one at ($TIDAL_ADDRESS; default the host name)")
    parser.add_argument("--tls-ca", type=Path, default=env("TIDAL_TLS_CA"),
                        help="CA certificate to verify the controller's TLS ($TIDAL_TLS_CA)")
    parser.add_argument("--leave-timeout", type=float, default=20.0,
                        help="seconds after SIGTERM to wait for the controller before leaving alone")
    parser.add_argument("--connect-timeout", type=float, default=600.0,
                        help="give up when not registered after this many seconds")
    parser.add_argument("--stop-grace", type=float, default=10.0, help="SIGTERM-to-SIGKILL grace for workers")
    parser.add_argument("--no-prestart", action="store_true",
                        help="live mode: start workers only once a world names this unit")
    parser.add_argument("--unit-nodes", type=int, default=int(env("TIDAL_UNIT_NODES") or 1),
                        help="nodes the unit spans ($TIDAL_UNIT_NODES): with more than one, srun starts one "
                        "launcher per node; the one on SLURM_NODEID 0 leads, the others follow it")
    parser.add_argument("--node-port-base", type=int, default=int(env("TIDAL_NODE_PORT_BASE") or DEFAULT_PORT_BASE),
                        help="multi-node units: the leader serves its followers on a port from this base "
                        "(derived from SLURM_JOB_ID, the first free of a few) ($TIDAL_NODE_PORT_BASE)")
    parser.add_argument("--node-timeout", type=float, default=10.0,
                        help="multi-node units: a node silent this many seconds is lost, and the replica with it")
    parser.add_argument("--worker-silence-timeout", type=float, default=2.0,
                        help="live mode: a worker whose beats stopped this many seconds ago is killed if it is "
                        "frozen (stopped, or no CPU time since), never if it is busy; a limit the controller "
                        "sends wins (0: never, unless the controller sends one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    missing = [name for name in ("controller", "job") if not getattr(args, name)]
    if missing:
        print(f"tidal-launcher: missing --{' and --'.join(missing)} (or their TIDAL_* variables)", file=sys.stderr)
        return EXIT_USAGE
    try:
        secret = read_secret(args.secret_file)
    except OSError as error:
        print(f"tidal-launcher: cannot read the job's secret: {error}", file=sys.stderr)
        return EXIT_USAGE
    if not secret:
        print("tidal-launcher: no job secret (set --secret-file, $TIDAL_SECRET_FILE or $TIDAL_JOB_SECRET)",
              file=sys.stderr)
        return EXIT_USAGE
    host = socket.gethostname()
    slurm_job_id = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    nodename = os.environ.get("SLURMD_NODENAME", host)
    layout: UnitNodes | None = None
    if args.unit_nodes > 1:
        try:
            layout = unit_nodes(os.environ, args.unit_nodes, args.node_port_base)
        except ValueError as error:
            print(f"tidal-launcher: {error}", file=sys.stderr)
            return EXIT_USAGE
    unit_id = args.unit or f"{layout.nodes[0] if layout else nodename}-{slurm_job_id or os.getpid()}"
    if layout is not None and not layout.is_leader:
        return asyncio.run(Follower(FollowerOptions(
            job_id=args.job, unit_id=unit_id, secret=secret, layout=layout, slurm_job_id=slurm_job_id,
            connect_timeout_s=args.connect_timeout, node_timeout_s=args.node_timeout,
            stop_grace_s=args.stop_grace, leave_timeout_s=args.leave_timeout)).run())
    options = LauncherOptions(
        controller=args.controller, job_id=args.job, unit_id=unit_id,
        secret=secret, address=args.address or host, nodes=layout.nodes if layout else (nodename,),
        slurm_job_id=slurm_job_id, tls_ca=args.tls_ca, leave_timeout_s=args.leave_timeout,
        connect_timeout_s=args.connect_timeout, stop_grace_s=args.stop_grace,
        worker_silence_timeout_s=args.worker_silence_timeout, prestart_workers=not args.no_prestart,
        unit_nodes=layout, node_timeout_s=args.node_timeout)
    return asyncio.run(Agent(options).run())


if __name__ == "__main__":
    sys.exit(main())

