"""What every benchmark shares: the machine, the result files, medians and ratios.

Each benchmark is a module run from the repository root (`python -m bench.overhead`),
writes `bench/results/<name>.json` (its rows, the command, the machine, the code version
(`git describe --always --dirty`), the date), and
`python -m bench.report` turns every result file into bench/RESULTS.md. `--quick` runs a
smoke version (`make test` runs those and checks they run, never their timing)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Where result files go ($TIDAL_BENCH_RESULTS: the quick runs in `make test` write elsewhere).
RESULTS_DIR = Path(os.environ.get("TIDAL_BENCH_RESULTS", REPO / "bench" / "results"))
LM_EXAMPLE = REPO / "examples" / "live_mode" / "train_lm.py"
MLP_EXAMPLE = REPO / "examples" / "live_mode" / "train_mlp.py"

# The small float64 language model the HybridSharded tests and chaos's sharded job train
# (tests/integration/test_hsdp.py, tests/slurm/test_live_multinode.py, bench.chaos --sharded).
GLOBAL_BATCH = 24
# The one-process references train the same global batch in two micro-batches, not twelve:
# the same run to float64 rounding (800 DataParallel steps: 1.5e-10 of a tensor's scale
# apart, against the tests' 1e-9) in half the time.
REFERENCE_MICRO_BATCH = GLOBAL_BATCH // 2
# The gradients' norm is clipped at 0.5, which some of these steps exceed: under hsdp
# the norm is a collective of the unit's shard group, taken before the step's commit vote.
MAX_GRAD_NORM = 0.5


def small_lm_command(out: Path, ledger: Path, strategy: str, *, steps: int, micro_batch: int = 2) -> list[str]:
    """train_lm.py's small float64 model (`strategy` dp or hsdp), its ledger and --out."""
    return [sys.executable, str(LM_EXAMPLE), "--strategy", strategy, "--dtype", "float64", "--steps", str(steps),
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(micro_batch), "--context", "16",
            "--width", "32", "--layers", "2", "--characters", "20000", "--seed", "3",
            "--log-every", "1000", "--ledger-dir", str(ledger), "--out", str(out),
            "--max-grad-norm", str(MAX_GRAD_NORM)]
DDP_BASELINE = REPO / "bench" / "baselines" / "ddp_lm.py"
# The environment of a torchrun baseline. torch 2.13's c10d rendezvous shares the agent's
# TCPStore with the workers by default and does not scope it per restart, so workers
# restarted by --max-restarts read the previous round's gloo addresses and fail to connect
# again and again (pytorch/pytorch#135712). The documented opt-out gives torchrun its
# working restarts, so the baseline is what a torchrun user who knows the issue gets.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass
class Row:
    """One line of RESULTS.md: Tidal's figure beside its baseline, from the same run."""

    benchmark: str
    metric: str
    unit: str
    tidal: float
    goal: str
    met: bool
    baseline: float | None = None
    baseline_name: str = ""
    # Every repetition, so a reader sees the spread behind the median.
    tidal_samples: list[float] = field(default_factory=list)
    baseline_samples: list[float] = field(default_factory=list)
    # The comparison in the same run, and what it means ("baseline / Tidal: Tidal is N×
    # faster", "Tidal / baseline steps/s").
    ratio: float | None = None
    ratio_meaning: str = ""
    note: str = ""


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of `values` at `confidence` (at least):
    the order statistics x(k) and x(n−k+1) with the largest k such that a Binomial(n, ½)
    falls below k with probability ≤ (1 − confidence) / 2. NaNs when n is too small for any
    (n < 6 at 95%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    below, k = 0.0, 0
    while k < n:
        # P(Binomial(n, ½) ≤ k), the chance that fewer than k + 1 values lie below the median.
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return ordered[k - 1], ordered[n - k]


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (from /proc), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Samples, in a thread, the CPU seconds the processes `pids()` names have used (each
    one's last figure kept once it exits): a list of (wall time, total CPU seconds)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._pids: Callable[[], Sequence[int]] = list
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self, pids: Callable[[], Sequence[int]]) -> None:
        self._pids = pids
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for pid in self._pids():
                    seconds = process_cpu_seconds(pid)
                    if seconds is not None:
                        self._last[pid] = seconds
                self.samples.append((time.time(), sum(self._last.values())))
            self._stop.wait(self.interval_s)

    def between(self, start: float, end: float) -> float:
        """CPU seconds used between wall times `start` and `end` (the samples nearest them)."""
        if not self.samples:
            return float("nan")
        first = min(self.samples, key=lambda s: abs(s[0] - start))
        last = min(self.samples, key=lambda s: abs(s[0] - end))
        return last[1] - first[1]


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory_gib = 0.0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gib = int(line.split()[1]) / 2**20
    slurm = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        slurm = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=10).stdout.strip()
    import torch

    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": round(memory_gib, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "slurm": slurm, "backend": "gloo on CPU"}


