"""The one interface through which Tidal talks to Slurm."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tidal.slurm.models import Job, Node, Partition, SlurmVersion, UnitSubmission


@runtime_checkable
class SlurmClient(Protocol):
    """Every call either returns fresh data or raises a `SlurmError` subclass; none
    returns stale or empty data in place of an answer it did not get."""

    def version(self) -> SlurmVersion:
        """The cluster's Slurm release."""
        ...

    def list_nodes(self) -> list[Node]:
        ...

    def list_partitions(self) -> list[Partition]:
        ...

    def list_jobs(self, user: str | None = None) -> list[Job]:
        """Jobs Slurm still knows (pending, running, and finished ones for MinJobAge);
        `user` keeps only that user's."""
        ...

    def get_job(self, job_id: int) -> Job:
        """Raises SlurmJobNotFound if Slurm does not know the job (any more)."""
        ...

    def submit(self, unit: UnitSubmission) -> int:
        """Submit one unit as a batch job; returns Slurm's job id."""
        ...

    def check(self, unit: UnitSubmission) -> None:
        """Ask Slurm whether it would accept `unit`, creating no job; raises
        SlurmCommandFailed with Slurm's words if not."""
        ...

    def cancel(self, job_id: int, signal: str | None = None, *, batch_only: bool = False) -> None:
        """Cancel a job, or only send `signal` (e.g. "TERM") to all its steps (or, with
        batch_only, to the batch script alone). A job that already ended is not an error."""
        ...

    def shrink(self, job_id: int, node_count: int) -> None:
        """Release nodes of a running job down to `node_count` (`scontrol update NumNodes`)."""
        ...
