"""One job's state, the inputs that change it and the effects a transition returns.

Every decision about a job is taken here: forming a generation, growing it, a unit's leave
(now, or deferred behind a change in flight), a failure, the end of training and the job's
completion, what a Slurm view means for the job's units, and node cool-downs. Nothing here
reads a clock, touches SQLite, sends a message or awaits; `transition` never changes the
state it is given (it works on a copy and returns it). The job actor
(`controller/jobs.py`) feeds it inputs and applies the effects it returns in one place:
the persistent ones in one SQLite transaction first, then the rest (messages, session
closes, Slurm cancels and submissions, metrics) in order.

Words: a **generation** is one version of the job's world (its members, their ranks, the
rendezvous, the step its state must be at and who holds that state); one name on the wire
(the `Generation` message), in SQLite (the `generations` table), in metrics, events and the workers'
environment (`TIDAL_GENERATION`). A data *epoch* is a pass over the data set, nothing else.

Times: `Now.monotonic` for deadlines and ages, `Now.wall` for what is recorded."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from tidal.controller.config import ControllerConfig
from tidal.controller.core import sharing
from tidal.controller.core.replicas import Slot
from tidal.controller.core.stragglers import Totals, WorkerCompute, WorkerKey
from tidal.controller.model import GenerationRecord, JobRecord, JobState, UnitFacts, UnitRecord, UnitState
from tidal.proto import common_pb2, launcher_pb2
from tidal.slurm.snapshot import ClusterView


@dataclasses.dataclass(frozen=True)
class Now:
    """The injected clock: `monotonic` for deadlines, `wall` for records."""

    monotonic: float
    wall: float


# Inputs.


@dataclasses.dataclass(frozen=True)
class LauncherConnected:
    """A launcher of `unit_id` opened a session (a newer one replaces the older); `slot`: its
    place in a replica of several nodes, as its `Registered` told it (None: not grouped)."""

    unit_id: str
    register: launcher_pb2.Register
    slot: Slot | None = None


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
    # Live mode, per local rank: the worker's own compute this generation (`stragglers.Totals`).
    compute: Mapping[int, Totals] = dataclasses.field(default_factory=dict)
    # Whether a heartbeat came on this session yet (before one, `steps` is empty because
    # nothing was said, not because the ranks hold nothing). The controller sets it from
    # the session's heartbeat sequence; a Link built without it stands for a beat.
    heard: bool = True


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
    many idle nodes this job may grow onto (None: no cap), which of its units yield to
    a waiting higher-priority Slurm job, and whether it is next in line by weight for a
    node that frees (`sharing.next_in_line`: it may keep a unit queued in Slurm)."""

    view: ClusterView
    grow_allowance: int | None = None
    yields: tuple[sharing.YieldOrder, ...] = ()
    next_in_line: bool = True


@dataclasses.dataclass(frozen=True)
class UnitSubmitted:
    """sbatch answered for a unit: its Slurm job id, or why it refused; or, with
    `answer_lost`, why its answer did not come (the job may exist all the same)."""

    unit_id: str
    slurm_job_id: int
    error: str = ""
    answer_lost: bool = False


@dataclasses.dataclass(frozen=True)
class CancelFailed:
    """scancel of a unit's Slurm job failed: Slurm did not answer (`unanswered`), or refused."""

    unit_id: str
    slurm_job_id: int
    error: str
    unanswered: bool = False


Input = (LauncherConnected | LauncherSaid | LauncherClosed | ClockTick | CancelRequested | DrainRequested
         | ResizeRequested | SlurmObserved | UnitSubmitted | CancelFailed)


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


# The controller's metrics, one effect type each (the job actor maps each to its series).


@dataclasses.dataclass(frozen=True)
class FailureCounted:
    """A unit failed (`tidal_failures_total{cause}`)."""

    cause: str


@dataclasses.dataclass(frozen=True)
class GenerationCounted:
    """A generation formed (`tidal_generations_formed_total{job_id}`)."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class StaleMessageCounted:
    """A launcher's message of an older generation was refused."""


@dataclasses.dataclass(frozen=True)
class StopTimed:
    """How long a stop round took, in seconds."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class RecoveryTimed:
    """From a failure's detection to the survivors' next generation, in seconds."""

    seconds: float


Metric = FailureCounted | GenerationCounted | StaleMessageCounted | StopTimed | RecoveryTimed


@dataclasses.dataclass(frozen=True)
class Note:
    """A log line that is no event of the job's."""

    event: str
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
    warning: bool = False


