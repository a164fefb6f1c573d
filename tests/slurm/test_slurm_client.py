"""The Slurm access layer against the real mini cluster (scripts/minicluster): what a user
of the cluster would check with sinfo, squeue and scontrol."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.waiting import wait_for
from tidal.slurm import (
    CliJsonSlurmClient,
    JobState,
    NodeState,
    SlurmCommandFailed,
    SlurmJobNotFound,
    SlurmNotInstalled,
    SlurmReportedError,
    SlurmTimeout,
    UnitSubmission,
)
from tidal.slurm.models import Job
from tidal.slurm.parse import node_state_from_names

pytestmark = pytest.mark.slurm
SLEEPER = "#!/bin/sh\nsleep 600\n"


def running(client: CliJsonSlurmClient, job_id: int) -> Job | None:
    job = client.get_job(job_id)
    return job if job.state is JobState.RUNNING else None


def test_nodes_match_sinfo(slurm: CliJsonSlurmClient) -> None:
    text = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %T %P"], capture_output=True,
                          text=True, check=True, timeout=10).stdout
    from_sinfo: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        name, state, partition = line.split()
        from_sinfo.setdefault(name, (state, set()))[1].add(partition.rstrip("*"))
    nodes = {n.name: n for n in slurm.list_nodes()}
    assert set(nodes) == set(from_sinfo) == {"n1", "n2", "n3", "n4"}
    for name, node in nodes.items():
        state, partitions = from_sinfo[name]
        # sinfo's text (`idle`, `drained`, `allocated`...) and the JSON agree.
        assert node_state_from_names([state]) == (node.state, node.flags), (name, state)
        assert set(node.partitions) == partitions == {"train", "urgent"}
        assert node.gres_count("gpu") == 2
    partitions = {p.name: p for p in slurm.list_partitions()}
    assert partitions["urgent"].priority_tier > partitions["train"].priority_tier
    assert slurm.version().major >= 22


def test_unit_runs_on_one_node_gets_its_environment_and_is_cancelled(slurm: CliJsonSlurmClient,
                                                                      tmp_path: Path) -> None:
    secret = "s3cret-" + os.urandom(8).hex()
    marker = tmp_path / "env-seen"
    script = f'#!/bin/sh\nprintf "%s" "$TIDAL_JOB_SECRET" > {marker}\nsleep 600\n'
    job_id = slurm.submit(UnitSubmission(name="tidal-test-unit", script=script, partition="train",
                                         environment={"TIDAL_JOB_SECRET": secret}, output="/dev/null"))
    job = wait_for("the unit to run", lambda: running(slurm, job_id))
    assert len(job.nodes) == 1 and job.node_count == 1 and job.partition == "train"
    assert wait_for("the job to write its environment", lambda: marker.exists() and marker.read_text()) == secret
    record = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True,
                            timeout=10).stdout
    assert secret not in record, "the secret must not appear in Slurm's record of the job"
    assert job.nodes[0] in {n.name for n in slurm.list_nodes() if n.state is NodeState.ALLOCATED}

    slurm.cancel(job_id)
    gone = wait_for("the unit to end", lambda: (j := slurm.get_job(job_id)).state.is_finished and j)
    assert gone.state is JobState.CANCELLED
    slurm.cancel(job_id)  # cancelling an ended job again is not an error


def test_train_job_preempted_by_urgent_job_is_seen_then_requeued(slurm: CliJsonSlurmClient) -> None:
    units = [slurm.submit(UnitSubmission(name=f"tidal-test-train-{i}", script=SLEEPER, partition="train",
                                         output="/dev/null")) for i in range(4)]
    wait_for("four train units to run", lambda: all(running(slurm, j) for j in units))
    urgent = slurm.submit(UnitSubmission(name="tidal-test-urgent", script=SLEEPER, partition="urgent",
                                         nodes=2, output="/dev/null", requeue=False))

    def signalled() -> list[Job] | None:
        jobs = [slurm.get_job(j) for j in units]
        chosen = [j for j in jobs if j.is_being_preempted]
        return chosen if len(chosen) == 2 else None

    chosen = wait_for("Slurm to choose two train units", signalled, timeout_s=30)
    for job in chosen:
        assert job.preempt_time is not None and job.end_time is not None
        assert (job.end_time - job.preempt_time).total_seconds() <= 6  # GraceTime 5 s
    # After GraceTime (and slurmctld's periodic time-limit check, up to 30 s) they requeue.
    def requeued() -> list[Job] | None:
        jobs = [slurm.get_job(j.job_id) for j in chosen]
        return jobs if all(j.state is JobState.PENDING and j.was_requeued for j in jobs) else None

    for job in wait_for("the preempted units to requeue", requeued, timeout_s=60):
        assert job.requeue_count == 1 and job.nodes == ()
    urgent_job = wait_for("the urgent job to run", lambda: running(slurm, urgent), timeout_s=30)
    assert len(urgent_job.nodes) == 2 and set(urgent_job.nodes) == {n for j in chosen for n in j.nodes}
    spared = [slurm.get_job(j) for j in units if j not in {c.job_id for c in chosen}]
    assert all(j.state is JobState.RUNNING and j.requeue_count == 0 for j in spared)


def test_running_two_node_job_is_shrunk_to_one(slurm: CliJsonSlurmClient) -> None:
    job_id = slurm.submit(UnitSubmission(name="tidal-test-pair", script=SLEEPER, partition="train", nodes=2,
                                         output="/dev/null"))
    job = wait_for("the two-node job to run", lambda: running(slurm, job_id))
    assert len(job.nodes) == 2
    slurm.shrink(job_id, 1)
    shrunk = slurm.get_job(job_id)
    assert shrunk.state is JobState.RUNNING and shrunk.node_count == 1 and shrunk.nodes == job.nodes[:1]
    released = job.nodes[1]
    wait_for("the released node to be idle",
             lambda: any(n.name == released and n.state is NodeState.IDLE for n in slurm.list_nodes()))
    with pytest.raises(SlurmJobNotFound):
        slurm.shrink(999999, 1)


def test_hung_slurmctld_gives_a_timeout_within_the_deadline(slurm: CliJsonSlurmClient, mini_cluster: dict) -> None:
    ctld = mini_cluster["daemons"]["slurmctld"]["pid"]
    client = CliJsonSlurmClient(timeout_s=2)
    os.kill(ctld, signal.SIGSTOP)  # slurmctld frozen: commands connect and wait
    try:
        started = time.monotonic()
        with pytest.raises(SlurmTimeout, match="no answer within 2s"):
            client.list_jobs()
        elapsed = time.monotonic() - started
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert 1.9 <= elapsed < 4, f"the timeout took {elapsed:.1f}s"
    assert slurm.list_nodes()  # and the cluster answers again


def test_unreachable_controller_is_an_error_not_an_empty_cluster(mini_cluster: dict, tmp_path: Path) -> None:
    """The same cluster's config with slurmctld's port changed to one nothing listens on:
    squeue --json then exits 0 with no jobs and an error list, which must not read as
    "no jobs"."""
    conf = Path(os.environ["SLURM_CONF"])
    port = mini_cluster["port_base"]
    dead = tmp_path / "slurm.conf"
    dead.write_text(conf.read_text().replace(f"SlurmctldPort={port}", f"SlurmctldPort={port + 98}"))
    for extra in ("gres.conf", "cgroup.conf"):
        (tmp_path / extra).write_text((conf.parent / extra).read_text())
    client = CliJsonSlurmClient(timeout_s=20, slurm_conf=str(dead))
    with pytest.raises(SlurmReportedError, match=r"Failed while looking for jobs|Unable to contact"):
        client.list_jobs()
    with pytest.raises((SlurmReportedError, SlurmCommandFailed)):
        client.list_nodes()


def test_failing_and_missing_commands_are_typed_errors(slurm: CliJsonSlurmClient, tmp_path: Path) -> None:
    with pytest.raises(SlurmNotInstalled):
        CliJsonSlurmClient(bin_dir=str(tmp_path)).list_jobs()
    with pytest.raises(SlurmCommandFailed, match=r"(?i)invalid partition"):
        slurm.submit(UnitSubmission(name="tidal-test-bad", script=SLEEPER, partition="no-such-partition"))
    with pytest.raises(SlurmJobNotFound):
        slurm.get_job(999999)
