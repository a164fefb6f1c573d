"""A unit spanning two "nodes" on loopback, without Slurm: the two launchers get what srun
would set (SLURM_NODEID 0 and 1 of a 2-node job). The leader registers the unit with both
nodes, the follower's worker takes the unit's second rank, and a follower that loses its
leader kills its workers and exits non-zero."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import EXAMPLE, ControllerProcess, alive, wait_until
from tidal.proto import admin_pb2, common_pb2

pytestmark = pytest.mark.integration


def start_launcher(directory: Path, controller: ControllerProcess, job_id: str, secret_path: str, node: int,
                   slurm_job_id: int, port_base: int) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = directory / f"launcher-node{node}.log"
    env = {**os.environ, "TIDAL_SECRET_FILE": secret_path, "TIDAL_LOG_FORMAT": "json",
           "SLURM_JOB_ID": str(slurm_job_id), "SLURM_JOB_NODELIST": "fake[1-2]", "SLURM_NODEID": str(node),
           "SLURMD_NODENAME": f"fake{node + 1}", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tidal.launcher.agent", "--controller", controller.address, "--job", job_id,
             "--unit", "u1", "--address", "127.0.0.1", "--stop-grace", "5", "--unit-nodes", "2",
             "--node-port-base", str(port_base)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return process, log_path


def worker_ranks(job_id: str) -> dict[int, tuple[int, str]]:
    """rank -> (pid, node) of the job's training processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes().decode(errors="replace")
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if env.get("TIDAL_JOB_ID") == job_id and "RANK" in env and "train_snapshot.py" in cmdline:
            found[int(env["RANK"])] = (int(entry.name), env["SLURMD_NODENAME"])
    return found


def test_a_two_node_unit_trains_with_a_rank_per_node_and_its_follower_dies_with_its_leader(tmp_path: Path) -> None:
    controller = ControllerProcess(tmp_path, {"join_settle_s": "1", "reconnect_grace_s": "10"})
    controller.start()
    launchers: list[subprocess.Popen[bytes]] = []
    try:
        spec = admin_pb2.JobSpec(
            name="span", min_replicas=1, max_replicas=1, nodes_per_replica=2, procs_per_node=1,
            mode=common_pb2.JOB_MODE_RESTART, working_dir=str(tmp_path), environment={"OMP_NUM_THREADS": "1"},
            command=[sys.executable, str(EXAMPLE), "--snapshot", str(tmp_path / "snap.pt"), "--steps", "100000",
                     "--step-time", "0.05"])
        with controller.admin() as admin:
            response = admin.submit(spec)
        job_id = response.job.job_id
        slurm_job_id, port_base = random.randrange(1000, 100000), random.randrange(20000, 24000)
        follower, follower_log = start_launcher(tmp_path, controller, job_id, response.secret_path, 1, slurm_job_id,
                                                port_base)
        leader, _ = start_launcher(tmp_path, controller, job_id, response.secret_path, 0, slurm_job_id, port_base)
        launchers += [leader, follower]

        formed = controller.wait_event(job_id, "world_formed", timeout=60)
        assert formed.fields["world_size"] == "2", formed
        with controller.admin() as admin:
            (unit,) = admin.job(job_id).units
        assert list(unit.nodes) == ["fake1", "fake2"]
        ranks = wait_until(lambda: len(found := worker_ranks(job_id)) == 2 and found, 60, "a worker on each node")
        assert {rank: node for rank, (_, node) in ranks.items()} == {0: "fake1", 1: "fake2"}
        wait_until(lambda: (tmp_path / "snap.pt").exists(), 60, "the first snapshot (the ranks train together)")

        # The leader dies: the follower loses it, kills its worker and exits non-zero.
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        assert follower.wait(30) == 1, follower_log.read_text()[-3000:]
        follower_pid = ranks[1][0]
        wait_until(lambda: not alive(follower_pid), 10, "the follower's worker to be gone")
        assert "leader_lost" in follower_log.read_text()
    finally:
        for process in launchers:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        controller.stop()
