"""HSDP in live mode end to end: units of two gloo workers, each unit one replica sharded
with FSDP2 over its two workers, replicated across units by Tidal.

Here: every unit lost (the job resumes every shard from its checkpoint at one step), and
the last unit preempted (each worker saves its own shard; the next unit resumes at that
step); each run ends where the same language model trained alone in one process ends,
full parameters equal to 1e-9 in float64. The grow, kill and leave of HSDP units, with
the joiner's shards streamed from live peers, runs on the mini cluster with both recipes
(tests/slurm/test_recipes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from bench.common import REFERENCE_MICRO_BATCH, small_lm_command
from tests.integration.conftest import TidalRun, alive, wait_until
from tests.integration.test_live_mode import read_ledger
from tidal.proto import common_pb2

pytestmark = pytest.mark.integration

STEPS = 90


def lm_command(out: Path, ledger: Path, strategy: str, steps: int = STEPS, micro_batch: int = 2) -> list[str]:
    return small_lm_command(out, ledger, strategy, steps=steps, micro_batch=micro_batch)


def test_hsdp_with_every_unit_lost_resumes_every_shard_from_its_checkpoint_at_one_step(tidal_run: TidalRun,
                                                                                        tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    checkpoints = tmp_path / "checkpoints"
    command = [*lm_command(tmp_path / "elastic.pt", ledger, "hsdp"), "--checkpoint-dir", str(checkpoints),
               "--checkpoint-every", "25"]
    tidal_run.submit(min_replicas=1, max_replicas=1, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=command)
    controller = tidal_run.controller
    tidal_run.start_launcher("a")

    def saved(shard: int) -> list[int]:
        return sorted(int(p.name[5:17]) for p in (checkpoints / f"shard-{shard}-of-2").glob("step-*.tidal"))

    def past_a_checkpoint() -> bool:
        committed = tidal_run.job().step
        return committed >= 30 and 3 <= committed % 25 <= 20 and saved(0)[-1:] == saved(1)[-1:] == [
            committed // 25 * 25]

    wait_until(past_a_checkpoint, 120, "the committed step a few steps past a checkpoint of both shards")
    os.kill(sorted(tidal_run.launchers["a"].worker_pids())[0], signal.SIGKILL)
    controller.wait_event(tidal_run.job_id, "job_degraded")
    newest = saved(0)[-1]

    tidal_run.start_launcher("b")
    resumed = controller.wait_event(tidal_run.job_id, "resumed_from_checkpoint", timeout=120)
    assert int(resumed.fields["checkpoint_step"]) == newest
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=300)
    b_pids = set(tidal_run.launchers["b"].worker_pids())
    first = {r["rank"]: r for r in read_ledger(ledger) if r["pid"] in b_pids and r["kind"] == "attempt"
             and r["step"] == newest}
    assert sorted(first) == [0, 1], "both of b's shards start at the checkpoint's step"

    assert_full_parameters_match_one_process(tmp_path)


def assert_full_parameters_match_one_process(tmp_path: Path, steps: int = STEPS) -> None:
    """The elastic run's full parameters (tmp_path/elastic.pt) equal the same model's
    trained alone in one process, to 1e-9 of each tensor's scale."""
    fixed_out = tmp_path / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_",
                                                                    "LOCAL_"))}
    subprocess.run(lm_command(fixed_out, tmp_path / "fixed-ledger", "dp", steps, micro_batch=REFERENCE_MICRO_BATCH),
                   check=True, env=env, timeout=600, stdout=subprocess.DEVNULL)
    elastic_params = torch.load(tmp_path / "elastic.pt", weights_only=True)["model"]
    for name, reference in torch.load(fixed_out, weights_only=True)["model"].items():
        scale = float(reference.abs().max())
        torch.testing.assert_close(elastic_params[name], reference, rtol=1e-9, atol=1e-9 * scale, msg=name)


