"""Chaos on the real mini cluster (bench/chaos.py): seeded sequences of faults against a
live float64 job under a CPU hog, each run to the job's end; and issue 12's scenario, a
fixed world of 4 under load that must simply finish."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import chaos
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

CHAOS_DEADLINE_S = 300.0
# Long enough for all four faults of the churn scenario to land before the end.
CHURN_STEPS = 1000
CHURN_DEADLINE_S = 260.0
# The urgent-job scenarios: one fault, a few seconds in (the job resumes at about step 70-120
# on 2 cores, 30 steps/s); what follows the resume is only the rest of the run (at 1,600
# steps, a minute of each test's 90 s).
URGENT_STEPS = 400
# `make test` plays seed 1 (seed 2 left it for time: `python -m bench.chaos --seeds 20` plays
# twenty, bench/RESULTS.md); TIDAL_CHAOS_SEEDS=1,2,3 plays others here.
SEEDS = [int(seed) for seed in os.environ.get("TIDAL_CHAOS_SEEDS", "1").split(",") if seed.strip()]
# Runs long enough for a seed's 4-6 faults, some waiting for a hard moment, to land before
# the last steps (a fault the job ends before fails the seed); each ends well within the
# seeds' 420 s timeout when Tidal works. Seed 1 alone (make test) needs fewer: its kill,
# grow and stop land by about step 200 (at 30 steps/s on 2 cores), and its drain waits for
# the last 5 % of the steps, which at 1,600 left the job training untouched for 40 s.
CHAOS_STEPS = 1000 if SEEDS == [1] else 1600


@pytest.fixture(scope="module")
def chaos_reference(tmp_path_factory: pytest.TempPathFactory) -> chaos.Reference:
    return chaos.fixed_run(CHAOS_STEPS, tmp_path_factory.mktemp("chaos-reference"))


@pytest.fixture(scope="module")
def urgent_reference(tmp_path_factory: pytest.TempPathFactory) -> chaos.Reference:
    return chaos.fixed_run(URGENT_STEPS, tmp_path_factory.mktemp("urgent-reference"))


@pytest.fixture
def hog() -> Iterator[list[int]]:
    with chaos.cpu_hog() as pids:
        yield pids


@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_sequence_of_faults_ends_completed_once_with_the_fixed_runs_steps_and_parameters(
        seed: int, slurm: CliJsonSlurmClient, mini_cluster: dict, chaos_reference: chaos.Reference,
        hog: list[int], tmp_path: Path) -> None:
    result = chaos.run_seed(seed, chaos_reference, tmp_path, deadline_s=CHAOS_DEADLINE_S)
    assert result.passed, result.report()


@pytest.mark.timeout(420)
def test_issue_12s_churn_grow_drain_resize_kill_resize_preempt_then_finish(
        slurm: CliJsonSlurmClient, mini_cluster: dict, hog: list[int], tmp_path: Path) -> None:
    """The sequence a new user tried (issue 12): the job grows to 4, a unit is drained,
    `resize --max 2` then back to 4 with a worker killed in between, an urgent job on 3
    nodes preempts units and is cancelled; then the job is left to finish. It must end
    COMPLETED once, every step with the fixed run's samples, parameters within 1e-9."""
    reference = chaos.fixed_run(CHURN_STEPS, tmp_path / "reference")
    faults = [chaos.PlannedFault(kind="drain", gap_s=2.0, pick=0.5, duration_s=0.0, nodes=0),
              chaos.PlannedFault(kind="shrink", gap_s=2.0, pick=0.0, duration_s=6.0, nodes=0),
              chaos.PlannedFault(kind="kill_worker", gap_s=1.0, pick=0.0, duration_s=0.0, nodes=0),
              chaos.PlannedFault(kind="urgent", gap_s=3.0, pick=0.0, duration_s=8.0, nodes=3)]
    result = chaos.run_seed(0, reference, tmp_path / "run", faults=faults, deadline_s=CHURN_DEADLINE_S)
    assert result.passed, result.report()
    assert result.faults == ["drain", "shrink", "kill_worker", "urgent"], result.report()


