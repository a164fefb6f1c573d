"""HSDP in live mode end to end: units of two gloo workers, each unit one replica sharded
with FSDP2 over its two workers, replicated across units by Tidal.

The run forms at 2 units, grows to 3 (the joiner's shards streamed from live peers, shard k
from shard k), loses a unit when one of its workers is killed mid-step (the unit's other
worker goes with it), and shrinks when a unit leaves gracefully. It must end where the same
language model trained alone in one process ends: full parameters equal to 1e-9 in
float64, the same samples in every step, no survivor restarted, and every shard of every
joiner bit-identical to its peers' before its first step."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import REPO, TidalRun, alive, wait_until
from tests.integration.test_live_mode import commits, highest_step, read_ledger
from tidal.proto import common_pb2
from tidal.train.data import GlobalOrder

pytestmark = pytest.mark.integration

LM_EXAMPLE = REPO / "examples" / "live_mode" / "train_lm.py"
STEPS = 120
# The grow test's run: long enough that a joiner still importing torch and building its
# FSDP model (about 11 s under a full test run here) joins well before the last step.
GROW_STEPS = 300
GLOBAL_BATCH = 24
SEED = 3
CONTEXT = 16
CHARACTERS = 20_000


def lm_dataset_size() -> int:
    spec = importlib.util.spec_from_file_location("train_lm", LM_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return len(module.CharWindows(module.generate_text(CHARACTERS, SEED), CONTEXT))


def lm_command(out: Path, ledger: Path, strategy: str, steps: int = STEPS) -> list[str]:
    return [sys.executable, str(LM_EXAMPLE), "--strategy", strategy, "--dtype", "float64", "--steps", str(steps),
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "2", "--context", str(CONTEXT), "--width", "32",
            "--layers", "2", "--characters", str(CHARACTERS), "--seed", str(SEED), "--log-every", "1000",
            "--ledger-dir", str(ledger), "--out", str(out)]


def test_hsdp_units_grow_lose_a_worker_and_leave_and_match_a_single_process_run(tidal_run: TidalRun,
                                                                                 tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    elastic_out = tmp_path / "elastic.pt"
    tidal_run.submit(min_replicas=1, max_replicas=3, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=lm_command(elastic_out, ledger, "hsdp", GROW_STEPS))
    controller = tidal_run.controller
    job_id = tidal_run.job_id

    for unit in "ab":
        tidal_run.start_launcher(unit)
    controller.wait_event(job_id, "world_formed", where=lambda e: e.fields["world_size"] == "4")
    wait_until(lambda: highest_step(ledger) >= 10, 120, "10 steps at 2 units")
    pids = {unit: sorted(tidal_run.launchers[unit].worker_pids()) for unit in "ab"}
    assert all(len(p) == 2 for p in pids.values()), pids

    # Grow to 3 units: c's two workers receive shard 0 and shard 1 from live peers.
    tidal_run.start_launcher("c")
    grown = controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "grow")
    assert grown.fields["world_size"] == "6"
    wait_until(lambda: len(commits(read_ledger(ledger), 6)) >= 6 * 8, 120, "8 steps at 3 units")
    pids["c"] = sorted(tidal_run.launchers["c"].worker_pids())

    # Kill one worker of b mid-step: b's other worker goes with its unit, a and c go on.
    os.kill(pids["b"][1], signal.SIGKILL)
    recovered = controller.wait_event(job_id, "recovered")
    assert recovered.fields["world_size"] == "4"
    wait_until(lambda: not alive(pids["b"][0]), 20, "b's other worker to be stopped with its unit")
    wait_until(lambda: len(commits(read_ledger(ledger), 4)) >= 4 * 20, 120, "steps at 2 units after the kill")

    # c leaves gracefully: a finishes alone.
    tidal_run.launchers["c"].process.send_signal(signal.SIGTERM)
    left = controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "leave")
    assert left.fields["world_size"] == "2"
    wait_until(lambda: tidal_run.launchers["c"].process.poll() is not None, 30, "c's launcher to exit")
    assert tidal_run.launchers["c"].process.returncode == 0
    controller.wait_event(job_id, "job_completed", timeout=300)

    # The reference: the same model alone in one process (plain data parallelism, world of one).
    fixed_ledger = tmp_path / "fixed-ledger"
    fixed_out = tmp_path / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_",
                                                                    "LOCAL_"))}
    subprocess.run(lm_command(fixed_out, fixed_ledger, "dp", GROW_STEPS), check=True, env=env, timeout=600,
                   stdout=subprocess.DEVNULL)
    records = read_ledger(ledger)
    fixed = read_ledger(fixed_ledger)

    elastic_params = torch.load(elastic_out, weights_only=True)["model"]
    fixed_params = torch.load(fixed_out, weights_only=True)["model"]
    assert sorted(elastic_params) == sorted(fixed_params)
    for name, reference in fixed_params.items():
        assert reference.dtype == torch.float64
        # To 1e-9 of the tensor's scale: Adam divides by sqrt(v), so an element whose
        # gradients are all near 0 carries the summation order's rounding further.
        scale = float(reference.abs().max())
        torch.testing.assert_close(elastic_params[name], reference, rtol=1e-9, atol=1e-9 * scale, msg=name)
    fixed_loss = {r["step"]: r["loss"] for r in commits(fixed)}
    elastic_loss = {r["step"]: r["loss"] for r in commits(records)}
    assert sorted(elastic_loss) == list(range(GROW_STEPS)) == sorted(fixed_loss)
    for step, loss in fixed_loss.items():
        assert elastic_loss[step] == pytest.approx(loss, rel=1e-9), f"step {step}"
    assert {r["world_size"] for r in commits(records)} == {2, 4, 6}

    # Every step consumed exactly the fixed run's samples, in rank order.
    order = GlobalOrder(lm_dataset_size(), SEED)
    committed_epoch = {r["step"]: r["epoch"] for r in commits(records)}
    shares: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for record in records:
        if record["kind"] == "attempt" and committed_epoch.get(record["step"]) == record["epoch"]:
            shares[record["step"]][record["rank"]] = record["indices"]
    fixed_samples = {r["step"]: r["indices"] for r in fixed if r["kind"] == "attempt"}
    for step in range(GROW_STEPS):
        consumed = [i for rank in sorted(shares[step]) for i in shares[step][rank]]
        assert consumed == fixed_samples[step] == order.samples(step * GLOBAL_BATCH, GLOBAL_BATCH), f"step {step}"
    assert [r for r in records if r["kind"] == "abandoned"], "the kill landed between steps"

    # No survivor restarted.
    for unit in ("a", "c"):
        assert sorted(tidal_run.launchers[unit].worker_pids()) == pids[unit]
    assert {r["pid"] for r in commits(records) if r["step"] > int(recovered.fields["step"])} <= {
        *pids["a"], *pids["c"]}

    # Joiner shards: at every world formed, each shard index has one digest on every
    # replica; the grow streamed each of c's shards from a live peer's same shard.
    formed = [r for r in records if r["kind"] == "formed"]
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    for record in formed:
        digests[(record["epoch"], record["shard"])].add(record["digest"])
    assert all(len(found) == 1 for found in digests.values()), digests
    assert digests[(grown.epoch, 0)] != digests[(grown.epoch, 1)], "the two shards of a replica hold different halves"
    joined = [r for r in formed if r["epoch"] == grown.epoch and r["pid"] in pids["c"]]
    assert sorted(r["shard"] for r in joined) == [0, 1]
    received = [r for r in records if r["kind"] == "transfer" and r["epoch"] == grown.epoch and r["role"] == "receiver"]
    assert sorted(r["shard"] for r in received) == [0, 1] and all(r["bytes"] > 0 for r in received)
    first_commit = min(r["time"] for r in commits(records) if r["pid"] in pids["c"])
    assert all(r["time"] < first_commit for r in joined)


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
    subprocess.run(lm_command(fixed_out, tmp_path / "fixed-ledger", "dp", steps), check=True, env=env, timeout=600,
                   stdout=subprocess.DEVNULL)
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
