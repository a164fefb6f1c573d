"""An unmodified PyTorch Lightning DDP script under restart mode on the real mini cluster:
two replicas as Slurm jobs, one worker killed with SIGKILL mid-training; Lightning sees a
torchrun launch, resumes from its own checkpoint and the job completes."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from bench.chaos import process_environment, unit_processes
from tests.conftest import REPO_ROOT
from tests.integration.conftest import alive
from tests.slurm.test_autoscaling import running_at, slurm_controller, wait_for_units_to_end
from tests.waiting import wait_for
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient

pytestmark = pytest.mark.slurm

LIGHTNING_EXAMPLE = REPO_ROOT / "examples" / "restart_mode" / "lightning_ddp.py"
EPOCHS = 3
# 512 samples in batches of 16: 16 steps an epoch at world size 2.
STEP_TIME_S = 0.15


def lightning_job(directory: Path, checkpoints: Path) -> admin_pb2.JobSpec:
    return admin_pb2.JobSpec(
        name="lightning", min_replicas=2, max_replicas=2, partition="train", mode=common_pb2.JOB_MODE_RESTART,
        working_dir=str(directory), environment={"OMP_NUM_THREADS": "1"},
        command=[sys.executable, str(LIGHTNING_EXAMPLE), "--checkpoint-dir", str(checkpoints), "--epochs",
                 str(EPOCHS), "--step-time", str(STEP_TIME_S)])


def live_worker(state_dir: Path, job_id: str, unit_id: str) -> int | None:
    """The unit's running worker, from the PIDs its launcher logged (checked by its environment)."""
    found = unit_processes(state_dir, job_id).get(unit_id)
    for pid in reversed(found.workers.get(0, []) if found is not None else []):
        env = process_environment(pid)
        if alive(pid) and env.get("TIDAL_JOB_ID") == job_id and env.get("TIDAL_UNIT_ID") == unit_id:
            return pid
    return None


def unit_output(state_dir: Path, job_id: str) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted((state_dir / "units").glob(f"{job_id}-*.out")))


@pytest.mark.timeout(300)
def test_a_lightning_ddp_script_survives_a_killed_worker_and_completes(slurm: CliJsonSlurmClient, mini_cluster: dict,
                                                                        tmp_path: Path) -> None:
    controller = slurm_controller(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    try:
        with controller.admin() as admin:
            job_id = admin.submit(lightning_job(tmp_path, checkpoints)).job.job_id
            job = wait_for("world size 2", running_at(admin, job_id, 2), timeout_s=90, interval_s=0.5)
            # Mid-training: Lightning's first checkpoint is written (4 steps in).
            wait_for("a checkpoint", lambda: (checkpoints / "last.ckpt").exists(), timeout_s=90, interval_s=0.2)
            victim_unit = job.units[-1].unit_id
            victim = wait_for("the victim's worker", lambda: live_worker(controller.state_dir, job_id, victim_unit),
                              timeout_s=10)
            os.kill(victim, signal.SIGKILL)

            final = wait_for("the job to end", lambda: _ended(admin, job_id), timeout_s=200, interval_s=1.0)
            events = admin.events(job_id)
        output = unit_output(controller.state_dir, job_id)
        assert final.state == admin_pb2.JOB_STATE_COMPLETED, f"{final.state}: {final.last_event.reason}\n{output}"
        failure = next(e for e in events if e.kind == "failure_detected")
        assert failure.unit_id == victim_unit and "SIGKILL" in failure.reason
        # Lightning took every start for torchrun's, and trained to its last epoch after
        # resuming from its own checkpoint.
        environments = re.findall(r"cluster_environment=(\w+)", output)
        assert len(environments) >= 4 and set(environments) == {"TorchElasticEnvironment"}, output
        assert "Restored all states from the checkpoint" in output, output
        assert re.search(rf"finished epoch={EPOCHS} global_step=\d+ world_size=2", output), output
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def _ended(admin: AdminClient, job_id: str) -> admin_pb2.Job | None:
    job = admin.job(job_id)
    final = (admin_pb2.JOB_STATE_COMPLETED, admin_pb2.JOB_STATE_FAILED, admin_pb2.JOB_STATE_CANCELLED)
    return job if job.state in final else None
