"""What the benchmarks' figures rest on (bench/common.py, bench/overhead.py, bench/goodput.py):
the interval of a median, CPU seconds per step read from the runs' own records, and the
node-seconds of progress a run's committed steps are worth."""

from __future__ import annotations

import math
import random

from bench.common import CpuSampler, median_interval
from bench.goodput import progress_node_seconds
from bench.overhead import steady_run


def test_the_median_interval_is_the_textbook_order_statistics_and_covers_the_median() -> None:
    # n = 15 at 95%: the 4th and 12th values (P(Binomial(15, ½) ≤ 3) = 0.018 ≤ 0.025 < P(≤ 4)).
    assert median_interval([float(v) for v in range(15, 0, -1)]) == (4.0, 12.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    low, high = median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert math.isnan(low) and math.isnan(high)  # 5 values cannot give 95%: [min, max] covers 93.75%
    # Over many samples of a known distribution the interval holds the true median (0) at
    # least 95% of the time.
    generator = random.Random(7)
    covered = 0
    for _ in range(2000):
        low, high = median_interval([generator.gauss(0.0, 1.0) for _ in range(15)])
        covered += low <= 0.0 <= high
    assert covered / 2000 >= 0.95


def test_cpu_per_step_counts_every_process_over_the_steady_steps_only() -> None:
    agents = CpuSampler()
    agents.samples = [(100.0, 5.0), (110.0, 6.0), (120.0, 7.0)]
    records = []
    for rank in (0, 1):
        for step in range(21):
            # Each rank costs 2 s of CPU for the first 5 steps (start-up), then 0.1 s a step.
            cpu = 2.0 * min(step, 5) + 0.1 * max(0, step - 5)
            records.append({"rank": rank, "time": 100.0 + step, "cpu_s": cpu})
    run = steady_run(records, 10, agents)
    assert run.steps_per_s == 1.0
    assert math.isclose(run.worker_cpu_per_step, 0.2)  # two ranks × 0.1 s, start-up left out
    assert math.isclose(run.agent_cpu_per_step, 0.1)  # 1 CPU second over the 10 steps from t=110 to 120


def test_a_step_counts_once_at_its_world_size_times_the_typical_step_time() -> None:
    # Steps 1-4 at world 2 (1 s apart), a stall, step 4 again (redone after a restart), 5-6 at world 4 (0.5 s apart).
    steps = [(1, 10.0, 2), (2, 11.0, 2), (3, 12.0, 2), (4, 13.0, 2), (4, 30.0, 4), (5, 30.5, 4), (6, 31.0, 4)]
    progress, distinct = progress_node_seconds(steps)
    assert distinct == 6
    # Steps 1-4 cost 2 × 1 s each; 5 and 6 cost 4 × 0.5 s each; the stall is not progress.
    assert math.isclose(progress, 4 * 2.0 + 2 * 2.0)
