"""A live-mode job on loopback (a controller, one launcher per unit, the worker library)
that a benchmark can hurt and watch: kill or freeze a replica, add one back, read the
controller's events with their times. And a job run at a fixed world to its end, with the
times its steps committed."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import CpuSampler, read_jsonl
from tests.integration.conftest import TidalRun, alive, wait_until
from tidal.proto import admin_pb2, common_pb2


class LiveJob:
    def __init__(self, folder: Path, command: Sequence[str], replicas: int,
                 mode: common_pb2.JobMode = common_pb2.JOB_MODE_LIVE,
                 settings: dict[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.run = TidalRun(folder)
        self.run.controller.settings.update(settings or {})
        self.replicas = replicas
        self.mode = mode
        self.command = list(command)
        self.next_unit = 0
        self.units: list[str] = []

    def __enter__(self) -> LiveJob:
        self.run.controller.start()
        self.run.submit(min_replicas=1, max_replicas=self.replicas, mode=self.mode, name="bench",
                        command=self.command)
        for _ in range(self.replicas):
            self.add_unit()
        self.wait_world(self.replicas)
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = self.run.close()
        assert not leftovers, f"workers outlived the run: {leftovers}"

    def add_unit(self) -> str:
        self.next_unit += 1
        unit = f"u{self.next_unit}"
        self.run.start_launcher(unit)
        self.units.append(unit)
        return unit

    def wait_world(self, replicas: int, timeout_s: float = 180.0) -> admin_pb2.Job:
        def formed() -> admin_pb2.Job | None:
            job = self.run.job()
            running = job.state == admin_pb2.JOB_STATE_RUNNING and job.replicas == replicas
            return job if running and self.run.controller.events(self.run.job_id)[-1].kind != "world_reconfiguring" \
                else None
        job = wait_until(formed, timeout_s, f"a running world of {replicas} replicas", interval=0.2)
        # Hurt a world only once it trains: a failure while ranks still build their
        # process group is a different case (they wait out gloo's connection attempts).
        wait_until(lambda: any(e.kind in ("first_step",
                                          "recovered") and e.generation == job.generation for e in self.events()),
                   60, f"the first step of generation {job.generation}", interval=0.1)
        time.sleep(0.5)
        return job

    def events(self) -> list[admin_pb2.Event]:
        return self.run.controller.events(self.run.job_id)

    def event_after(self, kind: str, after: float, timeout_s: float = 120.0) -> admin_pb2.Event:
        def found() -> admin_pb2.Event | None:
            return next((e for e in self.events() if e.kind == kind and event_time(e) >= after), None)
        return wait_until(found, timeout_s, f"event {kind}", interval=0.02)

    def worker_pid(self, unit: str) -> int:
        pids = [p for p in self.run.launchers[unit].worker_pids() if alive(p)]
        assert len(pids) == 1, f"{unit}: workers {pids}"
        return pids[0]

    def hurt(self, unit: str, how: str) -> float:
        """Hurt `unit` and return when (wall clock): "kill" SIGKILLs its worker, "freeze"
        SIGSTOPs it, "replica" SIGKILLs its launcher and worker together."""
        worker = self.worker_pid(unit)
        launcher = self.run.launchers[unit].pid
        at = time.time()
        if how == "kill":
            os.kill(worker, signal.SIGKILL)
        elif how == "freeze":
            os.kill(worker, signal.SIGSTOP)
        elif how == "replica":
            os.kill(launcher, signal.SIGKILL)
            os.kill(worker, signal.SIGKILL)
        else:
            raise ValueError(how)
        self.units.remove(unit)
        return at


def event_time(event: admin_pb2.Event) -> float:
    return event.time.ToNanoseconds() / 1e9


def mlp_command(ledger: Path, step_time: float = 0.01) -> list[str]:
    from bench.common import MLP_EXAMPLE
    return [sys.executable, str(MLP_EXAMPLE), "--steps", "1000000", "--global-batch", "24", "--micro-batch", "4",
            "--step-time", str(step_time), "--ledger-dir", str(ledger)]


def run_fixed_world(folder: Path, command: Sequence[str], replicas: int, name: str, timeout_s: float = 600.0,
                    agents_cpu: CpuSampler | None = None) -> None:
    """Run `command` as a live-mode job of exactly `replicas` units (one launcher each) on
    loopback until the job completes; `agents_cpu`, if given, samples the CPU time of the
    controller and the launchers meanwhile.

    While it trains the job is watched through its launchers, which exit once it is done,
    not through the controller's admin API: a poll of that every half second cost the
    controller about 4 ms of CPU a second (a new connection, its relay and GetJob each
    time), on the cores the workers train on, which a measured run must not pay."""
    folder.mkdir(parents=True, exist_ok=True)
    run = TidalRun(folder)
    run.controller.start()
    if agents_cpu is not None:
        agents_cpu.start(lambda: [p.pid for p in (run.controller.process,
                                                  *(launcher.process for launcher in run.launchers.values()))
                                  if p is not None])
    try:
        run.submit(min_replicas=replicas, max_replicas=replicas, mode=common_pb2.JOB_MODE_LIVE, name=name,
                   command=list(command))
        launchers = [run.start_launcher(f"u{index + 1}") for index in range(replicas)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(launcher.process is not None and launcher.process.poll() is None
                                                  for launcher in launchers):
            time.sleep(0.2)
        wait_until(lambda: run.job().state == admin_pb2.JOB_STATE_COMPLETED, max(10.0, deadline - time.monotonic()),
                   f"the {name} run to finish", interval=0.5)
    finally:
        if agents_cpu is not None:
            agents_cpu.stop()
        run.close()


def commit_times(ledger: Path, world_size: int) -> list[float]:
    """When rank 0 committed each step at `world_size`, from the workers' ledgers
    (`--ledger-dir`), in time order."""
    return [r["time"] for r in read_jsonl(sorted(ledger.glob("ledger-*.jsonl")))
            if r["kind"] == "commit" and r["rank"] == 0 and r["world_size"] == world_size]
