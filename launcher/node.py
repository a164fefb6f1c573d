"""One launcher process on one node of a unit, the leader's or a follower's: one event
queue and one loop, the node's workers (start, watch, stop, report their exits and
progress), signals and ticks. The decisions on a worker's exit, a signal and a tick are
pure (`decisions`, over `liveness.liveness_verdicts` for the tick); `NodeAgent.apply`
carries their actions out.

The unit's leader (`leader.Agent`) adds the controller link, the rendezvous store, live
mode and, in a unit of several nodes, the follower hub; a follower node
(`follower.Follower`) adds the connection to its leader. A one-node unit is a leader with
no followers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from tidal.launcher import decisions
from tidal.launcher import workers as worker_processes
from tidal.launcher.events import SignalReceived, Tick, WorkerExit, WorkersStopped
from tidal.launcher.lifecycle import EXIT_OK, EXIT_UNIT_FAILED, TICK_INTERVAL_S, LauncherState
from tidal.launcher.liveness import Now, Observations, liveness_verdicts
from tidal.launcher.rundirs import sweep_abandoned
from tidal.launcher.workers import (
    Placement,
    WorkerGroup,
    error_files,
    read_progress,
    read_worker_error,
    start_workers,
    worker_environment,
)
from tidal.proto import launcher_pb2

if TYPE_CHECKING:
    from tidal.launcher.live import LastBeat


class NodeSettings(Protocol):
    """What every launcher's options say (`leader.LauncherOptions`, `follower.FollowerOptions`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def unit_id(self) -> str: ...

    @property
    def stop_grace_s(self) -> float: ...

    @property
    def leave_timeout_s(self) -> float: ...


OptionsT = TypeVar("OptionsT", bound=NodeSettings)


