"""Queries: pure functions of a job's state, for the gRPC layer and the cluster-wide plans;
and how a worker's exit is described."""

from __future__ import annotations

import signal

from google.protobuf import duration_pb2

from tidal.controller import units as unit_rules
from tidal.controller.core import replicas, sharing
from tidal.controller.core.state import (
    State,
)
from tidal.controller.model import JobState, UnitRecord, UnitState
from tidal.proto import launcher_pb2
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.snapshot import ClusterView


def refusal(state: State, register: launcher_pb2.Register) -> str | None:
    """Why a launcher's Register is refused (its secret already checked), or None."""
    job = state.job
    if job.state.is_final:
        return f"job {job.job_id} is {job.state.value}"
    unit = state.units.get(register.unit_id)
    if unit is not None and unit.state.is_final:
        return (f"unit {unit.unit_id} is {unit.state.value} ({unit.reason or 'no reason recorded'}); "
                f"it is no longer part of job {job.job_id}")
    if register.last_generation > job.generation:
        return (f"unit {register.unit_id} claims generation {register.last_generation}, "
                f"but job {job.job_id} is at generation {job.generation}")
    in_current = state.generation is not None and state.generation.member(register.unit_id) is not None
    if register.last_generation and register.last_generation < job.generation and not in_current:
        return (f"stale generation {register.last_generation}: job {job.job_id} is at generation {job.generation} "
                f"and unit {register.unit_id} is not part of it")
    if register.last_generation and unit is None:
        return (f"unit {register.unit_id} claims generation {register.last_generation} of job {job.job_id}, "
                "which has no record of it")
    return None


def unit_number(unit_id: str) -> int:
    """The number in a unit's id (`u12`: 12; 0 for an id not made so)."""
    return int(unit_id[1:]) if unit_id[1:].isdigit() else 0


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
    # (Counted in units: a replica of K one-node units in live mode is K of them.)
    return sharing.GrowingJob(job_id=job.job_id, weight=job.spec.weight or 1, replicas=len(alive_units(state)),
                              max_replicas=job.spec.max_replicas * replicas.nodes_per_replica(job.spec),
                              fits=frozenset(unit_rules.idle_nodes_for(job.spec, view.nodes, excluded)),
                              usable=unit_rules.partition_nodes(job.spec, view.nodes))


def yielding_job(state: State, view: ClusterView) -> sharing.YieldingJob | None:
    """This job's active units that could yield to a waiting Slurm job, if it allows
    yielding and no world change or stop is in flight."""
    job = state.job
    if (not state.slurm_units or not job.spec.yield_to_pending or job.state is not JobState.RUNNING
            or state.in_flight is not None):
        return None
    candidates = []
    for unit in state.units.values():
        found = view.job(unit.slurm_job_id) if unit.slurm_job_id else None
        if unit.state is not UnitState.ACTIVE or found is None or found.state is not SlurmJobState.RUNNING:
            continue
        order = unit_number(unit.unit_id)
        candidates.append(sharing.YieldableUnit(unit_id=unit.unit_id, nodes=tuple(unit.nodes),
                                                rank=(view.priority_tier(found.partition), found.priority),
                                                order=order))
    return sharing.YieldingJob(job_id=job.job_id, weight=job.spec.weight or 1, min_replicas=job.spec.min_replicas,
                               units=tuple(candidates))


def world_size(state: State) -> int:
    """The size of the world training now (0 when none trains)."""
    world = state.training_world
    return world.world_size if world is not None else 0


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
