"""Every benchmark's --quick run works end to end (its timing is not judged here: that is
`make bench`'s job, on a quiet machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

BENCHMARKS = ["detection", "recovery", "overhead", "controller_scale", "grow", "preemption", "goodput"]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_quick_benchmark_runs_and_writes_its_rows(name: str, slurm: CliJsonSlurmClient, mini_cluster: dict,
                                                      tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=900, env={**os.environ, "TIDAL_BENCH_RESULTS": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / f"{name}.quick.json").read_text())
    assert document["quick"] and document["machine"]["cores"]
    assert document["command"].startswith(f"python -m bench.{name}")
    assert document["rows"], document
    for row in document["rows"]:
        assert math.isfinite(row["tidal"]) and row["tidal_samples"], row
        if row["baseline"] is not None:
            assert math.isfinite(row["baseline"]), row
