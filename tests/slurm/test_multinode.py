"""Replicas spanning nodes on the real mini cluster: a restart-mode job of 2-node replicas
fills the 4 nodes, loses a node (its slurmd and the unit's processes there killed), goes on
at one replica with the node excluded, and grows back to two once the node returns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import ControllerProcess
from tests.slurm.test_autoscaling import minicluster, require_four_idle_nodes, running_at, wait_for_units_to_end
from tests.waiting import wait_for
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

EXAMPLE = REPO_ROOT / "examples" / "restart_mode" / "train_snapshot.py"
PROCS_PER_NODE = 1
NODES_PER_REPLICA = 2


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def mark_down(node: str) -> None:
    """A killed node DOWN at once, as slurmctld marks a node that stops answering (after
    SlurmdTimeout, 30 s here; the node comes back sooner in these tests). The controller
    cancels the failed unit's Slurm job when its stream breaks; when that came before Slurm
    heard of the batch script's death, the job stayed COMPLETING, holding the node, until
    slurmctld sent its TERMINATE_JOB again 61-70 s later (seen in fresh-clone runs of this
    test and of test_live_multinode). `minicluster start-node` resumes the node.
    (tests/slurm/test_autoscaling.py's node failure leaves the node to Slurm: it checks
    that Tidal's own exclusion keeps the replacement off the node.)"""
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=tidal test: node failed"],
                   check=True, timeout=30, capture_output=True)


def unit_processes(job_id: str) -> list[tuple[int, dict[str, str]]]:
    """Every process a unit of `job_id` runs (launchers, workers), with its environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            env = environ(int(entry.name))
            if env.get("SLURM_JOB_ID") and (env.get("TIDAL_JOB_ID") == job_id
                                            or f"tidal-{job_id}-" in env.get("SLURM_JOB_NAME", "")):
                found.append((int(entry.name), env))
    return found


def workers(job_id: str) -> dict[int, dict[str, str]]:
    """The job's training processes by global rank (the deathsig wrapper execs the script)."""
    return {int(env["RANK"]): env for pid, env in unit_processes(job_id)
            if "RANK" in env and "train_snapshot.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace")}


def logged_steps(log_dir: Path) -> list[dict]:
    records = []
    for path in log_dir.glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def active_units(job: admin_pb2.Job) -> list[admin_pb2.Unit]:
    return [u for u in job.units if u.state == admin_pb2.UNIT_STATE_ACTIVE]


