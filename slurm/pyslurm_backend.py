"""SlurmClient over pyslurm 25.11 (Slurm's C API through Cython), for clusters that have it.

WHAT HAS AND HAS NOT RUN: pyslurm builds only against the one Slurm release it was
generated for (25.11), and no Slurm 25.11 can be installed on Tidal's development and CI
machines (Debian offers 22.05, 24.11 and 26.05). So this module has never talked to a real
slurmctld. What is tested (tests/unit/test_pyslurm_backend.py) is its translation of
pyslurm's objects into Tidal's dataclasses, against stand-in objects with the attribute
names of pyslurm 25.11's `Job`, `Node` and `Partition` (pyslurm/core/job/job.pyx,
pyslurm/core/node/node.pyx). The CLI-JSON backend is the default everywhere else.

It is chosen automatically only when `import pyslurm` works and pyslurm's version matches
the cluster's Slurm release (see `tidal.slurm.default_client`).
"""

from __future__ import annotations

import os
import signal as signal_module
from collections.abc import Iterable
from typing import Any

from tidal.slurm.errors import SlurmCommandFailed, SlurmError, SlurmJobNotFound
from tidal.slurm.hostlist import compress, expand
from tidal.slurm.models import Gres, Job, Node, Partition, PreemptMode, SlurmVersion, UnitSubmission
from tidal.slurm.parse import job_state_from_names, node_state_from_names, parse_version, timestamp


def pyslurm_version(module: Any) -> SlurmVersion:
    """pyslurm's own version, e.g. 25.11.0 (its major.minor is the Slurm it was built for)."""
    return parse_version(str(getattr(module, "__version__", "")))


def job_from_pyslurm(job: Any) -> Job:
    """A pyslurm.Job (25.11 attribute names) → Job."""
    state, flags = job_state_from_names([job.state or ""])
    return Job(
        job_id=int(job.id),
        name=job.name or "",
        user=job.user_name or "",
        state=state,
        flags=flags,
        partition=job.partition or "",
        nodes=expand(job.allocated_nodes or ""),
        node_count=int(job.num_nodes or 0),
        priority=int(job.priority or 0),
        submit_time=timestamp(job.submit_time),
        start_time=timestamp(job.start_time),
        end_time=timestamp(job.end_time),
        preempt_time=timestamp(job.preempt_time),
        requeue_count=int(job.requeue_count or 0),
        reason=job.state_reason or "",
        comment=job.comment or "",
    )


def _gres_from_dict(gres: dict[str, Any] | None) -> tuple[Gres, ...]:
    """pyslurm's gres dict: {"gpu": 4} or {"gpu:a100": 4}."""
    result = []
    for key, count in (gres or {}).items():
        name, _, kind = str(key).partition(":")
        result.append(Gres(name, kind or None, int(count)))
    return tuple(result)


def node_from_pyslurm(node: Any) -> Node:
    """A pyslurm.Node (25.11 attribute names) → Node. Its `state` is Slurm's complete
    state string, e.g. "IDLE+DRAIN"."""
    state, flags = node_state_from_names([node.state or ""])
    return Node(
        name=node.name,
        state=state,
        flags=flags,
        partitions=tuple(node.partitions or ()),
        cpus=int(node.total_cpus or 0),
        gres=_gres_from_dict(node.configured_gres),
        features=tuple(node.available_features or ()),
        reason=node.reason or "",
        address=node.address or "",
    )


def partition_from_pyslurm(partition: Any) -> Partition:
    """A pyslurm.Partition (25.11 attribute names) → Partition."""
    mode_words: Iterable[str] = str(partition.preempt_mode or "OFF").upper().split(",")
    return Partition(
        name=partition.name,
        nodes=expand(partition.nodes or ""),
        priority_tier=int(partition.priority_tier or 0),
        preempt_mode=frozenset(PreemptMode(m) for m in mode_words if m in PreemptMode.__members__),
        grace_time_s=int(partition.preemption_grace_time or 0),
        is_default=bool(partition.is_default),
        is_up=str(partition.state or "UP").upper() == "UP",
    )


