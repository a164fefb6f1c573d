"""What the controller knows of jobs, units, generations and events: plain dataclasses and
enums, stored by `store.py`, decided on by the core (`controller/core/`)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from typing import cast

from tidal.proto import admin_pb2, common_pb2


class JobState(enum.Enum):
    """A job's lifecycle.

    PENDING until `min_replicas` units have registered and generation 1 forms; RUNNING
    while a generation's workers run (a change that is one message keeps it RUNNING);
    RECONFIGURING while a generation is being stopped in a stop round (the fallback) and
    the next one planned; DEGRADED when fewer than `min_replicas` units are
    alive, waiting for more; FINISHING once a rank committed the job's last step (no
    generation forms any more; exits and silence are not failures); COMPLETED, FAILED and
    CANCELLED are final."""

    PENDING = "pending"
    RUNNING = "running"
    RECONFIGURING = "reconfiguring"
    DEGRADED = "degraded"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FINISHING = "finishing"

    @property
    def is_final(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)

    def to_proto(self) -> admin_pb2.JobState:
        # protoc's .pyi types an enum's values as the enum, and its Value() as int.
        return cast(admin_pb2.JobState, admin_pb2.JobState.Value("JOB_STATE_" + self.name))


class UnitState(enum.Enum):
    """A unit's lifecycle: SUBMITTED (to Slurm, not registered) → JOINING (registered,
    not in the current generation) → ACTIVE (a member of the current generation) → LEAVING (asked
    to leave, stopping) → LEFT; FAILED from any state. LEFT and FAILED are final."""

    SUBMITTED = "submitted"
    JOINING = "joining"
    ACTIVE = "active"
    LEAVING = "leaving"
    LEFT = "left"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (UnitState.LEFT, UnitState.FAILED)

    def to_proto(self) -> admin_pb2.UnitState:
        return cast(admin_pb2.UnitState, admin_pb2.UnitState.Value("UNIT_STATE_" + self.name))


@dataclasses.dataclass
class JobRecord:
    job_id: str
    spec: admin_pb2.JobSpec
    state: JobState
    owner_uid: int
    secret_sha256: str
    # The newest generation's number (0 before the first forms).
    generation: int = 0
    # Last step completed everywhere, as the workers reported it.
    step: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class UnitFacts:
    """What this controller knows of a unit besides its stored record: learnt again after a
    restart, never written to SQLite. Monotonic times unless said; None: not so."""

    # Its launcher has a session open now, and the port of the rendezvous store it serves.
    connected: bool = False
    store_port: int = 0
    # When it last registered, or reconnected, waiting to join (a joiner settles from it).
    joined_at: float | None = None
    # When it was asked to leave: past the grace a stop gets, it is cancelled in Slurm.
    leaving_since: float | None = None
    # Live mode: its leave carries save_state (its workers write the state, or its node
    # index's shards, to disk on the way out); no world without the state forms meanwhile.
    saving_state: bool = False
    # A live member back after a controller restart with no workers, waiting for its reports.
    back_without_workers_at: float | None = None
    # While the job is FINISHING: when its session closed without it leaving.
    disconnected_at: float | None = None
    # Live mode: a leave asked for while a world change was in flight (cause, detail).
    deferred_leave: tuple[str, str] | None = None
    # When sbatch accepted it, or its answer was lost (wall clock): an older Slurm view
    # proves nothing of it.
    submitted_at: float = 0.0
    # Submitted by this controller, sbatch's answer not read yet (a unit SUBMITTED with no
    # Slurm job id and none in flight was decided by a controller that stopped before
    # sbatch answered: `slurm_units.find_unanswered`).
    sbatch_in_flight: bool = False
    # Submitted ahead of any free node (`queued_units`), to wait in Slurm's queue.
    queued_ahead: bool = False
    # Before its launcher registers: queued ahead and still waiting for a node (from its
    # submission until a Slurm view says otherwise: PENDING keeps it, a start or a view
    # that Slurm did not answer ends it); when Slurm started it (monotonic; its start time
    # as a view showed it).
    queued_in_slurm: bool = False
    started_seen_at: float | None = None
    # The nodes its sbatch excluded (node_cooldown's, as they were at its submission).
    excluded: tuple[str, ...] = ()
    # Live mode: a step its workers are known to hold by their reports (a world they
    # reached with the state verified, a first step they committed), which heartbeats
    # may not say yet (they are up to an interval old).
    holds_step: int = 0
    # While the job is FINISHING, a member of the finished world: how many of its workers
    # the end waits for (None: not a member), and those that exited since: 0, or how.
    finishing_workers: int | None = None
    # While the job is FINISHING: Slurm chose it for preemption (recorded once, and kept
    # across a controller's restart; it does not leave before its workers end or Slurm's
    # grace time does).
    preempted_after_training: bool = False
    # Live mode, replicas of several nodes: since when its replica has lacked a node (it
    # waits, out of the world, for one to take the lost one's place).
    waiting_for_node_since: float | None = None
    exited_ok: frozenset[int] = frozenset()
    exited_failed: Mapping[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class UnitRecord:
    """One unit: its phase (`state`) and what goes with it. The fields before `facts` are
    stored in SQLite; `facts` are this controller's own (`UnitFacts`)."""

    job_id: str
    unit_id: str
    state: UnitState
    nodes: list[str] = dataclasses.field(default_factory=list)
    address: str = ""
    procs_per_node: int = 1
    slurm_job_id: int = 0
    group_rank: int = -1
    registered_at: float = 0.0
    reason: str = ""
    # Live mode with replicas of K > 1 nodes (one-node units, grouped by the controller):
    # the replica this unit belongs to (1, 2, ...; 0: not grouped) and its node's place in
    # it (0..K-1), fixed when it registers: its workers' shard ranks follow from it.
    replica: int = 0
    node_index: int = 0
    facts: UnitFacts = dataclasses.field(default_factory=UnitFacts, repr=False)