@pytest.mark.timeout(360)
def test_a_live_job_left_below_min_by_an_urgent_job_gives_its_last_node_back_and_resumes_from_the_saved_state(
        slurm: CliJsonSlurmClient, mini_cluster: dict, urgent_reference: chaos.Reference, hog: list[int],
        tmp_path: Path) -> None:
    """min 2 on 4 nodes: an urgent job on 3 preempts 3 units, and the one left trains
    nothing. With the default release settings, Slurm's views show nothing on its way (no
    idle node, no unit of its starting), so after below_min_blocked_release_s (5 s), not
    below_min_release_s (30 s), it gives its node back, saving the training state as it
    leaves; once the urgent job is gone the job resumes at that step and completes once,
    every step with the fixed run's samples, parameters within 1e-9."""
    faults = [chaos.PlannedFault(kind="urgent", gap_s=3.0, pick=0.0, duration_s=12.0, nodes=3)]
    result = chaos.run_seed(0, urgent_reference, tmp_path / "run", faults=faults, min_replicas=2, max_replicas=4,
                            deadline_s=CHAOS_DEADLINE_S)
    assert result.passed, result.report()
    assert result.faults == ["urgent"], result.report()
    timeline = "\n".join(result.timeline)
    released = [line for line in result.timeline if " below_min_released " in line]
    assert released and "below_min_blocked_release_s" in released[0], timeline
    assert "left after saving the training state at step" in timeline, timeline
    assert "state_lost" not in timeline and "resumed_from_checkpoint" not in timeline, timeline


# Long enough for the six faults below, a few seconds apart, and the release below min
# (5 s) with its resume, to land before the last 5 % of the steps.
SPANNING_STEPS = 1400


@pytest.mark.timeout(420)
def test_replicas_of_two_nodes_through_a_kill_a_shrink_an_urgent_job_a_restart_a_node_failure_and_a_drain(
        slurm: CliJsonSlurmClient, mini_cluster: dict, hog: list[int], tmp_path: Path) -> None:
    """`bench.chaos --nodes-per-replica 2`'s checks with faults chosen for replicas of two
    one-node units (min 1, max 2 replicas, DataParallel): a launcher killed (the other node
    of its replica trains on; its place is taken), --max 1 and back to 2, an urgent job on 3
    nodes (the node left is below min 1: it gives its node back saving the state, and the
    job resumes from it), the controller killed and started again, a node's slurmd and
    processes killed, a unit drained. COMPLETED once, every step with the fixed run's
    samples, parameters within 1e-9, no survivor restarted, no healthy unit failed."""
    reference = chaos.fixed_run(SPANNING_STEPS, tmp_path / "reference")
    # (The node failure comes after the urgent job, which needs every node training: a
    # killed node's Slurm job stays COMPLETING there for half a minute or more after its
    # slurmd is back, Slurm's resent TERMINATE_JOB, so the node is not idle to take again.)
    faults = [chaos.PlannedFault(kind="kill_launcher", gap_s=2.0, pick=0.0, duration_s=0.0, nodes=0),
              chaos.PlannedFault(kind="shrink", gap_s=2.0, pick=0.0, duration_s=4.0, nodes=0),
              chaos.PlannedFault(kind="urgent", gap_s=2.0, pick=0.0, duration_s=9.0, nodes=3),
              chaos.PlannedFault(kind="controller_restart", gap_s=2.0, pick=0.0, duration_s=4.0, nodes=0),
              chaos.PlannedFault(kind="node_fail", gap_s=2.0, pick=0.5, duration_s=3.0, nodes=0),
              chaos.PlannedFault(kind="drain", gap_s=2.0, pick=0.5, duration_s=0.0, nodes=0)]
    result = chaos.run_seed(0, reference, tmp_path / "run", faults=faults, nodes_per_replica=2,
                            deadline_s=CHAOS_DEADLINE_S)
    assert result.passed, result.report()
    assert result.faults == ["kill_launcher", "shrink", "urgent", "controller_restart", "node_fail", "drain"], \
        result.report()
    timeline = "\n".join(result.timeline)
    assert "replicas of 2 nodes" in timeline, timeline
    assert any(" below_min_released " in line for line in result.timeline), timeline
    assert "left after saving the training state at step" in timeline, timeline

