"""Real processes on loopback: a tidal-controller, tidal-launchers, and torch gloo workers
running an unmodified torchrun-style script. Every process is tracked by PID and stopped
by PID; a test fails if a worker outlives it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_for
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, common_pb2

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "restart_mode" / "train_snapshot.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for a server that a test
    restarts on the same port. A port the kernel handed out (bind to 0) may, once its server
    is killed, become the local end of any outgoing connection on this machine, and even of
    a client's reconnect to that very port (a loopback socket connected to itself), so that
    the restarted server cannot bind it: seen once in a fresh-clone make test. Ports below the
    ephemeral range are taken only by an explicit bind; these lie below the mini cluster's
    (`scripts/minicluster --port-base`, 17000 by default) and a multi-node unit's
    (`tidal.launcher.nodes`, from 20000)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = (10000, 17000) if ephemeral_low > 17000 else (ephemeral_low // 2, ephemeral_low)
    chooser = random.Random()
    for _ in range(200):
        port = chooser.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    return wait_for(what, predicate, timeout_s=timeout, interval_s=interval)


def _stop_process(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
            process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


class ControllerProcess:
    def __init__(self, directory: Path, settings: dict[str, str]) -> None:
        self.directory = directory
        # Restarts keep the port. It lies below the ephemeral range (`listening_port`); if it
        # was taken between its choice and the first start, the first start takes another.
        self.port = listening_port()
        # Outside pytest's 0700 folders, so that a test may connect as another user.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="tidal-test-"))
        self.socket_dir.chmod(0o755)
        self.socket = self.socket_dir / "controller.sock"
        self.state_dir = directory / "state"
        # The tests submit as root (allowed here, refused by default), and keep unit output
        # under the test's folder rather than in root's home.
        self.settings = {"allow_root_jobs": "true", "unit_output_dir": str(self.state_dir / "units"), **settings}
        self.extra_env: dict[str, str] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        ready_file = self.directory / "controller.ready.json"
        ready_file.unlink(missing_ok=True)
        self.starts += 1
        command = [sys.executable, "-m", "tidal.controller.daemon", "--state-dir", str(self.state_dir),
                   "--listen", self.address, "--unix-socket", str(self.socket), "--metrics-listen", "127.0.0.1:0",
                   "--ready-file", str(ready_file)]
        for key, value in self.settings.items():
            command += ["--set", f"{key}={value}"]
        log = open(self.directory / f"controller-{self.starts}.log", "wb")  # noqa: SIM115
        # Only the settings above: no TIDAL_* variable of the test run leaks into the config.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**env, "TIDAL_LOG_FORMAT": "json", **self.extra_env})
        self.process = process
        log.close()
        wait_until(lambda: ready_file.exists() or process.poll() is not None, 30, "the controller to serve")
        log_text = (self.directory / f"controller-{self.starts}.log").read_text(errors="replace")
        if process.poll() is not None and self.starts == 1 and any(
                sign in log_text.lower() for sign in ("address already in use", "failed to bind", "cannot listen on")):
            self.port = listening_port()
            self.start()
            return
        assert process.poll() is None, log_text
        self.ready = json.loads(ready_file.read_text())
        self.port = int(self.ready["tcp_port"])

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            _stop_process(self.process)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def admin(self) -> AdminClient:
        return AdminClient(unix_socket=self.socket, timeout_s=10.0)

    def events(self, job_id: str) -> list[admin_pb2.Event]:
        with self.admin() as client:
            return client.events(job_id)

    def wait_event(self, job_id: str, kind: str, timeout: float = 60.0,
                   where: Callable[[admin_pb2.Event], bool] = lambda e: True) -> admin_pb2.Event:
        def found() -> admin_pb2.Event | None:
            try:
                return next((e for e in self.events(job_id) if e.kind == kind and where(e)), None)
            except Exception:  # the controller may be restarting
                return None

        return wait_until(found, timeout, f"event {kind}", interval=0.1)


class LauncherProcess:
    def __init__(self, directory: Path, unit_id: str) -> None:
        self.unit_id = unit_id
        self.log_path = directory / f"launcher-{unit_id}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, controller: ControllerProcess, job_id: str, secret_path: str, extra: tuple[str, ...] = (),
              environment: dict[str, str] | None = None) -> None:
        """`environment`: set for this launcher (and its workers) only, as a node's own
        (say, the GPUs Slurm gave it in CUDA_VISIBLE_DEVICES)."""
        log = open(self.log_path, "ab")  # noqa: SIM115
        env = {**os.environ, **(environment or {}), "TIDAL_SECRET_FILE": secret_path, "TIDAL_LOG_FORMAT": "json"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tidal.launcher.agent", "--controller", controller.address, "--job", job_id,
             "--unit", self.unit_id, "--address", "127.0.0.1", "--stop-grace", "5", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        log.close()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records

    def worker_pids(self) -> list[int]:
        return [pid for r in self.log_records() if r.get("event") == "workers_started" for pid in r["pids"]]

    def stop(self) -> None:
        if self.process is not None:
            _stop_process(self.process)


class TidalRun:
    """A controller, its launchers, one job, and the worker logs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log_dir = directory / "worker-logs"
        self.controller = ControllerProcess(directory, {"join_settle_s": "1.5", "reconnect_grace_s": "10"})
        self.launchers: dict[str, LauncherProcess] = {}
        self.job_id = ""
        self.secret_path = ""

    def submit(self, *, min_replicas: int, max_replicas: int, steps: int = 100_000, step_time: float = 0.05,
               name: str = "train", procs_per_node: int = 1, command: list[str] | None = None,
               mode: common_pb2.JobMode = common_pb2.JOB_MODE_RESTART, nodes_per_replica: int = 1) -> admin_pb2.Job:
        """Submit the restart-mode example, or `command`."""
        if command is None:
            command = [sys.executable, str(EXAMPLE), "--snapshot", str(self.directory / "snapshot.pt"),
                       "--steps", str(steps), "--step-time", str(step_time), "--log-dir", str(self.log_dir)]
        # Every "node" shares this machine's cores: one compute thread per worker, or
        # OpenMP's spinning threads of one worker starve the others.
        spec = admin_pb2.JobSpec(name=name, min_replicas=min_replicas, max_replicas=max_replicas, command=command,
                                 working_dir=str(self.directory), procs_per_node=procs_per_node, mode=mode,
                                 nodes_per_replica=nodes_per_replica, environment={"OMP_NUM_THREADS": "1"})
        with self.controller.admin() as client:
            response = client.submit(spec)
        self.job_id = response.job.job_id
        self.secret_path = response.secret_path
        return response.job

    def start_launcher(self, unit_id: str, extra: tuple[str, ...] = (),
                       environment: dict[str, str] | None = None) -> LauncherProcess:
        launcher = LauncherProcess(self.directory, unit_id)
        launcher.start(self.controller, self.job_id, self.secret_path, extra, environment)
        self.launchers[unit_id] = launcher
        return launcher

    def job(self) -> admin_pb2.Job:
        with self.controller.admin() as client:
            return client.job(self.job_id)

    def steps(self) -> list[dict[str, Any]]:
        """Every step every worker logged, in time order."""
        records: list[dict[str, Any]] = []
        for path in sorted(self.log_dir.glob("rank-*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return sorted(records, key=lambda r: r["time"])

    def wait_steps(self, count: int, world_size: int, timeout: float = 90.0) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]]:
            done = [r for r in self.steps() if r["world_size"] == world_size and r["rank"] == 0]
            return done if len(done) >= count else []

        return wait_until(enough, timeout, f"{count} steps at world size {world_size}", interval=0.2)

    def all_worker_pids(self) -> set[int]:
        return {pid for launcher in self.launchers.values() for pid in launcher.worker_pids()}

    def close(self) -> list[int]:
        """Stop everything; return worker PIDs that had to be killed here (should be none)."""
        workers = self.all_worker_pids()
        # Cancel first, so the launchers leave together instead of re-forming one by one.
        with contextlib.suppress(Exception):
            if self.job_id and self.controller.process and self.controller.process.poll() is None:
                with self.controller.admin() as client:
                    client.cancel(self.job_id)
                for launcher in self.launchers.values():
                    if launcher.process is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            launcher.process.wait(10)
        for launcher in self.launchers.values():
            launcher.stop()
        self.controller.stop()
        leftovers = []
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                if alive(pid):
                    leftovers.append(pid)
                    os.killpg(pid, signal.SIGKILL)
        return leftovers


@pytest.fixture
def tidal_run(tmp_path: Path) -> Iterator[TidalRun]:
    run = TidalRun(tmp_path)
    run.controller.start()
    yield run
    leftovers = run.close()
    assert not leftovers, f"worker processes outlived their launchers: {leftovers}"