@dataclasses.dataclass(frozen=True)
class Member:
    """One unit's place in a generation."""

    unit_id: str
    nodes: tuple[str, ...]
    procs_per_node: int
    group_rank: int
    first_rank: int

    @property
    def world_share(self) -> int:
        return self.procs_per_node * len(self.nodes)


@dataclasses.dataclass(frozen=True)
class GenerationRecord:
    """One generation of a job's world: its members, their ranks and the rendezvous, and the step
    its state must be at (`resume_step`)."""

    job_id: str
    number: int
    members: tuple[Member, ...]
    rendezvous_host: str
    rendezvous_port: int
    rendezvous_unit_id: str
    reason: str
    created_at: float
    resume_step: int = 0

    # Computed once per record (it is frozen): a generation of 2,048 members is looked up
    # and sent to each of them, and a scan per member made that O(n^2) (bench.world_scale).
    @functools.cached_property
    def world_size(self) -> int:
        return sum(m.world_share for m in self.members)

    @functools.cached_property
    def unit_ids(self) -> tuple[str, ...]:
        return tuple(m.unit_id for m in self.members)

    @functools.cached_property
    def _members_by_unit(self) -> dict[str, Member]:
        # The first member of a unit id wins, as a scan in order would find it.
        return {m.unit_id: m for m in reversed(self.members)}

    def member(self, unit_id: str) -> Member | None:
        return self._members_by_unit.get(unit_id)

    def rank_table(self, only_unit: str | None = None) -> common_pb2.RankTable:
        """Every member's assignment, or only `only_unit`'s (what that unit's launcher needs)."""
        if only_unit is None:
            members: tuple[Member, ...] = self.members
        else:
            found = self.member(only_unit)
            members = (found,) if found is not None else ()
        return common_pb2.RankTable(
            world_size=self.world_size, groups=len(self.members),
            assignments=[common_pb2.RankAssignment(unit_id=m.unit_id, nodes=list(m.nodes), group_rank=m.group_rank,
                                                   first_rank=m.first_rank, procs_per_node=m.procs_per_node)
                         for m in members])

    def rendezvous(self) -> common_pb2.Rendezvous:
        return common_pb2.Rendezvous(host=self.rendezvous_host, port=self.rendezvous_port,
                                     host_unit_id=self.rendezvous_unit_id)


@dataclasses.dataclass(frozen=True)
class EventRecord:
    sequence: int
    time: float
    job_id: str
    unit_id: str
    generation: int
    kind: str
    reason: str
    fields: dict[str, str]


def members_from_rank_table(table: common_pb2.RankTable) -> tuple[Member, ...]:
    return tuple(Member(unit_id=a.unit_id, nodes=tuple(a.nodes), procs_per_node=a.procs_per_node,
                        group_rank=a.group_rank, first_rank=a.first_rank) for a in table.assignments)


def join_ids(ids: Sequence[str]) -> str:
    return ",".join(ids) if ids else "-"
