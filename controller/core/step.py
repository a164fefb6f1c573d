"""One transition in the making (`Step`): the state (a working copy, changed in place), the
clock, and the effects so far, in order; with the few helpers every concern uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tidal.controller.config import ControllerConfig
from tidal.controller.core import planning, replicas
from tidal.controller.core.state import (
    Effect,
    Now,
    Record,
    SaveJob,
    SavePending,
    Send,
    State,
)
from tidal.controller.model import JobRecord, JobState, UnitRecord
from tidal.proto import launcher_pb2


class Step:
    """One transition in the making: the state (a copy, changed in place), the clock, and
    the effects so far, in order. The concern modules (`inputs`, `tick`, `failure`,
    `forming`, `leaving`, `slurm_units`, `finishing`) are functions over it."""

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

    def forget_link(self, unit_id: str) -> None:
        """Drop what `unit_id`'s heartbeats said (its session opened or closed): the links
        are shared with the state the transition was given, so replaced, not changed."""
        links = self.state.links
        if unit_id in links:
            self.state.links = {u: link for u, link in links.items() if u != unit_id}

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
        if self.state.connected(unit_id):
            self.emit(Send(unit_id, message))

    def connected(self, unit_id: str) -> bool:
        return self.state.connected(unit_id)

    def take_deferred_leaves(self) -> dict[str, tuple[str, str]]:
        """The leaves deferred behind a world change, cleared from their units (and from
        what SQLite keeps in flight)."""
        deferred = self.state.deferred_leaves
        for unit_id in deferred:
            self.note(self.state.units[unit_id], deferred_leave=None)
        self.save_pending()
        return deferred

    def note(self, unit: UnitRecord, **facts: Any) -> UnitRecord:
        """`unit`'s record (owned) with `facts` (fields of `UnitFacts`) changed."""
        unit = self.own(unit)
        unit.facts = dataclasses.replace(unit.facts, **facts)
        return unit

    @property
    def replica_nodes(self) -> int:
        """The one-node units that are in or out of a world together: K for replicas whose
        model spans their nodes, 1 when a unit is a replica or every replica fits in one
        node (`replicas.world_nodes`)."""
        return replicas.world_nodes(self.job.spec, self.state.replica_workers)

    @property
    def world_scale(self) -> int:
        """What one replica of the spec counts for in world decisions: 1, or K when replicas
        of K nodes are decided node by node (DataParallel: the spec's min/max replicas are
        then K times as many units)."""
        return replicas.nodes_per_replica(self.job.spec) // self.replica_nodes

    @property
    def min_world(self) -> int:
        """min_replicas in the units (or whole replicas) that world decisions count."""
        return self.job.spec.min_replicas * self.world_scale

    @property
    def max_world(self) -> int:
        """max_replicas in the units (or whole replicas) that world decisions count."""
        return self.job.spec.max_replicas * self.world_scale

    def sizes(self) -> tuple[int, ...]:
        """The world sizes (in replicas, or in units when replicas are decided node by node)
        the job allows."""
        spec = self.job.spec
        if self.world_scale == 1:
            return tuple(planning.allowed_sizes(spec.min_replicas, spec.max_replicas, spec.replica_step,
                                                list(spec.allowed_replicas)))
        # Node by node (DataParallel over replicas of K nodes): any count of nodes within
        # min and max, so that a lost node never forces a stop round; replica_step and
        # allowed_replicas are not applied (docs/live-mode.md).
        return tuple(planning.allowed_sizes(self.min_world, self.max_world))

    def save_pending(self) -> None:
        """Persist what is in flight besides the job's state (node cool-downs, with their
        ends on the wall clock; deferred leaves), so that a restarted controller resumes it."""
        state = self.state
        offset = self.now.wall - self.now.monotonic
        self.emit(SavePending("node_cooldown", {node: [failures, until + offset] for node, (failures, until)
                                                in state.node_cooldown.items()}),
                  SavePending("deferred_leaves", {unit_id: list(leave)
                                                  for unit_id, leave in state.deferred_leaves.items()}))

    def set_state(self, job_state: JobState, reason: str) -> None:
        if self.job.state is job_state:
            return
        self.enter_state(job_state)
        self.emit(SaveJob(self.job))
        self.record(f"job_{job_state.value}", reason)

    def enter_state(self, job_state: JobState) -> None:
        """The job's state, and what follows from a change of it, with no event of its own
        (a new generation's `world_formed` says the job runs): since when it is DEGRADED,
        what Slurm's views said while it was, and, running again, the end of a release
        below min_replicas."""
        state = self.state
        if self.job.state is not job_state:
            state.degraded_since = self.now.monotonic if job_state is JobState.DEGRADED else None
            state.blocked_below_min_since = state.blocked_below_min_seen_at = None
        if job_state is JobState.RUNNING and state.released_below_min:
            state.released_below_min = False
            self.emit(SavePending("released_below_min", False))
        self.job.state = job_state

