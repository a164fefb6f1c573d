"""Cluster-wide decisions across elastic jobs, on one Slurm view: how idle nodes are
shared by weight, and which units yield to a higher-priority Slurm job that waits.

Pure functions of what the controller passes in; the controller turns their answers into
inputs for each job's actor, which records them as events with these reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

#: (partition PriorityTier, job priority): the order Slurm schedules in.
Rank = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class GrowingJob:
    """An elastic job as the idle-node share sees it."""

    job_id: str
    weight: int
    # Units that hold or wait for a place (submitted, joining, active).
    replicas: int
    max_replicas: int
    # Idle nodes this job's units could start on (partition, cool-down).
    fits: frozenset[str]
    # Every node of the job's partition, idle or not (no cool-down): jobs whose sets meet
    # compete for the next node that frees (`next_in_line`). Empty: competes with all.
    usable: frozenset[str] = frozenset()


def share_idle_nodes(jobs: Sequence[GrowingJob]) -> dict[str, int]:
    """How many idle nodes each job may grow onto now.

    One node at a time goes to the job with the fewest replicas per unit of weight (after
    what it was given so far) that still has room below max_replicas and an idle node it
    fits that nobody took; ties go to the job id. So over time each job's replicas follow
    its weight, and a node only one job fits goes to that job. Running units are never
    taken from one elastic job for another."""
    granted = {job.job_id: 0 for job in jobs}
    taken: set[str] = set()
    while True:
        open_jobs = [job for job in jobs if job.replicas + granted[job.job_id] < job.max_replicas
                     and job.fits - taken]
        if not open_jobs:
            return granted
        job = min(open_jobs, key=lambda j: ((j.replicas + granted[j.job_id]) / max(1, j.weight), j.job_id))
        taken.add(min(job.fits - taken))
        granted[job.job_id] += 1


def next_in_line(jobs: Sequence[GrowingJob]) -> frozenset[str]:
    """The jobs that may keep a unit queued in Slurm ahead of the next node that frees
    (`queued_units`): of the jobs below max_replicas whose partitions share a node, the one
    `share_idle_nodes` would give that node to (the fewest replicas per unit of weight, a
    unit already queued counted; ties to the job id). So the queued units follow the
    weights as idle nodes do, one job's unit at a time, and a job alone on its nodes
    always may. Which queued unit Slurm starts first is Slurm's (priority), not this."""
    open_jobs = [job for job in jobs if job.replicas < job.max_replicas]

    def competes(a: GrowingJob, b: GrowingJob) -> bool:
        return not a.usable or not b.usable or bool(a.usable & b.usable)

    def order(job: GrowingJob) -> tuple[float, str]:
        return job.replicas / max(1, job.weight), job.job_id

    return frozenset(job.job_id for job in open_jobs
                     if min((j for j in open_jobs if competes(job, j)), key=order) is job)


@dataclasses.dataclass(frozen=True)
class WaitingJob:
    """A pending Slurm job (not a Tidal unit) that waits for nodes."""

    slurm_job_id: int
    nodes_needed: int
    # Nodes of the partition(s) it asked for.
    could_use: frozenset[str]
    rank: Rank


@dataclasses.dataclass(frozen=True)
class YieldableUnit:
    unit_id: str
    nodes: tuple[str, ...]
    rank: Rank
    # Newer units yield first (they have trained least in this world).
    order: int


@dataclasses.dataclass(frozen=True)
class YieldingJob:
    """An elastic job that allows yielding, with its active units (none leaving)."""

    job_id: str
    weight: int
    min_replicas: int
    units: tuple[YieldableUnit, ...]


@dataclasses.dataclass(frozen=True)
class YieldOrder:
    job_id: str
    unit_id: str
    slurm_job_id: int
    reason: str


def plan_yields(waiting: Sequence[WaitingJob], jobs: Sequence[YieldingJob], idle: frozenset[str],
                releasing: Mapping[int, int]) -> list[YieldOrder]:
    """Which units leave so that waiting higher-priority Slurm jobs start without a
    preemption.

    Waiting jobs are served in Slurm's order (highest rank first). Each needs
    `nodes_needed` nodes; idle nodes it could use count first, then nodes already being
    released for it (`releasing`: units told to yield that still hold their node). For
    the rest, units on nodes it could use and ranked below it leave, taken from the job
    with the most replicas per unit of weight first, never below a job's min_replicas. A
    waiting job that cannot be given every node it needs gets none: a partial yield would
    only idle nodes."""
    orders: list[YieldOrder] = []
    free = set(idle)
    remaining = {job.job_id: list(job.units) for job in jobs}
    replicas = {job.job_id: len(job.units) for job in jobs}
    by_id = {job.job_id: job for job in jobs}
    for waiter in sorted(waiting, key=lambda w: (w.rank, -w.slurm_job_id), reverse=True):
        usable_idle = sorted(free & waiter.could_use)
        missing = waiter.nodes_needed - len(usable_idle) - releasing.get(waiter.slurm_job_id, 0)
        if missing <= 0:
            free -= set(usable_idle[: waiter.nodes_needed])
            continue
        chosen: list[tuple[str, YieldableUnit]] = []
        counts = dict(replicas)
        candidates = {job_id: [u for u in units if u.rank < waiter.rank and set(u.nodes) <= waiter.could_use]
                      for job_id, units in remaining.items()}
        freed = 0
        while freed < missing:
            open_jobs = [job_id for job_id, units in candidates.items()
                         if units and counts[job_id] > by_id[job_id].min_replicas]
            if not open_jobs:
                break
            job_id = max(open_jobs, key=lambda j: (counts[j] / max(1, by_id[j].weight), j))
            unit = max(candidates[job_id], key=lambda u: u.order)
            candidates[job_id].remove(unit)
            counts[job_id] -= 1
            chosen.append((job_id, unit))
            freed += len(unit.nodes)
        if freed < missing:
            continue
        free -= set(usable_idle)
        replicas = counts
        for job_id, unit in chosen:
            remaining[job_id].remove(unit)
            orders.append(YieldOrder(job_id, unit.unit_id, waiter.slurm_job_id,
                                     f"Slurm job {waiter.slurm_job_id} (priority tier {waiter.rank[0]}, priority "
                                     f"{waiter.rank[1]}) waits for {waiter.nodes_needed} node(s); "
                                     f"{len(usable_idle)} idle"))
    return orders
