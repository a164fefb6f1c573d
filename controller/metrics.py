"""Prometheus metrics of the controller, on a registry of its own (so two controllers in
one test process do not collide). Counters and histograms are updated where things
happen; the gauges of jobs, units, world sizes and generations are read from the job actors
when Prometheus scrapes, so no code path has to keep them up to date.

A Tidal job is the label `job_id` (its id, as `tidal status` shows it), not `job`:
Prometheus gives every scraped series a `job` label of its own (the scrape job's name) and
would rename ours `exported_job`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class JobView(Protocol):
    """What the state gauges read of a job (a JobActor)."""

    @property
    def job_id(self) -> str: ...

    @property
    def job_state(self) -> str: ...

    @property
    def unit_states(self) -> Iterable[str]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def generation_number(self) -> int: ...

    @property
    def connected_launchers(self) -> int: ...

    @property
    def unit_compute(self) -> Mapping[str, tuple[float, bool]]: ...


class _StateCollector(Collector):
    def __init__(self, jobs: Callable[[], Iterable[JobView]], job_states: Iterable[str],
                 unit_states: Iterable[str]) -> None:
        self._jobs = jobs
        self._job_states = list(job_states)
        self._unit_states = list(unit_states)

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("tidal_jobs", "Jobs by state.", labels=["state"])
        units = GaugeMetricFamily("tidal_units", "Units (replicas) by state.", labels=["state"])
        world = GaugeMetricFamily("tidal_world_size", "Ranks in the job's current generation (0 when not running).",
                                  labels=["job_id"])
        generation = GaugeMetricFamily("tidal_generation", "The job's current generation number.", labels=["job_id"])
        compute_ratio = GaugeMetricFamily(
            "tidal_unit_compute_ratio", "Live mode: the unit's slowest worker's own compute per sample over its "
            "peers' median (1: as fast; scored workers only).", labels=["job_id", "unit_id"])
        straggler = GaugeMetricFamily("tidal_unit_straggler", "Live mode: 1 while a worker of the unit is a straggler.",
                                      labels=["job_id", "unit_id"])
        connected = 0
        job_counts = dict.fromkeys(self._job_states, 0)
        unit_counts = dict.fromkeys(self._unit_states, 0)
        for job in self._jobs():
            job_counts[job.job_state] = job_counts.get(job.job_state, 0) + 1
            for state in job.unit_states:
                unit_counts[state] = unit_counts.get(state, 0) + 1
            world.add_metric([job.job_id], job.world_size)
            generation.add_metric([job.job_id], job.generation_number)
            for unit_id, (ratio, slow) in sorted(job.unit_compute.items()):
                compute_ratio.add_metric([job.job_id, unit_id], ratio)
                straggler.add_metric([job.job_id, unit_id], 1.0 if slow else 0.0)
            connected += job.connected_launchers
        for state, count in job_counts.items():
            jobs.add_metric([state], count)
        for state, count in unit_counts.items():
            units.add_metric([state], count)
        yield from (jobs, units, world, generation, compute_ratio, straggler,
                    GaugeMetricFamily("tidal_launchers_connected", "Launcher sessions open.", value=connected))


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.generations_formed = Counter("tidal_generations_formed", "Generations formed.", ["job_id"],
                                          registry=self.registry)
        self.failures = Counter("tidal_failures", "Failures detected, by cause.", ["cause"], registry=self.registry)
        self.heartbeat_latency = Histogram(
            "tidal_heartbeat_latency_seconds", "Launcher send to controller receipt (clocks may differ).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry)
        self.stop_duration = Histogram(
            "tidal_stop_duration_seconds", "Failure detection to every rank of the generation stopped (a stop round).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0), registry=self.registry)
        self.recovery_duration = Histogram(
            "tidal_recovery_duration_seconds", "Failure detection to the next generation started.",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0), registry=self.registry)
        self.refused_calls = Counter("tidal_refused_launcher_calls", "Launcher calls refused, by gRPC status.",
                                     ["code"], registry=self.registry)
        self.stale_messages = Counter("tidal_stale_messages", "Launcher messages of an old generation, ignored.",
                                      registry=self.registry)

    def read_job_states(self, jobs: Callable[[], Iterable[JobView]], job_states: Iterable[str],
                        unit_states: Iterable[str]) -> None:
        """Serve the state gauges from `jobs()` at every scrape."""
        self.registry.register(_StateCollector(jobs, job_states, unit_states))
