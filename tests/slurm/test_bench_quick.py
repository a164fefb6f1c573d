"""Every benchmark's --quick run works end to end (its timing is not judged here: that is
`make bench`'s job, on a quiet machine)."""

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
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

# bench.scaling and bench.cluster_sim are left out: the first is sleep-bound by design
# (tests/unit/test_simulated.py covers its model), the second needs no cluster
# (tests/unit/test_cluster_sim.py runs it).
# torchft runs beside Tidal in these when it is installed (`make test` installs it).
WITH_TORCHFT = {"recovery", "overhead", "goodput"}
# bench.world_scale needs no cluster but runs here with the others (its --quick: about 10 s).
BENCHMARKS = ["detection", "recovery", "overhead", "reduction", "transfer", "controller_scale", "world_scale", "grow",
              "preemption", "goodput"]


@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.timeout(600)
def test_the_quick_benchmark_runs_and_writes_its_rows(name: str, slurm: CliJsonSlurmClient, mini_cluster: dict,
                                                      tmp_path: Path) -> None:
    benchmark = subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--quick"], cwd=REPO_ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env={**os.environ, "TIDAL_BENCH_RESULTS": str(tmp_path)})
    try:
        output, _ = benchmark.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        # SIGINT, not SIGKILL: the benchmark's cleanup stops what it started (agents, launchers).
        benchmark.send_signal(signal.SIGINT)
        output, _ = benchmark.communicate(timeout=60)
        pytest.fail(f"bench.{name} --quick ran over 480 s: {output[-3000:]}")
    assert benchmark.returncode == 0, output[-6000:]
    document = json.loads((tmp_path / f"{name}.quick.json").read_text())
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
