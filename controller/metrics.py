"""Prometheus metrics of the controller, on a registry of its own (so two controllers in
one test process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge("tidal_jobs", "Jobs by state.", ["state"], registry=self.registry)
        self.units = Gauge("tidal_units", "Units (replicas) by state.", ["state"], registry=self.registry)
        self.world_size = Gauge("tidal_world_size", "Ranks in the job's current epoch.", ["job"],
                                registry=self.registry)
        self.epoch = Gauge("tidal_epoch", "The job's current epoch number.", ["job"], registry=self.registry)
        self.epochs_formed = Counter("tidal_epochs_formed", "Epochs formed.", ["job"], registry=self.registry)
        self.failures = Counter("tidal_failures", "Failures detected, by cause.", ["cause"], registry=self.registry)
        self.launchers_connected = Gauge("tidal_launchers_connected", "Launcher sessions open.",
                                         registry=self.registry)
        self.heartbeat_latency = Histogram(
            "tidal_heartbeat_latency_seconds", "Launcher send to controller receipt (clocks may differ).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry)
        self.stop_duration = Histogram(
            "tidal_stop_duration_seconds", "Failure detection to every rank of the epoch stopped.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0), registry=self.registry)
        self.recovery_duration = Histogram(
            "tidal_recovery_duration_seconds", "Failure detection to the next epoch started.",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0), registry=self.registry)
        self.refused_calls = Counter("tidal_refused_launcher_calls", "Launcher calls refused, by gRPC status.",
                                     ["code"], registry=self.registry)
        self.stale_messages = Counter("tidal_stale_messages", "Launcher messages of an old epoch, ignored.",
                                      registry=self.registry)
