"""One actor per elastic job: the job's state machine, one input queue, one loop.

Inputs are launcher sessions opening and closing, what launchers say, admin requests and a
clock tick. Every transition is written to SQLite (and the event log) before any message
about it leaves, so a controller killed at any point reloads what it decided. Decisions
come from the pure functions in `planning` and `health`; this module only applies them."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import signal
import time
from pathlib import Path

import grpc
import structlog
from google.protobuf import duration_pb2

from tidal.controller import core, planning, sharing, units
from tidal.controller.config import ControllerConfig
from tidal.controller.events import EventLog
from tidal.controller.health import Failure, HealthPolicy, UnitHealth, health_verdicts
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import EpochRecord, EventRecord, JobRecord, JobState, UnitRecord, UnitState, join_ids
from tidal.controller.security import secret_matches
from tidal.controller.sessions import LauncherSession
from tidal.controller.store import StateStore
from tidal.launcher.control import EXIT_STATE_LOST
from tidal.proto import admin_pb2, common_pb2, launcher_pb2
from tidal.slurm.client import SlurmClient
from tidal.slurm.errors import SlurmError
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.snapshot import ClusterView

log = structlog.get_logger("tidal.controller.jobs")


class Refusal(Exception):
    """A launcher call the controller refuses, with the gRPC status it gets."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# Inputs of the actor's loop.


@dataclasses.dataclass(frozen=True)
class Connected:
    session: LauncherSession
    register: launcher_pb2.Register


@dataclasses.dataclass(frozen=True)
class Said:
    session: LauncherSession
    message: launcher_pb2.LauncherMessage


@dataclasses.dataclass(frozen=True)
class Disconnected:
    session: LauncherSession
    reason: str


@dataclasses.dataclass(frozen=True)
class Tick:
    pass


@dataclasses.dataclass(frozen=True)
class CancelRequested:
    uid: int


@dataclasses.dataclass(frozen=True)
class DrainRequested:
    unit_ids: tuple[str, ...]
    uid: int


@dataclasses.dataclass(frozen=True)
class ResizeRequested:
    min_replicas: int
    max_replicas: int
    uid: int


@dataclasses.dataclass(frozen=True)
class Barrier:
    """Resolves `done` once every input queued before it has been handled."""

    done: asyncio.Future[None]


@dataclasses.dataclass(frozen=True)
class SlurmObserved:
    """One cluster-wide view of Slurm, from the poller, with the cluster-wide decisions
    taken on it: how many idle nodes this job may grow onto (None: no cap) and which of
    its units yield to a waiting higher-priority Slurm job."""

    view: ClusterView
    grow_allowance: int | None = None
    yields: tuple[sharing.YieldOrder, ...] = ()


@dataclasses.dataclass(frozen=True)
class UnitSubmitted:
    """sbatch answered for a unit: its Slurm job id, or why it refused."""

    unit_id: str
    slurm_job_id: int
    error: str = ""


@dataclasses.dataclass(frozen=True)
class SlurmUnits:
    """How this controller runs units as Slurm jobs."""

    client: SlurmClient
    launcher: tuple[str, ...]
    controller_address: str
    output_dir: Path
    secrets_dir: Path


JobInput = (Connected | Said | Disconnected | Tick | CancelRequested | DrainRequested | ResizeRequested | Barrier
            | SlurmObserved | UnitSubmitted)


class Throughput:
    """Steps and samples per second over the last `window_s`, and goodput: the share of
    node-seconds held by the job's launchers that went to a running world's members."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, int, int]] = collections.deque()
        self.last_at: float | None = None
        self.held_node_seconds = 0.0
        self.training_node_seconds = 0.0

    def observe(self, now: float, step: int, samples: int, held_nodes: int, training_nodes: int) -> None:
        if self.last_at is not None:
            elapsed = now - self.last_at
            self.held_node_seconds += held_nodes * elapsed
            self.training_node_seconds += min(training_nodes, held_nodes) * elapsed
        self.last_at = now
        if not self.points or self.points[-1][1:] != (step, samples):
            self.points.append((now, step, samples))
        while len(self.points) > 2 and self.points[1][0] < now - self.window_s:
            self.points.popleft()

    def rates(self, now: float, global_batch: int) -> tuple[float, float]:
        """(steps/s, samples/s) over the window; samples/s from the workers' own count
        where they report it (live mode), else steps/s x the spec's global batch."""
        if len(self.points) < 2 or now - self.points[-1][0] > self.window_s:
            return 0.0, 0.0
        (t0, step0, samples0), (t1, step1, samples1) = self.points[0], self.points[-1]
        elapsed = now - t0 if now > t1 else t1 - t0
        if elapsed <= 0:
            return 0.0, 0.0
        steps = max(0, step1 - step0) / elapsed
        samples = max(0, samples1 - samples0) / elapsed if samples1 else steps * global_batch
        return steps, samples

    @property
    def goodput(self) -> float:
        return self.training_node_seconds / self.held_node_seconds if self.held_node_seconds > 0 else 0.0


@dataclasses.dataclass
class PendingStop:
    """An epoch being stopped: who must still confirm, and what comes next."""

    epoch: int
    cause: str
    reason: str
    detected_at: float
    waiting_for: set[str]
    deadline: float


@dataclasses.dataclass
class PendingReconfigure:
    """Live mode: a world change in flight, from `from_epoch` to `epoch`. Joiners start
    their workers first; the old members hear of it once every joiner is ready, so
    training never waits for a joiner's start-up."""

    epoch: int
    from_epoch: int
    previous: EpochRecord
    cause: str
    message: launcher_pb2.ControllerMessage
    # Members of `from_epoch` to tell (leavers included: they leave after the agreed step).
    old_members: tuple[str, ...]
    joiners_waiting: set[str]
    # Members of `epoch` that have not reported EPOCH_PHASE_RECONFIGURED yet.
    waiting_for: set[str]
    decided_at: float
    deadline: float
    told_old_members: bool = False


@dataclasses.dataclass
class Recovery:
    """A failure whose recovery is not measured yet: from the death (or its detection)
    to the first step the survivors complete."""

    failed_at: float
    detected_at: float
    unit_id: str


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def describe_exit(exit_code: int, signal_number: int) -> str:
    if signal_number:
        try:
            return f"killed by {signal.Signals(signal_number).name}"
        except ValueError:
            return f"killed by signal {signal_number}"
    return f"exit code {exit_code}"