@dataclasses.dataclass(frozen=True)
class PollSlurmSoon:
    """Ask for the next Slurm poll now rather than at `slurm_poll_interval_s`'s end: what
    the job needs next (a replacement unit) is decided on a view of Slurm."""

    reason: str


Persist = SaveJob | SaveUnit | SaveGeneration | GenerationStopped | Record | SavePending
Effect = Persist | Send | Close | CancelInSlurm | Submit | PollSlurmSoon | Metric | Note
PERSISTENT = (SaveJob, SaveUnit, SaveGeneration, GenerationStopped, Record, SavePending)


# The state.


class ChangeKind(enum.Enum):
    """What the world change in flight waits for."""

    # The generation `InFlight.generation` is stopped (an empty generation went out): its
    # members confirm STOPPED (or LEFT); then the next generation forms.
    STOP = "stop"
    # Live mode: the world moves in-process from `from_generation` to `generation` at a step
    # boundary its ranks agree on: joiners confirm STARTED, then every member RECONFIGURED.
    STEP_BOUNDARY = "step_boundary"


@dataclasses.dataclass
class InFlight:
    """The one world change in flight (a job has at most one; a newer generation supersedes
    it): the generation message that went out, and who must still confirm it by
    `deadline`. A change that is one message with nothing to wait for (a form, restart
    mode's change, a failure's next generation) is never in flight."""

    kind: ChangeKind
    # STOP: the generation stopped; STEP_BOUNDARY: the new generation.
    generation: int
    cause: str
    reason: str
    decided_at: float
    deadline: float
    # Members that have not confirmed yet (STOPPED / LEFT, or RECONFIGURED).
    waiting_for: set[str]
    # STEP_BOUNDARY only: the generation it leaves (its members train on until they move),
    # the message, the old members to tell (leavers included) once every joiner is ready.
    from_generation: int = 0
    previous: GenerationRecord | None = None
    message: launcher_pb2.ControllerMessage | None = None
    old_members: tuple[str, ...] = ()
    joiners_waiting: set[str] = dataclasses.field(default_factory=set)
    told_old_members: bool = False


@dataclasses.dataclass
class Recovery:
    """A failure whose recovery is not measured yet: from the death (or its detection)
    to the first step the survivors complete (wall clock)."""

    failed_at: float
    detected_at: float
    unit_id: str
    # The generation the failure broke: the first step of any later one ends the recovery.
    broken_generation: int = 0


@dataclasses.dataclass(frozen=True)
class CrashLoop:
    """Generations in a row that failed by a worker's error soon after forming, with no
    step committed since `step` (`failure.count_crash`)."""

    generations: int
    step: int
    last_generation: int
    # When the counted error of `last_generation` happened (wall clock).
    exited_at: float


