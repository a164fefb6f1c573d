"""torchft beside Tidal: a lighthouse and N replica groups of bench/baselines/torchft_lm.py
(one process each), all on loopback, for bench/recovery.py and bench/overhead.py. torchft
is a bench-only extra (`pip install torchft==0.2.0`, which `make bench` does); without it
the torchft rows are left out and the benchmark says so."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.common import read_jsonl
from tests.integration.conftest import free_port, wait_until

TORCHFT_BASELINE = Path(__file__).resolve().parent / "baselines" / "torchft_lm.py"


def lighthouse_options(min_replicas: int = 1) -> list[str]:
    """torchft's own Slurm example settings (torchft/examples/slurm/README.md), with the
    quorum's least size; the lighthouse's heartbeat timeout is its default, 5 s. The
    goodput benchmark gives it the min_replicas Tidal's job has, so that neither trains
    on fewer replica groups than the other may."""
    return ["--min_replicas", str(min_replicas), "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def torchft_name(wrapper: str = "ddp", min_replicas: int = 1) -> str:
    """How RESULTS.md names the torchft baseline run with `wrapper`."""
    named = "its DistributedDataParallel" if wrapper == "ddp" else "its PureDistributedDataParallel"
    return (f"torchft 0.2.0 (Manager, {named}, gloo; lighthouse " + " ".join(lighthouse_options(min_replicas))
            + ", heartbeat timeout 5 s)")


def torchft_lighthouse() -> Path | None:
    """The lighthouse binary of the torchft wheel in this environment, or None."""
    found = Path(sys.executable).parent / "torchft_lighthouse"
    return found if importlib.util.find_spec("torchft") is not None and found.exists() else None


def lighthouse_command(lighthouse: Path, port: int, min_replicas: int = 1) -> list[str]:
    """The lighthouse serving on 127.0.0.1:`port` with the benchmarks' options."""
    return [str(lighthouse), *lighthouse_options(min_replicas), "--bind", f"127.0.0.1:{port}"]


def replica_command(replica: int, replicas: int, lighthouse_port: int, log_dir: Path, model: list[str],
                    steps: int = 1_000_000, wrapper: str = "ddp") -> list[str]:
    """One replica group of bench/baselines/torchft_lm.py (its own store on a free port)."""
    return [sys.executable, str(TORCHFT_BASELINE), "--replica", str(replica), "--replicas", str(replicas),
            "--lighthouse", f"http://127.0.0.1:{lighthouse_port}", "--store-port", str(free_port()),
            "--steps", str(steps), "--wrapper", wrapper, "--log-dir", str(log_dir), *model]


class TorchftJob:
    """A lighthouse and `replicas` replica groups training `model` (ddp_lm's options)."""

    def __init__(self, folder: Path, lighthouse: Path, replicas: int, model: list[str], steps: int = 1_000_000,
                 wrapper: str = "ddp") -> None:
        self.folder = folder
        self.processes: list[subprocess.Popen[bytes]] = []
        folder.mkdir(parents=True)
        port = free_port()
        self._start(folder / "lighthouse.log", lighthouse_command(lighthouse, port))
        for replica in range(replicas):
            self._start(folder / f"replica-{replica}.log",
                        replica_command(replica, replicas, port, folder, model, steps, wrapper))

    def _start(self, log_path: Path, command: list[str]) -> None:
        with open(log_path, "wb") as log:
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True,
                                                   env={**os.environ, "OMP_NUM_THREADS": "1"}))

    def steps(self, since: float, world_size: int | None = None) -> list[dict[str, Any]]:
        """Committed steps logged after `since` (by any group), at `world_size` participants."""
        return [r for r in read_jsonl(sorted(self.folder.glob("torchft-*.jsonl")))
                if r["time"] > since and r["committed"] and (world_size is None or r["world_size"] == world_size)]

    def wait_stepping(self, world_size: int, timeout_s: float = 300.0) -> None:
        wait_until(lambda: len(self.steps(time.time() - 1.0, world_size)) > 0, timeout_s,
                   f"torchft at {world_size} replica groups", interval=0.2)

    def wait_done(self, timeout_s: float) -> None:
        """Every replica group's process exited (it trained its --steps)."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes[1:]:
            process.wait(max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"a torchft replica group exited {process.returncode}: see {self.folder}")

    def kill(self, replica: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.processes[1 + replica].pid, signal.SIGKILL)

    def __enter__(self) -> TorchftJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