class JobActor:
    def __init__(self, job: JobRecord, units: list[UnitRecord], epoch: EpochRecord | None, *,
                 epoch_stopped: bool, config: ControllerConfig, store: StateStore, events: EventLog,
                 metrics: ControllerMetrics, started_at: float, slurm: SlurmUnits | None = None) -> None:
        self.job = job
        self.units = {u.unit_id: u for u in units}
        self.epoch = epoch
        self.config = config
        self.store = store
        self.events = events
        self.metrics = metrics
        self.inputs: asyncio.Queue[JobInput] = asyncio.Queue()
        self.sessions: dict[str, LauncherSession] = {}
        self.stop: PendingStop | None = None
        self.registered_at: dict[str, float] = {}
        # When each unit was asked to leave (monotonic): one that is still there past the
        # grace a stop gets is cancelled in Slurm (`_cancel_overdue_leavers`).
        self.leaving_since: dict[str, float] = {}
        self.last_change_at: float | None = None
        self.epoch_started_at = started_at
        self.reconnect_deadline = started_at + config.reconnect_grace_s
        self.exited_ok: dict[str, set[int]] = {}
        # While FINISHING: workers that exited non-zero after the last step, by unit.
        self.exited_failed: dict[str, dict[int, str]] = {}
        # Live mode: the units that held the running generation's state when it formed.
        self.state_holders: tuple[str, ...] = ()
        # When the watermark (job.step) was last written to SQLite (monotonic).
        self.step_persisted_at = 0.0
        # Live members that reconnected after a controller restart with no workers (when).
        self.returned_without_workers: dict[str, float] = {}
        # While FINISHING: members whose session closed without leaving (when), given
        # reconnect_grace_s to come back before they count as gone.
        self.finishing_disconnected: dict[str, float] = {}
        # While FINISHING: the units of the world that trained the last step (what the
        # job's completion waits for; after a controller restart, the last generation's).
        self.finishing_members: dict[str, int] = ({m.unit_id: m.world_share for m in epoch.members}
                                                  if epoch is not None else {})
        self.failure_detected_at: float | None = None
        self.reconfigure: PendingReconfigure | None = None
        self.recovery: Recovery | None = None
        # Live mode: leaves asked for while a world change is in flight; each follows it.
        self.deferred_leaves: dict[str, tuple[str, str]] = {}
        self.first_step_epochs: set[int] = set()
        self.slurm = slurm
        # sbatch refusals in a row, and no new submission before this (monotonic).
        self.submit_failures = 0
        self.next_submit_at = 0.0
        # When sbatch accepted each unit (wall clock), so that an older view does not read
        # as the unit's Slurm job having vanished.
        self.submitted_at: dict[str, float] = {}
        # Nodes where a unit failed: failures there, and no new unit before (monotonic).
        self.node_cooldown: dict[str, tuple[int, float]] = {}
        self.growth_held_reason = ""
        self._load_pending(started_at)
        # In memory: a controller restart starts the rates and goodput afresh.
        self.throughput = Throughput()
        self.log = log.bind(job=job.job_id)
        if job.state is JobState.RECONFIGURING and epoch is not None and not epoch_stopped:
            # Killed while stopping an epoch: finish the stop with whoever comes back.
            members = {m.unit_id for m in epoch.members if not self.units[m.unit_id].state.is_final}
            self.stop = PendingStop(epoch=epoch.epoch, cause="restart", reason="stop resumed after controller restart",
                                    detected_at=started_at, waiting_for=members,
                                    deadline=self.reconnect_deadline + config.restart_grace_s)

    # Entry points used by the gRPC layer (synchronous, on the event loop).

    def admit(self, register: launcher_pb2.Register) -> launcher_pb2.Registered:
        """Check a launcher's Register; raise Refusal with the status it gets."""
        job = self.job
        if not secret_matches(register.secret, job.secret_sha256):
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"wrong secret for job {job.job_id}")
        if job.state.is_final:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"job {job.job_id} is {job.state.value}")
        unit = self.units.get(register.unit_id)
        if unit is not None and unit.state.is_final:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"unit {unit.unit_id} is {unit.state.value} ({unit.reason or 'no reason recorded'}); "
                          f"it is no longer part of job {job.job_id}")
        if register.last_epoch > job.epoch:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"unit {register.unit_id} claims epoch {register.last_epoch}, "
                          f"but job {job.job_id} is at epoch {job.epoch}")
        in_current = self.epoch is not None and self.epoch.member(register.unit_id) is not None
        if register.last_epoch and register.last_epoch < job.epoch and not in_current:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale epoch {register.last_epoch}: job {job.job_id} is at epoch {job.epoch} "
                          f"and unit {register.unit_id} is not part of it")
        if register.last_epoch and unit is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"unit {register.unit_id} claims epoch {register.last_epoch} of job {job.job_id}, "
                          "which has no record of it")
        spec = job.spec
        return launcher_pb2.Registered(
            current_epoch=job.epoch, heartbeat_interval=_duration(self.config.heartbeat_interval_s),
            heartbeat_timeout=_duration(self.config.heartbeat_timeout_s), mode=spec.mode,
            progress_timeout=_duration(self.config.progress_timeout_s), command=list(spec.command),
            environment=dict(spec.environment), working_dir=spec.working_dir,
            procs_per_node=spec.procs_per_node or 1, job_name=spec.name,
            worker_silence_timeout=_duration(self.config.worker_silence_timeout_s))

    def heartbeat(self, session: LauncherSession, beat: launcher_pb2.Heartbeat) -> None:
        """Record a heartbeat; it needs no decision, so it skips the queue, and no reply
        (the stream and gRPC keepalive tell the launcher the controller is there)."""
        now = time.monotonic()
        session.last_heartbeat_at = now
        if beat.sequence and beat.sequence <= session.heartbeat_sequence:
            # Older than one already taken (the stream keeps order; a resent copy does not).
            return
        session.heartbeat_sequence = beat.sequence
        if beat.HasField("sent_at"):
            sent_at = beat.sent_at.ToNanoseconds() / 1e9
            self.metrics.heartbeat_latency.observe(max(0.0, time.time() - sent_at))
            # Only the workers this heartbeat names: in live mode a worker's rank changes
            # with the world, and an old rank must not linger as a silent one.
            progress_at, steps, beat_at, waiting = {}, {}, {}, {}
            for worker in beat.workers:
                if worker.HasField("progress_time"):
                    age = max(0.0, sent_at - worker.progress_time.ToNanoseconds() / 1e9)
                    progress_at[worker.rank] = now - age
                    steps[worker.rank] = worker.step
                if worker.HasField("beat_time"):
                    beat_at[worker.rank] = now - max(0.0, sent_at - worker.beat_time.ToNanoseconds() / 1e9)
                    waiting[worker.rank] = worker.waiting
            session.progress_at, session.steps, session.beat_at, session.waiting = progress_at, steps, beat_at, waiting
            session.samples = max((w.samples for w in beat.workers), default=0)

    def put(self, item: JobInput) -> None:
        self.inputs.put_nowait(item)

    async def put_and_wait(self, item: JobInput) -> None:
        """Queue `item` and return once the actor has handled it, so that an admin call
        answers with the state it asked for."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.inputs.put_nowait(item)
        self.inputs.put_nowait(Barrier(done))
        await done

    async def run(self) -> None:
        while True:
            item = await self.inputs.get()
            try:
                self.handle(item)
            except Exception:
                # One bad input must not take the job (or the daemon) down.
                self.log.exception("job_input_failed", input=type(item).__name__)

    # The one place transitions happen.

    def handle(self, item: JobInput) -> None:
        match item:
            case Tick():
                self._on_tick(time.monotonic())
            case Connected(session, register):
                self._on_connected(session, register)
            case Said(session, message):
                if self.sessions.get(session.unit_id) is session:
                    self._on_said(session, message)
            case Disconnected(session, reason):
                self._on_disconnected(session, reason)
            case CancelRequested(uid):
                self._on_cancel(uid)
            case DrainRequested(unit_ids, uid):
                for unit_id in unit_ids:
                    self._leave(unit_id, "drained", f"drained by uid {uid}")
            case ResizeRequested(min_replicas, max_replicas, uid):
                self._on_resize(min_replicas, max_replicas, uid)
            case Barrier(done):
                if not done.done():
                    done.set_result(None)
            case SlurmObserved(view, grow_allowance, yields):
                self._on_slurm(view, time.monotonic(), grow_allowance, yields)
            case UnitSubmitted(unit_id, slurm_job_id, error):
                self._on_unit_submitted(unit_id, slurm_job_id, error)

    def _on_connected(self, session: LauncherSession, register: launcher_pb2.Register) -> None:
        now = time.monotonic()
        unit_id = session.unit_id
        previous = self.sessions.get(unit_id)
        if previous is not None:
            previous.close(grpc.StatusCode.ABORTED, "replaced by a newer session of the same unit")
        self.sessions[unit_id] = session
        unit = self.units.get(unit_id)
        fields = {"address": register.address, "nodes": join_ids(list(register.nodes)),
                  "workers": join_ids([str(p) for p in register.worker_pids])}
        if unit is None or unit.state is UnitState.SUBMITTED:
            unit = unit or UnitRecord(job_id=self.job.job_id, unit_id=unit_id, state=UnitState.JOINING)
            unit.state = UnitState.JOINING
            unit.nodes = list(register.nodes) or [register.address]
            unit.address = register.address
            unit.procs_per_node = self.job.spec.procs_per_node or 1
            # The id Tidal submitted stays known when a launcher does not report one.
            unit.slurm_job_id = register.slurm_job_id or unit.slurm_job_id
            unit.registered_at = time.time()
            self.units[unit_id] = unit
            with self.store.transaction():
                self.store.upsert_unit(unit)
                self.events.record(self.job.job_id, "unit_registered", "launcher registered", unit_id=unit_id,
                                   epoch=self.job.epoch, fields=fields)
            self.registered_at[unit_id] = now
            if self.job.state is JobState.FINISHING:
                self._leave(unit_id, "finished", "training finished before this unit joined")
            return
        unit.address = register.address or unit.address
        if self.job.state is JobState.FINISHING:
            if unit.state is UnitState.JOINING or not register.worker_pids:
                # Not part of the finished world, or its workers are gone (they exited while
                # the controller was away): nothing more to wait for here.
                self._leave(unit_id, "finished", "reconnected after the last step")
            return
        member = self.epoch.member(unit_id) if self.epoch is not None else None
        if unit.state is UnitState.JOINING:
            self.registered_at[unit_id] = now
            self.events.record(self.job.job_id, "launcher_reconnected", "joining unit reconnected", unit_id=unit_id,
                               epoch=self.job.epoch, fields=fields)
            return
        if member is None or self.epoch is None:
            return
        if self.stop is not None and self.stop.epoch == self.epoch.epoch:
            self.stop.waiting_for.add(unit_id)
            session.send(self._stop_message(self.stop.epoch, self.stop.reason, self.stop.cause))
            self.events.record(self.job.job_id, "launcher_reconnected", "told to stop the epoch being stopped",
                               unit_id=unit_id, epoch=self.epoch.epoch, fields=fields)
        elif register.last_epoch == self.epoch.epoch and register.worker_pids:
            self.events.record(self.job.job_id, "launcher_reattached",
                               f"still running epoch {self.epoch.epoch}; workers untouched", unit_id=unit_id,
                               epoch=self.epoch.epoch, fields=fields)
        elif self.live and register.last_epoch and not register.worker_pids and self.job.state is JobState.RUNNING:
            # A live member back with no workers lost them while the controller was away: its
            # queued reports (the exit, or "finished") follow on this stream. No fresh worker
            # goes into the running world; if those reports do not settle it within
            # heartbeat_timeout_s, the unit has failed (`_on_tick`).
            self.returned_without_workers[unit_id] = now
            self.events.record(self.job.job_id, "launcher_reconnected", "back with no workers; waiting for its "
                               "reports", unit_id=unit_id, epoch=self.epoch.epoch, fields=fields)
        elif self.job.state is JobState.RUNNING:
            session.send(self._start_message(self.epoch, unit_id))
            self.events.record(self.job.job_id, "epoch_start_resent",
                               f"reconnected without workers of epoch {self.epoch.epoch}", unit_id=unit_id,
                               epoch=self.epoch.epoch, fields=fields)

    def _on_said(self, session: LauncherSession, message: launcher_pb2.LauncherMessage) -> None:
        unit_id = session.unit_id
        kind = message.WhichOneof("body")
        if kind == "worker_exited":
            exited = message.worker_exited
            if self.job.state is JobState.FINISHING:
                self._on_exit_after_finish(unit_id, exited)
                return
            if self.live and exited.exit_code == EXIT_STATE_LOST:
                # The worker refused to train: no state at the target and no checkpoint (its
                # own report says more, and normally comes first).
                self._on_state_lost(f"a worker of unit {unit_id} exited {EXIT_STATE_LOST}: no replica holds the "
                                    f"training state at step {self.job.step} and there is no checkpoint")
                return
            current = {self.epoch.epoch} if self.epoch is not None else set()
            if self.reconfigure is not None:
                current.add(self.reconfigure.from_epoch)
            if self.epoch is None or exited.epoch not in current or self.job.state is not JobState.RUNNING:
                self.metrics.stale_messages.inc()
                self.log.info("stale_message_ignored", unit=unit_id, kind=kind, message_epoch=exited.epoch)
                return
            member = self.epoch.member(unit_id)
            if member is None:
                return
            rank = member.first_rank + exited.local_rank
            if exited.exit_code == 0 and exited.signal == 0:
                # A rank that exits 0 is done training (restart mode's only sign of the end;
                # live mode says "finished" first): the job finishes, nothing re-forms.
                self._begin_finishing(unit_id, exited.epoch, self.job.step, f"rank {rank} (pid {exited.pid}) exited 0")
                self._on_exit_after_finish(unit_id, exited)
                return
            detail = f" ({exited.detail})" if exited.detail else ""
            self._fail(unit_id, f"worker rank {rank} (pid {exited.pid}) "
                       f"{describe_exit(exited.exit_code, exited.signal)}{detail}",
                       "silent" if exited.detail else "worker_exit", time.monotonic(),
                       failed_at=exited.exited_at.ToNanoseconds() / 1e9 if exited.HasField("exited_at") else None)
        elif kind == "leave_request":
            request = message.leave_request
            cause = launcher_pb2.LeaveCause.Name(request.cause).removeprefix("LEAVE_CAUSE_").lower()
            self._leave(unit_id, cause, request.detail or cause)
        elif kind == "epoch_report":
            report = message.epoch_report
            if report.store_port:
                session.store_port = report.store_port
            if report.phase == launcher_pb2.EPOCH_PHASE_LEFT:
                self._mark_left(unit_id, report.detail or "left")
                if self.job.state is JobState.FINISHING:
                    self._maybe_complete()
            elif report.phase == launcher_pb2.EPOCH_PHASE_FINISHED:
                self._begin_finishing(unit_id, report.epoch, report.step,
                                      f"unit {unit_id} committed the last step, {report.step}")
            elif report.phase == launcher_pb2.EPOCH_PHASE_RESUMED_FROM_CHECKPOINT:
                self._on_resumed_from_checkpoint(unit_id, report)
            elif report.phase == launcher_pb2.EPOCH_PHASE_STATE_LOST:
                self._on_state_lost(report.detail or f"no member of generation {report.epoch} holds step "
                                    f"{report.step} and there is no checkpoint")
            elif report.phase == launcher_pb2.EPOCH_PHASE_FIRST_STEP:
                self._on_first_step(unit_id, report)
            elif self.reconfigure is not None and report.epoch == self.reconfigure.epoch:
                self._on_reconfigure_report(unit_id, report)
            if (report.phase in (launcher_pb2.EPOCH_PHASE_STOPPED, launcher_pb2.EPOCH_PHASE_LEFT)
                    and self.stop is not None and report.epoch == self.stop.epoch):
                self.stop.waiting_for.discard(unit_id)
                self._maybe_finish_stop()

    def _on_disconnected(self, session: LauncherSession, reason: str) -> None:
        if self.sessions.get(session.unit_id) is not session:
            return
        del self.sessions[session.unit_id]
        unit = self.units.get(session.unit_id)
        if unit is None or unit.state.is_final:
            return
        if self.job.state is JobState.FINISHING:
            # Past the last step a closed session is no failure; it may be a blip, so the
            # unit has reconnect_grace_s to come back before it counts as gone (`_on_tick`).
            self.finishing_disconnected[unit.unit_id] = time.monotonic()
            return
        if unit.state is UnitState.LEAVING or self.job.state.is_final:
            self._mark_left(unit.unit_id, f"session closed ({reason})")
            if self.stop is not None:
                self.stop.waiting_for.discard(unit.unit_id)
                self._maybe_finish_stop()
            return
        if unit.state is UnitState.ACTIVE and self.epoch is not None and self.epoch.member(unit.unit_id):
            self._fail(unit.unit_id, f"launcher stream broke: {reason}", "stream", time.monotonic())
            return
        self.registered_at.pop(unit.unit_id, None)
        self.events.record(self.job.job_id, "launcher_disconnected", reason, unit_id=unit.unit_id,
                           epoch=self.job.epoch)

    def _on_tick(self, now: float) -> None:
        self._cancel_overdue_leavers(now)
        if self.job.state.is_final:
            return
        self._observe_throughput(now)
        if self.job.state is JobState.FINISHING:
            for unit_id, unit in self.units.items():
                if unit.state.is_final or unit_id in self.sessions:
                    self.finishing_disconnected.pop(unit_id, None)
                    continue
                since = self.finishing_disconnected.get(unit_id)
                if (since is not None and now - since > self.config.reconnect_grace_s) or (
                        since is None and now > self.reconnect_deadline):
                    self.finishing_disconnected.pop(unit_id, None)
                    # Whatever is left of it gives its allocation back.
                    self._cancel_in_slurm(unit)
                    self._mark_left(unit_id, "launcher out of touch after the last step")
            self._maybe_complete()
            return
        self._observe_progress(now)
        for unit_id, since in list(self.returned_without_workers.items()):
            if now - since > self.config.heartbeat_timeout_s:
                del self.returned_without_workers[unit_id]
                returned = self.units.get(unit_id)
                if returned is not None and returned.state is UnitState.ACTIVE and self.job.state is JobState.RUNNING:
                    self._fail(unit_id, "came back after a controller restart with no workers left, and said "
                               "nothing of them", "worker_exit", now)
        if self.stop is not None:
            if now > self.stop.deadline:
                for unit_id in sorted(self.stop.waiting_for):
                    self._fail(unit_id, f"did not confirm the stop of epoch {self.stop.epoch} in time", "stop", now)
                self.stop.waiting_for.clear()
                self._maybe_finish_stop()
            return
        if self.job.state is JobState.RUNNING and self.epoch is not None:
            for failure in self._health_failures(now):
                self._fail(failure.unit_id, failure.reason, failure.cause, now)
                if self.job.state is not JobState.RUNNING:
                    return
        if self.reconfigure is not None:
            if now > self.reconfigure.deadline:
                pending = self.reconfigure
                late = sorted(pending.joiners_waiting if not pending.told_old_members else pending.waiting_for)
                for unit_id in late:
                    self._fail(unit_id, f"did not reach epoch {pending.epoch} within "
                               f"{self.config.reconfigure_timeout_s:g} s", "reconfigure", now)
            return
        if (self.deferred_leaves and self.job.state is JobState.RUNNING and self.epoch is not None
                and (now > self.reconnect_deadline or all(u in self.sessions for u in self.epoch.unit_ids))):
            # Deferred behind a world change that a controller restart cut short: once the
            # world's launchers are back, so that the leave is a change, not a failure.
            deferred, self.deferred_leaves = self.deferred_leaves, {}
            self._save_pending()
            for leave_unit, (cause, detail) in deferred.items():
                self._leave(leave_unit, cause, detail)
            return
        self._decide(now)

    def _observe_throughput(self, now: float) -> None:
        steps = [step for s in self.sessions.values() for step in s.steps.values()]
        samples = max((s.samples for s in self.sessions.values()), default=0)
        training = 0
        if self.epoch is not None and self.job.state is JobState.RUNNING and self.stop is None:
            training = sum(len(m.nodes) for m in self.epoch.members if m.unit_id in self.sessions)
        held = sum(len(self.units[u].nodes) or 1 for u in self.sessions if u in self.units)
        self.throughput.observe(now, min(steps) if steps else self.job.step, samples, held, training)

    def _health_failures(self, now: float) -> list[Failure]:
        assert self.epoch is not None
        observed: list[UnitHealth] = []
        for member in self.epoch.members:
            session = self.sessions.get(member.unit_id)
            if self.units[member.unit_id].state is not UnitState.ACTIVE:
                continue
            observed.append(UnitHealth(unit_id=member.unit_id, connected=session is not None,
                                       last_heartbeat_at=session.last_heartbeat_at if session else None,
                                       progress_at=dict(session.progress_at) if session else {},
                                       beat_at=dict(session.beat_at) if session else {},
                                       waiting=dict(session.waiting) if session else {}))
        policy = HealthPolicy(self.config.heartbeat_timeout_s, self.config.progress_timeout_s)
        return health_verdicts(observed, now=now, policy=policy, epoch_started_at=self.epoch_started_at,
                               reconnect_deadline=self.reconnect_deadline)

    def _decide(self, now: float, after: str = "") -> None:
        running = self.job.state is JobState.RUNNING and self.epoch is not None
        if running:
            assert self.epoch is not None
            members = self.epoch.unit_ids
        else:
            members = tuple(u for u, unit in self.units.items()
                            if unit.state is UnitState.ACTIVE and u in self.sessions)
        joiners = {u: self.registered_at.get(u, now) for u, unit in self.units.items()
                   if unit.state is UnitState.JOINING and u in self.sessions}
        spec = self.job.spec
        snapshot = planning.WorldSnapshot(
            running=running, members=members, joiners=joiners, min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            sizes=tuple(planning.allowed_sizes(spec.min_replicas, spec.max_replicas, spec.replica_step,
                                               list(spec.allowed_replicas))),
            last_change_at=self.last_change_at, join_settle_s=self.config.join_settle_s,
            scale_up_snooze_s=self.config.scale_up_snooze_s,
            expected=(sum(1 for u in self.units.values() if u.state is UnitState.SUBMITTED)
                      if self.slurm is not None else None))
        action = planning.decide_world(snapshot, now)
        match action:
            case planning.Form():
                if after:
                    action = dataclasses.replace(action, reason=f"{after}; {action.reason}")
                self._start_epoch(members, action, now)
            case planning.Grow():
                if self.live:
                    self._reconfigure(action.joiners, (), "grow", action.reason, now)
                else:
                    self._begin_stop("grow", action.reason, now)
            case planning.Wait():
                if not running and self.job.state is JobState.RUNNING:
                    self._set_state(JobState.DEGRADED, action.reason)

    # Actions.

    def _fail(self, unit_id: str, reason: str, cause: str, detected_at: float,
              failed_at: float | None = None) -> None:
        """The one failure path: record, tell the failed unit to kill its workers, and stop
        the epoch everywhere else. `failed_at` (wall clock) is when the failure happened,
        where known; the survivors' first step after it ends the recovery."""
        unit = self.units.get(unit_id)
        if unit is None or unit.state.is_final:
            return
        if self.job.state is JobState.FINISHING:
            # Training is over: nothing to recover; the unit is just gone.
            self._mark_left(unit_id, f"after the last step: {reason}")
            self._maybe_complete()
            return
        epoch_number = self.epoch.epoch if self.epoch is not None else 0
        was_member = (self.epoch is not None and self.epoch.member(unit_id) is not None
                      and unit.state in (UnitState.ACTIVE, UnitState.LEAVING)
                      and self.job.state in (JobState.RUNNING, JobState.RECONFIGURING))
        unit.state = UnitState.FAILED
        unit.reason = reason
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, "failure_detected", reason, unit_id=unit_id, epoch=epoch_number,
                               fields={"cause": cause})
        self.metrics.failures.labels(cause=cause).inc()
        if self.slurm is not None:
            self._cool_down(unit, detected_at)
            # A failed unit never comes back: whatever is left of it (a hung launcher, a
            # node whose slurmd died) gives its allocation back.
            self._cancel_in_slurm(unit)
        session = self.sessions.get(unit_id)
        if session is not None:
            session.send(self._stop_message(epoch_number, reason, "failure", failed_unit_id=unit_id))
            session.close(grpc.StatusCode.ABORTED, f"unit {unit_id} failed: {reason}")
        if not was_member:
            return
        if self.stop is not None:
            self.stop.waiting_for.discard(unit_id)
            self._maybe_finish_stop()
            return
        self.failure_detected_at = detected_at
        wall_detected = time.time() - (time.monotonic() - detected_at)
        self.recovery = Recovery(failed_at=failed_at or wall_detected, detected_at=wall_detected, unit_id=unit_id)
        self._begin_stop("failure", f"unit {unit_id} failed: {reason}", detected_at)

    def _stop_grace_s(self, cause: str) -> float:
        """Workers' SIGTERM-to-SIGKILL grace: short for a failure, longer for a planned change."""
        return self.config.failure_stop_grace_s if cause == "failure" else self.config.restart_grace_s

    def _stop_message(self, epoch: int, reason: str, cause: str,
                      failed_unit_id: str = "") -> launcher_pb2.ControllerMessage:
        return launcher_pb2.ControllerMessage(stop_epoch=launcher_pb2.StopEpoch(
            epoch=epoch, reason=reason, failed_unit_id=failed_unit_id,
            grace=_duration(self._stop_grace_s(cause))))

    def _begin_stop(self, cause: str, reason: str, detected_at: float) -> None:
        """Broadcast STOP for the running epoch to every member and wait for each to
        confirm (or fail past the deadline)."""
        assert self.epoch is not None
        now = time.monotonic()
        waiting = {m.unit_id for m in self.epoch.members
                   if self.units[m.unit_id].state in (UnitState.ACTIVE, UnitState.LEAVING)
                   and (m.unit_id in self.sessions or now < self.reconnect_deadline)}
        # Live-mode workers stop in-process at their next check (a micro-batch boundary, or a
        # collective failing): they get the planned-change grace, not a failure's.
        grace_s = self.config.restart_grace_s if self.live else self._stop_grace_s(cause)
        deadline = max(now + grace_s + self.config.heartbeat_timeout_s, self.reconnect_deadline)
        self.stop = PendingStop(epoch=self.epoch.epoch, cause=cause, reason=reason, detected_at=detected_at,
                                waiting_for=waiting, deadline=deadline)
        self.reconfigure = None
        self.job.state = JobState.RECONFIGURING
        with self.store.transaction():
            self.store.update_job(self.job)
            self.events.record(self.job.job_id, "epoch_stopping", reason, epoch=self.epoch.epoch,
                               fields={"cause": cause, "waiting_for": join_ids(sorted(waiting))})
        message = self._stop_message(self.stop.epoch, reason, cause)
        for unit_id in waiting:
            session = self.sessions.get(unit_id)
            if session is not None and self.units[unit_id].state is not UnitState.LEAVING:
                session.send(message)
        self._maybe_finish_stop()

    def _maybe_finish_stop(self) -> None:
        stop = self.stop
        if stop is None or stop.waiting_for:
            return
        now = time.monotonic()
        self.stop = None
        elapsed = now - stop.detected_at
        with self.store.transaction():
            self.store.mark_epoch_stopped(self.job.job_id, stop.epoch, time.time())
            self.events.record(self.job.job_id, "epoch_stopped", f"every rank of epoch {stop.epoch} stopped",
                               epoch=stop.epoch, fields={"cause": stop.cause,
                                                         "detection_to_all_stopped_s": f"{elapsed:.3f}"})
        if stop.cause == "failure":
            self.metrics.stop_duration.observe(elapsed)
        if self.job.state.is_final:
            return
        self._decide(now, after=stop.reason)
        if self.job.state is JobState.RECONFIGURING:
            alive = sum(1 for u in self.units.values() if u.state in (UnitState.ACTIVE, UnitState.JOINING))
            self._set_state(JobState.DEGRADED, f"{alive} replica(s) alive, below min_replicas "
                            f"{self.job.spec.min_replicas}; waiting for more")

    def _candidates(self, unit_ids: list[str]) -> list[planning.Candidate]:
        previous = self.epoch
        candidates = []
        for unit_id in unit_ids:
            unit = self.units[unit_id]
            session = self.sessions[unit_id]
            member = previous.member(unit_id) if previous is not None else None
            candidates.append(planning.Candidate(
                unit_id=unit_id, nodes=tuple(unit.nodes), procs_per_node=unit.procs_per_node, address=unit.address,
                store_port=session.store_port, previous_group_rank=member.group_rank if member else None,
                registered_at=unit.registered_at))
        return candidates

    def _start_epoch(self, survivors: tuple[str, ...], form: planning.Form, now: float) -> None:
        chosen = list(survivors) + list(form.joiners)
        candidates = self._candidates(chosen)
        try:
            plan = planning.plan_epoch(job_id=self.job.job_id, epoch=self.job.epoch + 1, candidates=candidates,
                                       replicas=form.replicas, reason=form.reason, now=time.time(),
                                       resume_step=self.job.step)
        except ValueError as error:
            self.log.warning("epoch_not_formed", reason=str(error))
            return
        self.job.epoch = plan.epoch
        self.job.state = JobState.RUNNING
        fields: dict[str, object] = {"world_size": plan.world_size, "replicas": len(plan.members),
                                     "members": join_ids(list(plan.unit_ids)),
                                     "rendezvous": f"{plan.rendezvous_host}:{plan.rendezvous_port}"}
        if self.failure_detected_at is not None:
            fields["detection_to_started_s"] = f"{now - self.failure_detected_at:.3f}"
        fields.update(self._state_fields(plan))
        self._commit_epoch(plan, chosen, "world_formed", form.reason, fields)
        if self.failure_detected_at is not None:
            self.metrics.recovery_duration.observe(now - self.failure_detected_at)
            self.failure_detected_at = None
        self.metrics.epochs_formed.labels(job=self.job.job_id).inc()
        self.epoch = plan
        self.epoch_started_at = now
        self.last_change_at = now
        self.exited_ok = {}
        self.reconfigure = None
        for unit_id in plan.unit_ids:
            self.sessions[unit_id].send(self._start_message(plan, unit_id))

    def _commit_epoch(self, plan: EpochRecord, units: list[str], kind: str, reason: str,
                      fields: dict[str, object]) -> None:
        """One transaction, before any message about the epoch leaves: the epoch with its
        rank table, the job's epoch number, each of `units` in its place (a member is
        active; a unit left out waits as a joiner) and the event `kind`."""
        members = set(plan.unit_ids)
        with self.store.transaction():
            self.store.insert_epoch(plan)
            self.store.update_job(self.job)
            for unit_id in units:
                unit = self.units[unit_id]
                member = plan.member(unit_id)
                unit.state = UnitState.ACTIVE if unit_id in members else UnitState.JOINING
                unit.group_rank = member.group_rank if member else -1
                self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, kind, reason, epoch=plan.epoch, fields=fields)

    def _start_message(self, epoch: EpochRecord, unit_id: str) -> launcher_pb2.ControllerMessage:
        return launcher_pb2.ControllerMessage(start_epoch=launcher_pb2.StartEpoch(
            epoch=epoch.epoch, rank_table=epoch.rank_table(only_unit=unit_id), rendezvous=epoch.rendezvous(),
            resume_step=epoch.resume_step, state_holders=list(self.state_holders)))

    def _state_fields(self, plan: EpochRecord) -> dict[str, object]:
        """Decide and describe the state a new generation must be at: its target step (the
        watermark) and its holders. With none holding it past step 0 (live mode), the event
        says so: the workers load a checkpoint at or before it, or refuse to train."""
        self.state_holders = self._holders(plan.unit_ids)
        if self.live and plan.resume_step > 0 and not self.state_holders:
            self.events.record(self.job.job_id, "state_not_held",
                               f"no member of generation {plan.epoch} holds the training state at step "
                               f"{plan.resume_step}: its workers resume from a checkpoint at or before it, or "
                               "refuse to train", epoch=plan.epoch, fields={"target_step": plan.resume_step})
        return {"target_step": plan.resume_step, "state_holders": join_ids(list(self.state_holders))}

    def _leave(self, unit_id: str, cause: str, detail: str) -> None:
        unit = self.units.get(unit_id)
        if unit is None or unit.state.is_final or unit.state is UnitState.LEAVING:
            return
        was_active = unit.state is UnitState.ACTIVE
        session = self.sessions.get(unit_id)
        running = was_active and self.job.state is JobState.RUNNING and self.epoch is not None and self.stop is None
        if running and self.live and session is not None and self.reconfigure is not None:
            # One world change at a time: this leave follows the one in flight.
            self.deferred_leaves.setdefault(unit_id, (cause, detail))
            self._save_pending()
            return
        unit.state = UnitState.LEAVING
        self.leaving_since[unit_id] = time.monotonic()
        unit.reason = f"{cause}: {detail}" if detail != cause else cause
        epoch_number = self.epoch.epoch if self.epoch is not None else 0
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, "unit_leaving", unit.reason, unit_id=unit_id, epoch=epoch_number,
                               fields={"cause": cause})
        if running and self.live and session is not None:
            assert self.epoch is not None
            remaining = [m.unit_id for m in self.epoch.members if m.unit_id != unit_id]
            if len(remaining) >= self.job.spec.min_replicas and all(u in self.sessions for u in remaining):
                self._reconfigure((), (unit_id,), "leave", f"unit {unit_id} leaves ({cause})", time.monotonic())
                return
        if session is not None:
            session.send(launcher_pb2.ControllerMessage(leave=launcher_pb2.Leave(
                epoch=epoch_number, reason=unit.reason)))
        else:
            self._mark_left(unit_id, "not connected when asked to leave")
        if self.stop is not None:
            if session is not None and self.stop.epoch == epoch_number and was_active:
                self.stop.waiting_for.add(unit_id)
            return
        if was_active and self.job.state is JobState.RUNNING and self.epoch is not None:
            self._begin_stop("leave", f"unit {unit_id} leaves ({cause})", time.monotonic())

    # Live mode: world changes in-process.

    @property
    def live(self) -> bool:
        return self.job.spec.mode == common_pb2.JOB_MODE_LIVE

    def _reconfigure(self, joiners: tuple[str, ...], leaving: tuple[str, ...], cause: str, reason: str,
                     now: float) -> None:
        """Plan the next epoch from the running one plus `joiners` minus `leaving`, commit
        it, and tell the joiners (or, with none, every old member) to move there."""
        previous = self.epoch
        assert previous is not None
        kept = [m.unit_id for m in previous.members if m.unit_id not in leaving]
        chosen = kept + list(joiners)
        try:
            plan = planning.plan_epoch(job_id=self.job.job_id, epoch=self.job.epoch + 1,
                                       candidates=self._candidates(chosen), replicas=len(chosen), reason=reason,
                                       now=time.time(), resume_step=self.job.step)
        except ValueError as error:
            self.log.warning("reconfigure_not_planned", reason=str(error))
            return
        old_members = tuple(m.unit_id for m in previous.members)
        # The state's source: the new world's rank 0, a survivor (survivors keep their order).
        source = min(plan.members, key=lambda m: m.group_rank).unit_id
        state = self._state_fields(plan)
        message = launcher_pb2.ControllerMessage(reconfigure=launcher_pb2.Reconfigure(
            epoch=plan.epoch, from_epoch=previous.epoch, rank_table=plan.rank_table(),
            rendezvous=plan.rendezvous(), state_sources=list(self.state_holders) or [source],
            target_step=plan.resume_step))
        self.job.epoch = plan.epoch
        fields: dict[str, object] = {"cause": cause, "from_epoch": previous.epoch, "world_size": plan.world_size,
                                     "replicas": len(plan.members), "members": join_ids(list(plan.unit_ids)),
                                     "joiners": join_ids(list(joiners)), "leaving": join_ids(list(leaving)),
                                     "state_source": source, **state}
        self._commit_epoch(plan, chosen, "world_reconfiguring", reason, fields)
        self.metrics.epochs_formed.labels(job=self.job.job_id).inc()
        self.reconfigure = PendingReconfigure(
            epoch=plan.epoch, from_epoch=previous.epoch, previous=previous, cause=cause, message=message,
            old_members=old_members,
            joiners_waiting=set(joiners), waiting_for=set(plan.unit_ids), decided_at=now,
            deadline=now + self.config.reconfigure_timeout_s)
        self.epoch = plan
        self.epoch_started_at = now
        self.last_change_at = now
        self.exited_ok = {}
        if joiners:
            for unit_id in joiners:
                self.sessions[unit_id].send(message)
        else:
            self._tell_old_members()

    def _tell_old_members(self) -> None:
        pending = self.reconfigure
        assert pending is not None
        pending.told_old_members = True
        for unit_id in pending.old_members:
            session = self.sessions.get(unit_id)
            if session is not None and not self.units[unit_id].state.is_final:
                session.send(pending.message)

    def _on_reconfigure_report(self, unit_id: str, report: launcher_pb2.EpochReport) -> None:
        pending = self.reconfigure
        assert pending is not None
        now = time.monotonic()
        if report.phase == launcher_pb2.EPOCH_PHASE_STARTED and unit_id in pending.joiners_waiting:
            pending.joiners_waiting.discard(unit_id)
            if not pending.joiners_waiting and not pending.told_old_members:
                ready_s = f"{now - pending.decided_at:.3f}"
                self.events.record(self.job.job_id, "joiners_ready", "every joiner's workers are up",
                                   epoch=pending.epoch, fields={"decision_to_ready_s": ready_s})
                self._tell_old_members()
        elif report.phase == launcher_pb2.EPOCH_PHASE_RECONFIGURED:
            pending.waiting_for.discard(unit_id)
            if pending.waiting_for or not pending.told_old_members:
                return
            self.reconfigure = None
            # (The watermark rises from heartbeats only, so that it never runs ahead of the
            # steps the state holders are judged by.)
            with self.store.transaction():
                self.store.update_job(self.job)
                self.events.record(self.job.job_id, "world_reconfigured",
                                   f"every rank moved from epoch {pending.from_epoch} in-process",
                                   epoch=pending.epoch, fields={
                                       "cause": pending.cause, "at_step": report.step,
                                       "world_size": self.epoch.world_size if self.epoch else 0,
                                       "decision_to_reconfigured_s": f"{now - pending.decided_at:.3f}"})
            deferred, self.deferred_leaves = self.deferred_leaves, {}
            self._save_pending()
            for leave_unit, (cause, detail) in deferred.items():
                self._leave(leave_unit, cause, detail)

    def _on_first_step(self, unit_id: str, report: launcher_pb2.EpochReport) -> None:
        """The first step of an epoch committed (every rank commits it together): the end
        of a recovery, or of a planned change."""
        if self.epoch is None or report.epoch != self.epoch.epoch or report.epoch in self.first_step_epochs:
            return
        self.first_step_epochs.add(report.epoch)
        at = report.at.ToNanoseconds() / 1e9 if report.HasField("at") else time.time()
        fields: dict[str, object] = {"step": report.step, "world_size": self.epoch.world_size}
        recovery = self.recovery
        if recovery is not None:
            self.recovery = None
            fields.update({"failed_unit": recovery.unit_id,
                           "failure_to_first_step_s": f"{at - recovery.failed_at:.3f}",
                           "detection_to_first_step_s": f"{at - recovery.detected_at:.3f}"})
            self.events.record(self.job.job_id, "recovered",
                               f"survivors completed step {report.step} at world size {self.epoch.world_size}",
                               unit_id=unit_id, epoch=report.epoch, fields=fields)
            return
        self.events.record(self.job.job_id, "first_step", f"first step of epoch {report.epoch} completed",
                           unit_id=unit_id, epoch=report.epoch, fields=fields)

    # Units as Slurm jobs.

    def _alive_units(self) -> list[UnitRecord]:
        """Units that hold or wait for a place (submitted, joining, active)."""
        return [u for u in self.units.values() if u.state in (UnitState.SUBMITTED, UnitState.JOINING,
                                                              UnitState.ACTIVE)]

    def growing_job(self, view: ClusterView, now: float) -> sharing.GrowingJob | None:
        """What the idle-node share across jobs needs of this job, or None if it runs no
        units in Slurm."""
        if self.slurm is None or self.job.state.is_final or self.job.state is JobState.FINISHING:
            return None
        excluded = frozenset(self._excluded_nodes(now))
        return sharing.GrowingJob(job_id=self.job.job_id, weight=self.job.spec.weight or 1,
                                  replicas=len(self._alive_units()), max_replicas=self.job.spec.max_replicas,
                                  fits=frozenset(units.idle_nodes_for(self.job.spec, view.nodes, excluded)))

    def yielding_job(self, view: ClusterView) -> sharing.YieldingJob | None:
        """This job's active units that could yield to a waiting Slurm job, if it allows
        yielding and no world change or stop is in flight."""
        if (self.slurm is None or not self.job.spec.yield_to_pending or self.job.state is not JobState.RUNNING
                or self.stop is not None or self.reconfigure is not None):
            return None
        candidates = []
        for unit in self.units.values():
            found = view.job(unit.slurm_job_id) if unit.slurm_job_id else None
            if unit.state is not UnitState.ACTIVE or found is None or found.state is not SlurmJobState.RUNNING:
                continue
            order = int(unit.unit_id[1:]) if unit.unit_id[1:].isdigit() else 0
            candidates.append(sharing.YieldableUnit(unit_id=unit.unit_id, nodes=tuple(unit.nodes),
                                                    rank=(view.priority_tier(found.partition), found.priority),
                                                    order=order))
        return sharing.YieldingJob(job_id=self.job.job_id, weight=self.job.spec.weight or 1,
                                   min_replicas=self.job.spec.min_replicas, units=tuple(candidates))

    def _on_slurm(self, view: ClusterView, now: float, grow_allowance: int | None = None,
                  yields: tuple[sharing.YieldOrder, ...] = ()) -> None:
        """Reconcile units with what Slurm shows, yield what the cluster-wide plan asks,
        then submit what the job needs. A stale view (Slurm did not answer) decides
        nothing."""
        if self.slurm is None or self.job.state.is_final or view.stale:
            return
        for unit in list(self.units.values()):
            if not unit.slurm_job_id or unit.state not in (UnitState.SUBMITTED, UnitState.ACTIVE,
                                                           UnitState.JOINING):
                continue
            found = view.job(unit.slurm_job_id)
            if found is not None and found.was_requeued and found.state is SlurmJobState.PENDING:
                # Slurm requeued the unit (an sbatch option allowed it): its processes are
                # gone, and a copy that started later would hold a node Tidal did not ask
                # for. Tidal places replacements itself, so the copy is cancelled.
                self._on_requeued(unit, found.job_id)
            elif unit.state in (UnitState.ACTIVE, UnitState.JOINING):
                # Slurm chose the unit for preemption: it has until its end time (GraceTime),
                # and SIGTERM reaches the launcher only at the end of it. Leave now.
                if found is not None and found.is_being_preempted:
                    self._leave(unit.unit_id, "preempted", f"Slurm preempts job {unit.slurm_job_id}")
            elif view.observed_at >= self.submitted_at.get(unit.unit_id, 0.0) + 1.0 and (
                    found is None or found.state.is_finished):
                # (A view taken before the submission proves nothing.)
                what = found.state.value.lower() if found else "gone from squeue"
                self._unit_lost(unit, f"Slurm job {unit.slurm_job_id} {what} before its launcher registered")
        for order in yields:
            self._leave(order.unit_id, "yielded", order.reason)
        if now < self.next_submit_at or self.stop is not None or self.job.state is JobState.FINISHING:
            return
        spec = self.job.spec
        alive = self._alive_units()
        # Units Slurm has not placed yet will take idle nodes; running ones already hold theirs.
        waiting = sum(1 for u in alive if u.state is UnitState.SUBMITTED
                      and ((found := view.job(u.slurm_job_id)) is None or found.state is SlurmJobState.PENDING))
        excluded = self._excluded_nodes(now)
        idle = units.idle_nodes_for(spec, view.nodes, frozenset(excluded))
        # Idle nodes are for others first: grow only while no other Slurm job waits for
        # nodes this job could take.
        others_waiting = units.others_waiting_for(view, self.job.job_id, frozenset(n.name for n in view.nodes
                                                                                   if spec.partition in n.partitions
                                                                                   or not spec.partition))
        demand = units.units_to_submit(spec, alive=len(alive), idle_nodes=max(0, len(idle) - waiting), now=now,
                                       last_change_at=self.last_change_at,
                                       scale_up_snooze_s=self.config.scale_up_snooze_s,
                                       others_waiting=len(others_waiting))
        count = demand.count
        if grow_allowance is not None and len(alive) >= spec.min_replicas and count > grow_allowance:
            # Other elastic jobs share these idle nodes by weight.
            count = grow_allowance
            self._note_growth_held(f"{demand.count - count} of {demand.count} idle node(s) go to other elastic "
                                   f"jobs by weight (this job's weight {spec.weight or 1})")
        for _ in range(count):
            self._submit_unit(demand.reason, excluded)

    def _note_growth_held(self, reason: str) -> None:
        """An event when growth is held back for a new reason (not on every poll)."""
        if reason != self.growth_held_reason:
            self.growth_held_reason = reason
            self.events.record(self.job.job_id, "growth_shared", reason, epoch=self.job.epoch)

    def _on_requeued(self, unit: UnitRecord, slurm_job_id: int) -> None:
        self.events.record(self.job.job_id, "unit_requeued", f"Slurm requeued job {slurm_job_id}; Tidal cancels "
                           "the requeued copy and places replacements itself", unit_id=unit.unit_id,
                           epoch=self.job.epoch, fields={"slurm_job_id": slurm_job_id})
        self._cancel_in_slurm(unit)
        if unit.state is UnitState.SUBMITTED:
            self._unit_lost(unit, f"Slurm job {slurm_job_id} requeued before its launcher registered")
        else:
            self._leave(unit.unit_id, "requeued", f"Slurm requeued job {slurm_job_id}")

    def _cool_down(self, unit: UnitRecord, now: float) -> None:
        """No unit of this job on the failed unit's nodes for a while (doubling with each
        failure there), so a bad node does not eat every replacement."""
        for node in unit.nodes:
            failures = self.node_cooldown.get(node, (0, 0.0))[0] + 1
            seconds = self.config.node_cooldown_s * min(8, 2 ** (failures - 1))
            self.node_cooldown[node] = (failures, now + seconds)
            self._save_pending()
            self.events.record(self.job.job_id, "node_excluded", f"unit {unit.unit_id} failed there",
                               unit_id=unit.unit_id, epoch=self.job.epoch,
                               fields={"node": node, "failures": failures, "for_s": f"{seconds:.0f}"})

    def _save_pending(self) -> None:
        """Write what is in flight besides the job's state (node cool-downs, with their ends
        on the wall clock; deferred leaves), so that a restarted controller resumes it."""
        offset = time.time() - time.monotonic()
        self.store.save_pending(self.job.job_id, "node_cooldown",
                                {node: [failures, until + offset] for node, (failures, until)
                                 in self.node_cooldown.items()})
        self.store.save_pending(self.job.job_id, "deferred_leaves",
                                {unit_id: list(leave) for unit_id, leave in self.deferred_leaves.items()})

    def _load_pending(self, now: float) -> None:
        pending = self.store.pending(self.job.job_id)
        offset = time.time() - now
        for node, (failures, until) in pending.get("node_cooldown", {}).items():
            self.node_cooldown[node] = (int(failures), float(until) - offset)
        finishing = pending.get("finishing_members")
        if isinstance(finishing, dict):
            self.finishing_members = {str(u): int(n) for u, n in finishing.items() if u in self.units}
        for unit_id, (cause, detail) in pending.get("deferred_leaves", {}).items():
            if unit_id in self.units and not self.units[unit_id].state.is_final:
                self.deferred_leaves[unit_id] = (str(cause), str(detail))
        # A unit that was asked to leave before the restart: its grace starts again now.
        for unit_id, unit in self.units.items():
            if unit.state is UnitState.LEAVING:
                self.leaving_since[unit_id] = now

    def _excluded_nodes(self, now: float) -> tuple[str, ...]:
        return tuple(sorted(node for node, (_, until) in self.node_cooldown.items() if now < until))

    def _submit_unit(self, reason: str, excluded: tuple[str, ...] = ()) -> None:
        assert self.slurm is not None
        numbers = [int(u[1:]) for u in self.units if u.startswith("u") and u[1:].isdigit()]
        unit_id = f"u{max(numbers, default=0) + 1}"
        unit = UnitRecord(job_id=self.job.job_id, unit_id=unit_id, state=UnitState.SUBMITTED,
                          procs_per_node=self.job.spec.procs_per_node or 1)
        self.units[unit_id] = unit
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, "unit_submitting", reason, unit_id=unit_id, epoch=self.job.epoch)
        slurm = self.slurm
        submission = units.unit_submission(
            self.job.spec, job_id=self.job.job_id, unit_id=unit_id, launcher=slurm.launcher,
            controller=slurm.controller_address, secret_path=slurm.secrets_dir / f"{self.job.job_id}.secret",
            output_dir=slurm.output_dir, exclude=excluded)

        def submit() -> None:
            try:
                self.put(UnitSubmitted(unit_id, slurm.client.submit(submission)))
            except (SlurmError, OSError) as error:
                self.put(UnitSubmitted(unit_id, 0, str(error)))

        asyncio.get_running_loop().run_in_executor(None, submit)

    def _on_unit_submitted(self, unit_id: str, slurm_job_id: int, error: str) -> None:
        unit = self.units.get(unit_id)
        if unit is None:
            return
        if error:
            self.submit_failures += 1
            backoff = min(60.0, self.config.slurm_poll_interval_s * 2 ** self.submit_failures)
            self.next_submit_at = time.monotonic() + backoff
            self._unit_lost(unit, f"sbatch refused the unit: {error}", kind="unit_submit_failed",
                            fields={"retry_in_s": f"{backoff:.0f}"})
            return
        self.submit_failures = 0
        self.submitted_at[unit_id] = time.time()
        unit.slurm_job_id = slurm_job_id
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, "unit_submitted", f"Slurm job {slurm_job_id}", unit_id=unit_id,
                               epoch=self.job.epoch, fields={"slurm_job_id": slurm_job_id})
        if self.job.state.is_final or unit.state.is_final:
            self._cancel_in_slurm(unit)

    def _unit_lost(self, unit: UnitRecord, reason: str, kind: str = "unit_lost",
                   fields: dict[str, object] | None = None) -> None:
        """A unit that never registered is gone (Slurm ended it, or sbatch refused it)."""
        unit.state = UnitState.FAILED
        unit.reason = reason
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, kind, reason, unit_id=unit.unit_id, epoch=self.job.epoch,
                               fields=fields)

    def _cancel_overdue_leavers(self, now: float) -> None:
        """A unit asked to leave that is still there after the grace a stop gets
        (`restart_grace_s` + `heartbeat_timeout_s`: its launcher or workers hung) has its
        Slurm job cancelled, so that it never holds a node for nothing; Slurm then signals
        and kills what runs there, and the closed session marks the unit left."""
        overdue_s = self.config.restart_grace_s + self.config.heartbeat_timeout_s
        for unit_id, since in list(self.leaving_since.items()):
            unit = self.units.get(unit_id)
            if unit is None or unit.state is not UnitState.LEAVING:
                del self.leaving_since[unit_id]
            elif now - since > overdue_s:
                del self.leaving_since[unit_id]
                self.events.record(self.job.job_id, "unit_leave_overdue",
                                   f"still there {now - since:.0f} s after it was asked to leave"
                                   + (f"; Slurm job {unit.slurm_job_id} cancelled" if self.slurm and unit.slurm_job_id
                                      else ""), unit_id=unit_id, epoch=self.job.epoch)
                self._cancel_in_slurm(unit)

    def _cancel_in_slurm(self, unit: UnitRecord) -> None:
        if self.slurm is None or not unit.slurm_job_id:
            return
        client, slurm_job_id = self.slurm.client, unit.slurm_job_id

        def cancel() -> None:
            try:
                client.cancel(slurm_job_id)
            except SlurmError as error:
                self.log.warning("unit_cancel_failed", unit=unit.unit_id, slurm_job_id=slurm_job_id, error=str(error))

        asyncio.get_running_loop().run_in_executor(None, cancel)

    def _mark_left(self, unit_id: str, reason: str) -> None:
        unit = self.units.get(unit_id)
        if unit is None or unit.state.is_final:
            return
        unit.state = UnitState.LEFT
        with self.store.transaction():
            self.store.upsert_unit(unit)
            self.events.record(self.job.job_id, "unit_left", reason, unit_id=unit_id, epoch=self.job.epoch)

    # The end of training: FINISHING, then COMPLETED once.

    def _begin_finishing(self, unit_id: str, epoch: int, step: int, reason: str) -> None:
        """A rank committed the job's last step (or, in restart mode, exited 0): training is
        over. No generation forms from here; a world change or stop in flight is dropped;
        units that are not in the finished world leave; exits and silences are no longer
        failures. Persisted before anything is sent."""
        if self.job.state.is_final or self.job.state is JobState.FINISHING:
            return
        self.job.state = JobState.FINISHING
        self.job.step = max(self.job.step, step)
        finished_world = self._world_of(epoch)
        self.stop = None
        self.reconfigure = None
        self.deferred_leaves = {}
        self._save_pending()
        with self.store.transaction():
            self.store.update_job(self.job)
            self.events.record(self.job.job_id, "job_finishing", reason, unit_id=unit_id, epoch=epoch,
                               fields={"step": self.job.step})
        self.finishing_members = ({m.unit_id: m.world_share for m in finished_world.members}
                                  if finished_world is not None else {})
        self.store.save_pending(self.job.job_id, "finishing_members", self.finishing_members)
        members = set(self.finishing_members)
        for other_id, unit in list(self.units.items()):
            if unit.state.is_final or other_id in members:
                continue
            if unit.state is UnitState.SUBMITTED:
                self._cancel_in_slurm(unit)
                self._mark_left(other_id, "training finished before it registered")
            else:
                self._leave(other_id, "finished", "training finished")
        self._maybe_complete()

    def _world_of(self, epoch: int) -> EpochRecord | None:
        """The generation numbered `epoch`, if it is the current one or the one a live change
        in flight leaves; else the current one."""
        if self.reconfigure is not None and self.reconfigure.previous.epoch == epoch:
            return self.reconfigure.previous
        return self.epoch

    def _on_exit_after_finish(self, unit_id: str, exited: launcher_pb2.WorkerExited) -> None:
        if exited.exit_code == 0 and exited.signal == 0:
            self.exited_ok.setdefault(unit_id, set()).add(exited.local_rank)
            self.events.record(self.job.job_id, "worker_finished", f"local rank {exited.local_rank} "
                               f"(pid {exited.pid}) exited 0", unit_id=unit_id, epoch=self.job.epoch)
        else:
            how = describe_exit(exited.exit_code, exited.signal) + (f" ({exited.detail})" if exited.detail else "")
            self.exited_failed.setdefault(unit_id, {})[exited.local_rank] = how
            self.events.record(self.job.job_id, "worker_failed_after_training",
                               f"local rank {exited.local_rank} (pid {exited.pid}) {how} after the last step; "
                               "training is complete, so nothing re-forms", unit_id=unit_id, epoch=self.job.epoch)
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.job.state is not JobState.FINISHING:
            return
        members = []
        for unit_id, workers in self.finishing_members.items():
            unit = self.units[unit_id]
            members.append(core.FinishingMember(
                unit_id=unit_id, workers=workers,
                exited_ok=frozenset(self.exited_ok.get(unit_id, ())),
                exited_failed=dict(self.exited_failed.get(unit_id, {})), gone=unit.state.is_final))
        verdict = core.completion_verdict(self.job.step, members)
        if verdict is not None:
            self._end(JobState.COMPLETED, "job_completed", verdict.reason)

    def _on_state_lost(self, reason: str) -> None:
        """The workers refuse to train from nothing: the job fails, loudly. A job already
        past its last step is not failed by a late report."""
        if not self.job.state.is_final and self.job.state is not JobState.FINISHING:
            self._end(JobState.FAILED, "state_lost", reason)

    def _on_resumed_from_checkpoint(self, unit_id: str, report: launcher_pb2.EpochReport) -> None:
        """No member of a generation held the state at its target step; the workers loaded a
        checkpoint at `report.step`. The watermark goes back to it, loudly."""
        target = self.job.step
        self.job.step = report.step
        with self.store.transaction():
            self.store.update_job(self.job)
            self.events.record(self.job.job_id, "resumed_from_checkpoint",
                               report.detail or f"resumed from the checkpoint at step {report.step}",
                               unit_id=unit_id, epoch=report.epoch,
                               fields={"checkpoint_step": report.step, "target_step": target,
                                       "steps_redone": max(0, target - report.step)})

    def _observe_progress(self, now: float) -> None:
        """Raise the job's committed step from what the training world's ranks report;
        written to SQLite at most once a second (and with every generation)."""
        world = self.reconfigure.previous if self.reconfigure is not None else self.epoch
        if world is None or self.job.state is not JobState.RUNNING or self.stop is not None:
            return
        reports = []
        for member in world.members:
            session = self.sessions.get(member.unit_id)
            reports.append(core.MemberProgress(unit_id=member.unit_id, ranks=member.world_share,
                                               steps=dict(session.steps) if session is not None else {}))
        step = core.committed_step(self.job.step, reports)
        if step != self.job.step:
            self.job.step = step
            if now - self.step_persisted_at >= 1.0:
                self.step_persisted_at = now
                self.store.update_job(self.job)

    def _holders(self, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
        """Live mode: which of `unit_ids` hold the state at the job's committed step."""
        if not self.live:
            return ()
        return core.state_holders(self.job.step, {
            unit_id: list(session.steps.values()) for unit_id in unit_ids
            if (session := self.sessions.get(unit_id)) is not None})

    def _on_cancel(self, uid: int) -> None:
        if not self.job.state.is_final:
            self._end(JobState.CANCELLED, "job_cancelled", f"cancelled by uid {uid}")

    def _end(self, state: JobState, kind: str, reason: str) -> None:
        self.job.state = state
        self.stop = None
        epoch_number = self.epoch.epoch if self.epoch is not None else 0
        with self.store.transaction():
            self.store.update_job(self.job)
            if self.epoch is not None:
                self.store.mark_epoch_stopped(self.job.job_id, epoch_number, time.time())
            self.events.record(self.job.job_id, kind, reason, epoch=epoch_number)
        for unit_id, unit in self.units.items():
            if unit.state.is_final:
                continue
            session = self.sessions.get(unit_id)
            if session is None:
                # Waiting in Slurm's queue (it would start for nothing), or running with its
                # launcher out of touch: the job is over, so its Slurm job goes too.
                self._cancel_in_slurm(unit)
                self._mark_left(unit_id, reason)
                continue
            if unit.state is UnitState.LEAVING:
                continue
            unit.state = UnitState.LEAVING
            self.leaving_since[unit_id] = time.monotonic()
            self.store.upsert_unit(unit)
            session.send(launcher_pb2.ControllerMessage(leave=launcher_pb2.Leave(
                epoch=epoch_number, reason=reason)))

    def _on_resize(self, min_replicas: int, max_replicas: int, uid: int) -> None:
        spec = self.job.spec
        spec.min_replicas = min_replicas or spec.min_replicas
        spec.max_replicas = max_replicas or spec.max_replicas
        with self.store.transaction():
            self.store.update_job(self.job)
            self.events.record(self.job.job_id, "job_resized", f"by uid {uid}", epoch=self.job.epoch,
                               fields={"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas})
        if self.epoch is not None and self.job.state is JobState.RUNNING:
            surplus = len(self.epoch.members) - spec.max_replicas
            for member in sorted(self.epoch.members, key=lambda m: -m.group_rank)[:max(0, surplus)]:
                self._leave(member.unit_id, "resized", f"max_replicas is now {spec.max_replicas}")

    def _set_state(self, state: JobState, reason: str) -> None:
        if self.job.state is state:
            return
        self.job.state = state
        with self.store.transaction():
            self.store.update_job(self.job)
            self.events.record(self.job.job_id, f"job_{state.value}", reason, epoch=self.job.epoch)

    # What the state gauges read (metrics.JobView).

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def job_state(self) -> str:
        return self.job.state.value

    @property
    def unit_states(self) -> list[str]:
        return [unit.state.value for unit in self.units.values()]

    @property
    def world_size(self) -> int:
        """The world training in now: while a live change is in flight, the old one."""
        if self.epoch is None or self.job.state is not JobState.RUNNING:
            return 0
        return self.reconfigure.previous.world_size if self.reconfigure is not None else self.epoch.world_size

    @property
    def epoch_number(self) -> int:
        return self.job.epoch

    @property
    def connected_launchers(self) -> int:
        return len(self.sessions)

    # Admin views.

    def to_proto(self) -> admin_pb2.Job:
        job = self.job
        epoch = self.epoch
        running = epoch is not None and job.state is JobState.RUNNING
        units = []
        for unit in self.units.values():
            session = self.sessions.get(unit.unit_id)
            entry = admin_pb2.Unit(unit_id=unit.unit_id, slurm_job_id=unit.slurm_job_id, nodes=unit.nodes,
                                   state=unit.state.to_proto(), group_rank=unit.group_rank)
            if session is not None:
                entry.last_heartbeat.FromNanoseconds(
                    int((time.time() - (time.monotonic() - session.last_heartbeat_at)) * 1e9))
            units.append(entry)
        message = admin_pb2.Job(job_id=job.job_id, spec=job.spec, state=job.state.to_proto(),
                                owner_uid=job.owner_uid, epoch=job.epoch,
                                world_size=self.world_size,
                                replicas=len(epoch.members) if running and epoch else 0,
                                step=job.step, units=units)
        _, message.samples_per_second = self.throughput.rates(time.monotonic(), job.spec.global_batch)
        message.goodput = self.throughput.goodput
        message.created_at.FromNanoseconds(int(job.created_at * 1e9))
        last = self.store.last_event(job.job_id)
        if last is not None:
            message.last_event.CopyFrom(event_to_proto(last))
        return message


def event_to_proto(event: EventRecord) -> admin_pb2.Event:
    message = admin_pb2.Event(sequence=event.sequence, job_id=event.job_id, unit_id=event.unit_id,
                              epoch=event.epoch, kind=event.kind, reason=event.reason, fields=event.fields)
    message.time.FromNanoseconds(int(event.time * 1e9))
    return message

