"""One job's state machine: `transition(state, input, now) -> (state, effects)`.

Every decision about a job is taken here: forming a generation, growing it, a unit's leave
(now, or deferred behind a change in flight), a failure, the end of training and the job's
completion, what a Slurm view means for the job's units, and node cool-downs. Nothing here
reads a clock, touches SQLite, sends a message or awaits; `transition` never changes the
state it is given (it works on a copy and returns it). The job actor
(`controller/jobs.py`) feeds it inputs and applies the effects it returns in one place:
the persistent ones in one SQLite transaction first, then the rest (messages, session
closes, Slurm cancels and submissions, metrics) in order.

Words: a **generation** is one version of the job's world (its members, their ranks, the
rendezvous, the step its state must be at and who holds that state). On the wire and in
SQLite it is still called an "epoch" (`StartEpoch`, `GenerationRecord`, the `epochs` table):
those names stay so that launchers and databases of earlier versions keep working.

Times: `Now.monotonic` for deadlines and ages, `Now.wall` for what is recorded."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping

from google.protobuf import duration_pb2

from tidal.controller import units as unit_rules
from tidal.controller.config import ControllerConfig
from tidal.controller.core import planning, sharing
from tidal.controller.core.completion import FinishingMember, completion_verdict
from tidal.controller.core.health import Failure, HealthPolicy, UnitHealth, health_verdicts
from tidal.controller.core.progress import MemberProgress, committed_step, state_holders
from tidal.controller.model import GenerationRecord, JobRecord, JobState, UnitRecord, UnitState, join_ids
from tidal.proto import admin_pb2, common_pb2, launcher_pb2
from tidal.proto.control import EXIT_STATE_LOST
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.snapshot import ClusterView


@dataclasses.dataclass(frozen=True)
class Now:
    """The injected clock: `monotonic` for deadlines, `wall` for records."""

    monotonic: float
    wall: float


# Inputs.


@dataclasses.dataclass(frozen=True)
class LauncherConnected:
    """A launcher of `unit_id` opened a session (a newer one replaces the older)."""

    unit_id: str
    register: launcher_pb2.Register


@dataclasses.dataclass(frozen=True)
class LauncherSaid:
    unit_id: str
    message: launcher_pb2.LauncherMessage


@dataclasses.dataclass(frozen=True)
class LauncherClosed:
    """The unit's current session ended."""

    unit_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Link:
    """What the controller last saw of one connected launcher's heartbeats (monotonic
    times, per global rank)."""

    last_heartbeat_at: float
    progress_at: Mapping[int, float] = dataclasses.field(default_factory=dict)
    steps: Mapping[int, int] = dataclasses.field(default_factory=dict)
    beat_at: Mapping[int, float] = dataclasses.field(default_factory=dict)
    waiting: Mapping[int, bool] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ClockTick:
    """Time passed; `links` is what every connected launcher's heartbeats said so far
    (heartbeats need no decision of their own, so they reach the core with the tick)."""

    links: Mapping[str, Link] = dataclasses.field(default_factory=dict)


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
class SlurmObserved:
    """One cluster-wide view of Slurm, with the cluster-wide decisions taken on it: how
    many idle nodes this job may grow onto (None: no cap) and which of its units yield to
    a waiting higher-priority Slurm job."""

    view: ClusterView
    grow_allowance: int | None = None
    yields: tuple[sharing.YieldOrder, ...] = ()


@dataclasses.dataclass(frozen=True)
class UnitSubmitted:
    """sbatch answered for a unit: its Slurm job id, or why it refused."""

    unit_id: str
    slurm_job_id: int
    error: str = ""


Input = (LauncherConnected | LauncherSaid | LauncherClosed | ClockTick | CancelRequested | DrainRequested
         | ResizeRequested | SlurmObserved | UnitSubmitted)


# Effects. The persistent ones are applied first, in one transaction.


@dataclasses.dataclass(frozen=True)
class SaveJob:
    job: JobRecord


@dataclasses.dataclass(frozen=True)
class SaveUnit:
    unit: UnitRecord


@dataclasses.dataclass(frozen=True)
class SaveGeneration:
    generation: GenerationRecord


@dataclasses.dataclass(frozen=True)
class GenerationStopped:
    job_id: str
    number: int
    at: float


@dataclasses.dataclass(frozen=True)
class Record:
    """An event for the job's event log."""

    kind: str
    reason: str
    unit_id: str = ""
    generation: int = 0
    fields: Mapping[str, object] | None = None


@dataclasses.dataclass(frozen=True)
class SavePending:
    """What is in flight besides the job's state (see `restore`), under `key`."""

    key: str
    value: object


@dataclasses.dataclass(frozen=True)
class Send:
    unit_id: str
    message: launcher_pb2.ControllerMessage


@dataclasses.dataclass(frozen=True)
class Close:
    """End the unit's session (after what was sent on it)."""

    unit_id: str
    details: str


@dataclasses.dataclass(frozen=True)
class CancelInSlurm:
    unit_id: str
    slurm_job_id: int


@dataclasses.dataclass(frozen=True)
class Submit:
    """Submit the unit (already recorded as SUBMITTED) to Slurm, avoiding `excluded`."""

    unit_id: str
    excluded: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Metric:
    """Count (or, for a duration, observe) one of the controller's metrics."""

    name: str
    value: float = 1.0
    label: str = ""


@dataclasses.dataclass(frozen=True)
class Note:
    """A log line that is no event of the job's."""

    event: str
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
    warning: bool = False


Persist = SaveJob | SaveUnit | SaveGeneration | GenerationStopped | Record | SavePending
Effect = Persist | Send | Close | CancelInSlurm | Submit | Metric | Note
PERSISTENT = (SaveJob, SaveUnit, SaveGeneration, GenerationStopped, Record, SavePending)


# The state.


@dataclasses.dataclass
class PendingStop:
    """A generation being stopped: who must still confirm, and what comes next."""

    generation: int
    cause: str
    reason: str
    detected_at: float
    waiting_for: set[str]
    deadline: float


@dataclasses.dataclass
class PendingReconfigure:
    """Live mode: a world change in flight, from generation `from_generation` to
    `generation`. Joiners start their workers first; the old members hear of it once every
    joiner is ready, so training never waits for a joiner's start-up."""

    generation: int
    from_generation: int
    previous: GenerationRecord
    cause: str
    message: launcher_pb2.ControllerMessage
    # Members of `from_generation` to tell (leavers included: they leave after the agreed step).
    old_members: tuple[str, ...]
    joiners_waiting: set[str]
    # Members of `generation` that have not reported EPOCH_PHASE_RECONFIGURED yet.
    waiting_for: set[str]
    decided_at: float
    deadline: float
    told_old_members: bool = False


@dataclasses.dataclass
class Recovery:
    """A failure whose recovery is not measured yet: from the death (or its detection)
    to the first step the survivors complete (wall clock)."""

    failed_at: float
    detected_at: float
    unit_id: str


@dataclasses.dataclass
class State:
    """Everything the controller knows of one job (monotonic times unless said)."""

    job: JobRecord
    units: dict[str, UnitRecord]
    # The newest generation (while a live change is in flight, the one it goes to).
    generation: GenerationRecord | None
    config: ControllerConfig
    # Whether this controller runs the job's units as Slurm jobs.
    slurm_units: bool = False
    # Units with an open launcher session, the store port each serves, and their heartbeats
    # as of the last tick.
    connected: set[str] = dataclasses.field(default_factory=set)
    store_ports: dict[str, int] = dataclasses.field(default_factory=dict)
    links: dict[str, Link] = dataclasses.field(default_factory=dict)
    stop: PendingStop | None = None
    reconfigure: PendingReconfigure | None = None
    registered_at: dict[str, float] = dataclasses.field(default_factory=dict)
    # When each unit was asked to leave: one still there past the grace a stop gets is
    # cancelled in Slurm.
    leaving_since: dict[str, float] = dataclasses.field(default_factory=dict)
    last_change_at: float | None = None
    generation_started_at: float = 0.0
    reconnect_deadline: float = 0.0
    # While FINISHING: local ranks that exited 0, and those that exited otherwise (how), by unit.
    exited_ok: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    exited_failed: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    # Live mode: the units that held the newest generation's state when it formed.
    state_holders: tuple[str, ...] = ()
    # When the watermark (job.step) was last written.
    step_persisted_at: float = 0.0
    # Live members that reconnected after a controller restart with no workers (when).
    returned_without_workers: dict[str, float] = dataclasses.field(default_factory=dict)
    # While FINISHING: members whose session closed without leaving (when).
    finishing_disconnected: dict[str, float] = dataclasses.field(default_factory=dict)
    # While FINISHING: the units of the world that trained the last step, with their ranks.
    finishing_members: dict[str, int] = dataclasses.field(default_factory=dict)
    failure_detected_at: float | None = None
    recovery: Recovery | None = None
    # Live mode: leaves asked for while a world change is in flight (cause, detail).
    deferred_leaves: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    first_step_generations: set[int] = dataclasses.field(default_factory=set)
    # sbatch refusals in a row, and no new submission before this.
    submit_failures: int = 0
    next_submit_at: float = 0.0
    # When sbatch accepted each unit (wall clock): an older view proves nothing of it.
    submitted_at: dict[str, float] = dataclasses.field(default_factory=dict)
    # Nodes where a unit failed: failures there, and no new unit there before (monotonic).
    node_cooldown: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    growth_held_reason: str = ""
    # Since when the job is DEGRADED (below min_replicas), monotonic; None otherwise.
    degraded_since: float | None = None
    # Live mode with Slurm units: the job gave its nodes back below min_replicas
    # (below_min_release_s); until a world forms again it submits units only once
    # min_replicas nodes are idle, rather than queueing replacements.
    released_below_min: bool = False

    @property
    def live(self) -> bool:
        return self.job.spec.mode == common_pb2.JOB_MODE_LIVE

    @property
    def training_world(self) -> GenerationRecord | None:
        """The generation that trains now: while a live change is in flight, the old one."""
        return self.reconfigure.previous if self.reconfigure is not None else self.generation

    def excluded_nodes(self, now: float) -> tuple[str, ...]:
        return tuple(sorted(node for node, (_, until) in self.node_cooldown.items() if now < until))


