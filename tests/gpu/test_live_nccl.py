"""Live mode on NCCL, one rank per GPU: the scenarios tests/integration/test_live_mode.py
and test_hsdp.py run on gloo, with the MLP and the language model on CUDA tensors and
every unit given its own GPUs (CUDA_VISIBLE_DEVICES, as Slurm gives a node's job step).

- DataParallel on 2 GPUs, units of one worker: grow 1 -> 2, kill -9 of a worker mid-step,
  grow again, SIGSTOP of a worker (frozen mid-collective: only the abort of the survivors'
  communicators from their control channel's thread ends their wait, well before the
  groups' 120 s timeout), grow again, graceful leave, run to the end; every step's samples
  and the final parameters equal the script's run alone on one GPU.
- HybridSharded on 2 GPUs, one unit of two workers (each on cuda:LOCAL_RANK): preempted,
  each worker saves its shard and the next unit resumes at that step; run to the end equal
  to one process.
- HybridSharded on 4 GPUs, units of two workers: grow 1 -> 2 units, kill -9 of a worker
  (its unit lost), grow, SIGSTOP of a worker, grow, graceful leave, run to the end equal
  to one process.

NOT RUN ON A GPU YET: they need two and four GPUs, and the one machine lent had one; elsewhere
they are left out (see tests/gpu/conftest.py). They are the integration tests' harness and
assertions, unchanged but for the device and the GPUs each launcher is given."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.gpu.conftest import assert_close_to, run_alone, visible
from tests.integration.conftest import TidalRun, alive, wait_until
from tests.integration.test_hsdp import lm_command
from tests.integration.test_live_mode import GLOBAL_BATCH, SAMPLES, SEED, commits, example_command, read_ledger
from tidal.proto import common_pb2
from tidal.train.data import GlobalOrder

# Long enough for every change below to land before the end (a step is a few tens of ms).
DP_STEPS = 1500
HSDP_STEPS = 400
# Far below the groups' timeout (Elastic's timeout_s, 120 s): a recovery within it was not
# the timeout's doing.
RECOVERY_S = 45.0


def _dp_command(tmp_path: Path, steps: int = DP_STEPS) -> list[str]:
    return [*example_command(tmp_path / "elastic.pt", tmp_path / "ledger", steps), "--device", "cuda"]


def _hsdp_command(tmp_path: Path, steps: int = HSDP_STEPS) -> list[str]:
    return [*lm_command(tmp_path / "elastic.pt", tmp_path / "ledger", "hsdp", steps), "--device", "cuda"]


def _steps_after(ledger: Path, world_size: int, since: float, count: int) -> bool:
    return len([r for r in commits(read_ledger(ledger), world_size) if r["time"] > since and r["rank"] == 0]) >= count


def _workers(run: TidalRun, unit: str, count: int) -> list[int]:
    pids = wait_until(lambda: run.launchers[unit].worker_pids() or None, 60, f"{unit}'s workers")
    assert len(pids) == count, pids
    return pids


def _freeze_and_recover(run: TidalRun, pid: int, world_size: int) -> None:
    """SIGSTOP `pid` mid-training: its launcher kills it (silent), and the survivors, blocked
    in an NCCL collective with it, are freed by the abort and train at `world_size`."""
    before = {e.generation for e in run.controller.events(run.job_id) if e.kind == "recovered"}
    frozen_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    failure = run.controller.wait_event(run.job_id, "failure_detected",
                                        where=lambda e: e.fields.get("cause") == "silent", timeout=RECOVERY_S)
    assert "killed by its launcher" in failure.reason, failure.reason
    recovered = run.controller.wait_event(run.job_id, "recovered", where=lambda e: e.generation not in before,
                                          timeout=RECOVERY_S)
    assert recovered.fields["world_size"] == str(world_size)
    assert time.monotonic() - frozen_at < RECOVERY_S
    wait_until(lambda: not alive(pid), 10, "the frozen worker to be killed")


def _assert_every_step_once_in_order(ledger: Path, steps: int) -> None:
    """Each step committed, with exactly its B samples of the seeded order across ranks."""
    records = read_ledger(ledger)
    committed_generation = {r["step"]: r["generation"] for r in commits(records)}
    assert sorted(committed_generation) == list(range(steps))
    shares: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for record in records:
        if record["kind"] == "attempt" and committed_generation.get(record["step"]) == record["generation"]:
            shares[record["step"]][record["rank"]] = record["indices"]
    order = GlobalOrder(SAMPLES, SEED)
    for step in range(steps):
        consumed = [i for rank in sorted(shares[step]) for i in shares[step][rank]]
        assert consumed == order.samples(step * GLOBAL_BATCH, GLOBAL_BATCH), f"step {step}"
    digests: dict[int, set[str]] = defaultdict(set)
    for record in records:
        if record["kind"] == "formed":
            digests[record["generation"]].add(record["digest"])
    assert all(len(found) == 1 for found in digests.values()), digests


@pytest.mark.gpu(devices=2)
def test_live_data_parallel_on_nccl_grows_survives_a_kill_and_a_freeze_leaves_and_matches_a_fixed_run(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    controller = tidal_run.controller
    tidal_run.submit(min_replicas=1, max_replicas=2, command=_dp_command(tmp_path), mode=common_pb2.JOB_MODE_LIVE)
    job_id = tidal_run.job_id
    # Unit a keeps GPU 0 all along (and hosts the store); b, c, d take GPU 1 in turn.
    tidal_run.start_launcher("a", environment=visible(0))
    controller.wait_event(job_id, "world_formed")
    wait_until(lambda: _steps_after(ledger, 1, 0, 20), 120, "20 steps at world size 1")

    # Grow 1 -> 2: b's worker receives the state over NCCL from a's GPU.
    tidal_run.start_launcher("b", environment=visible(1))
    controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "grow")
    grown_at = time.time()
    wait_until(lambda: _steps_after(ledger, 2, grown_at, 20), 120, "20 steps at world size 2")

    # kill -9 of b's worker mid-step: a goes on alone, in-process.
    [b_pid] = _workers(tidal_run, "b", 1)
    killed_at = time.monotonic()
    os.kill(b_pid, signal.SIGKILL)
    controller.wait_event(job_id, "recovered", timeout=RECOVERY_S)
    assert time.monotonic() - killed_at < RECOVERY_S
    wait_until(lambda: tidal_run.launchers["b"].process.poll() is not None, 30, "b's launcher to exit")
    recovered_at = time.time()
    wait_until(lambda: _steps_after(ledger, 1, recovered_at, 20), 120, "20 steps at world size 1 after the kill")

    # Grow again onto the freed GPU, then freeze c's worker.
    tidal_run.start_launcher("c", environment=visible(1))
    wait_until(lambda: _steps_after(ledger, 2, recovered_at, 20), 120, "20 steps at world size 2 with c")
    [c_pid] = _workers(tidal_run, "c", 1)
    _freeze_and_recover(tidal_run, c_pid, world_size=1)
    wait_until(lambda: tidal_run.launchers["c"].process.poll() is not None, 30, "c's launcher to exit")

    # Grow once more, then d leaves gracefully (SIGTERM to its launcher, as Slurm's preemption).
    frozen_recovered_at = time.time()
    tidal_run.start_launcher("d", environment=visible(1))
    wait_until(lambda: _steps_after(ledger, 2, frozen_recovered_at, 20), 120, "20 steps at world size 2 with d")
    tidal_run.launchers["d"].process.send_signal(signal.SIGTERM)
    controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "leave")
    wait_until(lambda: tidal_run.launchers["d"].process.poll() is not None, 30, "d's launcher to exit")
    assert tidal_run.launchers["d"].process.returncode == 0

    controller.wait_event(job_id, "job_completed", timeout=600)
    a_pids = tidal_run.launchers["a"].worker_pids()
    assert len(a_pids) == 1, "a's worker was never restarted"
    assert {r["world_size"] for r in commits(read_ledger(ledger))} == {1, 2}
    assert [r for r in read_ledger(ledger) if r["kind"] == "abandoned"], "a step was abandoned to a failure"
    _assert_every_step_once_in_order(ledger, DP_STEPS)
    run_alone([*example_command(tmp_path / "fixed.pt", tmp_path / "fixed-ledger", DP_STEPS, step_time=0.0),
               "--device", "cuda"], 0)
    assert_close_to(tmp_path / "elastic.pt", tmp_path / "fixed.pt")


def _hsdp_fixed_run(tmp_path: Path, steps: int = HSDP_STEPS) -> Path:
    fixed = tmp_path / "fixed.pt"
    run_alone([*lm_command(fixed, tmp_path / "fixed-ledger", "dp", steps), "--device", "cuda"], 0)
    return fixed


@pytest.mark.gpu(devices=2)
def test_an_hsdp_unit_on_two_gpus_preempted_saves_each_shard_and_the_next_resumes_to_a_fixed_runs_end(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    controller = tidal_run.controller
    tidal_run.submit(min_replicas=1, max_replicas=1, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=_hsdp_command(tmp_path))
    launcher_a = tidal_run.start_launcher("a", environment=visible(0, 1))
    wait_until(lambda: tidal_run.job().step >= 30, 300, "30 steps committed")
    a_pids = _workers(tidal_run, "a", 2)
    for pid in [launcher_a.pid, *a_pids]:
        os.kill(pid, signal.SIGTERM)
    left = controller.wait_event(tidal_run.job_id, "unit_left", timeout=60, where=lambda e: e.unit_id == "a")
    assert "left after saving the training state at step" in left.reason, left.reason
    saved_step = int(left.reason.split("at step ")[1].split()[0])
    wait_until(lambda: not any(alive(pid) for pid in a_pids), 30, "a's workers to exit")

    tidal_run.start_launcher("b", environment=visible(0, 1))
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=600)
    b_pids = set(tidal_run.launchers["b"].worker_pids())
    first: dict[int, int] = {}
    for record in read_ledger(ledger):
        if record["pid"] in b_pids and record["kind"] == "attempt":
            first.setdefault(record["rank"], record["step"])
    assert first == {0: saved_step, 1: saved_step}, "both of b's shards start at the saved step"
    assert_close_to(tmp_path / "elastic.pt", _hsdp_fixed_run(tmp_path), relative_to_scale=True)


@pytest.mark.gpu(devices=4)
def test_hsdp_units_on_nccl_grow_lose_a_unit_to_a_kill_and_to_a_freeze_leave_and_match_one_process(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    controller = tidal_run.controller
    tidal_run.submit(min_replicas=1, max_replicas=2, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=_hsdp_command(tmp_path, steps=1000))
    job_id = tidal_run.job_id
    tidal_run.start_launcher("a", environment=visible(0, 1))
    controller.wait_event(job_id, "world_formed")
    wait_until(lambda: _steps_after(ledger, 2, 0, 10), 300, "10 steps with one unit")

    # Grow 1 -> 2 units: b's two shards stream from a's two GPUs.
    tidal_run.start_launcher("b", environment=visible(2, 3))
    controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "grow")
    since = time.time()
    wait_until(lambda: _steps_after(ledger, 4, since, 10), 300, "10 steps with two units")

    # kill -9 of one of b's workers: unit b is lost as a whole; a goes on.
    b_pids = _workers(tidal_run, "b", 2)
    os.kill(b_pids[1], signal.SIGKILL)
    recovered = controller.wait_event(job_id, "recovered", timeout=RECOVERY_S)
    assert recovered.fields["world_size"] == "2"
    wait_until(lambda: not alive(b_pids[0]), 30, "b's other worker to go with its unit")
    wait_until(lambda: tidal_run.launchers["b"].process.poll() is not None, 30, "b's launcher to exit")

    # Grow onto the freed GPUs, then freeze one of c's workers mid-collective.
    since = time.time()
    tidal_run.start_launcher("c", environment=visible(2, 3))
    wait_until(lambda: _steps_after(ledger, 4, since, 10), 300, "10 steps with c")
    c_pids = _workers(tidal_run, "c", 2)
    _freeze_and_recover(tidal_run, c_pids[0], world_size=2)
    wait_until(lambda: tidal_run.launchers["c"].process.poll() is not None, 30, "c's launcher to exit")

    # Grow again, then d leaves gracefully.
    since = time.time()
    tidal_run.start_launcher("d", environment=visible(2, 3))
    wait_until(lambda: _steps_after(ledger, 4, since, 10), 300, "10 steps with d")
    tidal_run.launchers["d"].process.send_signal(signal.SIGTERM)
    controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "leave")
    wait_until(lambda: tidal_run.launchers["d"].process.poll() is not None, 60, "d's launcher to exit")
    assert tidal_run.launchers["d"].process.returncode == 0

    controller.wait_event(job_id, "job_completed", timeout=900)
    _workers(tidal_run, "a", 2)  # the same two all along: a's workers were never restarted
    records = read_ledger(ledger)
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    for record in records:
        if record["kind"] == "formed":
            digests[(record["generation"], record["shard"])].add(record["digest"])
    assert all(len(found) == 1 for found in digests.values()), "each shard index one digest per world"
    assert sorted({r["step"] for r in commits(records)}) == list(range(1000))
    assert_close_to(tmp_path / "elastic.pt", _hsdp_fixed_run(tmp_path, steps=1000), relative_to_scale=True)
