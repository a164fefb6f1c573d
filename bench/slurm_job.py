"""A live job whose units are Slurm jobs on the mini cluster (scripts/minicluster up,
SLURM_CONF exported): the controller polls Slurm every `poll_s`, and a benchmark watches
the workers' ledger and the controller's events."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import MLP_EXAMPLE, read_jsonl
from bench.live import event_time
from tests.integration.conftest import ControllerProcess, wait_until
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient, UnitSubmission


class SlurmJob:
    def __init__(self, folder: Path, max_replicas: int, poll_s: float, blocked_nodes: int = 0,
                 step_time: float = 0.01, settings: dict[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.ledger = folder / "ledger"
        self.slurm = CliJsonSlurmClient(timeout_s=10)
        self.controller = ControllerProcess(folder, {"slurm_units": "true", "slurm_poll_interval_s": str(poll_s),
                                                     "join_settle_s": "1", "reconnect_grace_s": "10",
                                                     **(settings or {})})
        self.max_replicas = max_replicas
        self.job_id = ""
        self.blockers: list[int] = []
        self.blocked_nodes = blocked_nodes
        self.step_time = step_time

    def __enter__(self) -> SlurmJob:
        idle = [n for n in self.slurm.list_nodes() if "train" in n.partitions and n.is_idle_and_usable]
        if len(idle) < self.max_replicas:
            raise SystemExit(f"the mini cluster has {len(idle)} idle nodes; this benchmark needs "
                             f"{self.max_replicas} (scripts/minicluster up, nothing else running)")
        try:
            for _ in range(self.blocked_nodes):
                self.block_a_node()
            self.controller.start()
            spec = admin_pb2.JobSpec(
                name="bench", min_replicas=1, max_replicas=self.max_replicas, partition="train",
                mode=common_pb2.JOB_MODE_LIVE, working_dir=str(self.folder), environment={"OMP_NUM_THREADS": "1"},
                command=[sys.executable, str(MLP_EXAMPLE), "--steps", "1000000", "--global-batch", "24",
                         "--micro-batch", "4", "--step-time", str(self.step_time), "--ledger-dir", str(self.ledger)])
            with self.controller.admin() as admin:
                self.job_id = admin.submit(spec).job.job_id
        except BaseException:
            # Stopped (a SIGTERM's SystemExit) or failed on the way in: nothing is left behind.
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.job_id:
                with self.controller.admin() as admin:
                    admin.cancel(self.job_id)
                wait_until(lambda: not any(j.is_active for j in self.slurm.list_jobs()
                                           if j.name.startswith(f"tidal-{self.job_id}-")), 60, "the units to end")
        finally:
            for blocker in self.blockers:
                self.slurm.cancel(blocker)
            self.controller.stop()

    def job(self) -> admin_pb2.Job:
        with self.controller.admin() as admin:
            return admin.job(self.job_id)

    def events(self) -> list[admin_pb2.Event]:
        with self.controller.admin() as admin:
            return list(admin.events(self.job_id))

    def event_after(self, kind: str, after: float, timeout_s: float = 120.0) -> admin_pb2.Event:
        return wait_until(lambda: next((e for e in self.events() if e.kind == kind and event_time(e) >= after), None),
                          timeout_s, f"event {kind}", interval=0.05)

    def wait_world(self, replicas: int, timeout_s: float = 180.0) -> admin_pb2.Job:
        def ready() -> admin_pb2.Job | None:
            job = self.job()
            return job if job.world_size == replicas and job.state == admin_pb2.JOB_STATE_RUNNING else None
        job = wait_until(ready, timeout_s, f"world size {replicas}", interval=0.2)
        wait_until(lambda: self.commits_after(time.time() - 1.0, replicas), 60, f"steps at world size {replicas}",
                   interval=0.2)
        return job

    def commits_after(self, since: float, world_size: int | None = None) -> list[dict]:
        return [r for r in read_jsonl(sorted(self.ledger.glob("ledger-*.jsonl"))) if r["kind"] == "commit"
                and r["time"] > since and (world_size is None or r["world_size"] == world_size)]

    def abandoned_after(self, since: float) -> list[dict]:
        return [r for r in read_jsonl(sorted(self.ledger.glob("ledger-*.jsonl")))
                if r["kind"] == "abandoned" and r["time"] > since]

    def resize(self, max_replicas: int) -> None:
        with self.controller.admin() as admin:
            admin.resize(self.job_id, min_replicas=0, max_replicas=max_replicas)

    def block_a_node(self) -> int:
        """A plain Slurm job on one idle node of `train` (what holds a node until cancelled)."""
        blocker = self.slurm.submit(UnitSubmission(name="bench-blocker", script="#!/bin/sh\nsleep 3600\n",
                                                   partition="train", nodes=1, exclusive=True, requeue=False,
                                                   output=str(self.folder / "blocker-%j.out")))
        self.blockers.append(blocker)
        wait_until(lambda: self.slurm.get_job(blocker).state.value == "RUNNING", 60, "the blocker to run")
        return blocker