class NodeAgent(Generic[OptionsT]):
    """What every launcher of a unit runs. A role supplies: `_open` (connect; False ends
    the launcher), `_close`, `_on_event` (its own events), `_on_workers_stopped`,
    `_send_up` (a worker's exit, to the controller or the leader), `observe` (what its
    tick's liveness verdict looks at), `view` (what the decisions read) and `_apply_own`
    (the actions only it takes)."""

    # The structured events of the loop's end and of a handler's failure.
    exited_event: ClassVar[str] = "launcher_exited"
    event_failed_event: ClassVar[str] = "launcher_event_failed"

    def __init__(self, options: OptionsT, *, run_dir: Path, log: Any) -> None:
        self.options = options
        self.state = LauncherState.CONNECTING
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.generation = 0
        self.workers: WorkerGroup | None = None
        self.exit_code = EXIT_OK
        self.exit_reason = ""
        # When the first SIGTERM came (monotonic): the unit is asked to leave.
        self.leave_requested_at: float | None = None
        self.run_dir = run_dir
        self.log = log
        # Folders of this user's launchers on this node that died without removing theirs.
        abandoned = sweep_abandoned(run_dir.parent)
        if abandoned:
            log.info("run_folders_removed", count=len(abandoned), folders=[f.name for f in abandoned][:10],
                     reason="their launchers are gone")
        # Whether the exit waits for an unreachable controller to take the last reports.
        self.await_controller_on_exit = False

    # The loop.

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # SIGHUP (the terminal it was started from closed) and SIGQUIT (^\\) as torchrun's
        # agent takes them: like SIGTERM. By default they ended the launcher at once, its
        # workers SIGKILLed with it and the controller told nothing.
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            loop.add_signal_handler(signum, self.events.put_nowait, SignalReceived(signum))
        ticker: asyncio.Task[None] | None = None
        try:
            if await self._open():
                ticker = loop.create_task(self._tick_forever(), name="ticker")
                while not self.state.is_final:
                    event = await self.events.get()
                    try:
                        self._handle(event)
                    except Exception:
                        # A bug in one handler must not take the replica (and its workers) down.
                        self.log.exception(self.event_failed_event, event_type=type(event).__name__)
        finally:
            if ticker is not None:
                ticker.cancel()
            if self.workers is not None and not self.workers.all_exited and not self.workers.unkillable:
                await self.workers.stop(grace_s=1.0, repeat_term_after_s=self.term_repeat_s)
            await self._close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.log.info(self.exited_event, state=self.state.value, exit_code=self.exit_code,
                          reason=self.exit_reason)
        return self.exit_code

    async def _tick_forever(self) -> None:
        # Ticks come faster than heartbeats, so that a silent worker is found within a
        # quarter second of its timeout.
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self.events.put_nowait(Tick())

    def _handle(self, event: object) -> None:
        """The one place events are dispatched."""
        match event:
            case WorkerExit(generation, worker, returncode):
                self.apply(decisions.on_worker_exit(self.view(), generation, worker.local_rank, returncode))
            case WorkersStopped(generation):
                if self.workers is not None and self.workers.unkillable:
                    # The node cannot be trusted with workers again.
                    pids = ", ".join(map(str, self.workers.unkillable))
                    self.finish(LauncherState.FAILED, EXIT_UNIT_FAILED,
                                f"worker pid {pids} still there {worker_processes.KILL_WAIT_S:g} s after SIGKILL "
                                "(uninterruptible sleep: a hung file system or device driver)")
                else:
                    self._on_workers_stopped(generation)
            case SignalReceived(signum):
                self.apply(decisions.on_signal(self.view(), signum, time.monotonic()))
            case Tick():
                self._on_tick(Now(monotonic=time.monotonic(), wall=time.time()))
            case _:
                self._on_event(event)

    def _on_tick(self, now: Now) -> None:
        verdicts = liveness_verdicts(self.observe(now), now)
        self.apply(decisions.on_tick(self.view(), verdicts, now.monotonic))

    def apply(self, actions: Iterable[object]) -> None:
        """The one place the decisions' actions are carried out, in order."""
        for action in actions:
            if self.state.is_final:
                return
            match action:
                case decisions.Log(event, fields, warning):
                    (self.log.warning if warning else self.log.info)(event, **fields)
                case decisions.ReportWorkerExit():
                    self._report_worker_exit(action)
                case decisions.StopWorkers(next_state, grace_s):
                    self.stop_workers(next_state, grace_s)
                case decisions.WorkersGone(generation):
                    self.events.put_nowait(WorkersStopped(generation))
                case decisions.NoteLeaveRequested(at):
                    self.leave_requested_at = at
                case decisions.Finish(state, exit_code, reason, await_controller):
                    self.finish(state, exit_code, reason)
                    self.await_controller_on_exit = await_controller
                case _:
                    self._apply_own(action)

    def finish(self, state: LauncherState, exit_code: int, reason: str) -> None:
        self.state = state
        self.exit_code = exit_code
        self.exit_reason = reason

    # The node's workers.

    @property
    def term_repeat_s(self) -> float | None:
        """How a stop SIGTERMs the workers: once, unless the role says otherwise."""
        return None

    def start_group(self, placement: Placement, registered: launcher_pb2.Registered,
                    extra_environment: Mapping[str, str]) -> WorkerGroup:
        """Start this node's workers of `placement`'s generation; their exits come back as
        WorkerExit events. OSError if the command cannot be started."""
        procs = placement.procs_per_node
        progress = [self.run_dir / f"progress-{local}" for local in range(procs)]
        errors = error_files(self.run_dir, placement.generation, procs)
        environments = [worker_environment(os.environ, extra_environment, placement=placement, local_rank=local,
                                           job_id=self.options.job_id, unit_id=self.options.unit_id,
                                           progress_file=progress[local], error_file=errors[local])
                        for local in range(procs)]
        generation = placement.generation
        return start_workers(
            list(registered.command), environments, generation=generation, first_rank=placement.first_rank,
            working_dir=registered.working_dir, progress_files=progress, error_files=errors,
            on_exit=lambda worker, code: self.events.put_nowait(WorkerExit(generation, worker, code)))

    def stop_group(self, grace_s: float, *, post_when_gone: bool = True) -> None:
        """Stop this node's workers (SIGTERM, SIGKILL after `grace_s`); WorkersStopped
        follows once they are gone (at once if none runs, with `post_when_gone`)."""
        group = self.workers
        generation = self.generation
        if group is None or group.all_exited:
            if post_when_gone:
                self.events.put_nowait(WorkersStopped(generation))
            return
        if group.stopping:
            return
        repeat = self.term_repeat_s

        async def stop() -> None:
            await group.stop(grace_s, repeat_term_after_s=repeat)
            self.events.put_nowait(WorkersStopped(generation))

        asyncio.get_running_loop().create_task(stop())

    def _report_worker_exit(self, action: decisions.ReportWorkerExit) -> None:
        group = self.workers
        worker = next((w for w in group.workers if w.local_rank == action.local_rank), None) if group else None
        if group is None or worker is None:
            return
        failed = action.exit_code != 0 or action.signal != 0
        error = read_worker_error(worker.error_file) if failed else None
        self.log.info("worker_exited", generation=group.generation, rank=worker.rank, pid=worker.pid,
                      exit_code=action.exit_code, signal=action.signal,
                      error=error.message if error is not None else None)
        exited = launcher_pb2.WorkerExited(generation=self.generation, local_rank=worker.local_rank, pid=worker.pid,
                                           exit_code=action.exit_code, signal=action.signal, detail=action.detail,
                                           error=error.message if error is not None else "",
                                           traceback=error.traceback if error is not None else "")
        exited.exited_at.GetCurrentTime()
        self._send_up(exited)

    def progress_entries(self, beats: Mapping[int, LastBeat] | None = None) -> list[launcher_pb2.WorkerProgress]:
        """What each running worker of this node last reported: its progress file and, in
        live mode, its last beat (`beats`, by local rank)."""
        entries: list[launcher_pb2.WorkerProgress] = []
        if self.workers is None:
            return entries
        for worker in self.workers.workers:
            if worker.exited.done():
                continue
            entry = launcher_pb2.WorkerProgress(local_rank=worker.local_rank, rank=worker.rank, pid=worker.pid)
            progress = read_progress(worker.progress_file)
            if progress is not None:
                entry.step = progress.step
                entry.progress_time.FromNanoseconds(int(progress.at * 1e9))
            last_beat = beats.get(worker.local_rank) if beats is not None else None
            if last_beat is not None:
                entry.beat_time.FromNanoseconds(int(last_beat.at * 1e9))
                entry.waiting = last_beat.waiting
                entry.samples = last_beat.samples
                if last_beat.loss is not None:
                    entry.loss = last_beat.loss
                entry.compute_generation = last_beat.compute_generation
                entry.compute_seconds = last_beat.compute_seconds
                entry.compute_samples = last_beat.compute_samples
                entry.compute_steps = last_beat.compute_steps
            entries.append(entry)
        return entries

    # What a role supplies.

    async def _open(self) -> bool:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def _on_event(self, event: object) -> None:
        raise NotImplementedError

    def _on_workers_stopped(self, generation: int) -> None:
        raise NotImplementedError

    def _send_up(self, exited: launcher_pb2.WorkerExited) -> None:
        raise NotImplementedError

    def stop_workers(self, next_state: LauncherState, grace_s: float) -> None:
        raise NotImplementedError

    def observe(self, now: Now) -> Observations:
        raise NotImplementedError

    def view(self) -> decisions.NodeView:
        raise NotImplementedError

    def _apply_own(self, action: object) -> None:
        raise NotImplementedError

