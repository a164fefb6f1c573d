"""Live mode end to end: a controller, three launchers and gloo workers running the MLP
example through `tidal.train.elastic`, against the same script run alone.

One run goes through a grow (2 -> 3), a peer killed with SIGKILL mid-step (3 -> 2; the
peer at group rank 0, whose launcher hosts the rendezvous store) and a graceful leave
(2 -> 1), and must end where a fixed single-replica run ends: parameters
and per-step losses equal to 1e-9 in float64, the same samples in every step, no
survivor restarted, joiners bit-identical to their peers, and the recovery recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import REPO, TidalRun, alive, wait_until
from tidal.proto import admin_pb2, common_pb2
from tidal.train.data import GlobalOrder

pytestmark = pytest.mark.integration

LIVE_EXAMPLE = REPO / "examples" / "live_mode" / "train_mlp.py"
STEPS = 260
GLOBAL_BATCH = 24
SAMPLES = 500
SEED = 7


def example_command(out: Path, ledger: Path, steps: int = STEPS, step_time: float = 0.01) -> list[str]:
    """The example MLP; `step_time` s slept a micro-batch (the one-process references sleep
    none: the sleep changes no number, and 260 steps of 6 micro-batches would sleep 15.6 s)."""
    return [sys.executable, str(LIVE_EXAMPLE), "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH),
            "--micro-batch", "4", "--samples", str(SAMPLES), "--seed", str(SEED), "--dtype", "float64",
            "--step-time", f"{step_time:g}", "--ledger-dir", str(ledger), "--out", str(out)]


def read_ledger(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(directory.glob("ledger-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a SIGKILL
                continue
    return sorted(records, key=lambda r: r["time"])


def commits(records: list[dict[str, Any]], world_size: int | None = None) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "commit" and (world_size is None or r["world_size"] == world_size)]


def highest_step(directory: Path) -> int:
    return max((r["step"] for r in commits(read_ledger(directory))), default=-1)


def assert_parameters_match_a_fixed_run(tmp_path: Path, steps: int) -> None:
    """The elastic run's parameters (tmp_path/elastic.pt) equal the same script's alone."""
    fixed_out = tmp_path / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    subprocess.run(example_command(fixed_out, tmp_path / "fixed-ledger", steps, step_time=0.0), check=True, env=env,
                   timeout=300, stdout=subprocess.DEVNULL)
    elastic_params = torch.load(tmp_path / "elastic.pt", weights_only=True)["model"]
    for name, reference in torch.load(fixed_out, weights_only=True)["model"].items():
        torch.testing.assert_close(elastic_params[name], reference, rtol=1e-9, atol=1e-12, msg=name)


def worker_pid(run: TidalRun, unit_id: str) -> int:
    pids = run.launchers[unit_id].worker_pids()
    assert len(pids) == 1, f"{unit_id} started workers {pids}; live mode starts one group per unit"
    return pids[0]


# Its joiner must be in the world for 15 steps before the job's end: under another
# stream's load (make test's first part) it once was not. Run after it (`alone`).
@pytest.mark.alone
def test_live_grow_kill_leave_matches_a_fixed_run(tidal_run: TidalRun, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    elastic_out = tmp_path / "elastic.pt"
    tidal_run.submit(min_replicas=1, max_replicas=3, command=example_command(elastic_out, ledger),
                     mode=common_pb2.JOB_MODE_LIVE)
    controller = tidal_run.controller
    job_id = tidal_run.job_id

    # Two replicas form generation 1.
    tidal_run.start_launcher("a")
    tidal_run.start_launcher("b")
    formed = controller.wait_event(job_id, "world_formed", where=lambda e: e.fields["replicas"] == "2")
    # The unit at group rank 0 hosts the rendezvous store and is the state source: it is
    # the one killed below, so that losing it is shown not to matter.
    host, other = formed.fields["members"].split(",")
    wait_until(lambda: highest_step(ledger) >= 20, 60, "20 steps at world size 2")
    pids = {unit: worker_pid(tidal_run, unit) for unit in (host, other)}

    # Grow 2 -> 3: c's worker receives the state from a live peer.
    tidal_run.start_launcher("c")
    grown = controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "grow")
    wait_until(lambda: len(commits(read_ledger(ledger), 3)) >= 3 * 15, 60, "15 steps at world size 3")
    pids["c"] = worker_pid(tidal_run, "c")
    assert grown.fields["world_size"] == "3"

    # Kill the host's worker mid-step: 3 -> 2, in-process on the survivors, on a new store.
    killed_at = time.time()
    os.kill(pids[host], signal.SIGKILL)
    recovered = controller.wait_event(job_id, "recovered")
    wait_until(lambda: tidal_run.launchers[host].process.poll() is not None, 20, "the host's launcher to exit")
    assert tidal_run.launchers[host].process.returncode == 1
    reformed = [e for e in controller.events(job_id) if e.kind == "world_formed"][-1]
    assert reformed.fields["members"] == f"{other},c"
    # (Counted from the kill: generation 1's commits were at world size 2 too, and the
    # controller's history must see the new world of 2 train before the leave below.)
    wait_until(lambda: len([r for r in commits(read_ledger(ledger), 2) if r["time"] > killed_at]) >= 2 * 40, 60,
               "steps at world size 2 after the kill")

    # Graceful leave 2 -> 1: c finishes the agreed step and exits 0.
    tidal_run.launchers["c"].process.send_signal(signal.SIGTERM)
    left = controller.wait_event(job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "leave")
    wait_until(lambda: tidal_run.launchers["c"].process.poll() is not None, 30, "c's launcher to exit")
    assert tidal_run.launchers["c"].process.returncode == 0
    controller.wait_event(job_id, "job_completed", timeout=120)
    wait_until(lambda: tidal_run.launchers[other].process.poll() is not None, 30, "the last launcher to exit")

    # The controller's history of the job (`tidal plot`): the world went 2 -> 3 -> 2 -> 1,
    # the loss the workers reported is the fixed run's (checked below), and the plot marks
    # the grow, the failure, the recovery and the leave.
    with controller.admin() as admin:
        history = admin.history(job_id)
    sizes = [s.world_size for s in history.samples]
    assert {1, 2, 3} <= set(sizes) and sizes[-1] == 0, sizes
    assert sizes.index(3) < len(sizes) - 1 - sizes[::-1].index(2)  # a 2 after the 3: the kill
    history_losses = {s.step: s.loss for s in history.samples if s.HasField("loss")}
    assert len(history_losses) >= 5
    drawn_with = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket),
                                 "plot", job_id, "-o", str(tmp_path / "job.svg")],
                                capture_output=True, text=True, timeout=120)
    assert drawn_with.returncode == 0, drawn_with.stderr
    assert drawn_with.stdout.startswith(str(tmp_path / "job.svg"))
    marked = set(drawn_with.stdout.rsplit(": ", 1)[-1].rstrip(")\n").split(", "))
    assert {"grow", "failure", "recovery", "preemption", "end"} <= marked, drawn_with.stdout
    assert "world size (ranks)" in (tmp_path / "job.svg").read_text()

    # The reference: the same script alone, a fixed world of one.
    fixed_ledger = tmp_path / "fixed-ledger"
    fixed_out = tmp_path / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    subprocess.run(example_command(fixed_out, fixed_ledger, step_time=0.0), check=True, env=env, timeout=300,
                   stdout=subprocess.DEVNULL)

    records = read_ledger(ledger)
    fixed = read_ledger(fixed_ledger)

    # Equivalence: parameters and per-step losses to 1e-9 relative.
    elastic_params = torch.load(elastic_out, weights_only=True)["model"]
    fixed_params = torch.load(fixed_out, weights_only=True)["model"]
    for name, reference in fixed_params.items():
        assert reference.dtype == torch.float64
        torch.testing.assert_close(elastic_params[name], reference, rtol=1e-9, atol=1e-12, msg=name)
    fixed_loss = {r["step"]: r["loss"] for r in commits(fixed)}
    elastic_loss: dict[int, float] = {}
    for record in commits(records):
        elastic_loss.setdefault(record["step"], record["loss"])
        assert record["loss"] == pytest.approx(elastic_loss[record["step"]], rel=1e-12)
    assert sorted(elastic_loss) == list(range(STEPS)) == sorted(fixed_loss)
    for step, loss in fixed_loss.items():
        assert elastic_loss[step] == pytest.approx(loss, rel=1e-9), f"step {step}"
    # Each loss in the controller's history is one the fixed run computed.
    for loss in history_losses.values():
        assert any(loss == pytest.approx(fixed, rel=1e-9) for fixed in fixed_loss.values()), loss
    world_sizes = {r["world_size"] for r in commits(records)}
    assert world_sizes == {1, 2, 3}

    # Accounting: per step, the shares of the attempt that committed, in rank order, are
    # exactly positions [kB, (k+1)B) of the seeded order, as in the fixed run: no sample
    # lost, none repeated (a sample may recur only across a data-epoch boundary).
    order = GlobalOrder(SAMPLES, SEED)
    committed_generation = {r["step"]: r["generation"] for r in commits(records)}
    shares: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for record in records:
        if record["kind"] == "attempt" and committed_generation.get(record["step"]) == record["generation"]:
            assert record["rank"] not in shares[record["step"]], f"rank {record['rank']} twice in step {record['step']}"
            shares[record["step"]][record["rank"]] = record["indices"]
    fixed_samples = {r["step"]: r["indices"] for r in fixed if r["kind"] == "attempt"}
    for step in range(STEPS):
        consumed = [i for rank in sorted(shares[step]) for i in shares[step][rank]]
        assert consumed == fixed_samples[step] == order.samples(step * GLOBAL_BATCH, GLOBAL_BATCH), f"step {step}"
    abandoned = [r for r in records if r["kind"] == "abandoned"]
    assert abandoned, "the kill landed between steps; the test means to kill mid-step"

    # No survivor restarted: one worker PID per unit for the whole run.
    by_unit = {unit: set(tidal_run.launchers[unit].worker_pids()) for unit in "abc"}
    assert by_unit == {unit: {pid} for unit, pid in pids.items()}
    assert {r["pid"] for r in commits(records)} == set(pids.values())
    assert {r["pid"] for r in commits(records) if r["step"] > int(recovered.fields["step"])} <= {pids[other], pids["c"]}
    assert not alive(pids[other]) and not alive(pids["c"])

    # Joiner state: at every world formed, every rank held the same digest.
    digests: dict[int, set[str]] = defaultdict(set)
    for record in records:
        if record["kind"] == "formed":
            digests[record["generation"]].add(record["digest"])
    assert all(len(found) == 1 for found in digests.values()), digests
    grow_generation = grown.generation
    joined = [r for r in records if r["kind"] == "formed" and r["generation"] == grow_generation]
    assert {r["pid"] for r in joined} == set(pids.values())

    # While c started, the old world was told that the grow was coming (`ChangeComing`), and
    # both of its ranks voted again at each step's end. The SIGTERM to c's launcher is word
    # of a leave too, which its world may have overtaken; no other world took that vote
    # (the kill came with no word before it): the word ends with the world it announced.
    end_votes = [r for r in records if r["kind"] == "end_vote"]
    assert {r["generation"] for r in end_votes} <= {formed.generation, reformed.generation}
    before_grow = [r for r in end_votes if r["generation"] == formed.generation]
    # (Steps take about 20 ms. A joiner whose workers, started on standby at its
    # registration, were up by the time the grow was decided leaves no step's end to vote
    # at: its world follows the word at once. That happened on a loaded host.)
    [ready] = [e for e in controller.events(job_id) if e.kind == "joiners_ready" and e.generation == grown.generation]
    if float(ready.fields["decision_to_ready_s"]) >= 0.5:
        assert {r["pid"] for r in before_grow} == {pids[host], pids[other]}
        assert len(before_grow) >= 2 * 3, "a vote at each step's end while the joiner starts"

    # Recovery time, recorded as an event.
    assert float(recovered.fields["failure_to_first_step_s"]) > 0
    assert recovered.fields["world_size"] == "2"
    assert left.fields["world_size"] == "1"


def test_a_hung_rank_is_killed_and_the_survivors_go_on_in_process(tidal_run: TidalRun, tmp_path: Path) -> None:
    controller = tidal_run.controller
    controller.stop()
    # The silence limit below the progress timeout: the frozen rank's own launcher finds it
    # first (with the two equal, either verdict may come first).
    controller.settings["progress_timeout_s"] = "2"
    controller.settings["worker_silence_timeout_s"] = "1"
    controller.start()
    ledger = tmp_path / "ledger"
    tidal_run.submit(min_replicas=1, max_replicas=3, command=example_command(tmp_path / "out.pt", ledger, 100_000),
                     mode=common_pb2.JOB_MODE_LIVE)
    for unit in "abc":
        tidal_run.start_launcher(unit)
    controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.fields["replicas"] == "3")
    wait_until(lambda: len(commits(read_ledger(ledger), 3)) >= 3 * 20, 60, "20 steps at world size 3")
    pids = {unit: worker_pid(tidal_run, unit) for unit in "abc"}

    os.kill(pids["b"], signal.SIGSTOP)
    failure = controller.wait_event(tidal_run.job_id, "failure_detected")
    # Its beats stop: its own launcher kills it and says why; never a peer waiting for it.
    assert failure.unit_id == "b" and failure.fields["cause"] == "silent", failure
    assert "no beat for" in failure.reason and "killed by its launcher" in failure.reason, failure.reason
    recovered = controller.wait_event(tidal_run.job_id, "recovered")
    assert recovered.fields["world_size"] == "2"
    # The launcher killed its frozen worker (a hung rank becomes a dead one) and left.
    wait_until(lambda: not alive(pids["b"]), 10, "the hung worker to be killed")
    wait_until(lambda: tidal_run.launchers["b"].process.poll() is not None, 10, "b's launcher to exit")
    assert tidal_run.launchers["b"].process.returncode == 1
    wait_until(lambda: len(commits(read_ledger(ledger), 2)) >= 2 * 20, 60, "20 steps at world size 2")
    assert {unit: worker_pid(tidal_run, unit) for unit in "ac"} == {"a": pids["a"], "c": pids["c"]}
    assert alive(pids["a"]) and alive(pids["c"])


def test_every_replica_lost_falls_back_to_the_checkpoint_at_the_exact_step(tidal_run: TidalRun,
                                                                           tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    checkpoints = tmp_path / "checkpoints"
    steps = 150
    command = [*example_command(tmp_path / "elastic.pt", ledger, steps),
               "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "40"]
    tidal_run.submit(min_replicas=1, max_replicas=1, command=command, mode=common_pb2.JOB_MODE_LIVE)
    controller = tidal_run.controller
    tidal_run.start_launcher("a")

    def saved_steps() -> list[int]:
        return sorted(int(p.name[5:17]) for p in checkpoints.glob("step-*.tidal"))

    # The controller's committed step is past the newest checkpoint, so some steps are redone.
    def past_a_checkpoint() -> bool:
        committed = tidal_run.job().step
        return committed >= 45 and 3 <= committed % 40 <= 30 and saved_steps()[-1:] == [committed // 40 * 40]

    wait_until(past_a_checkpoint, 60, "the committed step a few steps past a checkpoint")
    os.kill(worker_pid(tidal_run, "a"), signal.SIGKILL)
    controller.wait_event(tidal_run.job_id, "job_degraded")
    lost_at = highest_step(ledger) + 1
    saved = saved_steps()
    assert saved and saved[-1] <= lost_at

    tidal_run.start_launcher("d")
    resumed = controller.wait_event(tidal_run.job_id, "resumed_from_checkpoint", timeout=60)
    assert int(resumed.fields["checkpoint_step"]) == saved[-1]
    target = int(resumed.fields["target_step"])
    assert saved[-1] < target <= lost_at
    assert int(resumed.fields["steps_redone"]) == target - saved[-1]
    assert f"steps {saved[-1]}..{target - 1} are redone" in resumed.reason
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=120)
    records = read_ledger(ledger)
    pid_d = worker_pid(tidal_run, "d")
    resumed = [r for r in records if r["pid"] == pid_d and r["kind"] == "attempt"]
    assert resumed[0]["step"] == saved[-1], "the new replica starts at the newest checkpoint's step"
    assert resumed[0]["indices"] == GlobalOrder(SAMPLES, SEED).samples(saved[-1] * GLOBAL_BATCH, GLOBAL_BATCH)

    assert_parameters_match_a_fixed_run(tmp_path, steps)


def test_with_every_replica_lost_and_no_checkpoint_the_job_fails_loudly_instead_of_restarting_at_step_0(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    tidal_run.submit(min_replicas=1, max_replicas=1, command=example_command(tmp_path / "elastic.pt", ledger, 400),
                     mode=common_pb2.JOB_MODE_LIVE)
    controller = tidal_run.controller
    tidal_run.start_launcher("a")
    wait_until(lambda: tidal_run.job().step >= 30, 60, "30 steps committed")
    os.kill(worker_pid(tidal_run, "a"), signal.SIGKILL)
    controller.wait_event(tidal_run.job_id, "job_degraded")

    tidal_run.start_launcher("d")
    not_held = controller.wait_event(tidal_run.job_id, "state_not_held", timeout=60)
    target = int(not_held.fields["target_step"])
    assert target >= 30
    lost = controller.wait_event(tidal_run.job_id, "state_lost", timeout=60)
    assert f"holds the training state at step {target}" in lost.reason
    assert "refusing to train from step 0" in lost.reason
    assert tidal_run.job().state == admin_pb2.JOB_STATE_FAILED
    pid_d = worker_pid(tidal_run, "d")
    assert not [r for r in read_ledger(ledger) if r["pid"] == pid_d and r["kind"] in ("attempt", "commit")], \
        "the new replica trained nothing"
    wait_until(lambda: not alive(pid_d), 30, "the refusing worker to exit")


def test_the_last_replica_preempted_saves_the_state_and_the_next_world_resumes_at_its_step(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    """Slurm ends the allocation of the job's only unit (SIGTERM to the launcher and to both
    of its workers at once, as Slurm signals every process of a job): the workers hold the
    SIGTERM, write the state to the job's state folder after the step they agree on, and
    leave; a new unit resumes at exactly that step (nothing redone, nothing lost) and the
    job completes with the parameters of a fixed-size run."""
    ledger = tmp_path / "ledger"
    steps = 160
    tidal_run.submit(min_replicas=1, max_replicas=1, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=example_command(tmp_path / "elastic.pt", ledger, steps))
    controller = tidal_run.controller
    launcher_a = tidal_run.start_launcher("a")
    wait_until(lambda: tidal_run.job().step >= 40, 60, "40 steps committed")
    a_pids = launcher_a.worker_pids()
    assert len(a_pids) == 2
    for pid in [launcher_a.pid, *a_pids]:
        os.kill(pid, signal.SIGTERM)
    saving = controller.wait_event(tidal_run.job_id, "state_saving", timeout=30)
    assert saving.unit_id == "a"
    left = controller.wait_event(tidal_run.job_id, "unit_left", timeout=30, where=lambda e: e.unit_id == "a")
    assert "left after saving the training state at step" in left.reason, left.reason
    saved_step = int(left.reason.split("at step ")[1].split()[0])
    state_folder = tmp_path / "tidal-state" / tidal_run.job_id
    assert str(state_folder) in left.reason
    assert (state_folder / f"step-{saved_step:012d}.tidal").is_file()
    records = read_ledger(ledger)
    a_left = [r for r in records if r["pid"] in a_pids and r["kind"] == "left"]
    assert sorted(r["pid"] for r in a_left) == sorted(a_pids), "both workers left (none was killed)"
    assert {r["step"] for r in a_left} == {saved_step}
    assert max(r["step"] + 1 for r in commits(records) if r["pid"] in a_pids) == saved_step
    wait_until(lambda: not any(alive(pid) for pid in a_pids), 10, "a's workers to exit")

    tidal_run.start_launcher("d")
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=180)
    events = [e.kind for e in controller.events(tidal_run.job_id)]
    assert "state_lost" not in events and "resumed_from_checkpoint" not in events, events
    records = read_ledger(ledger)
    d_pids = tidal_run.launchers["d"].worker_pids()
    d_attempts = [r for r in records if r["pid"] in d_pids and r["kind"] == "attempt"]
    assert min(r["step"] for r in d_attempts) == saved_step, "the new unit starts at the saved step"
    # Every step committed once by each rank of its world, none lost, none redone.
    by_step: dict[int, int] = defaultdict(int)
    for record in commits(records):
        if record["rank"] == 0:
            by_step[record["step"]] += 1
    assert sorted(by_step) == list(range(steps)) and set(by_step.values()) == {1}
    assert not state_folder.exists(), "the saved state is removed once the job completes"

    assert_parameters_match_a_fixed_run(tmp_path, steps)


def test_two_units_leaving_at_once_leave_in_one_world_change_and_the_run_matches_a_fixed_one(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    """A resize from 3 replicas to 1 (as Slurm preempting two units in one view): both
    leave at one step boundary, in one world change, the survivor training on in-process;
    nothing stops, nothing is redone, and the job ends with a fixed run's parameters."""
    ledger = tmp_path / "ledger"
    steps = 160
    tidal_run.submit(min_replicas=1, max_replicas=3, mode=common_pb2.JOB_MODE_LIVE,
                     command=example_command(tmp_path / "elastic.pt", ledger, steps))
    controller = tidal_run.controller
    for unit in "abc":
        tidal_run.start_launcher(unit)
    wait_until(lambda: len(commits(read_ledger(ledger), 3)) >= 3 * 10, 90, "10 steps at world size 3")
    pids = {unit: worker_pid(tidal_run, unit) for unit in "abc"}
    with controller.admin() as admin:
        admin.resize(tidal_run.job_id, max_replicas=1)
    left = controller.wait_event(tidal_run.job_id, "world_reconfigured", timeout=60,
                                 where=lambda e: e.fields["cause"] == "leave")
    assert left.fields["world_size"] == "1"
    changing = [e for e in controller.events(tidal_run.job_id) if e.kind == "world_reconfiguring"
                and e.fields["cause"] == "leave"]
    assert len(changing) == 1 and len(changing[0].fields["leaving"].split(",")) == 2, changing
    (survivor,) = changing[0].fields["members"].split(",")
    controller.wait_event(tidal_run.job_id, "job_completed", timeout=180)
    kinds = [e.kind for e in controller.events(tidal_run.job_id)]
    assert "generation_stopping" not in kinds and "failure_detected" not in kinds, kinds
    records = read_ledger(ledger)
    by_step: dict[int, int] = defaultdict(int)
    for record in commits(records):
        if record["rank"] == 0:
            by_step[record["step"]] += 1
    assert sorted(by_step) == list(range(steps)) and set(by_step.values()) == {1}
    assert {r["pid"] for r in commits(records) if r["world_size"] == 1} == {pids[survivor]}, "no restart"
    assert_parameters_match_a_fixed_run(tmp_path, steps)