def parser(description: str) -> argparse.ArgumentParser:
    """Every benchmark's command line; notes the code version as the run starts."""
    code_version()
    result = argparse.ArgumentParser(description=description)
    result.add_argument("--quick", action="store_true", help="a smoke run: fewer, shorter repetitions")
    result.add_argument("--repeat", type=int, default=0, help="repetitions (default: the benchmark's own)")
    result.add_argument("--keep", type=Path, default=None, help="keep logs and state in this folder")
    return result


@contextlib.contextmanager
def workspace(keep: Path | None, name: str) -> Iterator[Path]:
    if keep is not None:
        folder = keep / name
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix=f"tidal-bench-{name}-") as scratch:
        os.chmod(scratch, 0o755)
        yield Path(scratch)


@functools.cache
def code_version() -> str:
    """The code a run measured: `git describe --always --dirty` of the repository (a
    "-dirty" suffix: the working tree differed from that commit), or "unknown" outside a
    git checkout. Asked once per process: `parser()` asks at the start of a run, so that a
    commit made while a long benchmark runs does not stand for the code it measured."""
    try:
        result = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def write_result(name: str, rows: list[Row], *, quick: bool, settings: dict[str, Any], text: str = "",
                 extra: dict[str, Any] | None = None, module: str = "") -> Path:
    """Write the benchmark's result file; `text`, when given, is a paragraph RESULTS.md
    prints under the benchmark's heading (what a reader must know to read its rows);
    `extra` adds top-level keys a benchmark's own report part reads; `module` names the
    bench module that wrote it where that is not `name` (one module, two result files)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}{'.quick' if quick else ''}.json"
    command = "python -m bench." + (module or name) + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    document = {"benchmark": name, "command": command, "quick": quick, "machine": machine(),
                "code": code_version(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "settings": settings, "rows": [asdict(r) for r in rows], **({"text": text} if text else {}),
                **(extra or {})}
    path.write_text(json.dumps(document, indent=2) + "\n")
    for row in rows:
        baseline = f", baseline {row.baseline_name} {row.baseline:.4g} {row.unit}" if row.baseline is not None else ""
        ratio = f" ({row.ratio_meaning} = {row.ratio:.3g})" if row.ratio is not None else ""
        print(f"{name}: {row.metric}: Tidal {row.tidal:.4g} {row.unit}{baseline}{ratio}; goal {row.goal}: "
              f"{'met' if row.met else 'NOT met'}", flush=True)
    print(f"{name}: wrote {path}")
    return path


def read_jsonl(paths: Sequence[Path]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return sorted(records, key=lambda r: r["time"])


def steady_rate(times: Sequence[float], skip: int) -> float:
    """Steps per second between the `skip`-th and the last of consecutive step times."""
    kept = sorted(times)[skip:]
    if len(kept) < 2:
        return float("nan")
    return (len(kept) - 1) / (kept[-1] - kept[0])


def stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (timeout, a CI runner, a kill by PID) unwinds like SIGINT: every `finally`
    stops what it started (controllers, lighthouses, the trace's Slurm jobs)."""
    raise SystemExit(128 + signum)