def test_the_last_hsdp_unit_preempted_saves_every_shard_and_the_next_unit_resumes_at_that_step(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    """The job's only unit (one replica, sharded over its 2 workers, no checkpoint_dir) is
    SIGTERMed as Slurm preempts: launcher and both workers at once. Each worker writes its
    own shard to the job's state folder after the step they agree on; the next unit's two
    workers each load their shard at exactly that step, and the run ends where one process
    ends."""
    ledger = tmp_path / "ledger"
    tidal_run.submit(min_replicas=1, max_replicas=1, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=lm_command(tmp_path / "elastic.pt", ledger, "hsdp"))
    controller = tidal_run.controller
    launcher_a = tidal_run.start_launcher("a")
    wait_until(lambda: tidal_run.job().step >= 30, 120, "30 steps committed")
    a_pids = launcher_a.worker_pids()
    for pid in [launcher_a.pid, *a_pids]:
        os.kill(pid, signal.SIGTERM)
    controller.wait_event(tidal_run.job_id, "state_saving", timeout=30)
    left = controller.wait_event(tidal_run.job_id, "unit_left", timeout=30, where=lambda e: e.unit_id == "a")
    assert "left after saving the training state at step" in left.reason, left.reason
    saved_step = int(left.reason.split("at step ")[1].split()[0])
    state_folder = tmp_path / "tidal-state" / tidal_run.job_id
    for shard in range(2):
        assert (state_folder / f"shard-{shard}-of-2" / f"step-{saved_step:012d}.tidal").is_file(), shard
    wait_until(lambda: not any(alive(pid) for pid in a_pids), 10, "a's workers to exit")

    tidal_run.start_launcher("b")
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=300)
    kinds = [e.kind for e in controller.events(tidal_run.job_id)]
    assert "resumed_from_checkpoint" not in kinds and "state_lost" not in kinds, kinds
    b_pids = set(tidal_run.launchers["b"].worker_pids())
    first: dict[int, int] = {}
    for record in read_ledger(ledger):  # in time order
        if record["pid"] in b_pids and record["kind"] == "attempt":
            first.setdefault(record["rank"], record["step"])
    assert first == {0: saved_step, 1: saved_step}, "both of b's shards start at the saved step"
    assert not state_folder.exists(), "the saved state is removed once the job completes"
    assert_full_parameters_match_one_process(tmp_path)


def test_a_single_replica_of_two_nodes_losing_one_stops_loudly_rather_than_mix_shards(tidal_run: TidalRun,
                                                                                     tmp_path: Path) -> None:
    """A job of one replica of two one-node units: the lost node's shard is held by no live
    peer, so when a new node takes its place the replica's state is not whole. The job
    fails with `state_lost`, saying why and that a new submission resumes from the
    checkpoint, rather than mix shards of different steps or start over."""
    ledger = tmp_path / "ledger"
    command = [*lm_command(tmp_path / "elastic.pt", ledger, "hsdp", steps=200), "--checkpoint-dir",
               str(tmp_path / "checkpoints"), "--checkpoint-every", "25"]
    tidal_run.submit(min_replicas=1, max_replicas=1, procs_per_node=1, nodes_per_replica=2,
                     mode=common_pb2.JOB_MODE_LIVE, command=command)
    controller = tidal_run.controller
    for unit in "ab":
        tidal_run.start_launcher(unit)
    wait_until(lambda: tidal_run.job().step >= 30, 120, "30 steps")
    registered = {e.unit_id: e for e in controller.events(tidal_run.job_id) if e.kind == "unit_registered"}
    lost = next(u for u in "ab" if registered[u].fields["node_index"] == "1")
    os.kill(tidal_run.launchers[lost].worker_pids()[0], signal.SIGKILL)
    controller.wait_event(tidal_run.job_id, "job_degraded")
    tidal_run.start_launcher("c")
    failed = controller.wait_event(tidal_run.job_id, "state_lost", timeout=120)
    assert "incomplete" in failed.reason and "Submit the job again" in failed.reason, failed.reason
    assert not [e for e in controller.events(tidal_run.job_id) if e.kind in ("job_completed", "first_step")
                and e.generation > 1]
