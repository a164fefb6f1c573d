"""The launcher on a follower node of a multi-node unit (SLURM_NODEID > 0).

It never talks to the controller: it connects to the unit's leader (`nodes`), starts its
node's workers when the leader relays a generation, stops them when the leader says so,
and reports their progress and exits. Losing the leader loses the replica: the follower
kills its workers and exits non-zero.

One state machine (`FollowerState`) and one loop (`Follower.run`) over one event queue,
as in the leader's agent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import structlog

from tidal.launcher.events import SignalReceived, Tick, WorkerExit, WorkersStopped
from tidal.launcher.nodes import LeaderRefused, UnitNodes, connect_to_leader, node_placement, read_frame
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
from tidal.proto import launcher_pb2

log = structlog.get_logger("tidal.launcher.follower")

EXIT_OK = 0
EXIT_UNIT_FAILED = 1
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
TICK_INTERVAL_S = 0.25
REPORT_INTERVAL_S = 1.0


class FollowerState(enum.StrEnum):
    """CONNECTING: looking for the leader. IDLE: admitted, no workers. RUNNING: the
    workers of `generation` run. STOPPING: stopping them (a stop, or before a new
    generation). SUCCEEDED, FAILED: final; the process exits."""

    CONNECTING = "connecting"
    IDLE = "idle"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (FollowerState.SUCCEEDED, FollowerState.FAILED)


@dataclasses.dataclass(frozen=True)
class LeaderSaid:
    message: launcher_pb2.LeaderMessage


@dataclasses.dataclass(frozen=True)
class LeaderLost:
    reason: str


FollowerEvent = LeaderSaid | LeaderLost | WorkerExit | WorkersStopped | SignalReceived | Tick


@dataclasses.dataclass(frozen=True)
class FollowerOptions:
    job_id: str
    unit_id: str
    secret: str
    layout: UnitNodes
    slurm_job_id: int
    connect_timeout_s: float = 600.0
    # A leader silent this long is lost (it beats every second).
    node_timeout_s: float = 10.0
    stop_grace_s: float = 10.0
    # After SIGTERM: how long to wait for the leader to stop this node before leaving alone.
    leave_timeout_s: float = 20.0


class Follower:
    def __init__(self, options: FollowerOptions) -> None:
        self.options = options
        self.state = FollowerState.CONNECTING
        self.events: asyncio.Queue[FollowerEvent] = asyncio.Queue()
        self.workers: WorkerGroup | None = None
        self.generation = 0
        self.exit_code = EXIT_OK
        self.exit_reason = ""
        self.pending_start: launcher_pb2.NodeStart | None = None
        # The generation a stop was asked for, answered with NodeStopped once the workers are gone.
        self.stop_asked: int | None = None
        self.exit_after_stop: tuple[FollowerState, int, str] | None = None
        self.terminated_at: float | None = None
        self.last_heard = time.monotonic()
        self.last_report_at = 0.0
        self.writer: asyncio.StreamWriter | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"tidal-{options.unit_id}-node{options.layout.index}-"))
        self.log = log.bind(job=options.job_id, unit=options.unit_id, node=options.layout.node,
                            node_index=options.layout.index)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.events.put_nowait, SignalReceived(signum))
        options = self.options
        self.log.info("follower_started", leader=options.layout.leader_address, pid=os.getpid())
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                reader, self.writer = await connect_to_leader(
                    options.layout, job_id=options.job_id, unit_id=options.unit_id,
                    slurm_job_id=options.slurm_job_id, secret=options.secret, timeout_s=options.connect_timeout_s)
            except LeaderRefused as error:
                self._finish(FollowerState.FAILED, EXIT_REFUSED, str(error))
                return self.exit_code
            except TimeoutError as error:
                self._finish(FollowerState.FAILED, EXIT_UNREACHABLE, str(error))
                return self.exit_code
            self.state = FollowerState.IDLE
            self.last_heard = time.monotonic()
            self.log.info("follower_admitted")
            tasks = [loop.create_task(self._read_forever(reader)), loop.create_task(self._tick_forever())]
            while not self.state.is_final:
                event = await self.events.get()
                try:
                    self._handle(event)
                except Exception:
                    self.log.exception("follower_event_failed", event_type=type(event).__name__)
        finally:
            for task in tasks:
                task.cancel()
            if self.workers is not None and not self.workers.all_exited:
                await self.workers.stop(grace_s=1.0)
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.writer.drain(), timeout=2.0)
                self.writer.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.log.info("follower_exited", state=self.state.value, exit_code=self.exit_code, reason=self.exit_reason)
        return self.exit_code

    async def _read_forever(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader, launcher_pb2.LeaderMessage)
                self.events.put_nowait(LeaderSaid(message))
        except EOFError:
            self.events.put_nowait(LeaderLost("the leader's connection closed"))
        except (ValueError, OSError) as error:
            self.events.put_nowait(LeaderLost(f"the leader's connection failed: {error}"))

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self.events.put_nowait(Tick())

    def _send(self, message: launcher_pb2.FollowerMessage) -> None:
        if self.writer is None:
            return
        data = message.SerializeToString()
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.write(len(data).to_bytes(4, "big") + data)

    # The one place transitions happen.

    def _handle(self, event: FollowerEvent) -> None:
        match event:
            case LeaderSaid(message):
                self.last_heard = time.monotonic()
                self._on_leader(message)
            case LeaderLost(reason):
                self._on_leader_lost(reason)
            case WorkerExit(generation, worker, returncode):
                self._on_worker_exit(generation, worker, returncode)
            case WorkersStopped(generation):
                self._on_workers_stopped(generation)
            case SignalReceived(signum):
                self._on_signal(signum)
            case Tick():
                self._on_tick()

    def _on_leader(self, message: launcher_pb2.LeaderMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "start":
            if self._workers_running:
                # A new generation replaces the running one: the old workers go first.
                self.pending_start = message.start
                start = message.start.start
                grace_s = (start.stop_grace.ToNanoseconds() / 1e9 if start.HasField("stop_grace")
                           else self.options.stop_grace_s)
                self._stop(grace_s)
            elif self.state is FollowerState.STOPPING:
                self.pending_start = message.start
            else:
                self._start(message.start)
        elif kind == "stop":
            self.pending_start = None
            self.stop_asked = message.stop.generation
            self._stop(message.stop.grace.ToNanoseconds() / 1e9 if message.stop.HasField("grace")
                       else self.options.stop_grace_s)
        elif kind == "done":
            code = message.done.exit_code
            self.exit_after_stop = (FollowerState.SUCCEEDED if code == 0 else FollowerState.FAILED, code,
                                    f"the leader exited: {message.done.reason}")
            self.pending_start = None
            self._stop(self.options.stop_grace_s)

    @property
    def _workers_running(self) -> bool:
        return self.workers is not None and not self.workers.all_exited

    def _start(self, relayed: launcher_pb2.NodeStart) -> None:
        options = self.options
        start = relayed.start
        placement = node_placement(start, options.unit_id, options.layout.index)
        if placement is None:
            self.log.warning("not_in_rank_table", generation=start.generation)
            return
        registered = relayed.registered
        progress = [self.run_dir / f"progress-{local}" for local in range(placement.procs_per_node)]
        errors = error_files(self.run_dir, start.generation, placement.procs_per_node)
        environments = [worker_environment(os.environ, dict(registered.environment), placement=placement,
                                           local_rank=local, job_id=options.job_id, unit_id=options.unit_id,
                                           progress_file=progress[local], error_file=errors[local])
                        for local in range(placement.procs_per_node)]
        generation = start.generation
        self.generation = generation
        try:
            self.workers = start_workers(
                list(registered.command), environments, generation=generation, first_rank=placement.first_rank,
                working_dir=registered.working_dir, progress_files=progress, error_files=errors,
                on_exit=lambda worker, code: self.events.put_nowait(WorkerExit(generation, worker, code)))
        except OSError as error:
            self.log.error("workers_not_started", generation=generation, error=str(error))
            exited = launcher_pb2.WorkerExited(generation=generation, local_rank=0, pid=0, exit_code=127,
                                               detail=f"node {options.layout.node}: {error}")
            exited.exited_at.GetCurrentTime()
            self._send(launcher_pb2.FollowerMessage(worker_exited=exited))
            return
        self.state = FollowerState.RUNNING
        self.log.info("generation_started", generation=generation, first_rank=placement.first_rank,
                      world_size=placement.world_size, master=f"{placement.master_addr}:{placement.master_port}")

    def _stop(self, grace_s: float) -> None:
        group = self.workers
        generation = self.generation
        if group is None or group.all_exited:
            self.state = FollowerState.STOPPING
            self.events.put_nowait(WorkersStopped(generation))
            return
        if self.state is FollowerState.STOPPING and group.stopping:
            return
        self.state = FollowerState.STOPPING

        async def stop() -> None:
            await group.stop(grace_s)
            self.events.put_nowait(WorkersStopped(generation))

        asyncio.get_running_loop().create_task(stop())

    def _on_workers_stopped(self, generation: int) -> None:
        if self.state is not FollowerState.STOPPING:
            return
        if self._workers_running:
            return  # an older stop finished; the current one is still under way
        self.state = FollowerState.IDLE
        if self.stop_asked is not None:
            self._send(launcher_pb2.FollowerMessage(stopped=launcher_pb2.NodeStopped(generation=self.stop_asked)))
            self.stop_asked = None
        if self.exit_after_stop is not None:
            self._finish(*self.exit_after_stop)
            return
        if self.pending_start is not None:
            relayed, self.pending_start = self.pending_start, None
            self._start(relayed)

    def _on_worker_exit(self, generation: int, worker: Worker, returncode: int) -> None:
        group = self.workers
        if group is None or group.generation != generation or group.stopping:
            return
        exit_code, signum = exit_status(returncode)
        if self.terminated_at is not None and signum == signal.SIGTERM:
            # Slurm signals the whole allocation; a worker ended by that SIGTERM is leaving too.
            self.log.info("worker_terminated_with_launcher", generation=generation, rank=worker.rank, pid=worker.pid)
            return
        error = read_worker_error(worker.error_file) if returncode != 0 else None
        self.log.info("worker_exited", generation=generation, rank=worker.rank, pid=worker.pid, exit_code=exit_code,
                      signal=signum, error=error.message if error is not None else None)
        exited = launcher_pb2.WorkerExited(generation=generation, local_rank=worker.local_rank, pid=worker.pid,
                                           exit_code=exit_code, signal=signum,
                                           error=error.message if error is not None else "",
                                           traceback=error.traceback if error is not None else "")
        exited.exited_at.GetCurrentTime()
        self._send(launcher_pb2.FollowerMessage(worker_exited=exited))

    def _on_leader_lost(self, reason: str) -> None:
        if self.state.is_final:
            return
        if self.exit_after_stop is not None and self.exit_after_stop[1] == EXIT_OK:
            return  # the leader said it was done; its connection closing is expected
        self.log.warning("leader_lost", reason=reason)
        # Nothing to wait for: the replica is lost. `run` kills the workers on the way out.
        self._finish(FollowerState.FAILED, EXIT_UNIT_FAILED, f"lost the unit's leader: {reason}")

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.terminated_at is not None:
            self.log.warning("leaving_now", signal=name)
            self.exit_after_stop = (FollowerState.SUCCEEDED, EXIT_OK, f"{name} twice")
            self._stop(1.0)
            return
        # The leader got the same signal and asks the controller to leave; it stops this
        # node's workers when the controller says so.
        self.log.info("leave_requested", signal=name)
        self.terminated_at = time.monotonic()

    def _on_tick(self) -> None:
        now = time.monotonic()
        if now - self.last_heard > self.options.node_timeout_s:
            self._on_leader_lost(f"silent for {now - self.last_heard:.1f} s")
            return
        if (self.terminated_at is not None and self.exit_after_stop is None
                and now - self.terminated_at > self.options.leave_timeout_s):
            self.log.warning("leaving_without_leader", waited_s=self.options.leave_timeout_s)
            self.exit_after_stop = (FollowerState.SUCCEEDED, EXIT_OK, "left after SIGTERM")
            self._stop(self.options.stop_grace_s)
        if now - self.last_report_at >= REPORT_INTERVAL_S:
            self.last_report_at = now
            self._send(launcher_pb2.FollowerMessage(report=self._report()))

    def _report(self) -> launcher_pb2.NodeReport:
        report = launcher_pb2.NodeReport()
        if self.workers is not None:
            for worker in self.workers.workers:
                if worker.exited.done():
                    continue
                entry = launcher_pb2.WorkerProgress(local_rank=worker.local_rank, rank=worker.rank, pid=worker.pid)
                progress = read_progress(worker.progress_file)
                if progress is not None:
                    entry.step = progress.step
                    entry.progress_time.FromNanoseconds(int(progress.at * 1e9))
                report.workers.append(entry)
        return report

    def _finish(self, state: FollowerState, exit_code: int, reason: str) -> None:
        self.state = state
        self.exit_code = exit_code
        self.exit_reason = reason