def restore(job: JobRecord, units: list[UnitRecord], generation: GenerationRecord | None, *, generation_stopped: bool,
            pending: Mapping[str, object], config: ControllerConfig, now: Now, slurm_units: bool = False) -> State:
    """The state of a job as SQLite holds it, at a controller's start: what was in flight
    (`pending`: node cool-downs, deferred leaves, the finishing world) resumes; a stop cut
    short finishes with whoever comes back."""
    state = State(job=job, units={u.unit_id: u for u in units}, generation=generation, config=config,
                  slurm_units=slurm_units, generation_started_at=now.monotonic,
                  reconnect_deadline=now.monotonic + config.reconnect_grace_s)
    if generation is not None:
        state.finishing_members = {m.unit_id: m.world_share for m in generation.members}
    offset = now.wall - now.monotonic
    cooldown = pending.get("node_cooldown")
    if isinstance(cooldown, Mapping):
        for node, (failures, until) in cooldown.items():
            state.node_cooldown[str(node)] = (int(failures), float(until) - offset)
    finishing = pending.get("finishing_members")
    if isinstance(finishing, Mapping):
        state.finishing_members = {str(u): int(n) for u, n in finishing.items() if u in state.units}
    deferred = pending.get("deferred_leaves")
    if isinstance(deferred, Mapping):
        for unit_id, (cause, detail) in deferred.items():
            if unit_id in state.units and not state.units[unit_id].state.is_final:
                state.deferred_leaves[str(unit_id)] = (str(cause), str(detail))
    # A unit that was asked to leave before the restart: its grace starts again now.
    for unit_id, unit in state.units.items():
        if unit.state is UnitState.LEAVING:
            state.leaving_since[unit_id] = now.monotonic
    if job.state is JobState.RECONFIGURING and generation is not None and not generation_stopped:
        members = {m.unit_id for m in generation.members if not state.units[m.unit_id].state.is_final}
        state.stop = PendingStop(generation=generation.number, cause="restart",
                                 reason="stop resumed after controller restart", detected_at=now.monotonic,
                                 waiting_for=members, deadline=state.reconnect_deadline + config.restart_grace_s)
    return state


def transition(state: State, event: Input, now: Now) -> tuple[State, list[Effect]]:
    """The job's next state after `event` at `now`, and what to do about it. `state` is
    left as it was."""
    step = _Transition(_working_copy(state), now)
    step.handle(event)
    return step.state, step.effects


def _working_copy(state: State) -> State:
    """A copy of `state` that a transition may change: its own job record and containers;
    unit records are copied when first changed (`_Transition.own`); what is never changed in
    place (generations, links, the config) is shared. A deep copy of every unit at every
    input would cost O(units) each time (tens of ms at thousands of units)."""
    stop, pending = state.stop, state.reconfigure
    return dataclasses.replace(
        state, job=dataclasses.replace(state.job), units=dict(state.units), connected=set(state.connected),
        store_ports=dict(state.store_ports), links=dict(state.links),
        stop=dataclasses.replace(stop, waiting_for=set(stop.waiting_for)) if stop is not None else None,
        reconfigure=(dataclasses.replace(pending, joiners_waiting=set(pending.joiners_waiting),
                                         waiting_for=set(pending.waiting_for)) if pending is not None else None),
        registered_at=dict(state.registered_at), leaving_since=dict(state.leaving_since),
        exited_ok={u: set(ranks) for u, ranks in state.exited_ok.items()},
        exited_failed={u: dict(ranks) for u, ranks in state.exited_failed.items()},
        returned_without_workers=dict(state.returned_without_workers),
        finishing_disconnected=dict(state.finishing_disconnected), finishing_members=dict(state.finishing_members),
        deferred_leaves=dict(state.deferred_leaves), first_step_generations=set(state.first_step_generations),
        submitted_at=dict(state.submitted_at), node_cooldown=dict(state.node_cooldown))


# Queries: pure functions of the state, for the gRPC layer and the cluster-wide plans.


def refusal(state: State, register: launcher_pb2.Register) -> str | None:
    """Why a launcher's Register is refused (its secret already checked), or None."""
    job = state.job
    if job.state.is_final:
        return f"job {job.job_id} is {job.state.value}"
    unit = state.units.get(register.unit_id)
    if unit is not None and unit.state.is_final:
        return (f"unit {unit.unit_id} is {unit.state.value} ({unit.reason or 'no reason recorded'}); "
                f"it is no longer part of job {job.job_id}")
    if register.last_epoch > job.generation:
        return (f"unit {register.unit_id} claims generation {register.last_epoch}, "
                f"but job {job.job_id} is at generation {job.generation}")
    in_current = state.generation is not None and state.generation.member(register.unit_id) is not None
    if register.last_epoch and register.last_epoch < job.generation and not in_current:
        return (f"stale generation {register.last_epoch}: job {job.job_id} is at generation {job.generation} "
                f"and unit {register.unit_id} is not part of it")
    if register.last_epoch and unit is None:
        return (f"unit {register.unit_id} claims generation {register.last_epoch} of job {job.job_id}, "
                "which has no record of it")
    return None


def alive_units(state: State) -> list[UnitRecord]:
    """Units that hold or wait for a place (submitted, joining, active)."""
    return [u for u in state.units.values() if u.state in (UnitState.SUBMITTED, UnitState.JOINING,
                                                           UnitState.ACTIVE)]


def growing_job(state: State, view: ClusterView, now: float) -> sharing.GrowingJob | None:
    """What the idle-node share across jobs needs of this job, or None if it runs no units
    in Slurm (or is past training)."""
    job = state.job
    if not state.slurm_units or job.state.is_final or job.state is JobState.FINISHING:
        return None
    excluded = frozenset(state.excluded_nodes(now))
    return sharing.GrowingJob(job_id=job.job_id, weight=job.spec.weight or 1, replicas=len(alive_units(state)),
                              max_replicas=job.spec.max_replicas,
                              fits=frozenset(unit_rules.idle_nodes_for(job.spec, view.nodes, excluded)))


def yielding_job(state: State, view: ClusterView) -> sharing.YieldingJob | None:
    """This job's active units that could yield to a waiting Slurm job, if it allows
    yielding and no world change or stop is in flight."""
    job = state.job
    if (not state.slurm_units or not job.spec.yield_to_pending or job.state is not JobState.RUNNING
            or state.stop is not None or state.reconfigure is not None):
        return None
    candidates = []
    for unit in state.units.values():
        found = view.job(unit.slurm_job_id) if unit.slurm_job_id else None
        if unit.state is not UnitState.ACTIVE or found is None or found.state is not SlurmJobState.RUNNING:
            continue
        order = int(unit.unit_id[1:]) if unit.unit_id[1:].isdigit() else 0
        candidates.append(sharing.YieldableUnit(unit_id=unit.unit_id, nodes=tuple(unit.nodes),
                                                rank=(view.priority_tier(found.partition), found.priority),
                                                order=order))
    return sharing.YieldingJob(job_id=job.job_id, weight=job.spec.weight or 1, min_replicas=job.spec.min_replicas,
                               units=tuple(candidates))


def world_size(state: State) -> int:
    """The size of the world training now (0 when none trains)."""
    world = state.training_world
    return world.world_size if world is not None and state.job.state is JobState.RUNNING else 0


def describe_exit(exit_code: int, signal_number: int) -> str:
    if signal_number:
        try:
            return f"killed by {signal.Signals(signal_number).name}"
        except ValueError:
            return f"killed by signal {signal_number}"
    return f"exit code {exit_code}"


# A launcher's account of a worker's exception goes into events within these bounds,
# whatever the launcher sent.
MAX_WORKER_ERROR_CHARS = 500
MAX_WORKER_TRACEBACK_CHARS = 4000


def describe_worker_exit(exited: launcher_pb2.WorkerExited) -> str:
    """How a worker exited, with why its launcher ended it and the exception it raised:
    'exit code 1: ValueError: boom 42'."""
    how = describe_exit(exited.exit_code, exited.signal)
    if exited.detail:
        how += f" ({exited.detail})"
    if exited.error:
        how += f": {exited.error[:MAX_WORKER_ERROR_CHARS]}"
    return how