class PyslurmSlurmClient:
    """SlurmClient over pyslurm. Errors from pyslurm (RPCError) become SlurmCommandFailed."""

    def __init__(self, module: Any | None = None) -> None:
        if module is None:
            import pyslurm as module  # type: ignore[import-not-found, no-redef]
        self._pyslurm: Any = module

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except SlurmError:
            raise
        except Exception as error:  # pyslurm raises RPCError and ValueError
            raise SlurmCommandFailed(["pyslurm", what], 1, str(error)) from error

    def version(self) -> SlurmVersion:
        return pyslurm_version(self._pyslurm)

    def list_nodes(self) -> list[Node]:
        nodes = self._call("Nodes.load", self._pyslurm.Nodes.load)
        return [node_from_pyslurm(n) for n in nodes.values()]

    def list_partitions(self) -> list[Partition]:
        partitions = self._call("Partitions.load", self._pyslurm.Partitions.load)
        return [partition_from_pyslurm(p) for p in partitions.values()]

    def list_jobs(self, user: str | None = None) -> list[Job]:
        jobs = self._call("Jobs.load", self._pyslurm.Jobs.load)
        return [j for j in map(job_from_pyslurm, jobs.values()) if user is None or j.user == user]

    def get_job(self, job_id: int) -> Job:
        try:
            return job_from_pyslurm(self._pyslurm.Job.load(job_id))
        except Exception as error:
            if "Invalid job id" in str(error):
                raise SlurmJobNotFound(job_id) from None
            raise SlurmCommandFailed(["pyslurm", "Job.load"], 1, str(error)) from error

    def submit(self, unit: UnitSubmission) -> int:
        for_owner = unit.owner is not None and unit.owner.uid != os.geteuid()
        description = self._pyslurm.JobSubmitDescription(
            name=unit.name,
            nodes=unit.nodes,
            partition=unit.partition or None,
            resource_sharing="no" if unit.exclusive else None,
            time_limit=unit.time_limit or None,
            excluded_nodes=compress(unit.exclude_nodes) or None,
            constraints=unit.constraint or None,
            gres_per_node=unit.gres or None,
            account=unit.account or None,
            qos=unit.qos or None,
            working_directory=unit.working_dir or None,
            standard_output=unit.output or None,
            comment=unit.comment or None,
            is_requeueable=unit.requeue,
            script=unit.script,
            # The path of the job's secret stays in this process's memory and Slurm's job
            # record. Another user's unit gets that user's ids and an environment of its own.
            environment=unit.owner_environment() if for_owner else {**os.environ, **unit.environment},
            **({"user_id": unit.owner.uid, "group_id": unit.owner.gid}
               if for_owner and unit.owner is not None else {}),
        )
        if unit.extra_options:
            description.load_sbatch_options(list(unit.extra_options))
        return int(self._call("JobSubmitDescription.submit", description.submit))

    def check(self, unit: UnitSubmission) -> None:
        # pyslurm has no test-only submission; the partition is what can be checked here.
        # (The CLI backend runs `sbatch --test-only`, which checks every option.)
        if unit.partition and unit.partition not in {p.name for p in self.list_partitions()}:
            raise SlurmCommandFailed(["pyslurm"], 1, f"invalid partition specified: {unit.partition}")

    def cancel(self, job_id: int, signal: str | None = None, *, batch_only: bool = False) -> None:
        job = self._pyslurm.Job(job_id)
        if signal is None:
            self._call("Job.cancel", job.cancel)
            return
        number = int(getattr(signal_module, f"SIG{signal.upper().removeprefix('SIG')}"))
        self._call("Job.send_signal", job.send_signal, number, "batch" if batch_only else "all")

    def shrink(self, job_id: int, node_count: int) -> None:
        if node_count < 1:
            raise ValueError("a running job keeps at least one node")
        changes = self._pyslurm.JobSubmitDescription(nodes=node_count)
        self._call("Job.modify", self._pyslurm.Job(job_id).modify, changes)
