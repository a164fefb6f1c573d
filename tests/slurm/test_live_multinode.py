"""Live replicas spanning nodes on the real mini cluster (issue 25's scenario): HSDP with
replicas of K = 2 one-node units of P = 2 gloo workers each, the language model sharded
over a replica's 4 workers, float64.

The job grows from 1 to 2 replicas (`tidal resize --max 2`: all 4 nodes); a node of replica 2 fails (its slurmd
and every process of the unit there killed): replica 1 goes on in-process, replica 2's
other node keeps its workers (same PIDs) and their shards; once the node is back (its
cool-down over) Slurm is asked for one node, and the unit that gets it takes the lost
node's place and receives only that node's shards from replica 1; replica 2 rejoins; an
urgent job then takes two nodes and preempts a whole replica, which leaves at a step
boundary (0 steps lost); the job runs to its end: COMPLETED once, every step's samples
and the full parameters those of one process (1e-9 of each tensor's scale)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bench import chaos
from bench.common import REFERENCE_MICRO_BATCH
from tests.integration.conftest import ControllerProcess
from tests.integration.test_cli import tidal
from tests.integration.test_hsdp import lm_command
from tests.integration.test_live_mode import read_ledger
from tests.slurm.test_autoscaling import minicluster, require_four_idle_nodes, wait_for_units_to_end
from tests.slurm.test_multinode import mark_down, unit_processes
from tests.waiting import wait_for
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient
from tidal.slurm.models import JobState, UnitSubmission

pytestmark = pytest.mark.slurm

# Every change is done by about step 150 (HSDP, 2.7 steps/s on two cores whatever the world
# size; step 128 in a fresh-clone run on a slower host) and step 430 (DataParallel, about 23
# steps/s at world 4; 473 there): the rest is the tail, at world 4 (the urgent job keeps
# replica 1's nodes to the end, so the job does not grow back).
STEPS = 260
DP_STEPS = 680


def events(admin: AdminClient, job_id: str, kind: str) -> list[admin_pb2.Event]:
    return [e for e in admin.events(job_id) if e.kind == kind]


def slot_of(admin: AdminClient, job_id: str, unit_id: str) -> tuple[int, int]:
    [registered] = [e for e in events(admin, job_id, "unit_registered") if e.unit_id == unit_id]
    return int(registered.fields["replica"]), int(registered.fields["node_index"])


def worker_pids(job_id: str, unit: admin_pb2.Unit) -> set[int]:
    return {pid for pid, env in unit_processes(job_id)
            if env.get("SLURM_JOB_ID") == str(unit.slurm_job_id) and "RANK" in env}


def slurm_controller(slurm: CliJsonSlurmClient, tmp_path: Path, **settings: str) -> ControllerProcess:
    """A controller running units as Slurm jobs on the mini cluster's four idle nodes
    (`settings` over these tests' own)."""
    require_four_idle_nodes(slurm)
    controller = ControllerProcess(tmp_path, {"slurm_units": "true", "slurm_poll_interval_s": "1",
                                              "join_settle_s": "2", "reconnect_grace_s": "10",
                                              "node_cooldown_s": "5", **settings})
    controller.start()
    return controller


def submit_and_grow_to_two_replicas(admin: AdminClient, tmp_path: Path,
                                    command: list[str]) -> tuple[str, admin_pb2.Event]:
    """Submit `command` as a live job of one replica of two nodes of two workers, then
    `tidal resize --max 2`: two replicas, four one-node units in slots (1, 0) .. (2, 1)."""
    spec = admin_pb2.JobSpec(
        name="span-live", min_replicas=1, max_replicas=1, nodes_per_replica=2, procs_per_node=2,
        partition="train", mode=common_pb2.JOB_MODE_LIVE, working_dir=str(tmp_path),
        environment={"OMP_NUM_THREADS": "1"}, command=command)
    job_id = admin.submit(spec).job.job_id
    wait_for("one replica of two nodes", lambda: next(
        (e for e in events(admin, job_id, "world_formed") if e.fields["world_size"] == "4"), None),
        timeout_s=120, interval_s=0.5)
    wait_for("steps with one replica", lambda: admin.job(job_id).step >= 10, timeout_s=120)
    admin.resize(job_id, max_replicas=2)
    grown = wait_for("two replicas of two nodes", lambda: next(
        (e for e in events(admin, job_id, "world_reconfigured") if e.fields["world_size"] == "8"), None),
        timeout_s=240, interval_s=0.5)
    job = admin.job(job_id)
    units = [u for u in job.units if u.state == admin_pb2.UNIT_STATE_ACTIVE]
    assert job.replicas == 2 and len(units) == 4 and all(len(u.nodes) == 1 for u in units)
    assert sorted(slot_of(admin, job_id, u.unit_id) for u in units) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert sorted((u.replica, u.node_index) for u in units) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    wait_for("steps with two replicas", lambda: admin.job(job_id).step >= 20, timeout_s=120)
    return job_id, grown


def preempt_replica_1_and_finish(admin: AdminClient, slurm: CliJsonSlurmClient, job_id: str, lost: admin_pb2.Unit,
                                 tmp_path: Path) -> int:
    """An urgent job takes the two nodes of replica 1 (replica 2's are excluded): they leave
    at a step boundary, no failure but `lost`'s; then the job runs to its end on replica 2
    (the urgent job holds its nodes until then), COMPLETED once. Returns the generation
    before the urgent job."""
    replica_2_nodes = tuple(n for u in admin.job(job_id).units if u.state == admin_pb2.UNIT_STATE_ACTIVE
                            and slot_of(admin, job_id, u.unit_id)[0] == 2 for n in u.nodes)
    before_urgent = admin.job(job_id).generation
    urgent = slurm.submit(UnitSubmission(name="urgent", script="#!/bin/sh\nsleep 600\n", partition="urgent",
                                         nodes=2, exclusive=True, requeue=False, exclude_nodes=replica_2_nodes,
                                         output=str(tmp_path / "urgent-%j.out")))
    try:
        wait_for("the urgent job to run", lambda: slurm.get_job(urgent).state is JobState.RUNNING, timeout_s=90)
        assert not [e for e in events(admin, job_id, "failure_detected") if e.unit_id != lost.unit_id]
        wait_for("the job's end", lambda: admin.job(job_id).state == admin_pb2.JOB_STATE_COMPLETED,
                 timeout_s=600, interval_s=1.0)
    finally:
        slurm.cancel(urgent)
    assert [e.kind for e in admin.events(job_id)].count("job_completed") == 1
    return before_urgent


def kill_node(job_id: str, unit: admin_pb2.Unit) -> None:
    """The unit's node fails: its slurmd, then every process of the unit there (the workers last)."""
    minicluster("kill-node", unit.nodes[0])
    doomed = [pid for pid, env in unit_processes(job_id) if env.get("SLURM_JOB_ID") == str(unit.slurm_job_id)]
    for pid in sorted(doomed, key=lambda p: p in worker_pids(job_id, unit)):
        os.kill(pid, signal.SIGKILL)
    mark_down(unit.nodes[0])


def assert_every_step_once_and_one_process_parameters(tmp_path: Path, records: list[dict], steps: int) -> None:
    """Against the language model trained alone in one process: every step committed with
    its samples and none done twice (`bench.chaos.step_verdict`: a generation may break at
    a step some of its ranks committed and others abandoned — a gloo wait given up when the
    launcher said the world broke, as an NCCL abort does — and the next world starts after
    it), and the full parameters (tmp_path/elastic.pt) to 1e-9 of each tensor's scale."""
    fixed_out = tmp_path / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_",
                                                                    "LOCAL_", "SLURM_"))}
    subprocess.run(lm_command(fixed_out, tmp_path / "fixed-ledger", "dp", steps=steps,
                              micro_batch=REFERENCE_MICRO_BATCH), check=True, env=env,
                   timeout=600, stdout=subprocess.DEVNULL)
    samples = {r["step"]: sorted(r["indices"]) for r in read_ledger(tmp_path / "fixed-ledger")
               if r["kind"] == "attempt"}
    verdict = chaos.step_verdict(records, [samples[step] for step in range(steps)])
    assert not verdict.problems, verdict.problems
    elastic = torch.load(tmp_path / "elastic.pt", weights_only=True)["model"]
    for name, reference in torch.load(fixed_out, weights_only=True)["model"].items():
        scale = float(reference.abs().max())
        torch.testing.assert_close(elastic[name], reference, rtol=1e-9, atol=1e-9 * scale, msg=name)


