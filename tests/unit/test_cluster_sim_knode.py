"""K-node replicas on a busy cluster (bench/cluster_sim_knode.py): what a reader of the busy
rows relies on. Without failures nobody loses time; with one-node replicas patching is
K-at-once; a lost node costs patching the wait for one free node, and K-at-once the wait
for K (with a reservation: K freed one by one; without: K freed together; none when Slurm
keeps the K−1 it gave back for the request); healthy nodes are released after
`replica_patch_wait_s`; on a busy cluster of 16,384 GPUs patching keeps more work than
K-at-once (at 1,024 GPUs, where many patches outwait the 600 s, not in every seed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cluster_sim as sim
from bench import cluster_sim_knode as knode

COSTS = sim.Costs(worker_crash_s=0.1, node_lost_s=0.13, worker_hang_s=1.6, grow_s=5.0, world_change_s=0.11,
                  torchrun_restart_s=48.0, transfer_gb_s=3.2)
K = 8
WAIT_S = 600.0
REPO = Path(__file__).resolve().parents[2]


def busy(days: float = 1.0, *, name: str = "busy", nodes_per_replica: int = K) -> sim.Load:
    return sim.scenario(name, 1_024, days, nodes_per_replica=nodes_per_replica)


class OtherJobs:
    """The busy cluster's queue as `Cluster.backfill` draws from it (`random.Random`'s two
    calls), scripted: one-node jobs, the first running `runs_s`, every later one `then_s`."""

    def __init__(self, runs_s: list[float], then_s: float) -> None:
        self.runs_s = list(runs_s)
        self.then_s = then_s

    def randint(self, low: int, high: int) -> int:
        return 1

    def expovariate(self, rate: float) -> float:
        return self.runs_s.pop(0) if self.runs_s else self.then_s


def lost(at: float, node: int, in_step: float = 0.5) -> sim.Fault:
    # Repaired after the end: the failed node stays away.
    return sim.Fault(at=at, node=node, how="worker_crash", repair_s=10 * sim.DAY_S, in_step=in_step)


def run(load: sim.Load, trace: sim.Trace, *, patch: bool, wait_s: float = WAIT_S,
        other_jobs: OtherJobs | None = None) -> tuple[knode.KNodeReplicas, sim.Outcome]:
    job = knode.KNodeReplicas(load, trace, COSTS, patch=patch, patch_wait_s=wait_s, name="patch" if patch else "K")
    if other_jobs is not None:
        job.other_work = other_jobs  # type: ignore[assignment]
    return job, job.run()


def test_the_busy_cluster_has_whole_replicas_and_no_idle_node() -> None:
    load = busy()
    assert (load.nodes, load.home, load.replicas) == (128, 112, 14)
    job, _ = run(load, [e for e in sim.make_trace(load, seed=1) if not isinstance(e, sim.Fault)], patch=True)
    # Every node the job does not hold runs other work.
    assert not job.idle and len(job.replica_of) == load.home


def test_without_failures_the_k_node_policies_keep_all_their_time() -> None:
    load = busy()
    trace = [e for e in sim.make_trace(load, seed=2) if not isinstance(e, sim.Fault)]
    outcomes = {p.name: p.run() for p in knode.policies(load, trace, COSTS)}
    assert len(outcomes) == 4
    for name, outcome in outcomes.items():
        assert outcome.interruptions == 0, name
        if name.startswith("checkpoint-restart"):
            interval = sim.young_interval_s(load)
            assert outcome.ettr == pytest.approx(interval / (interval + sim.CHECKPOINT_WRITE_S), abs=2e-3), name
        else:
            assert (outcome.ettr, outcome.goodput, outcome.work) == pytest.approx((1.0, 1.0, 1.0), abs=1e-12), name


def test_with_one_node_replicas_patching_is_k_at_once() -> None:
    load = busy(days=20.0, nodes_per_replica=1)
    trace = sim.make_trace(load, seed=4)
    assert sum(isinstance(e, sim.Fault) for e in trace) >= 5
    _, patched = run(load, trace, patch=True)
    _, whole = run(load, trace, patch=False)
    assert patched.interruptions >= 1
    for measure in ("ettr", "goodput", "work", "interruptions", "replica_out_s"):
        assert getattr(patched, measure) == getattr(whole, measure), measure
    assert patched.released == 0


def test_a_lost_node_costs_patching_one_free_node_and_k_at_once_k() -> None:
    others = busy().nodes - busy().home
    # Node 3 (replica 0) is lost at 500 s; an other job ends at 1,000 s, then one every 100 s.
    def other_jobs() -> OtherJobs:
        return OtherJobs([1_000.0 + 100 * i for i in range(others)], 10 * sim.DAY_S)

    trace: sim.Trace = [lost(500.0, node=3)]
    join_s = knode.join_s(COSTS)
    span = busy().span_s
    home = busy().home

    def work(out_s: float) -> float:
        # Every member lost the step in flight, the 13 others paused for the recovery, the 14 for
        # the rejoin (when it came); the replica's 8 nodes trained nothing while it was out.
        rejoined = out_s < span - 500.0
        return (home * span - K * out_s - home * 0.5 * sim.STEP_S - (home - K) * COSTS.worker_crash_s
                - (home * COSTS.world_change_s if rejoined else 0.0)) / (home * span)

    patched_at = 1_000.0 + join_s - 500.0
    for name in sim.BUSY_SCENARIOS:
        patching, patched = run(busy(name=name), trace, patch=True, other_jobs=other_jobs())
        assert patched.replica_out_s == pytest.approx((patched_at,)), name
        assert patched.released == 0 and patching.replicas[0].phase is knode.Phase.TRAINING
        assert patched.ettr == pytest.approx(1 - (0.5 * sim.STEP_S + COSTS.worker_crash_s + COSTS.world_change_s)
                                             / span, rel=1e-12)
        assert patched.work == pytest.approx(work(patched_at), rel=1e-12), name
        # Held: the 7 healthy nodes waiting (idle) and the patch node from 1,000 s; not the lost one meanwhile.
        assert patched.goodput == pytest.approx(work(patched_at) * home * span / (home * span - 500.0), rel=1e-12)

    # K at once, Slurm reserving for it: the 7 healthy nodes went to other jobs first; then the
    # request holds nodes as they free, and the 8th frees at 1,700 s.
    _, whole = run(busy(), trace, patch=False, other_jobs=other_jobs())
    assert whole.replica_out_s == pytest.approx((1_700.0 + join_s - 500.0,))
    assert whole.work == pytest.approx(work(1_700.0 + join_s - 500.0), rel=1e-12)
    # Without a reservation the nodes free one at a time, never 8 together: it never returns.
    stranded_job, stranded = run(busy(name="busy-no-reservation"), trace, patch=False, other_jobs=other_jobs())
    assert stranded.replica_out_s == () and stranded_job.replicas[0].phase is knode.Phase.ABSENT
    assert stranded.out_at_end == 1 and patched.out_at_end == 0
    assert stranded.work == pytest.approx(work(span - 500.0), rel=1e-12)
    # When Slurm keeps the 7 for the new request, the 8th is the first free node: patching's wait.
    _, kept = run(busy(name="busy-requeue-keeps-nodes"), trace, patch=False, other_jobs=other_jobs())
    assert kept.replica_out_s == pytest.approx((patched_at,))
    assert kept.work == pytest.approx(work(patched_at), rel=1e-12)
    assert kept.goodput > patched.goodput  # the idle 7 are not the job's while Slurm holds them


def test_healthy_nodes_are_released_after_replica_patch_wait_s() -> None:
    load = busy()
    # No node frees for a day.
    trace: sim.Trace = [lost(500.0, node=3)]
    job, outcome = run(load, trace, patch=True, other_jobs=OtherJobs([], sim.DAY_S + 1))
    assert outcome.released == 1
    assert any("no free node in 600 s; 7 healthy nodes released" in d for d in outcome.decisions)
    # Released at 1,100 s, taken by other jobs at once; the replica now waits for 8 together.
    assert job.replicas[0].phase is knode.Phase.ABSENT and not job.replicas[0].nodes
    assert len(job.replica_of) == load.home - K and not job.idle
    _, whole = run(load, trace, patch=False, other_jobs=OtherJobs([], sim.DAY_S + 1))
    # The 7 held for the wait are the only difference from K at once (goodput), not the work.
    assert outcome.work == pytest.approx(whole.work, rel=1e-12)
    assert outcome.goodput < whole.goodput


def test_on_a_busy_cluster_patching_keeps_more_work_than_k_at_once() -> None:
    # 16,384 GPUs (236 replicas of 8 nodes), 5 days: about 40 nodes lost per run.
    load = sim.scenario("busy", 16_384, 5.0, nodes_per_replica=K)
    for seed in (1, 2, 3):
        results = knode.simulate(load, [seed], COSTS)
        patched = results[knode.patch_name(knode.REPLICA_PATCH_WAIT_S)][0]
        whole = results[knode.WHOLE_NAME][0]
        assert patched.interruptions > 20, seed
        assert patched.work > whole.work, seed
        # Time-based ETTR hardly separates them: the other replicas train on meanwhile.
        assert patched.ettr == pytest.approx(whole.ettr, abs=1e-4), seed
        checkpoint = next(o[0] for name, o in results.items() if name.startswith("checkpoint-restart"))
        assert checkpoint.ettr < min(patched.ettr, whole.ettr), seed


def test_the_quick_run_writes_the_busy_rows(tmp_path: Path) -> None:
    completed = subprocess.run([sys.executable, "-m", "bench.cluster_sim", "--quick", "--replica-patch-wait-s", "900"],
                               cwd=REPO, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "TIDAL_BENCH_RESULTS": str(tmp_path)})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    document = json.loads((tmp_path / "cluster_sim.quick.json").read_text())
    busy_entries = [e for e in document["table"] if e["scenario"].startswith("busy")]
    assert {(e["scenario"], e["gpus"], e["nodes_per_replica"]) for e in busy_entries} == {
        (name, 1_024, 8) for name in sim.BUSY_SCENARIOS}
    assert {e["policy"] for e in busy_entries} >= {knode.patch_name(900), knode.patch_name(2_700), knode.WHOLE_NAME}
    # The K-node policies say how long a replica was out and how many never came back.
    assert all("replicas" in e for e in busy_entries if not e["policy"].startswith("checkpoint-restart"))
    busy_rows = [r for r in document["rows"] if "K = 8" in r["metric"]]
    assert len(busy_rows) == 3 * len(sim.BUSY_SCENARIOS)
    assert all(r["tidal_samples"] and r["baseline_samples"] for r in busy_rows)
    assert document["settings"]["replica_patch_wait_s"] == 900