def worker_error_fields(exited: launcher_pb2.WorkerExited) -> dict[str, str]:
    """The event fields of a worker's exception (its error file): `error`, `traceback`."""
    fields = {}
    if exited.error:
        fields["error"] = exited.error[:MAX_WORKER_ERROR_CHARS]
    if exited.traceback:
        fields["traceback"] = exited.traceback[-MAX_WORKER_TRACEBACK_CHARS:]
    return fields


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class _Transition:
    """One transition in the making: the state (a copy, changed in place), the clock,
    and the effects so far, in order."""

    def __init__(self, state: State, now: Now) -> None:
        self.state = state
        self.now = now
        self.effects: list[Effect] = []
        # Units whose record this transition copied (it may change those in place).
        self.owned: set[str] = set()

    def own(self, unit: UnitRecord) -> UnitRecord:
        """`unit`'s record, copied on first change so that the state given to `transition`
        stays as it was."""
        if unit.unit_id not in self.owned:
            unit = dataclasses.replace(unit, nodes=list(unit.nodes))
            self.state.units[unit.unit_id] = unit
            self.owned.add(unit.unit_id)
        return unit

    # Shorthands.

    @property
    def job(self) -> JobRecord:
        return self.state.job

    @property
    def config(self) -> ControllerConfig:
        return self.state.config

    def emit(self, *effects: Effect) -> None:
        self.effects.extend(effects)

    def record(self, kind: str, reason: str, *, unit_id: str = "", generation: int | None = None,
               fields: Mapping[str, object] | None = None) -> None:
        self.emit(Record(kind, reason, unit_id=unit_id,
                         generation=self.job.generation if generation is None else generation, fields=fields))

    def send(self, unit_id: str, message: launcher_pb2.ControllerMessage) -> None:
        if unit_id in self.state.connected:
            self.emit(Send(unit_id, message))

    def connected(self, unit_id: str) -> bool:
        return unit_id in self.state.connected

    # The one place inputs are taken apart.

    def handle(self, event: Input) -> None:
        match event:
            case ClockTick(links):
                self.state.links = {u: link for u, link in links.items() if u in self.state.connected}
                self._on_tick(self.now.monotonic)
            case LauncherConnected(unit_id, register):
                self._on_connected(unit_id, register)
            case LauncherSaid(unit_id, message):
                if self.connected(unit_id):
                    self._on_said(unit_id, message)
            case LauncherClosed(unit_id, reason):
                self._on_disconnected(unit_id, reason)
            case CancelRequested(uid):
                if not self.job.state.is_final:
                    self._end(JobState.CANCELLED, "job_cancelled", f"cancelled by uid {uid}")
            case DrainRequested(unit_ids, uid):
                for unit_id in unit_ids:
                    self._leave(unit_id, "drained", f"drained by uid {uid}")
            case ResizeRequested(min_replicas, max_replicas, uid):
                self._on_resize(min_replicas, max_replicas, uid)
            case SlurmObserved(view, grow_allowance, yields):
                self._on_slurm(view, self.now.monotonic, grow_allowance, yields)
            case UnitSubmitted(unit_id, slurm_job_id, error):
                self._on_unit_submitted(unit_id, slurm_job_id, error)

    def _on_connected(self, unit_id: str, register: launcher_pb2.Register) -> None:
        state, now = self.state, self.now.monotonic
        state.connected.add(unit_id)
        state.store_ports[unit_id] = register.store_port
        state.links.pop(unit_id, None)
        unit = state.units.get(unit_id)
        fields = {"address": register.address, "nodes": join_ids(list(register.nodes)),
                  "workers": join_ids([str(p) for p in register.worker_pids])}
        if unit is None or unit.state is UnitState.SUBMITTED:
            unit = self.own(unit or UnitRecord(job_id=self.job.job_id, unit_id=unit_id, state=UnitState.JOINING))
            unit.state = UnitState.JOINING
            unit.nodes = list(register.nodes) or [register.address]
            unit.address = register.address
            unit.procs_per_node = self.job.spec.procs_per_node or 1
            # The id Tidal submitted stays known when a launcher does not report one.
            unit.slurm_job_id = register.slurm_job_id or unit.slurm_job_id
            unit.registered_at = self.now.wall
            state.units[unit_id] = unit
            self.emit(SaveUnit(unit))
            self.record("unit_registered", "launcher registered", unit_id=unit_id, fields=fields)
            state.registered_at[unit_id] = now
            if self.job.state is JobState.FINISHING:
                self._leave(unit_id, "finished", "training finished before this unit joined")
            return
        unit = self.own(unit)
        unit.address = register.address or unit.address
        if self.job.state is JobState.FINISHING:
            if unit.state is UnitState.JOINING or not register.worker_pids:
                # Not part of the finished world, or its workers are gone (they exited while
                # the controller was away): nothing more to wait for here.
                self._leave(unit_id, "finished", "reconnected after the last step")
            return
        generation = state.generation
        member = generation.member(unit_id) if generation is not None else None
        if unit.state is UnitState.JOINING:
            state.registered_at[unit_id] = now
            self.record("launcher_reconnected", "joining unit reconnected", unit_id=unit_id, fields=fields)
            return
        if member is None or generation is None:
            return
        if state.stop is not None and state.stop.generation == generation.number:
            state.stop.waiting_for.add(unit_id)
            self.send(unit_id, self._stop_message(state.stop.generation, state.stop.reason, state.stop.cause))
            self.record("launcher_reconnected", "told to stop the generation being stopped", unit_id=unit_id,
                        generation=generation.number, fields=fields)
        elif register.last_epoch == generation.number and register.worker_pids:
            self.record("launcher_reattached", f"still running generation {generation.number}; workers untouched",
                        unit_id=unit_id, generation=generation.number, fields=fields)
        elif state.live and register.last_epoch and not register.worker_pids and self.job.state is JobState.RUNNING:
            # A live member back with no workers lost them while the controller was away: its
            # queued reports (the exit, or "finished") follow on this stream. No fresh worker
            # goes into the running world; if those reports do not settle it within
            # heartbeat_timeout_s, the unit has failed (`_on_tick`).
            state.returned_without_workers[unit_id] = now
            self.record("launcher_reconnected", "back with no workers; waiting for its reports", unit_id=unit_id,
                        generation=generation.number, fields=fields)
        elif self.job.state is JobState.RUNNING:
            self.send(unit_id, self._start_message(generation, unit_id))
            had = (f"at generation {register.last_epoch}" if register.worker_pids
                   else "without workers")
            self.record("epoch_start_resent", f"reconnected {had}; sent generation {generation.number} again",
                        unit_id=unit_id, generation=generation.number, fields=fields)

    def _on_said(self, unit_id: str, message: launcher_pb2.LauncherMessage) -> None:
        state = self.state
        kind = message.WhichOneof("body")
        if kind == "worker_exited":
            self._on_worker_exited(unit_id, message.worker_exited)
        elif kind == "leave_request":
            request = message.leave_request
            cause = launcher_pb2.LeaveCause.Name(request.cause).removeprefix("LEAVE_CAUSE_").lower()
            self._leave(unit_id, cause, request.detail or cause)
        elif kind == "epoch_report":
            report = message.epoch_report
            if report.store_port:
                state.store_ports[unit_id] = report.store_port
            if report.phase == launcher_pb2.EPOCH_PHASE_LEFT:
                unit = state.units.get(unit_id)
                if (state.live and report.step > self.job.step and report.epoch == self.job.generation
                        and unit is not None and unit.state is UnitState.LEAVING):
                    # It saved the state at that step before leaving (save_state): every rank
                    # had committed it, and the next world's target is that step, not the
                    # heartbeats' older figure.
                    self.job.step = report.step
                    self.emit(SaveJob(self.job))
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
            elif state.reconfigure is not None and report.epoch == state.reconfigure.generation:
                self._on_reconfigure_report(unit_id, report)
            if (report.phase in (launcher_pb2.EPOCH_PHASE_STOPPED, launcher_pb2.EPOCH_PHASE_LEFT)
                    and state.stop is not None and report.epoch == state.stop.generation):
                state.stop.waiting_for.discard(unit_id)
                self._maybe_finish_stop()

    def _on_worker_exited(self, unit_id: str, exited: launcher_pb2.WorkerExited) -> None:
        state = self.state
        if self.job.state is JobState.FINISHING:
            self._on_exit_after_finish(unit_id, exited)
            return
        if state.live and exited.exit_code == EXIT_STATE_LOST:
            # The worker refused to train: no state at the target and no checkpoint (its
            # own report says more, and normally comes first).
            self._on_state_lost(f"a worker of unit {unit_id} exited {EXIT_STATE_LOST}: no replica holds the "
                                f"training state at step {self.job.step} and there is no checkpoint")
            return
        current = {state.generation.number} if state.generation is not None else set()
        if state.reconfigure is not None:
            current.add(state.reconfigure.from_generation)
        if state.generation is None or exited.epoch not in current or self.job.state is not JobState.RUNNING:
            self.emit(Metric("stale_messages"),
                      Note("stale_message_ignored", {"unit": unit_id, "kind": "worker_exited",
                                                     "message_generation": exited.epoch}))
            return
        member = state.generation.member(unit_id)
        if member is None:
            return
        rank = member.first_rank + exited.local_rank
        if exited.exit_code == 0 and exited.signal == 0:
            # A rank that exits 0 is done training (restart mode's only sign of the end;
            # live mode says "finished" first): the job finishes, nothing re-forms.
            self._begin_finishing(unit_id, exited.epoch, self.job.step, f"rank {rank} (pid {exited.pid}) exited 0")
            self._on_exit_after_finish(unit_id, exited)
            return
        self._fail(unit_id, f"worker rank {rank} (pid {exited.pid}) {describe_worker_exit(exited)}",
                   "silent" if exited.detail else "worker_exit", self.now.monotonic,
                   failed_at=exited.exited_at.ToNanoseconds() / 1e9 if exited.HasField("exited_at") else None,
                   fields=worker_error_fields(exited))

    def _on_disconnected(self, unit_id: str, reason: str) -> None:
        state = self.state
        state.connected.discard(unit_id)
        state.links.pop(unit_id, None)
        unit = state.units.get(unit_id)
        if unit is None or unit.state.is_final:
            return
        if self.job.state is JobState.FINISHING:
            # Past the last step a closed session is no failure; it may be a blip, so the
            # unit has reconnect_grace_s to come back before it counts as gone (`_on_tick`).
            state.finishing_disconnected[unit_id] = self.now.monotonic
            return
        if unit.state is UnitState.LEAVING or self.job.state.is_final:
            self._mark_left(unit_id, f"session closed ({reason})")
            if state.stop is not None:
                state.stop.waiting_for.discard(unit_id)
                self._maybe_finish_stop()
            return
        if unit.state is UnitState.ACTIVE and state.generation is not None and state.generation.member(unit_id):
            self._fail(unit_id, f"launcher stream broke: {reason}", "stream", self.now.monotonic)
            return
        state.registered_at.pop(unit_id, None)
        self.record("launcher_disconnected", reason, unit_id=unit_id)

    def _on_tick(self, now: float) -> None:
        state = self.state
        self._cancel_overdue_leavers(now)
        if self.job.state.is_final:
            return
        if self.job.state is JobState.FINISHING:
            for unit_id, unit in state.units.items():
                if unit.state.is_final or self.connected(unit_id):
                    state.finishing_disconnected.pop(unit_id, None)
                    continue
                since = state.finishing_disconnected.get(unit_id)
                if (since is not None and now - since > self.config.reconnect_grace_s) or (
                        since is None and now > state.reconnect_deadline):
                    state.finishing_disconnected.pop(unit_id, None)
                    # Whatever is left of it gives its allocation back.
                    self._cancel_in_slurm(unit)
                    self._mark_left(unit_id, "launcher out of touch after the last step")
            self._maybe_complete()
            return
        self._observe_progress(now)
        for unit_id, since in list(state.returned_without_workers.items()):
            if now - since > self.config.heartbeat_timeout_s:
                del state.returned_without_workers[unit_id]
                returned = state.units.get(unit_id)
                if returned is not None and returned.state is UnitState.ACTIVE and self.job.state is JobState.RUNNING:
                    self._fail(unit_id, "came back after a controller restart with no workers left, and said "
                               "nothing of them", "worker_exit", now)
        if state.stop is not None:
            if now > state.stop.deadline:
                for unit_id in sorted(state.stop.waiting_for):
                    self._fail(unit_id, f"did not confirm the stop of generation {state.stop.generation} in time",
                               "stop", now)
                if state.stop is not None:
                    state.stop.waiting_for.clear()
                self._maybe_finish_stop()
            return
        if self.job.state is JobState.DEGRADED:
            self._release_below_min(now)
            if self.job.state.is_final:
                return
        if self.job.state is JobState.RUNNING and state.generation is not None:
            failures = self._health_failures(now)
            if failures:
                # Failures found together are taken together: the world re-forms once.
                together = [(f.unit_id, f.reason, now) for f in failures
                            if self._fail(f.unit_id, f.reason, f.cause, now, regroup=False)]
                if together and self.job.state is JobState.RUNNING:
                    self._regroup(together)
                if self.job.state is not JobState.RUNNING:
                    return
        if state.reconfigure is not None:
            if now > state.reconfigure.deadline:
                pending = state.reconfigure
                late = sorted(pending.joiners_waiting if not pending.told_old_members else pending.waiting_for)
                for unit_id in late:
                    self._fail(unit_id, f"did not reach generation {pending.generation} within "
                               f"{self.config.reconfigure_timeout_s:g} s", "reconfigure", now)
            return
        if (state.deferred_leaves and self.job.state is JobState.RUNNING and state.generation is not None
                and (now > state.reconnect_deadline or all(self.connected(u) for u in state.generation.unit_ids))):
            # Deferred behind a world change that a controller restart cut short: once the
            # world's launchers are back, so that the leave is a change, not a failure.
            deferred, state.deferred_leaves = state.deferred_leaves, {}
            self._save_pending()
            for leave_unit, (cause, detail) in deferred.items():
                self._leave(leave_unit, cause, detail)
            return
        self._decide(now)

    def _sizes(self) -> tuple[int, ...]:
        """The world sizes (in replicas) the job allows."""
        spec = self.job.spec
        return tuple(planning.allowed_sizes(spec.min_replicas, spec.max_replicas, spec.replica_step,
                                            list(spec.allowed_replicas)))

    def _health_failures(self, now: float) -> list[Failure]:
        state = self.state
        assert state.generation is not None
        observed: list[UnitHealth] = []
        for member in state.generation.members:
            if state.units[member.unit_id].state is not UnitState.ACTIVE:
                continue
            connected = self.connected(member.unit_id)
            link = state.links.get(member.unit_id)
            observed.append(UnitHealth(
                unit_id=member.unit_id, connected=connected,
                last_heartbeat_at=(link.last_heartbeat_at if link else now) if connected else None,
                progress_at=link.progress_at if link else {}, beat_at=link.beat_at if link else {},
                waiting=link.waiting if link else {}))
        policy = HealthPolicy(self.config.heartbeat_timeout_s, self.config.progress_timeout_s)
        return health_verdicts(observed, now=now, policy=policy, generation_started_at=state.generation_started_at,
                               reconnect_deadline=state.reconnect_deadline)

    def _decide(self, now: float, after: str = "") -> None:
        state = self.state
        generation = state.generation
        running = self.job.state is JobState.RUNNING and generation is not None
        if running and generation is not None:
            members = generation.unit_ids
        else:
            members = tuple(u for u, unit in state.units.items()
                            if unit.state is UnitState.ACTIVE and self.connected(u))
        joiners = {u: state.registered_at.get(u, now) for u, unit in state.units.items()
                   if unit.state is UnitState.JOINING and self.connected(u)}
        spec = self.job.spec
        snapshot = planning.WorldSnapshot(
            running=running, members=members, joiners=joiners, min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas, sizes=self._sizes(),
            last_change_at=state.last_change_at, join_settle_s=self.config.join_settle_s,
            scale_up_snooze_s=self.config.scale_up_snooze_s,
            expected=(sum(1 for u in state.units.values() if u.state is UnitState.SUBMITTED)
                      if state.slurm_units else None))
        action = planning.decide_world(snapshot, now)
        match action:
            case planning.Form():
                if after:
                    action = dataclasses.replace(action, reason=f"{after}; {action.reason}")
                self._start_generation(members, action, now)
            case planning.Grow():
                if generation is None or not all(self.connected(u) for u in generation.unit_ids):
                    # A member not back yet after a controller restart: grow once it is.
                    return
                if state.live:
                    self._reconfigure(action.joiners, (), "grow", action.reason, now)
                elif not self._next_generation_now(generation.unit_ids, action.joiners, "grow", action.reason):
                    self._begin_stop("grow", action.reason, now)
            case planning.Wait():
                if not running and self.job.state is JobState.RUNNING:
                    self._set_state(JobState.DEGRADED, action.reason)

    # Failure and stop.

    def _fail(self, unit_id: str, reason: str, cause: str, detected_at: float,
              failed_at: float | None = None, regroup: bool = True,
              fields: Mapping[str, str] | None = None) -> bool:
        """The one failure path: record, tell the failed unit to kill its workers, and move
        the others to the next generation (`_regroup`; with `regroup` False the caller does,
        once for failures found together). `failed_at` (wall clock) is when the failure
        happened, where known; the survivors' first step after it ends the recovery;
        `fields` go into the failure's event besides its cause (a worker's exception).
        Whether the running world must re-form without the unit."""
        state = self.state
        unit = state.units.get(unit_id)
        if unit is None or unit.state.is_final:
            return False
        if self.job.state is JobState.FINISHING:
            # Training is over: nothing to recover; the unit is just gone.
            self._mark_left(unit_id, f"after the last step: {reason}")
            self._maybe_complete()
            return False
        number = state.generation.number if state.generation is not None else 0
        was_member = (state.generation is not None and state.generation.member(unit_id) is not None
                      and unit.state in (UnitState.ACTIVE, UnitState.LEAVING)
                      and self.job.state in (JobState.RUNNING, JobState.RECONFIGURING))
        unit = self.own(unit)
        unit.state = UnitState.FAILED
        unit.reason = reason
        self.emit(SaveUnit(unit), Record("failure_detected", reason, unit_id=unit_id, generation=number,
                                         fields={"cause": cause, **(fields or {})}), Metric("failures", label=cause))
        if state.slurm_units:
            self._cool_down(unit, detected_at)
            # A failed unit never comes back: whatever is left of it (a hung launcher, a
            # node whose slurmd died) gives its allocation back.
            self._cancel_in_slurm(unit)
        if self.connected(unit_id):
            self.send(unit_id, self._stop_message(number, reason, "failure", failed_unit_id=unit_id))
            self.emit(Close(unit_id, f"unit {unit_id} failed: {reason}"))
        if not was_member:
            return False
        if state.stop is not None:
            state.stop.waiting_for.discard(unit_id)
            self._maybe_finish_stop()
            return False
        if state.recovery is None:
            # (A recovery still unmeasured keeps its start: the first failure's.)
            state.failure_detected_at = detected_at
            wall_detected = self.now.wall - (self.now.monotonic - detected_at)
            state.recovery = Recovery(failed_at=failed_at or wall_detected, detected_at=wall_detected,
                                      unit_id=unit_id)
        if regroup:
            self._regroup([(unit_id, reason, detected_at)])
        return True

    def _regroup(self, failed: list[tuple[str, str, float]]) -> None:
        """After the failure of members of the running generation: the next one at once, or
        a stop round first."""
        what = "; ".join(f"unit {unit_id} failed: {reason}" for unit_id, reason, _ in failed)
        if not self._go_on_without(what):
            self._begin_stop("failure", what, min(at for _, _, at in failed))

    def _go_on_without(self, what: str) -> bool:
        """A failure is one message to each survivor: the next generation, formed from the
        survivors in this transition. In live mode the launcher hands it to the workers,
        which leave the broken world for it (a rank in a collective with the dead one sees
        the collective fail; the others move at the end of the step). In restart mode the
        launcher stops its workers with the failure's grace, then starts the new ones; each
        launcher hosting a generation has its next store ready, so no stop round is needed
        to learn where the next one meets. Whether it formed; if not (a live change in
        flight, or the survivors alone make no size the job allows), the generation is
        stopped first."""
        state = self.state
        generation = state.generation
        if state.reconfigure is not None or generation is None or self.job.state is not JobState.RUNNING:
            return False
        survivors = tuple(u for u in generation.unit_ids if state.units[u].state is UnitState.ACTIVE)
        if not all(self.connected(u) for u in survivors):
            # A survivor not back yet after a controller restart: a stop round waits for it.
            return False
        # Joiners that have settled come along, up to max_replicas: one change, not two.
        settled = sorted((at, u) for u, unit in state.units.items()
                         if unit.state is UnitState.JOINING and self.connected(u)
                         and (at := state.registered_at.get(u, self.now.monotonic))
                         <= self.now.monotonic - self.config.join_settle_s)
        room = max(0, self.job.spec.max_replicas - len(survivors))
        joiners = tuple(u for _, u in settled[:room])
        reason = f"{what}; the survivors go on without it"
        return (bool(joiners) and self._next_generation_now(survivors, joiners, "failure", reason)) or \
            self._next_generation_now(survivors, (), "failure", reason)

    def _next_generation_now(self, members: tuple[str, ...], joiners: tuple[str, ...], cause: str,
                             reason: str) -> bool:
        """Form and send the next generation of `members` + `joiners` now, as one message to
        each (StartEpoch; in restart mode the launcher stops the old workers first), if
        they make a size the job allows and one of them can host the rendezvous. Whether it
        formed."""
        state = self.state
        previous = state.generation
        count = len(members) + len(joiners)
        if not members or planning.choose_world_size(count, self._sizes()) != count:
            return False
        self._start_generation(members, planning.Form(replicas=count, joiners=joiners, reason=reason),
                               self.now.monotonic, cause=cause)
        if previous is None or self.job.generation == previous.number:
            return False
        self.emit(GenerationStopped(self.job.job_id, previous.number, self.now.wall))
        return True

    def _stop_grace_s(self, cause: str) -> float:
        """Workers' SIGTERM-to-SIGKILL grace: short for a failure, longer for a planned change."""
        return self.config.failure_stop_grace_s if cause == "failure" else self.config.restart_grace_s

    def _stop_message(self, generation: int, reason: str, cause: str,
                      failed_unit_id: str = "") -> launcher_pb2.ControllerMessage:
        return launcher_pb2.ControllerMessage(stop_epoch=launcher_pb2.StopEpoch(
            epoch=generation, reason=reason, failed_unit_id=failed_unit_id,
            grace=duration(self._stop_grace_s(cause))))

    def _begin_stop(self, cause: str, reason: str, detected_at: float) -> None:
        """Broadcast STOP for the running generation to every member and wait for each to
        confirm (or fail past the deadline)."""
        state = self.state
        assert state.generation is not None
        now = self.now.monotonic
        waiting = {m.unit_id for m in state.generation.members
                   if state.units[m.unit_id].state in (UnitState.ACTIVE, UnitState.LEAVING)
                   and (self.connected(m.unit_id) or now < state.reconnect_deadline)}
        # Live-mode workers stop in-process at their next check (a micro-batch boundary, or a
        # collective failing): they get the planned-change grace, not a failure's.
        grace_s = self.config.restart_grace_s if state.live else self._stop_grace_s(cause)
        deadline = max(now + grace_s + self.config.heartbeat_timeout_s, state.reconnect_deadline)
        state.stop = PendingStop(generation=state.generation.number, cause=cause, reason=reason,
                                 detected_at=detected_at, waiting_for=waiting, deadline=deadline)
        state.reconfigure = None
        self.job.state = JobState.RECONFIGURING
        self.emit(SaveJob(self.job))
        self.record("epoch_stopping", reason, generation=state.generation.number,
                    fields={"cause": cause, "waiting_for": join_ids(sorted(waiting))})
        message = self._stop_message(state.stop.generation, reason, cause)
        for unit_id in sorted(waiting):
            if state.units[unit_id].state is not UnitState.LEAVING:
                self.send(unit_id, message)
        self._maybe_finish_stop()

    def _maybe_finish_stop(self) -> None:
        state = self.state
        stop = state.stop
        if stop is None or stop.waiting_for:
            return
        now = self.now.monotonic
        state.stop = None
        elapsed = now - stop.detected_at
        self.emit(GenerationStopped(self.job.job_id, stop.generation, self.now.wall))
        self.record("epoch_stopped", f"every rank of generation {stop.generation} stopped",
                    generation=stop.generation,
                    fields={"cause": stop.cause, "detection_to_all_stopped_s": f"{elapsed:.3f}"})
        if stop.cause == "failure":
            self.emit(Metric("stop_duration", elapsed))
        if self.job.state.is_final:
            return
        self._decide(now, after=stop.reason)
        if self.job.state is JobState.RECONFIGURING:
            alive = sum(1 for u in state.units.values() if u.state in (UnitState.ACTIVE, UnitState.JOINING))
            self._set_state(JobState.DEGRADED, f"{alive} replica(s) alive, below min_replicas "
                            f"{self.job.spec.min_replicas}; waiting for more")

    # Forming generations.

    def _candidates(self, unit_ids: list[str]) -> list[planning.Candidate]:
        state = self.state
        previous = state.generation
        candidates = []
        for unit_id in unit_ids:
            unit = state.units[unit_id]
            member = previous.member(unit_id) if previous is not None else None
            store_port = state.store_ports.get(unit_id, 0)
            if (not state.live and previous is not None and previous.rendezvous_unit_id == unit_id
                    and store_port == previous.rendezvous_port):
                # Restart mode: that store is the running generation's; the unit's fresh one
                # is not reported yet (it comes with STARTED), so it cannot host the next.
                store_port = 0
            candidates.append(planning.Candidate(
                unit_id=unit_id, nodes=tuple(unit.nodes), procs_per_node=unit.procs_per_node, address=unit.address,
                store_port=store_port,
                previous_group_rank=member.group_rank if member else None, registered_at=unit.registered_at))
        return candidates

    def _start_generation(self, survivors: tuple[str, ...], form: planning.Form, now: float,
                          cause: str = "") -> None:
        """Commit the next generation of `survivors` + the form's joiners and send each its
        StartEpoch. `cause` (failure, grow, leave) is set when it replaces a running
        generation in one message: the old workers' stop grace follows from it."""
        state = self.state
        chosen = list(survivors) + list(form.joiners)
        try:
            plan = planning.plan_generation(job_id=self.job.job_id, number=self.job.generation + 1,
                                       candidates=self._candidates(chosen), replicas=form.replicas,
                                       reason=form.reason, now=self.now.wall, resume_step=self.job.step)
        except ValueError as error:
            self.emit(Note("generation_not_formed", {"reason": str(error)}, warning=True))
            return
        self.job.generation = plan.number
        self.job.state = JobState.RUNNING
        fields: dict[str, object] = {"world_size": plan.world_size, "replicas": len(plan.members),
                                     "members": join_ids(list(plan.unit_ids)),
                                     "rendezvous": f"{plan.rendezvous_host}:{plan.rendezvous_port}"}
        if state.failure_detected_at is not None:
            fields["detection_to_started_s"] = f"{now - state.failure_detected_at:.3f}"
        fields.update(self._state_fields(plan))
        self._commit_generation(plan, chosen, "world_formed", form.reason, fields)
        if state.failure_detected_at is not None:
            self.emit(Metric("recovery_duration", now - state.failure_detected_at))
            state.failure_detected_at = None
        self.emit(Metric("generations_formed", label=self.job.job_id))
        state.generation = plan
        state.generation_started_at = now
        state.last_change_at = now
        state.exited_ok = {}
        state.reconfigure = None
        for unit_id in plan.unit_ids:
            # Each is sent this generation now: nothing left to wait for from before.
            state.returned_without_workers.pop(unit_id, None)
        for unit_id in plan.unit_ids:
            self.send(unit_id, self._start_message(plan, unit_id, stop_grace_s=(
                self._stop_grace_s(cause) if cause else None)))

    def _commit_generation(self, plan: GenerationRecord, unit_ids: list[str], kind: str, reason: str,
                           fields: dict[str, object]) -> None:
        """What is persisted before any message about the generation leaves: the generation
        with its rank table, the job's generation number, each of `unit_ids` in its place (a
        member is active; a unit left out waits as a joiner) and the event `kind`."""
        members = set(plan.unit_ids)
        self.emit(SaveGeneration(plan), SaveJob(self.job))
        for unit_id in unit_ids:
            unit = self.own(self.state.units[unit_id])
            member = plan.member(unit_id)
            unit.state = UnitState.ACTIVE if unit_id in members else UnitState.JOINING
            unit.group_rank = member.group_rank if member else -1
            self.emit(SaveUnit(unit))
        self.record(kind, reason, generation=plan.number, fields=fields)

    def _start_message(self, generation: GenerationRecord, unit_id: str,
                       stop_grace_s: float | None = None) -> launcher_pb2.ControllerMessage:
        start = launcher_pb2.StartEpoch(
            epoch=generation.number, rank_table=generation.rank_table(only_unit=unit_id),
            rendezvous=generation.rendezvous(), resume_step=generation.resume_step,
            state_holders=list(self.state.state_holders))
        if stop_grace_s is not None:
            start.stop_grace.CopyFrom(duration(stop_grace_s))
        return launcher_pb2.ControllerMessage(start_epoch=start)

    def _state_fields(self, plan: GenerationRecord) -> dict[str, object]:
        """Decide and describe the state a new generation must be at: its target step (the
        watermark) and its holders. With none holding it past step 0 (live mode), the event
        says so: the workers load a checkpoint at or before it, or refuse to train."""
        state = self.state
        state.state_holders = self._holders(plan.unit_ids)
        if state.live and plan.resume_step > 0 and not state.state_holders:
            self.record("state_not_held",
                        f"no member of generation {plan.number} holds the training state at step "
                        f"{plan.resume_step}: its workers resume from a checkpoint at or before it, or "
                        "refuse to train", generation=plan.number, fields={"target_step": plan.resume_step})
        return {"target_step": plan.resume_step, "state_holders": join_ids(list(state.state_holders))}

    def _holders(self, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
        """Live mode: which of `unit_ids` hold the state at the job's committed step, as
        their heartbeats said by the last tick."""
        state = self.state
        if not state.live:
            return ()
        return state_holders(self.job.step, {
            unit_id: list(link.steps.values()) for unit_id in unit_ids
            if self.connected(unit_id) and (link := state.links.get(unit_id)) is not None})

    # Leaving.

    def _leave(self, unit_id: str, cause: str, detail: str) -> None:
        state = self.state
        unit = state.units.get(unit_id)
        if unit is None or unit.state.is_final or unit.state is UnitState.LEAVING:
            return
        was_active = unit.state is UnitState.ACTIVE
        connected = self.connected(unit_id)
        running = (was_active and self.job.state is JobState.RUNNING and state.generation is not None
                   and state.stop is None)
        if running and state.live and connected and state.reconfigure is not None:
            # One world change at a time: this leave follows the one in flight.
            state.deferred_leaves.setdefault(unit_id, (cause, detail))
            self._save_pending()
            return
        unit = self.own(unit)
        unit.state = UnitState.LEAVING
        state.leaving_since[unit_id] = self.now.monotonic
        unit.reason = f"{cause}: {detail}" if detail != cause else cause
        number = state.generation.number if state.generation is not None else 0
        self.emit(SaveUnit(unit))
        self.record("unit_leaving", unit.reason, unit_id=unit_id, generation=number, fields={"cause": cause})
        if running and state.live and connected:
            assert state.generation is not None
            remaining = [m.unit_id for m in state.generation.members if m.unit_id != unit_id]
            if len(remaining) >= self.job.spec.min_replicas and all(self.connected(u) for u in remaining):
                self._reconfigure((), (unit_id,), "leave", f"unit {unit_id} leaves ({cause})", self.now.monotonic)
                return
        if connected:
            save_state = was_active and self._holds_last_state(unit_id)
            if save_state:
                self.record("state_saving", f"unit {unit_id} holds the last copy of the training state: its workers "
                            "write it to disk before leaving, and the next world resumes from it",
                            unit_id=unit_id, generation=number)
            self.send(unit_id, launcher_pb2.ControllerMessage(leave=launcher_pb2.Leave(
                epoch=number, reason=unit.reason, save_state=save_state)))
        else:
            self._mark_left(unit_id, "not connected when asked to leave")
        if state.stop is not None:
            if connected and state.stop.generation == number and was_active:
                state.stop.waiting_for.add(unit_id)
            return
        if was_active and self.job.state is JobState.RUNNING and state.generation is not None:
            staying = tuple(u for u in state.generation.unit_ids if state.units[u].state is UnitState.ACTIVE)
            if state.live or not all(self.connected(u) for u in staying) or not self._next_generation_now(
                    staying, (), "leave", f"unit {unit_id} leaves ({cause})"):
                self._begin_stop("leave", f"unit {unit_id} leaves ({cause})", self.now.monotonic)

    def _release_below_min(self, now: float) -> None:
        """Live mode with Slurm units: below min_replicas for `below_min_release_s` since the
        last registration, the units that are left (they train nothing) give their nodes
        back; the last holder of the training state saves it as it leaves (`_leave`), the
        replacements queued in Slurm are cancelled (they would take the nodes given back),
        and the job submits units again only once min_replicas nodes are idle, resuming
        from the saved state."""
        state = self.state
        holding = sorted(u for u, unit in state.units.items()
                         if unit.state in (UnitState.ACTIVE, UnitState.JOINING) and self.connected(u))
        # A registration restarts the wait: more units may be on their way.
        since = max([state.degraded_since or now, *(state.registered_at.get(u, 0.0) for u in holding)])
        if not (state.live and state.slurm_units) or not planning.release_below_min(
                below_min_since=since, now=now, release_after_s=self.config.below_min_release_s,
                holding=len(holding)):
            return
        spec = self.job.spec
        queued = sorted(u for u, unit in state.units.items() if unit.state is UnitState.SUBMITTED)
        state.released_below_min = True
        self.record("below_min_released",
                    f"below min_replicas {spec.min_replicas} for {now - since:.0f} s: {len(holding)} unit(s) give "
                    "their nodes back; the last to hold the training state saves it, and the job resumes from it "
                    f"once {spec.min_replicas} node(s) are idle",
                    fields={"units": join_ids(holding), "cancelled_queued": join_ids(queued),
                            "below_min_release_s": f"{self.config.below_min_release_s:g}"})
        for unit_id in queued:
            self._cancel_in_slurm(state.units[unit_id])
            self._mark_left(unit_id, "cancelled while queued: the job gave its nodes back below min_replicas")
        # Those without the state first, so that the holder is the last to go and saves it.
        holders = set(state.state_holders)
        for unit_id in sorted(holding, key=lambda u: (u in holders, u)):
            self._leave(unit_id, "released", f"below min_replicas {spec.min_replicas} for "
                        f"{self.config.below_min_release_s:g} s (below_min_release_s): nodes given back")

    def _holds_last_state(self, unit_id: str) -> bool:
        """Live mode: whether `unit_id` is the running generation's last member that is
        still active and connected, or the others hold no state by their heartbeats (with
        it gone, no live process holds the state)."""
        state = self.state
        if not state.live or state.generation is None or unit_id not in state.generation.unit_ids:
            return False
        if self.job.state not in (JobState.RUNNING, JobState.RECONFIGURING, JobState.DEGRADED):
            return False
        others = tuple(u for u in state.generation.unit_ids
                       if u != unit_id and state.units[u].state is UnitState.ACTIVE and self.connected(u))
        # Another member counts only if it holds the state by its heartbeats: a joiner whose
        # workers never formed a world (or got the state) would take nothing with it.
        return not others or (not self._holders(others) and self.job.step > 0)

    def _mark_left(self, unit_id: str, reason: str) -> None:
        unit = self.state.units.get(unit_id)
        if unit is None or unit.state.is_final:
            return
        unit = self.own(unit)
        unit.state = UnitState.LEFT
        # Why it left, after why it was asked to (a preemption, a drain), if it was.
        unit.reason = f"{unit.reason}; {reason}" if unit.reason and unit.reason != reason else reason
        self.emit(SaveUnit(unit))
        self.record("unit_left", reason, unit_id=unit_id)

    # Live mode: world changes in-process.

    def _reconfigure(self, joiners: tuple[str, ...], leaving: tuple[str, ...], cause: str, reason: str,
                     now: float) -> None:
        """Plan the next generation from the running one plus `joiners` minus `leaving`,
        commit it, and tell the joiners (or, with none, every old member) to move there."""
        state = self.state
        previous = state.generation
        assert previous is not None
        kept = [m.unit_id for m in previous.members if m.unit_id not in leaving]
        chosen = kept + list(joiners)
        try:
            plan = planning.plan_generation(job_id=self.job.job_id, number=self.job.generation + 1,
                                       candidates=self._candidates(chosen), replicas=len(chosen), reason=reason,
                                       now=self.now.wall, resume_step=self.job.step)
        except ValueError as error:
            self.emit(Note("reconfigure_not_planned", {"reason": str(error)}, warning=True))
            return
        old_members = tuple(m.unit_id for m in previous.members)
        # The state's source: the new world's rank 0, a survivor (survivors keep their order).
        source = min(plan.members, key=lambda m: m.group_rank).unit_id
        fields_of_state = self._state_fields(plan)
        message = launcher_pb2.ControllerMessage(reconfigure=launcher_pb2.Reconfigure(
            epoch=plan.number, from_epoch=previous.number, rank_table=plan.rank_table(),
            rendezvous=plan.rendezvous(), state_sources=list(state.state_holders) or [source],
            target_step=plan.resume_step))
        self.job.generation = plan.number
        fields: dict[str, object] = {"cause": cause, "from_epoch": previous.number, "world_size": plan.world_size,
                                     "replicas": len(plan.members), "members": join_ids(list(plan.unit_ids)),
                                     "joiners": join_ids(list(joiners)), "leaving": join_ids(list(leaving)),
                                     "state_source": source, **fields_of_state}
        self._commit_generation(plan, chosen, "world_reconfiguring", reason, fields)
        self.emit(Metric("generations_formed", label=self.job.job_id))
        state.reconfigure = PendingReconfigure(
            generation=plan.number, from_generation=previous.number, previous=previous, cause=cause, message=message,
            old_members=old_members, joiners_waiting=set(joiners), waiting_for=set(plan.unit_ids), decided_at=now,
            deadline=now + self.config.reconfigure_timeout_s)
        state.generation = plan
        state.generation_started_at = now
        state.last_change_at = now
        state.exited_ok = {}
        if joiners:
            for unit_id in joiners:
                self.send(unit_id, message)
        else:
            self._tell_old_members()

    def _tell_old_members(self) -> None:
        pending = self.state.reconfigure
        assert pending is not None
        pending.told_old_members = True
        for unit_id in pending.old_members:
            if not self.state.units[unit_id].state.is_final:
                self.send(unit_id, pending.message)

    def _on_reconfigure_report(self, unit_id: str, report: launcher_pb2.EpochReport) -> None:
        state = self.state
        pending = state.reconfigure
        assert pending is not None
        now = self.now.monotonic
        if report.phase == launcher_pb2.EPOCH_PHASE_STARTED and unit_id in pending.joiners_waiting:
            pending.joiners_waiting.discard(unit_id)
            if not pending.joiners_waiting and not pending.told_old_members:
                self.record("joiners_ready", "every joiner's workers are up", generation=pending.generation,
                            fields={"decision_to_ready_s": f"{now - pending.decided_at:.3f}"})
                self._tell_old_members()
        elif report.phase == launcher_pb2.EPOCH_PHASE_RECONFIGURED:
            pending.waiting_for.discard(unit_id)
            if pending.waiting_for or not pending.told_old_members:
                return
            state.reconfigure = None
            # (The watermark rises from heartbeats only, so that it never runs ahead of the
            # steps the state holders are judged by.)
            self.emit(SaveJob(self.job))
            self.record("world_reconfigured", f"every rank moved from generation {pending.from_generation} "
                        "in-process", generation=pending.generation,
                        fields={"cause": pending.cause, "at_step": report.step,
                                "world_size": state.generation.world_size if state.generation else 0,
                                "decision_to_reconfigured_s": f"{now - pending.decided_at:.3f}"})
            deferred, state.deferred_leaves = state.deferred_leaves, {}
            self._save_pending()
            for leave_unit, (cause, detail) in deferred.items():
                self._leave(leave_unit, cause, detail)

    def _on_first_step(self, unit_id: str, report: launcher_pb2.EpochReport) -> None:
        """The first step of a generation committed (every rank commits it together): the
        end of a recovery, or of a planned change."""
        state = self.state
        generation = state.generation
        if generation is None or report.epoch != generation.number or report.epoch in state.first_step_generations:
            return
        state.first_step_generations.add(report.epoch)
        at = report.at.ToNanoseconds() / 1e9 if report.HasField("at") else self.now.wall
        fields: dict[str, object] = {"step": report.step, "world_size": generation.world_size}
        recovery = state.recovery
        if recovery is not None:
            state.recovery = None
            fields.update({"failed_unit": recovery.unit_id,
                           "failure_to_first_step_s": f"{at - recovery.failed_at:.3f}",
                           "detection_to_first_step_s": f"{at - recovery.detected_at:.3f}"})
            self.record("recovered", f"survivors completed step {report.step} at world size "
                        f"{generation.world_size}", unit_id=unit_id, generation=report.epoch, fields=fields)
            return
        self.record("first_step", f"first step of generation {report.epoch} completed", unit_id=unit_id,
                    generation=report.epoch, fields=fields)

    # Units as Slurm jobs.

    def _on_slurm(self, view: ClusterView, now: float, grow_allowance: int | None,
                  yields: tuple[sharing.YieldOrder, ...]) -> None:
        """Reconcile units with what Slurm shows, yield what the cluster-wide plan asks,
        then submit what the job needs. A stale view (Slurm did not answer) decides
        nothing."""
        state = self.state
        if not state.slurm_units or self.job.state.is_final or view.stale:
            return
        for unit in list(state.units.values()):
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
            elif view.observed_at >= state.submitted_at.get(unit.unit_id, 0.0) + 1.0 and (
                    found is None or found.state.is_finished):
                # (A view taken before the submission proves nothing.)
                what = found.state.value.lower() if found else "gone from squeue"
                self._unit_lost(unit, f"Slurm job {unit.slurm_job_id} {what} before its launcher registered")
        for order in yields:
            self._leave(order.unit_id, "yielded", order.reason)
        if now < state.next_submit_at or state.stop is not None or self.job.state is JobState.FINISHING:
            return
        spec = self.job.spec
        alive = alive_units(state)
        # Units Slurm has not placed yet will take idle nodes; running ones already hold theirs.
        waiting = sum(1 for u in alive if u.state is UnitState.SUBMITTED
                      and ((found := view.job(u.slurm_job_id)) is None or found.state is SlurmJobState.PENDING))
        excluded = state.excluded_nodes(now)
        idle = unit_rules.idle_nodes_for(spec, view.nodes, frozenset(excluded))
        # Idle nodes are for others first: grow only while no other Slurm job waits for
        # nodes this job could take.
        usable = frozenset(n.name for n in view.nodes if spec.partition in n.partitions or not spec.partition)
        others_waiting = unit_rules.others_waiting_for(view, self.job.job_id, usable)
        demand = unit_rules.units_to_submit(spec, alive=len(alive), idle_nodes=max(0, len(idle) - waiting), now=now,
                                            last_change_at=state.last_change_at,
                                            scale_up_snooze_s=self.config.scale_up_snooze_s,
                                            others_waiting=len(others_waiting),
                                            released=state.released_below_min)
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
        if reason != self.state.growth_held_reason:
            self.state.growth_held_reason = reason
            self.record("growth_shared", reason)

    def _on_requeued(self, unit: UnitRecord, slurm_job_id: int) -> None:
        self.record("unit_requeued", f"Slurm requeued job {slurm_job_id}; Tidal cancels the requeued copy and "
                    "places replacements itself", unit_id=unit.unit_id, fields={"slurm_job_id": slurm_job_id})
        self._cancel_in_slurm(unit)
        if unit.state is UnitState.SUBMITTED:
            self._unit_lost(unit, f"Slurm job {slurm_job_id} requeued before its launcher registered")
        else:
            self._leave(unit.unit_id, "requeued", f"Slurm requeued job {slurm_job_id}")

    def _cool_down(self, unit: UnitRecord, now: float) -> None:
        """No unit of this job on the failed unit's nodes for a while (doubling with each
        failure there), so a bad node does not eat every replacement."""
        for node in unit.nodes:
            failures = self.state.node_cooldown.get(node, (0, 0.0))[0] + 1
            seconds = self.config.node_cooldown_s * min(8, 2 ** (failures - 1))
            self.state.node_cooldown[node] = (failures, now + seconds)
            self._save_pending()
            self.record("node_excluded", f"unit {unit.unit_id} failed there", unit_id=unit.unit_id,
                        fields={"node": node, "failures": failures, "for_s": f"{seconds:.0f}"})

    def _save_pending(self) -> None:
        """Persist what is in flight besides the job's state (node cool-downs, with their
        ends on the wall clock; deferred leaves), so that a restarted controller resumes it."""
        state = self.state
        offset = self.now.wall - self.now.monotonic
        self.emit(SavePending("node_cooldown", {node: [failures, until + offset] for node, (failures, until)
                                                in state.node_cooldown.items()}),
                  SavePending("deferred_leaves", {unit_id: list(leave)
                                                  for unit_id, leave in state.deferred_leaves.items()}))

    def _submit_unit(self, reason: str, excluded: tuple[str, ...]) -> None:
        state = self.state
        numbers = [int(u[1:]) for u in state.units if u.startswith("u") and u[1:].isdigit()]
        unit_id = f"u{max(numbers, default=0) + 1}"
        unit = UnitRecord(job_id=self.job.job_id, unit_id=unit_id, state=UnitState.SUBMITTED,
                          procs_per_node=self.job.spec.procs_per_node or 1)
        state.units[unit_id] = unit
        self.emit(SaveUnit(unit))
        self.record("unit_submitting", reason, unit_id=unit_id)
        self.emit(Submit(unit_id, excluded))

    def _on_unit_submitted(self, unit_id: str, slurm_job_id: int, error: str) -> None:
        state = self.state
        unit = state.units.get(unit_id)
        if unit is None:
            return
        if error:
            state.submit_failures += 1
            backoff = min(60.0, self.config.slurm_poll_interval_s * 2 ** state.submit_failures)
            state.next_submit_at = self.now.monotonic + backoff
            self._unit_lost(unit, f"sbatch refused the unit: {error}", kind="unit_submit_failed",
                            fields={"retry_in_s": f"{backoff:.0f}"})
            return
        state.submit_failures = 0
        state.submitted_at[unit_id] = self.now.wall
        unit = self.own(unit)
        unit.slurm_job_id = slurm_job_id
        self.emit(SaveUnit(unit))
        self.record("unit_submitted", f"Slurm job {slurm_job_id}", unit_id=unit_id,
                    fields={"slurm_job_id": slurm_job_id})
        if self.job.state.is_final or unit.state.is_final:
            self._cancel_in_slurm(unit)

    def _unit_lost(self, unit: UnitRecord, reason: str, kind: str = "unit_lost",
                   fields: dict[str, object] | None = None) -> None:
        """A unit that never registered is gone (Slurm ended it, or sbatch refused it)."""
        unit = self.own(unit)
        unit.state = UnitState.FAILED
        unit.reason = reason
        self.emit(SaveUnit(unit))
        self.record(kind, reason, unit_id=unit.unit_id, fields=fields)

    def _cancel_overdue_leavers(self, now: float) -> None:
        """A unit asked to leave that is still there after the grace a stop gets
        (`restart_grace_s` + `heartbeat_timeout_s`: its launcher or workers hung) has its
        Slurm job cancelled, so that it never holds a node for nothing; Slurm then signals
        and kills what runs there, and the closed session marks the unit left."""
        state = self.state
        overdue_s = self.config.restart_grace_s + self.config.heartbeat_timeout_s
        for unit_id, since in list(state.leaving_since.items()):
            unit = state.units.get(unit_id)
            if unit is None or unit.state is not UnitState.LEAVING:
                del state.leaving_since[unit_id]
            elif now - since > overdue_s:
                del state.leaving_since[unit_id]
                cancelled = (f"; Slurm job {unit.slurm_job_id} cancelled"
                             if state.slurm_units and unit.slurm_job_id else "")
                self.record("unit_leave_overdue", f"still there {now - since:.0f} s after it was asked to leave"
                            + cancelled, unit_id=unit_id)
                self._cancel_in_slurm(unit)

    def _cancel_in_slurm(self, unit: UnitRecord) -> None:
        if self.state.slurm_units and unit.slurm_job_id:
            self.emit(CancelInSlurm(unit.unit_id, unit.slurm_job_id))

    # The end of training: FINISHING, then COMPLETED once.

    def _begin_finishing(self, unit_id: str, generation: int, step: int, reason: str) -> None:
        """A rank committed the job's last step (or, in restart mode, exited 0): training is
        over. No generation forms from here; a world change or stop in flight is dropped;
        units that are not in the finished world leave; exits and silences are no longer
        failures."""
        state = self.state
        if self.job.state.is_final or self.job.state is JobState.FINISHING:
            return
        self.job.state = JobState.FINISHING
        self.job.step = max(self.job.step, step)
        finished_world = self._world_of(generation)
        state.stop = None
        state.reconfigure = None
        state.deferred_leaves = {}
        self._save_pending()
        self.emit(SaveJob(self.job))
        self.record("job_finishing", reason, unit_id=unit_id, generation=generation, fields={"step": self.job.step})
        state.finishing_members = ({m.unit_id: m.world_share for m in finished_world.members}
                                   if finished_world is not None else {})
        self.emit(SavePending("finishing_members", dict(state.finishing_members)))
        for other_id, unit in list(state.units.items()):
            if unit.state.is_final or other_id in state.finishing_members:
                continue
            if unit.state is UnitState.SUBMITTED:
                self._cancel_in_slurm(unit)
                self._mark_left(other_id, "training finished before it registered")
            else:
                self._leave(other_id, "finished", "training finished")
        self._maybe_complete()

    def _world_of(self, generation: int) -> GenerationRecord | None:
        """The generation numbered `generation`, if it is the newest one or the one a live
        change in flight leaves; else the newest one."""
        pending = self.state.reconfigure
        if pending is not None and pending.previous.number == generation:
            return pending.previous
        return self.state.generation

    def _on_exit_after_finish(self, unit_id: str, exited: launcher_pb2.WorkerExited) -> None:
        state = self.state
        if exited.exit_code == 0 and exited.signal == 0:
            state.exited_ok.setdefault(unit_id, set()).add(exited.local_rank)
            self.record("worker_finished", f"local rank {exited.local_rank} (pid {exited.pid}) exited 0",
                        unit_id=unit_id)
        else:
            how = describe_worker_exit(exited)
            state.exited_failed.setdefault(unit_id, {})[exited.local_rank] = how
            self.record("worker_failed_after_training",
                        f"local rank {exited.local_rank} (pid {exited.pid}) {how} after the last step; "
                        "training is complete, so nothing re-forms", unit_id=unit_id,
                        fields=worker_error_fields(exited))
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        state = self.state
        if self.job.state is not JobState.FINISHING:
            return
        members = [FinishingMember(unit_id=unit_id, workers=workers,
                                   exited_ok=frozenset(state.exited_ok.get(unit_id, ())),
                                   exited_failed=dict(state.exited_failed.get(unit_id, {})),
                                   gone=state.units[unit_id].state.is_final)
                   for unit_id, workers in state.finishing_members.items()]
        verdict = completion_verdict(self.job.step, members)
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
        self.emit(SaveJob(self.job))
        self.record("resumed_from_checkpoint", report.detail or f"resumed from the checkpoint at step {report.step}",
                    unit_id=unit_id, generation=report.epoch,
                    fields={"checkpoint_step": report.step, "target_step": target,
                            "steps_redone": max(0, target - report.step)})

    def _observe_progress(self, now: float) -> None:
        """Raise the job's committed step from what the training world's ranks report;
        written at most once a second (and with every generation)."""
        state = self.state
        world = state.training_world
        if world is None or self.job.state is not JobState.RUNNING or state.stop is not None:
            return
        reports = []
        for member in world.members:
            link = state.links.get(member.unit_id) if self.connected(member.unit_id) else None
            reports.append(MemberProgress(unit_id=member.unit_id, ranks=member.world_share,
                                          steps=link.steps if link is not None else {}))
        step = committed_step(self.job.step, reports)
        if step != self.job.step:
            self.job.step = step
            if now - state.step_persisted_at >= 1.0:
                state.step_persisted_at = now
                self.emit(SaveJob(self.job))

    def _end(self, job_state: JobState, kind: str, reason: str) -> None:
        state = self.state
        self.job.state = job_state
        state.stop = None
        number = state.generation.number if state.generation is not None else 0
        self.emit(SaveJob(self.job))
        if state.generation is not None:
            self.emit(GenerationStopped(self.job.job_id, number, self.now.wall))
        self.record(kind, reason, generation=number)
        for unit_id, unit in state.units.items():
            if unit.state.is_final:
                continue
            if not self.connected(unit_id):
                # Waiting in Slurm's queue (it would start for nothing), or running with its
                # launcher out of touch: the job is over, so its Slurm job goes too.
                self._cancel_in_slurm(unit)
                self._mark_left(unit_id, reason)
                continue
            if unit.state is UnitState.LEAVING:
                continue
            unit = self.own(unit)
            unit.state = UnitState.LEAVING
            state.leaving_since[unit_id] = self.now.monotonic
            self.emit(SaveUnit(unit))
            self.send(unit_id, launcher_pb2.ControllerMessage(leave=launcher_pb2.Leave(epoch=number,
                                                                                      reason=reason)))

    def _on_resize(self, min_replicas: int, max_replicas: int, uid: int) -> None:
        state = self.state
        spec = admin_pb2.JobSpec()
        spec.CopyFrom(self.job.spec)
        self.job.spec = spec
        spec.min_replicas = min_replicas or spec.min_replicas
        spec.max_replicas = max_replicas or spec.max_replicas
        self.emit(SaveJob(self.job))
        self.record("job_resized", f"by uid {uid}",
                    fields={"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas})
        if state.generation is not None and self.job.state is JobState.RUNNING:
            surplus = len(state.generation.members) - spec.max_replicas
            for member in sorted(state.generation.members, key=lambda m: -m.group_rank)[:max(0, surplus)]:
                self._leave(member.unit_id, "resized", f"max_replicas is now {spec.max_replicas}")

    def _set_state(self, job_state: JobState, reason: str) -> None:
        if self.job.state is job_state:
            return
        self.state.degraded_since = self.now.monotonic if job_state is JobState.DEGRADED else None
        if job_state is JobState.RUNNING:
            self.state.released_below_min = False
        self.job.state = job_state
        self.emit(SaveJob(self.job))
        self.record(f"job_{job_state.value}", reason)