@pytest.mark.timeout(900)
def test_hsdp_replicas_of_two_nodes_lose_a_node_patch_it_with_one_node_and_finish_equal_to_one_process(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    controller = slurm_controller(slurm, tmp_path)
    ledger = tmp_path / "ledger"
    lost_node = ""
    try:
        with AdminClient(unix_socket=controller.socket, timeout_s=10.0) as admin:
            job_id, grown = submit_and_grow_to_two_replicas(
                admin, tmp_path, lm_command(tmp_path / "elastic.pt", ledger, "hsdp", steps=STEPS))
            units = [u for u in admin.job(job_id).units if u.state == admin_pb2.UNIT_STATE_ACTIVE]
            status = tidal(controller, "status", job_id).stdout
            assert "REPLICA/NODE" in status and all(f"{u.replica}/{u.node_index}" in status for u in units), status

            # A node of replica 2 fails: its slurmd, then the unit's processes there.
            lost = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (2, 1))
            kept = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (2, 0))
            replica_1 = [u for u in units if slot_of(admin, job_id, u.unit_id)[0] == 1]
            kept_pids = worker_pids(job_id, kept)
            replica_1_pids = {u.unit_id: worker_pids(job_id, u) for u in replica_1}
            assert len(kept_pids) == 2 and all(len(p) == 2 for p in replica_1_pids.values())
            lost_node = lost.nodes[0]
            kill_node(job_id, lost)
            wait_for("replica 1 going on alone", lambda: next(
                (e for e in events(admin, job_id, "recovered") if e.fields["world_size"] == "4"), None),
                timeout_s=60)
            aside = [e for e in events(admin, job_id, "unit_standby") if e.unit_id == kept.unit_id]
            assert aside and aside[-1].fields["cause"] == "replica_incomplete"
            step_at_loss = admin.job(job_id).step
            wait_for("replica 1 training", lambda: admin.job(job_id).step >= step_at_loss + 10, timeout_s=60)
            assert worker_pids(job_id, kept) == kept_pids, "replica 2's healthy node keeps its workers"

            # The node comes back: one one-node unit takes the lost node's place.
            minicluster("start-node", lost_node)
            rejoined = wait_for("replica 2 rejoining", lambda: next(
                (e for e in events(admin, job_id, "world_reconfiguring")
                 if e.generation > grown.generation and e.fields["world_size"] == "8"), None), timeout_s=180,
                interval_s=0.5)
            joiners = rejoined.fields["joiners"].split(",")
            patch = next(u for u in joiners if u != kept.unit_id)
            assert kept.unit_id in joiners and slot_of(admin, job_id, patch) == (2, 1)
            submitted = [e for e in events(admin, job_id, "unit_submitting") if e.unit_id == patch]
            assert submitted and "take the place of lost ones" in submitted[0].reason, submitted
            wait_for("replica 2 back in the world", lambda: next(
                (e for e in events(admin, job_id, "world_reconfigured") if e.generation == rejoined.generation),
                None), timeout_s=120)

            # An urgent job takes replica 1's two nodes: that replica leaves at a step boundary.
            before_urgent = preempt_replica_1_and_finish(admin, slurm, job_id, lost, tmp_path)
            assert all(worker_pids(job_id, u) in (set(), pids) for u in replica_1
                       for pids in [replica_1_pids[u.unit_id]]), "replica 1 never restarted"
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
        if lost_node:
            minicluster("start-node", lost_node)

    records = read_ledger(ledger)
    # Only the lost node's shards came to the new node, from replica 1's same shard indices.
    patch_pids = {r["pid"] for r in records if r["kind"] == "formed" and r["generation"] == rejoined.generation
                  and r["shard"] in (2, 3)}
    received = [r for r in records if r["kind"] == "transfer" and r["role"] == "receiver"
                and r["generation"] == rejoined.generation]
    print("transfers at the rejoin:", [(r["shard"], r["sources"], r["bytes"]) for r in received])
    assert {r["shard"] for r in received if r["pid"] in patch_pids} <= {2, 3}
    assert all(r["sources"] == [0] for r in received), "each shard from replica 1 (the only other one)"
    abandoned = [r for r in records if r["kind"] == "abandoned" and r["generation"] >= before_urgent]
    assert not abandoned, f"a step was lost when replica 1 left: {abandoned[:2]}"
    assert_every_step_once_and_one_process_parameters(tmp_path, records, STEPS)