@dataclasses.dataclass(frozen=True)
class ErrorExclusion:
    """A node excluded because a worker there exited with its own error: the error's
    generation and when it happened (wall clock), and the node's cool-down before it (None:
    none), restored if a worker of that generation turns out to have been killed before
    (`slurm_units.lift_error_exclusions`)."""

    generation: int
    exited_at: float
    before: tuple[int, float] | None


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
    # The generation before `generation` as SQLite held it at this controller's start: a
    # live change in flight then is not resumed, and the world it left may be the one that
    # finishes (`finishing.world_of`). None when not restored so.
    restored_previous: GenerationRecord | None = None
    # What the connected launchers' heartbeats said, as of the last tick (an observation
    # delivered with the tick, not a membership fact). Never changed in place, only
    # replaced (`Step.forget_link`): transitions share it rather than copy it.
    links: Mapping[str, Link] = dataclasses.field(default_factory=dict)
    in_flight: InFlight | None = None
    last_change_at: float | None = None
    # When the previous tick was taken (monotonic): a tick much later than it says the
    # controller itself was held up, and heartbeats it could not read meanwhile are no
    # launcher's silence (`health.judge`).
    last_tick_at: float | None = None
    generation_started_at: float = 0.0
    reconnect_deadline: float = 0.0
    # Live mode: the units that held the newest generation's state when it formed.
    state_holders: tuple[str, ...] = ()
    # When the watermark (job.step) was last written.
    step_persisted_at: float = 0.0
    failure_detected_at: float | None = None
    recovery: Recovery | None = None
    first_step_generations: set[int] = dataclasses.field(default_factory=set)
    # sbatch refusals in a row, and no new submission before this.
    submit_failures: int = 0
    next_submit_at: float = 0.0
    # Nodes where a unit failed: the failures that excluded it, and no new unit there
    # before (monotonic); (0, t): a worker failed there, not excluded, remembered until t.
    node_cooldown: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # Nodes node_cooldown excludes for a worker's own error (not persisted: the killed
    # peer's report that lifts one comes within moments).
    error_exclusions: dict[str, ErrorExclusion] = dataclasses.field(default_factory=dict)
    growth_held_reason: str = ""
    # Slurm job id -> unit: cancels that failed, made again on the next view that shows the
    # job active (not persisted; replaced, never changed in place).
    cancels_to_retry: dict[int, str] = dataclasses.field(default_factory=dict)
    # Since when the job is DEGRADED (below min_replicas), monotonic; None otherwise.
    degraded_since: float | None = None
    # Live mode with Slurm units: the job gave its nodes back below min_replicas
    # (below_min_release_s); until a world forms again it submits units only once
    # min_replicas nodes are idle, rather than queueing replacements. Persisted.
    released_below_min: bool = False
    # Replicas of several nodes: a replica number a merge took while a launcher told that
    # number was registering → the number its newcomers take instead
    # (`replicas.renumbered_if_taken`). Not persisted: a registration lasts moments.
    renumbered_replicas: dict[int, int] = dataclasses.field(default_factory=dict)
    # Live mode with Slurm units, DEGRADED: since when (monotonic) every Slurm view showed
    # nothing on its way to bring the job back to min_replicas (no idle node it could take,
    # none of its units started and not registered), and when the latest of those views was
    # taken; None otherwise, and None again when the job's state changes. Not persisted: a
    # restarted controller learns it from its next views.
    blocked_below_min_since: float | None = None
    blocked_below_min_seen_at: float | None = None
    # With Slurm units: when the newest Slurm view that Slurm answered was taken
    # (monotonic); None before the first. Not persisted.
    slurm_seen_at: float | None = None
    # Live mode: the workers one replica of the model spans, as the newest report of a
    # formed world said (0: none yet; `replicas.world_nodes`); kept in SQLite's pending
    # table, so that a restarted controller decides worlds as the last one did.
    replica_workers: int = 0
    # Live mode: each worker's recent compute per sample and its straggler score
    # (`stragglers`); not persisted (a restarted controller scores afresh).
    compute: dict[WorkerKey, WorkerCompute] = dataclasses.field(default_factory=dict)
    # Generations in a row that failed by a worker's error (`crash_loop_generations`); not
    # persisted (a restarted controller counts afresh).
    crash_loop: CrashLoop | None = None
    # straggler_action "replace": the straggler's unit asked to leave, until it is gone.
    straggler_leaving: str | None = None
    # The straggler's unit last said to stay (at min_replicas), so that it is said once.
    straggler_kept: str = ""

    @property
    def live(self) -> bool:
        return self.job.spec.mode == common_pb2.JOB_MODE_LIVE

    @property
    def stopping(self) -> InFlight | None:
        """The stop in flight, if the change in flight is one."""
        return self.in_flight if self.in_flight is not None and self.in_flight.kind is ChangeKind.STOP else None

    @property
    def changing(self) -> InFlight | None:
        """Live mode: the step-boundary change in flight, if it is one."""
        flight = self.in_flight
        return flight if flight is not None and flight.kind is ChangeKind.STEP_BOUNDARY else None

    @property
    def training_world(self) -> GenerationRecord | None:
        """The world whose ranks train now (the one definition): the running generation, or
        while a live world change is in flight the one it changes from (its members train
        on until they move; the joiners start meanwhile); None when no world runs (the job
        is not RUNNING, or a stop is in flight)."""
        if self.job.state is not JobState.RUNNING or self.stopping is not None:
            return None
        changing = self.changing
        return changing.previous if changing is not None and changing.previous is not None else self.generation

    def connected(self, unit_id: str) -> bool:
        """Whether the unit's launcher has a session open now."""
        unit = self.units.get(unit_id)
        return unit is not None and unit.facts.connected

    @property
    def deferred_leaves(self) -> dict[str, tuple[str, str]]:
        """Live mode: the leaves asked for while a world change was in flight, by unit."""
        return {u: unit.facts.deferred_leave for u, unit in self.units.items() if unit.facts.deferred_leave}

    def excluded_nodes(self, now: float) -> tuple[str, ...]:
        """The nodes no unit of the job goes to now: each failure there excludes it for a
        while (`slurm_units.cool_down`); a node's first worker failure is on record (0
        failures) but does not."""
        return tuple(sorted(node for node, (failures, until) in self.node_cooldown.items()
                            if failures > 0 and now < until))


