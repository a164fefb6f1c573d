"""One cluster-wide view per poll, and what to do when Slurm does not answer.

A failed poll never reads as "nothing changed": the last good view comes back marked
stale, with the error and its age, and `require_fresh()` refuses to act on it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from tidal.slurm.client import SlurmClient
from tidal.slurm.errors import SlurmError, SlurmParseError
from tidal.slurm.models import Job, Node, Partition


class StaleClusterView(SlurmError):
    """An action needed fresh data, and the last poll of Slurm failed."""


@dataclass(frozen=True)
class ClusterView:
    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    # When this data was read from Slurm (clock seconds); 0 if never.
    observed_at: float
    stale: bool
    error: SlurmError | None = None
    consecutive_failures: int = 0
    # Read every `partitions_every` polls (they change with slurm.conf, not with jobs).
    partitions: tuple[Partition, ...] = ()

    def require_fresh(self) -> ClusterView:
        if self.stale:
            raise StaleClusterView(f"Slurm data is stale ({self.consecutive_failures} failed polls): {self.error}")
        return self

    def job(self, job_id: int) -> Job | None:
        return self._jobs_by_id.get(job_id)

    @functools.cached_property
    def _jobs_by_id(self) -> dict[int, Job]:
        # Built once per view: every job actor looks up each of its units in every poll.
        return {j.job_id: j for j in self.jobs}

    def partition(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)

    def priority_tier(self, partitions: str) -> int:
        """The tier a job runs at: its partition's PriorityTier (the highest, for a
        pending job that names several, comma-separated)."""
        tiers = [p.priority_tier for name in partitions.split(",") if (p := self.partition(name)) is not None]
        return max(tiers, default=0)

    def partition_nodes(self, partitions: str) -> frozenset[str]:
        return frozenset(n for name in partitions.split(",") if (p := self.partition(name)) is not None
                         for n in p.nodes)


class ClusterPoll:
    """Reads nodes and jobs from a SlurmClient, one query each per `poll()`, and the
    partitions on the first poll and every `partitions_every` polls after."""

    def __init__(self, client: SlurmClient, clock: Callable[[], float] = time.time, partitions_every: int = 30) -> None:
        self.client = client
        self.clock = clock
        self.partitions_every = max(1, partitions_every)
        self._polls = 0
        self._partitions: tuple[Partition, ...] | None = None
        self._last = ClusterView(nodes=(), jobs=(), observed_at=0.0, stale=True)

    @property
    def last(self) -> ClusterView:
        return self._last

    def poll(self) -> ClusterView:
        try:
            if self._partitions is None or self._polls % self.partitions_every == 0:
                self._partitions = tuple(self.client.list_partitions())
            nodes = tuple(self.client.list_nodes())
            jobs = tuple(self.client.list_jobs())
        except Exception as error:  # (a poll never ends the controller's polling)
            if not isinstance(error, SlurmError):
                # A reading this layer failed to turn into a SlurmError (a bug, or Slurm's
                # nonsense in a shape not foreseen): a stale view too, not a dead poll loop.
                unexpected = error
                error = SlurmParseError(f"unexpected {type(error).__name__} reading Slurm: {error}"[:500])
                error.__cause__ = unexpected
            previous = self._last
            self._last = ClusterView(previous.nodes, previous.jobs, previous.observed_at, stale=True,
                                     error=error, consecutive_failures=previous.consecutive_failures + 1,
                                     partitions=previous.partitions)
            return self._last
        finally:
            self._polls += 1
        self._last = ClusterView(nodes, jobs, self.clock(), stale=False, partitions=self._partitions)
        return self._last