@pytest.mark.timeout(900)
def test_data_parallel_replicas_of_two_nodes_lose_a_node_that_costs_only_its_own_workers(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """The same scenario under DataParallel (every worker holds the whole model): the workers
    say so when their world forms, and the controller then keeps a node whose replica lost
    its other node in the world: a lost node costs its own two workers, no more."""
    controller = slurm_controller(slurm, tmp_path)
    ledger = tmp_path / "ledger"
    lost_node = ""
    try:
        with AdminClient(unix_socket=controller.socket, timeout_s=10.0) as admin:
            job_id, grown = submit_and_grow_to_two_replicas(
                admin, tmp_path, lm_command(tmp_path / "elastic.pt", ledger, "dp", steps=DP_STEPS))
            units = [u for u in admin.job(job_id).units if u.state == admin_pb2.UNIT_STATE_ACTIVE]

            lost = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (2, 1))
            kept = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (2, 0))
            survivors = [u for u in units if u.unit_id != lost.unit_id]
            survivor_pids = {u.unit_id: worker_pids(job_id, u) for u in survivors}
            assert all(len(p) == 2 for p in survivor_pids.values())
            lost_node = lost.nodes[0]
            kill_node(job_id, lost)

            def three_nodes_going_on() -> admin_pb2.Event | None:
                return next((e for e in events(admin, job_id, "recovered") if e.fields["world_size"] == "6"), None)

            try:
                # Survivors left in the broken generation's gloo collective until its timeout
                # (120 s) was a fault (fixed: their waits are sliced and told the world broke).
                recovered = wait_for("three nodes going on", three_nodes_going_on, timeout_s=30)
            except AssertionError:
                # Their stacks to their unit's log (faulthandler, SIGUSR1), for the failure's report.
                for pid in (p for pids in survivor_pids.values() for p in pids):
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(2)
                raise
            assert not [e for e in events(admin, job_id, "unit_standby") if e.unit_id == kept.unit_id]
            step_at_loss = admin.job(job_id).step
            wait_for("six workers training", lambda: admin.job(job_id).step >= step_at_loss + 10, timeout_s=60)
            assert {u.unit_id: worker_pids(job_id, u) for u in survivors} == survivor_pids, "no survivor restarted"

            minicluster("start-node", lost_node)
            rejoined = wait_for("the lost node's place taken", lambda: next(
                (e for e in events(admin, job_id, "world_reconfiguring")
                 if e.generation > recovered.generation and e.fields["world_size"] == "8"), None), timeout_s=180,
                interval_s=0.5)
            [patch] = rejoined.fields["joiners"].split(",")
            assert slot_of(admin, job_id, patch) == (2, 1)
            wait_for("eight workers again", lambda: next(
                (e for e in events(admin, job_id, "world_reconfigured") if e.generation == rejoined.generation),
                None), timeout_s=120)

            # An urgent job takes two nodes (not the kept node's, not the patch's): they leave
            # at a step boundary, the two others go on.
            before_urgent = preempt_replica_1_and_finish(admin, slurm, job_id, lost, tmp_path)
            assert worker_pids(job_id, kept) in (set(), survivor_pids[kept.unit_id]), "the kept node never restarted"
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
        if lost_node:
            minicluster("start-node", lost_node)

    records = read_ledger(ledger)
    received = [r for r in records if r["kind"] == "transfer" and r["role"] == "receiver"
                and r["generation"] == rejoined.generation]
    print("transfers at the patch:", [(r["pid"], r["sources"], r["bytes"]) for r in received])
    assert received and all(r["bytes"] > 0 for r in received), "the patch's workers received the state"
    assert grown.generation < recovered.generation < rejoined.generation
    abandoned = [r for r in records if r["kind"] == "abandoned" and r["generation"] >= before_urgent]
    assert not abandoned, f"a step was lost when two nodes left: {abandoned[:2]}"
    assert_every_step_once_and_one_process_parameters(tmp_path, records, DP_STEPS)


