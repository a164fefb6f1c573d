"""A benchmark's --quick run, end to end, as `make test` checks it (its timing is not judged
here: that is `make bench`'s job, on a quiet machine). tests/integration/test_bench_quick.py
runs the benchmarks that need no cluster, tests/slurm/test_bench_quick.py the rest."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# torchft runs beside Tidal in these when it is installed (`make test` installs it).
WITH_TORCHFT = {"recovery", "overhead", "goodput"}


def run_quick_benchmark(name: str, results: Path) -> None:
    """`python -m bench.NAME --quick`, writing into `results`: it must exit 0 and write its
    rows, every figure with its repetitions and its baseline's."""
    benchmark = subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--quick"], cwd=REPO_ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env={**os.environ, "TIDAL_BENCH_RESULTS": str(results)})
    try:
        output, _ = benchmark.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        # SIGINT, not SIGKILL: the benchmark's cleanup stops what it started (agents, launchers).
        benchmark.send_signal(signal.SIGINT)
        output, _ = benchmark.communicate(timeout=60)
        pytest.fail(f"bench.{name} --quick ran over 480 s: {output[-3000:]}")
    assert benchmark.returncode == 0, output[-6000:]
    document = json.loads((results / f"{name}.quick.json").read_text())
    assert document["quick"] and document["machine"]["cores"]
    assert document["command"].startswith(f"python -m bench.{name}")
    assert document["rows"], document
    for row in document["rows"]:
        # Every figure lists its repetitions; a baseline is measured beside it, in the same run.
        assert math.isfinite(row["tidal"]) and row["tidal_samples"], row
        if row["baseline"] is not None:
            assert math.isfinite(row["baseline"]) and row["baseline_samples"], row
    if name in WITH_TORCHFT and importlib.util.find_spec("torchft") is not None:
        assert any(row["baseline_name"].startswith("torchft") for row in document["rows"]), output[-3000:]