def restore(job: JobRecord, units: list[UnitRecord], generation: GenerationRecord | None, *, generation_stopped: bool,
            pending: Mapping[str, object], config: ControllerConfig, now: Now, slurm_units: bool = False,
            previous: GenerationRecord | None = None) -> State:
    """The state of a job as SQLite holds it, at a controller's start: what was in flight
    (`pending`: node cool-downs, deferred leaves, the finishing world, and its members Slurm
    preempts) resumes; a stop cut short finishes with whoever comes back. `previous`: the
    generation before `generation` (a live change in flight was not kept: the world it
    left may still be the one training, and finish)."""
    state = State(job=job, units={u.unit_id: u for u in units}, generation=generation, config=config,
                  restored_previous=previous,
                  slurm_units=slurm_units, generation_started_at=now.monotonic,
                  reconnect_deadline=now.monotonic + config.reconnect_grace_s,
                  # Below min: the release waits are counted again from the start (how long
                  # the job was below min before it is not kept); without it, never.
                  degraded_since=now.monotonic if job.state is JobState.DEGRADED else None)
    # A finishing world's members: as SQLite says, else the newest generation's.
    finishing_members = {m.unit_id: m.world_share for m in generation.members} if generation is not None else {}
    offset = now.wall - now.monotonic
    cooldown = pending.get("node_cooldown")
    if isinstance(cooldown, Mapping):
        for node, (failures, until) in cooldown.items():
            state.node_cooldown[str(node)] = (int(failures), float(until) - offset)
    finishing = pending.get("finishing_members")
    if isinstance(finishing, Mapping):
        finishing_members = {str(u): int(n) for u, n in finishing.items() if u in state.units}
    # A release below min_replicas goes on until a world forms again.
    state.released_below_min = pending.get("released_below_min") is True and job.state is JobState.DEGRADED
    replica_workers = pending.get("replica_workers")
    if isinstance(replica_workers, int) and replica_workers > 0:
        state.replica_workers = replica_workers
    # Members Slurm preempts after the last step (their event recorded once).
    listed = pending.get("preempted_after_training")
    finishing_job = job.state is JobState.FINISHING
    preempted = {str(u) for u in listed} if isinstance(listed, list) and finishing_job else set()
    deferred = pending.get("deferred_leaves")
    deferred = deferred if isinstance(deferred, Mapping) else {}
    for unit_id, unit in state.units.items():
        leave = deferred.get(unit_id)
        unit.facts = UnitFacts(
            deferred_leave=(str(leave[0]), str(leave[1])) if leave and not unit.state.is_final else None,
            # A unit that was asked to leave before the restart: its grace starts again now.
            leaving_since=now.monotonic if unit.state is UnitState.LEAVING else None,
            # Whether its leave carries save_state is not kept: a member leaving may be
            # saving, and a world without the state waits for it (bounded by that grace).
            saving_state=(unit.state is UnitState.LEAVING and generation is not None
                          and generation.member(unit_id) is not None),
            finishing_workers=finishing_members.get(unit_id),
            preempted_after_training=unit_id in preempted)
    if job.state is JobState.RECONFIGURING and generation is not None and not generation_stopped:
        members = {m.unit_id for m in generation.members if not state.units[m.unit_id].state.is_final}
        state.in_flight = InFlight(ChangeKind.STOP, generation=generation.number, cause="restart",
                                   reason="stop resumed after controller restart", decided_at=now.monotonic,
                                   waiting_for=members, deadline=state.reconnect_deadline + config.restart_grace_s)
    return state


def working_copy(state: State) -> State:
    """A copy of `state` that a transition may change: its own job record and containers;
    unit records are copied when first changed (`Step.own`); what is never changed in
    place (generations, links, the config) is shared. A deep copy of every unit at every
    input would cost O(units) each time (tens of ms at thousands of units)."""
    flight = state.in_flight
    return dataclasses.replace(
        state, job=dataclasses.replace(state.job), units=dict(state.units),
        in_flight=(dataclasses.replace(flight, joiners_waiting=set(flight.joiners_waiting),
                                       waiting_for=set(flight.waiting_for)) if flight is not None else None),
        first_step_generations=set(state.first_step_generations),
        node_cooldown=dict(state.node_cooldown), error_exclusions=dict(state.error_exclusions),
        renumbered_replicas=dict(state.renumbered_replicas))