HALVES_STEPS = 300


def submit_hsdp_of_one_worker_a_node(admin: AdminClient, tmp_path: Path, ledger: Path, name: str,
                                     max_replicas: int) -> tuple[str, list[admin_pb2.Unit]]:
    """Submit the language model under HSDP as replicas of two one-node units of one worker
    (min 1), wait until `max_replicas` of them train; the job and its active units."""
    spec = admin_pb2.JobSpec(
        name=name, min_replicas=1, max_replicas=max_replicas, nodes_per_replica=2, procs_per_node=1,
        partition="train", mode=common_pb2.JOB_MODE_LIVE, working_dir=str(tmp_path),
        environment={"OMP_NUM_THREADS": "1"},
        command=lm_command(tmp_path / "elastic.pt", ledger, "hsdp", steps=HALVES_STEPS))
    job_id = admin.submit(spec).job.job_id
    wait_for(f"{max_replicas} replica(s) of two nodes training", lambda: (
        lambda j: j.world_size == 2 * max_replicas and j.step >= 20)(admin.job(job_id)), timeout_s=180,
        interval_s=0.5)
    return job_id, [u for u in admin.job(job_id).units if u.state == admin_pb2.UNIT_STATE_ACTIVE]


@pytest.mark.timeout(600)
def test_hsdp_replicas_each_left_with_one_half_train_on_as_one_replica_and_end_equal_to_one_process(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """HSDP replicas of two one-node units of one worker (a unit holds its node index's
    shards): an urgent job takes replica 1's node 1 and replica 2's node 0. The survivors
    hold the two halves of the state between them, each the half its own replica lacks:
    they become one replica (`replicas_merged`) and the job trains on them, in the same
    processes, while the urgent job runs; shards newer than a survivor holds come from the
    preempted node that saves them as it leaves. (Until 2026-12-07 the two
    gave their nodes back, saving both halves, and the job waited for the urgent job's
    end.) Once the urgent job ends the job grows back and runs to its end: COMPLETED once,
    every step's samples and the parameters those of one process."""
    controller = slurm_controller(slurm, tmp_path)
    ledger = tmp_path / "ledger"
    urgent = 0
    try:
        with AdminClient(unix_socket=controller.socket, timeout_s=10.0) as admin:
            job_id, units = submit_hsdp_of_one_worker_a_node(admin, tmp_path, ledger, "halves", max_replicas=2)
            kept = {u.unit_id: u for u in units if (slot_of(admin, job_id, u.unit_id)) in ((1, 0), (2, 1))}
            assert len(kept) == 2
            pids = {unit_id: worker_pids(job_id, unit) for unit_id, unit in kept.items()}
            assert all(pids.values())
            urgent = slurm.submit(UnitSubmission(
                name="urgent", script="#!/bin/sh\nsleep 600\n", partition="urgent", nodes=2, exclusive=True,
                requeue=False, exclude_nodes=tuple(n for u in kept.values() for n in u.nodes),
                output=str(tmp_path / "urgent-%j.out")))
            merged = wait_for("the two halves merged", lambda: next(iter(events(admin, job_id, "replicas_merged")),
                                                                    None), timeout_s=120, interval_s=0.5)
            node_0 = next(u for u in kept if slot_of(admin, job_id, u) == (1, 0))
            assert merged.fields["units"].split(",") == [node_0, *(u for u in kept if u != node_0)]
            formed = wait_for("a world of the merged replica", lambda: next(
                (e for e in events(admin, job_id, "world_formed") if e.generation > 0
                 and set(e.fields["members"].split(",")) == set(kept)), None), timeout_s=120, interval_s=0.5)
            at_merge = admin.job(job_id).step
            wait_for("the merged replica training while the urgent job runs", lambda: (
                lambda j: j.world_size == 2 and j.step >= at_merge + 10)(admin.job(job_id)), timeout_s=120,
                interval_s=0.5)
            assert slurm_job_running(slurm, urgent)
            assert {unit_id: worker_pids(job_id, unit) for unit_id, unit in kept.items()} == pids, \
                "the survivors kept their processes"
            left = [e for e in events(admin, job_id, "unit_left") if e.unit_id in kept]
            assert not left, [e.reason for e in left]
            # (Which preempted node saved its shards, if either had to, depends on which of
            # the two leaves the controller took first: the other node's were in the world.)
            print("saved as they left:", [e.reason for e in events(admin, job_id, "unit_left")
                                          if "left after saving the training state" in e.reason])
            assert "below_min_released" not in [e.kind for e in admin.events(job_id, limit=5000)]
            slurm.cancel(urgent)
            wait_for("the job's end", lambda: admin.job(job_id).state == admin_pb2.JOB_STATE_COMPLETED,
                     timeout_s=300, interval_s=1.0)
            kinds = [e.kind for e in admin.events(job_id, limit=5000)]
            assert kinds.count("job_completed") == 1 and "state_lost" not in kinds
            assert formed.generation < max(e.generation for e in events(admin, job_id, "world_reconfigured"))
        wait_for_units_to_end(slurm, job_id)
    finally:
        if urgent:
            slurm.cancel(urgent)
        controller.stop()
    assert_every_step_once_and_one_process_parameters(tmp_path, read_ledger(ledger), HALVES_STEPS)


def slurm_job_running(slurm: CliJsonSlurmClient, slurm_job_id: int) -> bool:
    return any(j.job_id == slurm_job_id and j.state is JobState.RUNNING for j in slurm.list_jobs())


@pytest.mark.timeout(600)
def test_a_drained_node_of_the_one_hsdp_replica_saves_its_shards_and_its_replacement_resumes_them(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """One HSDP replica of two one-node units (max 1): an admin drains its node 0 for
    maintenance. Node 0's shards have no other holder: the unit saves them as it leaves;
    node 1 keeps its workers and its shards in memory. The unit that takes node 0's place
    loads node 0's shards of exactly that step from disk, node 1's stay live, and the job
    trains on to its end: COMPLETED once, equal to one process. (Until 2026-11-29 the
    drained unit saved nothing, and then its replacement would have loaded only a step
    every shard's folder had: the job failed, state_lost.)"""
    controller = slurm_controller(slurm, tmp_path)
    ledger = tmp_path / "ledger"
    try:
        with AdminClient(unix_socket=controller.socket, timeout_s=10.0) as admin:
            job_id, units = submit_hsdp_of_one_worker_a_node(admin, tmp_path, ledger, "drain-half", max_replicas=1)
            drained = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (1, 0))
            kept = next(u for u in units if slot_of(admin, job_id, u.unit_id) == (1, 1))
            kept_pids = worker_pids(job_id, kept)
            drained_pids = worker_pids(job_id, drained)
            admin.drain(drained.unit_id)
            [left] = wait_for("node 0's shards saved", lambda: [
                e for e in events(admin, job_id, "unit_left")
                if e.unit_id == drained.unit_id and "shard-0-of-2" in e.reason] or None, timeout_s=60)
            wait_for("the job's end", lambda: admin.job(job_id).state == admin_pb2.JOB_STATE_COMPLETED,
                     timeout_s=300, interval_s=1.0)
            kinds = [e.kind for e in admin.events(job_id, limit=5000)]
            assert kinds.count("job_completed") == 1 and "state_lost" not in kinds, kinds
            assert worker_pids(job_id, kept) in (set(), kept_pids), "node 1 kept its workers"
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
    records = read_ledger(ledger)
    saved_step = int(left.reason.split("at step ")[1].split()[0])
    resumed = [r for r in records if r["kind"] == "formed" and r["step"] == saved_step]
    assert {r["shard"] for r in resumed if r["pid"] not in drained_pids | kept_pids} == {0}, \
        "the new node 0 formed the next world at the saved step"
    assert {r["pid"] for r in resumed if r["shard"] == 1} <= kept_pids, "node 1's shards stayed live"
    assert_every_step_once_and_one_process_parameters(tmp_path, records, HALVES_STEPS)
