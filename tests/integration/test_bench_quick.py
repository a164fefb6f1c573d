"""The quick runs of the benchmarks that need no cluster (controllers, launchers, torchrun
and torchft on loopback; tests/bench_quick.py). `make test` runs them in the stream beside
the unit and integration tiers; those that need the mini cluster are in
tests/slurm/test_bench_quick.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_quick import run_quick_benchmark

pytestmark = pytest.mark.integration

# bench.world_scale's --quick: about 10 s on 2 cores; bench.reduction's about 22 s alone.
# (bench.recovery and bench.overhead, which need no cluster either, run in the Slurm tier:
# tests/slurm/test_bench_quick.py says why.)
BENCHMARKS = ["detection", "transfer", "controller_scale", "world_scale", "reduction"]


@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.timeout(600)
def test_the_quick_benchmark_runs_and_writes_its_rows(name: str, tmp_path: Path) -> None:
    run_quick_benchmark(name, tmp_path)