def test_units_of_two_workers_reform_in_process_and_a_failed_unit_takes_both_along(tidal_run: TidalRun,
                                                                                    tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    tidal_run.submit(min_replicas=1, max_replicas=2, procs_per_node=2, mode=common_pb2.JOB_MODE_LIVE,
                     command=example_command(tmp_path / "out.pt", ledger, 100_000))
    for unit in "ab":
        tidal_run.start_launcher(unit)
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.fields["world_size"] == "4")
    wait_until(lambda: len(commits(read_ledger(ledger), 4)) >= 4 * 10, 60, "10 steps at world size 4")
    a_pids, b_pids = (tidal_run.launchers[u].worker_pids() for u in "ab")
    assert len(a_pids) == len(b_pids) == 2

    os.kill(b_pids[1], signal.SIGKILL)
    recovered = tidal_run.controller.wait_event(tidal_run.job_id, "recovered")
    assert recovered.fields["world_size"] == "2"
    wait_until(lambda: not alive(b_pids[0]), 10, "b's other worker to be killed with its unit")
    wait_until(lambda: len(commits(read_ledger(ledger), 2)) >= 2 * 10, 60, "10 steps at world size 2")
    assert tidal_run.launchers["a"].worker_pids() == a_pids and all(alive(pid) for pid in a_pids)
    after = commits(read_ledger(ledger), 2)
    assert {r["pid"] for r in after} == set(a_pids) and {r["rank"] for r in after} == {0, 1}