@pytest.mark.timeout(300)
def test_two_node_replicas_fill_four_nodes_lose_a_node_go_on_at_one_and_grow_back(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    controller = ControllerProcess(tmp_path, {"slurm_units": "true", "slurm_poll_interval_s": "1",
                                              "join_settle_s": "3", "reconnect_grace_s": "10",
                                              "node_cooldown_s": "8", "restart_grace_s": "5"})
    controller.start()
    log_dir = tmp_path / "logs"
    world = 2 * NODES_PER_REPLICA * PROCS_PER_NODE
    lost_node = ""
    try:
        spec = admin_pb2.JobSpec(
            name="span", min_replicas=1, max_replicas=2, nodes_per_replica=NODES_PER_REPLICA,
            procs_per_node=PROCS_PER_NODE, partition="train", mode=common_pb2.JOB_MODE_RESTART,
            working_dir=str(tmp_path), environment={"OMP_NUM_THREADS": "1"},
            command=[sys.executable, str(EXAMPLE), "--steps", "100000", "--snapshot", str(tmp_path / "snap.pt"),
                     "--step-time", "0.05", "--log-dir", str(log_dir)])
        with AdminClient(unix_socket=controller.socket, timeout_s=10.0) as admin:
            job_id = admin.submit(spec).job.job_id

            # Two replicas of two nodes each: 4 ranks over the 4 nodes.
            job = wait_for(f"world size {world}", running_at(admin, job_id, world), timeout_s=150, interval_s=0.5)
            assert job.replicas == 2
            units = active_units(job)
            slurm_jobs = {j.job_id: j for j in slurm.list_jobs()}
            assert len(units) == 2
            for unit in units:
                assert len(unit.nodes) == NODES_PER_REPLICA, unit
                assert list(slurm_jobs[unit.slurm_job_id].nodes) == list(unit.nodes), unit
            assert sorted(n for u in units for n in u.nodes) == ["n1", "n2", "n3", "n4"]
            # Each unit's workers run on both of its nodes, ranks laid out node by node.
            ranks = wait_for("the 4 ranks' processes", lambda: (w := workers(job_id)) and len(w) == world and w,
                             timeout_s=30)
            by_slurm_job = {u.slurm_job_id: u for u in units}
            for rank, env in ranks.items():
                unit = by_slurm_job[int(env["SLURM_JOB_ID"])]
                assert env["WORLD_SIZE"] == str(world) and env["TIDAL_UNIT_ID"] == unit.unit_id
                assert env["SLURMD_NODENAME"] == unit.nodes[(rank % (NODES_PER_REPLICA * PROCS_PER_NODE))
                                                           // PROCS_PER_NODE], (rank, env["SLURMD_NODENAME"])
            wait_for("steps at world size 4", lambda: sum(1 for r in logged_steps(log_dir)
                                                           if r["world_size"] == world) >= 10 * world, timeout_s=60)

            # A follower node of one unit dies: its slurmd, then the unit's processes there.
            victim = units[1]
            lost_node = victim.nodes[1]
            minicluster("kill-node", lost_node)
            doomed = [(pid, env) for pid, env in unit_processes(job_id)
                      if env.get("SLURMD_NODENAME") == lost_node and env["SLURM_JOB_ID"] == str(victim.slurm_job_id)]
            assert doomed, f"no process of unit {victim.unit_id} on {lost_node}"
            # The launcher first (as a node dies, all at once), then its workers.
            doomed.sort(key=lambda item: "RANK" in item[1])
            for pid, _ in doomed:
                os.kill(pid, signal.SIGKILL)
            mark_down(lost_node)

            failure = wait_for("the unit's failure", lambda: next(
                (e for e in admin.events(job_id) if e.kind == "failure_detected" and e.unit_id == victim.unit_id),
                None), timeout_s=30)
            assert f"node {lost_node} lost" in failure.reason, failure.reason
            job = wait_for("one replica going on", running_at(admin, job_id, world // 2), timeout_s=60,
                           interval_s=0.5)
            assert [u.unit_id for u in active_units(job)] == [units[0].unit_id]
            excluded = [e.fields["node"] for e in admin.events(job_id) if e.kind == "node_excluded"]
            assert lost_node in excluded, excluded
            # The controller cancels the failed unit's Slurm job (slurmctld logs the request).
            slurmctld_log = Path(os.environ["SLURM_CONF"]).parent / "log" / "slurmctld.log"
            wait_for("the failed unit's Slurm job to be cancelled", lambda: (
                f"REQUEST_KILL_JOB JobId={victim.slurm_job_id} " in slurmctld_log.read_text()), timeout_s=30)
            before = max(r["step"] for r in logged_steps(log_dir))
            wait_for("steps at one replica", lambda: any(
                r["world_size"] == world // 2 and r["step"] > before for r in logged_steps(log_dir)), timeout_s=60)

            # The node comes back; once its cool-down ends the job grows back to two replicas.
            minicluster("start-node", lost_node)
            job = wait_for(f"world size {world} again", running_at(admin, job_id, world), timeout_s=120,
                           interval_s=0.5)
            assert job.replicas == 2 and all(len(u.nodes) == NODES_PER_REPLICA for u in active_units(job))
            regrown = max(r["step"] for r in logged_steps(log_dir))
            wait_for("steps at world size 4 again", lambda: sum(
                1 for r in logged_steps(log_dir) if r["world_size"] == world and r["step"] > regrown + 5) >= world,
                timeout_s=60)
            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
        if lost_node:
            # The next test needs every node.
            minicluster("start-node", lost_node)
