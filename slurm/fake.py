"""An in-memory Slurm with the same interface as the real clients, for unit tests.

Nothing here pretends to be a cluster in tests marked `slurm`: those use the real mini
cluster. Failure switches make it answer as a sick Slurm would:

    fake = FakeSlurmClient.with_nodes(4)
    fake.fail_next("list_jobs", SlurmTimeout(["squeue"], 10))   # one failed call
    fake.unavailable = True                                     # every call times out
    fake.fail_after_next("submit", SlurmTimeout(["sbatch"], 10))  # submitted, answer lost
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from tidal.slurm.errors import SlurmCommandFailed, SlurmError, SlurmJobNotFound, SlurmTimeout
from tidal.slurm.models import (
    Gres,
    Job,
    JobFlag,
    JobState,
    Node,
    NodeFlag,
    NodeState,
    Partition,
    PreemptMode,
    SlurmVersion,
    UnitSubmission,
)


def _utcnow() -> datetime:
    return datetime.now(tz=UTC)


class FakeSlurmClient:
    """SlurmClient over an in-memory job and node table. Jobs start at once on free nodes
    of their partition when `schedule()` runs (submit calls it)."""

    def __init__(self, nodes: list[Node], partitions: list[Partition],
                 clock: Callable[[], datetime] = _utcnow, user: str = "tidal") -> None:
        self.nodes = {n.name: n for n in nodes}
        self.partitions = {p.name: p for p in partitions}
        self.jobs: dict[int, Job] = {}
        self.submissions: dict[int, UnitSubmission] = {}
        self.clock = clock
        self.user = user
        self.unavailable = False
        self.calls: list[str] = []
        self._failures: dict[str, list[SlurmError]] = {}
        self._lost_answers: dict[str, list[SlurmError]] = {}
        self._ids = itertools.count(1)

    @classmethod
    def with_nodes(cls, count: int, clock: Callable[[], datetime] = _utcnow) -> FakeSlurmClient:
        names = tuple(f"n{i}" for i in range(1, count + 1))
        nodes = [Node(name, NodeState.IDLE, frozenset(), ("train", "urgent"), 2,
                      (Gres("gpu", None, 2),), ("cpu",), "") for name in names]
        partitions = [Partition("train", names, 1, frozenset({PreemptMode.REQUEUE}), 5, True, True),
                      Partition("urgent", names, 100, frozenset({PreemptMode.OFF}), 0, False, True)]
        return cls(nodes, partitions, clock)

    # ------------------------------------------------------------------ failure switches

    def fail_next(self, operation: str, error: SlurmError) -> None:
        """The next call of `operation` raises `error` (queue several to fail several)."""
        self._failures.setdefault(operation, []).append(error)

    def fail_after_next(self, operation: str, error: SlurmError) -> None:
        """The next call of `operation` does its work, then raises `error`: Slurm acted and
        its answer was lost (sbatch timed out after slurmctld took the job)."""
        self._lost_answers.setdefault(operation, []).append(error)

    def _answer(self, operation: str) -> None:
        queued = self._lost_answers.get(operation)
        if queued:
            raise queued.pop(0)

    def _enter(self, operation: str) -> None:
        self.calls.append(operation)
        if self.unavailable:
            raise SlurmTimeout([operation], 0)
        queued = self._failures.get(operation)
        if queued:
            raise queued.pop(0)

    # ------------------------------------------------------------------ SlurmClient

    def version(self) -> SlurmVersion:
        self._enter("version")
        return SlurmVersion(22, 5, 8)

    def list_nodes(self) -> list[Node]:
        self._enter("list_nodes")
        return list(self.nodes.values())

    def list_partitions(self) -> list[Partition]:
        self._enter("list_partitions")
        return list(self.partitions.values())

    def list_jobs(self, user: str | None = None) -> list[Job]:
        self._enter("list_jobs")
        return [j for j in self.jobs.values() if user is None or j.user == user]

    def get_job(self, job_id: int) -> Job:
        self._enter("get_job")
        if job_id not in self.jobs:
            raise SlurmJobNotFound(job_id)
        return self.jobs[job_id]

    def submit(self, unit: UnitSubmission) -> int:
        self._enter("submit")
        if unit.partition and unit.partition not in self.partitions:
            raise SlurmCommandFailed(["sbatch"], 1, "sbatch: error: invalid partition specified")
        job_id = next(self._ids)
        partition = unit.partition or next(p.name for p in self.partitions.values() if p.is_default)
        self.jobs[job_id] = Job(job_id, unit.name, self.user, JobState.PENDING, frozenset(), partition,
                                (), unit.nodes, 1, self.clock(), None, None, None, 0, "None",
                                unit.comment)
        self.submissions[job_id] = unit
        self.schedule()
        self._answer("submit")
        return job_id

    def check(self, unit: UnitSubmission) -> None:
        self._enter("check")
        if unit.partition and unit.partition not in self.partitions:
            raise SlurmCommandFailed(["sbatch", "--test-only"], 1, "sbatch: error: invalid partition specified")

    def cancel(self, job_id: int, signal: str | None = None, *, batch_only: bool = False) -> None:
        self._enter("cancel")
        if job_id not in self.jobs:
            raise SlurmJobNotFound(job_id)
        job = self.jobs[job_id]
        if signal is None and job.is_active:
            self._finish(job_id, JobState.CANCELLED)

    def shrink(self, job_id: int, node_count: int) -> None:
        self._enter("shrink")
        job = self.get_job(job_id)
        if job.state is not JobState.RUNNING or node_count < 1 or node_count > len(job.nodes):
            raise SlurmCommandFailed(["scontrol", "update"], 1, "Requested operation not supported")
        kept, released = job.nodes[:node_count], job.nodes[node_count:]
        self.jobs[job_id] = replace(job, nodes=kept, node_count=node_count)
        self._set_nodes(released, NodeState.IDLE)

    # ------------------------------------------------------------------ scenario helpers

    def schedule(self) -> None:
        """Start pending jobs, oldest first, on idle usable nodes of their partition."""
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            if job.state is not JobState.PENDING:
                continue
            excluded = set(self.submissions[job.job_id].exclude_nodes) if job.job_id in self.submissions else set()
            members = self.partitions[job.partition].nodes
            free = [n for n in members if self.nodes[n].is_idle_and_usable and n not in excluded]
            if len(free) < job.node_count:
                self.jobs[job.job_id] = replace(job, reason="Resources")
                continue
            chosen = tuple(free[: job.node_count])
            now = self.clock()
            self.jobs[job.job_id] = replace(job, state=JobState.RUNNING, nodes=chosen, start_time=now,
                                            end_time=now + timedelta(days=365), reason="None")
            self._set_nodes(chosen, NodeState.ALLOCATED)

    def preempt(self, job_id: int, grace_s: int = 5) -> None:
        """What Slurm does to a job chosen for preemption: preempt_time now, end_time cut."""
        job = self.get_job(job_id)
        now = self.clock()
        self.jobs[job_id] = replace(job, preempt_time=now, end_time=now + timedelta(seconds=grace_s))

    def requeue(self, job_id: int) -> None:
        """The preempted job leaves its nodes and waits again, as PENDING+REQUEUED."""
        job = self.get_job(job_id)
        self._set_nodes(job.nodes, NodeState.IDLE)
        self.jobs[job_id] = replace(job, state=JobState.PENDING, flags=frozenset({JobFlag.REQUEUED}),
                                    nodes=(), preempt_time=None, start_time=None,
                                    requeue_count=job.requeue_count + 1, reason="BeginTime")

    def finish(self, job_id: int, state: JobState = JobState.COMPLETED) -> None:
        self._finish(job_id, state)

    def set_node(self, name: str, state: NodeState, flags: frozenset[NodeFlag] = frozenset(),
                 reason: str = "") -> None:
        self.nodes[name] = replace(self.nodes[name], state=state, flags=flags, reason=reason)

    def _finish(self, job_id: int, state: JobState) -> None:
        job = self.jobs[job_id]
        self._set_nodes(job.nodes, NodeState.IDLE)
        self.jobs[job_id] = replace(job, state=state, end_time=self.clock())

    def _set_nodes(self, names: tuple[str, ...], state: NodeState) -> None:
        for name in names:
            if name in self.nodes:
                self.nodes[name] = replace(self.nodes[name], state=state)
