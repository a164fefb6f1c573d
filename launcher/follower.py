"""The launcher on a follower node of a multi-node unit (SLURM_NODEID > 0).

It never talks to the controller: it connects to the unit's leader (`nodes`), starts its
node's workers when the leader relays a generation, stops them when the leader says so,
and reports their progress and exits. Losing the leader loses the replica: the follower
kills its workers and exits non-zero.

Its loop, states, exit codes, workers and the decisions on a worker's exit, a signal and
a tick are every launcher's (`node.NodeAgent`); here is only what a follower adds: the
connection to its leader and what the leader says."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import structlog

from tidal.launcher import decisions
from tidal.launcher.events import SignalReceived
from tidal.launcher.lifecycle import EXIT_REFUSED, EXIT_UNIT_FAILED, EXIT_UNREACHABLE, LauncherState
from tidal.launcher.liveness import Now, Observations, Watched
from tidal.launcher.node import NodeAgent
from tidal.launcher.nodes import LeaderRefused, UnitNodes, connect_to_leader, node_placement, read_frame
from tidal.launcher.rundirs import make_run_dir
from tidal.proto import launcher_pb2

log = structlog.get_logger("tidal.launcher.follower")

REPORT_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class LeaderSaid:
    message: launcher_pb2.LeaderMessage


@dataclasses.dataclass(frozen=True)
class LeaderLost:
    reason: str


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


class Follower(NodeAgent[FollowerOptions]):
    exited_event = "follower_exited"
    event_failed_event = "follower_event_failed"

    def __init__(self, options: FollowerOptions) -> None:
        super().__init__(
            options, run_dir=make_run_dir(f"{options.unit_id}-node{options.layout.index}"),
            log=log.bind(job=options.job_id, unit=options.unit_id, node=options.layout.node,
                         node_index=options.layout.index))
        self.pending_start: launcher_pb2.NodeStart | None = None
        # The generation a stop was asked for, answered with NodeStopped once the workers are gone.
        self.stop_asked: int | None = None
        # How the follower exits once its workers are gone (LEAVING).
        self.exit_after_stop: tuple[LauncherState, int, str] | None = None
        self.last_heard = time.monotonic()
        self.last_report_at = 0.0
        self.writer: asyncio.StreamWriter | None = None
        self.reader_task: asyncio.Task[None] | None = None

    async def _open(self) -> bool:
        options = self.options
        self.log.info("follower_started", leader=options.layout.leader_address, pid=os.getpid())
        connecting = asyncio.ensure_future(connect_to_leader(
            options.layout, job_id=options.job_id, unit_id=options.unit_id,
            slurm_job_id=options.slurm_job_id, secret=options.secret, timeout_s=options.connect_timeout_s))
        # SIGTERM or SIGINT (scancel, ^C, a leader that died before this node reached it
        # and srun ending the step) ends the wait: it went on for the whole connect timeout.
        signalled = asyncio.ensure_future(self.events.get())
        await asyncio.wait((connecting, signalled), return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            event = signalled.result()
            while not connecting.done():
                # (Again until it ends: Python 3.11's wait_for swallows a cancel that comes
                # as its inner connect completes, and the attempts went on to the timeout.)
                connecting.cancel()
                await asyncio.wait((connecting,), timeout=0.1)
            with contextlib.suppress(BaseException):
                connecting.result()
            name = signal.Signals(event.signum).name if isinstance(event, SignalReceived) else type(event).__name__
            self.finish(LauncherState.FAILED, EXIT_UNREACHABLE, f"{name} while connecting to the unit's leader")
            return False
        if signalled.done():
            self.events.put_nowait(signalled.result())  # (it came with the connection: handled next)
        else:
            signalled.cancel()
        try:
            reader, self.writer = connecting.result()
        except LeaderRefused as error:
            self.finish(LauncherState.FAILED, EXIT_REFUSED, str(error))
            return False
        except TimeoutError as error:
            self.finish(LauncherState.FAILED, EXIT_UNREACHABLE, str(error))
            return False
        self.state = LauncherState.WAITING
        self.last_heard = time.monotonic()
        self.log.info("follower_admitted")
        self.reader_task = asyncio.get_running_loop().create_task(self._read_forever(reader))
        return True

    async def _close(self) -> None:
        if self.reader_task is not None:
            self.reader_task.cancel()
        if self.writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.drain(), timeout=2.0)
            self.writer.close()

    async def _read_forever(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader, launcher_pb2.LeaderMessage)
                self.events.put_nowait(LeaderSaid(message))
        except EOFError:
            self.events.put_nowait(LeaderLost("the leader's connection closed"))
        except (ValueError, OSError) as error:
            self.events.put_nowait(LeaderLost(f"the leader's connection failed: {error}"))

    def _send(self, message: launcher_pb2.FollowerMessage) -> None:
        if self.writer is None:
            return
        data = message.SerializeToString()
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.write(len(data).to_bytes(4, "big") + data)

    # Events only a follower gets: its leader's.

    def _on_event(self, event: object) -> None:
        match event:
            case LeaderSaid(message):
                self.last_heard = time.monotonic()
                self._on_leader(message)
            case LeaderLost(reason):
                self._on_leader_lost(reason)

    def _on_leader(self, message: launcher_pb2.LeaderMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "start":
            if self._workers_running:
                # A new generation replaces the running one: the old workers go first.
                self.pending_start = message.start
                start = message.start.start
                grace_s = (start.stop_grace.ToNanoseconds() / 1e9 if start.HasField("stop_grace")
                           else self.options.stop_grace_s)
                self.stop_workers(LauncherState.STOPPING, grace_s)
            elif self.state in (LauncherState.STOPPING, LauncherState.LEAVING):
                self.pending_start = message.start
            else:
                self._start(message.start)
        elif kind == "stop":
            self.pending_start = None
            self.stop_asked = message.stop.generation
            self.stop_workers(LauncherState.STOPPING,
                              message.stop.grace.ToNanoseconds() / 1e9 if message.stop.HasField("grace")
                              else self.options.stop_grace_s)
        elif kind == "done":
            code = message.done.exit_code
            self.exit_after_stop = (LauncherState.SUCCEEDED if code == 0 else LauncherState.FAILED, code,
                                    f"the leader exited: {message.done.reason}")
            self.pending_start = None
            self.stop_workers(LauncherState.LEAVING, self.options.stop_grace_s)

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
        generation = start.generation
        self.generation = generation
        try:
            self.workers = self.start_group(placement, relayed.registered, dict(relayed.registered.environment))
        except OSError as error:
            self.log.error("workers_not_started", generation=generation, error=str(error))
            exited = launcher_pb2.WorkerExited(generation=generation, local_rank=0, pid=0, exit_code=127,
                                               detail=f"node {options.layout.node}: {error}")
            exited.exited_at.GetCurrentTime()
            self._send_up(exited)
            return
        self.state = LauncherState.RUNNING
        self.log.info("generation_started", generation=generation, first_rank=placement.first_rank,
                      world_size=placement.world_size, master=f"{placement.master_addr}:{placement.master_port}")

    def stop_workers(self, next_state: LauncherState, grace_s: float) -> None:
        """Move to STOPPING (or LEAVING, which a stop does not undo); WorkersStopped
        follows once this node's workers are gone."""
        if self.state is not LauncherState.LEAVING:
            self.state = next_state
        self.stop_group(grace_s)

    def _on_workers_stopped(self, generation: int) -> None:
        if self.state not in (LauncherState.STOPPING, LauncherState.LEAVING):
            return
        if self._workers_running:
            return  # an older stop finished; the current one is still under way
        if self.stop_asked is not None:
            self._send(launcher_pb2.FollowerMessage(stopped=launcher_pb2.NodeStopped(generation=self.stop_asked)))
            self.stop_asked = None
        if self.exit_after_stop is not None:
            self.finish(*self.exit_after_stop)
            return
        self.state = LauncherState.WAITING
        if self.pending_start is not None:
            relayed, self.pending_start = self.pending_start, None
            self._start(relayed)

    def _on_leader_lost(self, reason: str) -> None:
        if self.state.is_final:
            return
        if self.exit_after_stop is not None:
            # The leader said it was done (with whatever code): its connection closing is
            # expected, and the workers stop with their grace, the follower exiting with
            # the leader's code and reason.
            return
        self.log.warning("leader_lost", reason=reason)
        # Nothing to wait for: the replica is lost. `run` kills the workers on the way out.
        self.finish(LauncherState.FAILED, EXIT_UNIT_FAILED, f"lost the unit's leader: {reason}")

    # The decisions' inputs and the actions only a follower takes.

    def view(self) -> decisions.NodeView:
        group = self.workers
        return decisions.NodeView(
            state=self.state, generation=self.generation, answers_to_controller=False,
            stop_grace_s=self.options.stop_grace_s, leave_timeout_s=self.options.leave_timeout_s,
            group_generation=group.generation if group is not None else None,
            group_stopping=group is not None and group.stopping,
            group_all_exited=group is None or group.all_exited, leave_requested_at=self.leave_requested_at)

    def observe(self, now: Now) -> Observations:
        return Observations(peers=((0, self.last_heard),), peer_kind=Watched.LEADER,
                            node_timeout_s=self.options.node_timeout_s)

    def _on_tick(self, now: Now) -> None:
        super()._on_tick(now)
        if not self.state.is_final and now.monotonic - self.last_report_at >= REPORT_INTERVAL_S:
            self.last_report_at = now.monotonic
            self._send(launcher_pb2.FollowerMessage(report=launcher_pb2.NodeReport(workers=self.progress_entries())))

    def _apply_own(self, action: object) -> None:
        match action:
            case decisions.ExitAfterStop(state, exit_code, reason):
                self.exit_after_stop = (state, exit_code, reason)
            case decisions.GiveUpLeader(reason):
                self._on_leader_lost(reason)
            case _:
                raise ValueError(f"not a follower's action: {action!r}")

    def _send_up(self, exited: launcher_pb2.WorkerExited) -> None:
        self._send(launcher_pb2.FollowerMessage(worker_exited=exited))
