"""The quick runs of the benchmarks that need the mini cluster, and of three that do not
(tests/bench_quick.py; the other benchmarks that run on loopback alone are in
tests/integration/test_bench_quick.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_quick import run_quick_benchmark
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

# bench.scaling and bench.cluster_sim are left out: the first is sleep-bound by design
# (tests/unit/test_simulated.py covers its model), the second needs no cluster
# (tests/unit/test_cluster_sim.py runs it); bench.chaos is tests/slurm/test_chaos.py's.
# bench.recovery and bench.overhead need no cluster either: they run here, in `make test`'s
# second part, not in its two streams, which are loaded enough (the side stream, about as
# long as the first, took bench.reduction's 22 s, tests/integration/test_bench_quick.py).
BENCHMARKS = ["recovery", "overhead", "grow", "preemption", "goodput"]


@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.timeout(600)
def test_the_quick_benchmark_runs_and_writes_its_rows(name: str, slurm: CliJsonSlurmClient, mini_cluster: dict,
                                                      tmp_path: Path) -> None:
    run_quick_benchmark(name, tmp_path)