def test_a_controller_restart_leaves_live_training_alone_and_it_grows_afterwards(tidal_run: TidalRun,
                                                                                 tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    controller = tidal_run.controller
    tidal_run.submit(min_replicas=2, max_replicas=3, mode=common_pb2.JOB_MODE_LIVE,
                     command=example_command(tmp_path / "out.pt", ledger, 100_000))
    for unit in "ab":
        tidal_run.start_launcher(unit)
    controller.wait_event(tidal_run.job_id, "world_formed")
    wait_until(lambda: len(commits(read_ledger(ledger), 2)) >= 2 * 10, 60, "10 steps at world size 2")
    pids = {unit: worker_pid(tidal_run, unit) for unit in "ab"}

    controller.kill()
    killed_at = time.time()
    time.sleep(3.5)  # past the heartbeat timeout: the launchers keep training on their own
    controller.start()
    restarted_at = time.time()
    wait_until(lambda: len([e for e in controller.events(tidal_run.job_id) if e.kind == "launcher_reattached"]) == 2,
               10, "both launchers to reattach")
    during = [r for r in commits(read_ledger(ledger), 2) if killed_at < r["time"] < restarted_at and r["rank"] == 0]
    assert len(during) >= 10, f"only {len(during)} steps while the controller was down"

    # The restarted controller grows the job in-process.
    tidal_run.start_launcher("c")
    controller.wait_event(tidal_run.job_id, "world_reconfigured", where=lambda e: e.fields["cause"] == "grow")
    wait_until(lambda: len(commits(read_ledger(ledger), 3)) >= 3 * 10, 60, "10 steps at world size 3")
    assert {unit: worker_pid(tidal_run, unit) for unit in "ab"} == pids
    assert not any(e.kind in ("failure_detected", "generation_stopping") for e in controller.events(tidal_run.job_id))


def test_a_joiner_still_starting_when_the_world_breaks_is_not_restarted(tidal_run: TidalRun, tmp_path: Path) -> None:
    """A failure while a joiner's worker is still starting (importing torch on a busy
    machine): the joiner has nothing to stop, so the stop completes at once and the same
    worker joins the next world when it is up; nobody waits out a stop grace or restarts it."""
    ledger = tmp_path / "ledger"
    # Unit b's worker takes 8 s more to start than the others.
    command = ["bash", "-c", 'if [ "$TIDAL_UNIT_ID" = b ]; then sleep 8; fi; exec "$@"', "worker",
               *example_command(tmp_path / "elastic.pt", ledger, 100_000)]
    tidal_run.submit(min_replicas=1, max_replicas=3, command=command, mode=common_pb2.JOB_MODE_LIVE)
    controller = tidal_run.controller
    tidal_run.start_launcher("a")
    tidal_run.start_launcher("c")
    controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.fields["replicas"] == "2")
    wait_until(lambda: highest_step(ledger) >= 10, 60, "10 steps at world size 2")
    tidal_run.start_launcher("b")
    controller.wait_event(tidal_run.job_id, "world_reconfiguring", where=lambda e: e.fields["joiners"] == "b")
    pid_b = worker_pid(tidal_run, "b")
    os.kill(worker_pid(tidal_run, "c"), signal.SIGKILL)
    stopped = controller.wait_event(tidal_run.job_id, "generation_stopped", timeout=30)
    assert float(stopped.fields["detection_to_all_stopped_s"]) < 3.0, "nobody waited out a stop grace"
    formed = controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.fields["members"] == "a,b",
                                   timeout=30)
    assert formed.fields["state_holders"] == "a"
    wait_until(lambda: len(commits(read_ledger(ledger), 2)) >= 2 * 10, 90, "10 steps at world size 2 with b")
    assert tidal_run.launchers["b"].worker_pids() == [pid_b], "b's worker was not restarted"
