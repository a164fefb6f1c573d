"""The pyslurm backend's translation into Tidal's models. pyslurm 25.11 cannot be built
here (no Slurm 25.11 on these machines), so these stand-ins carry the attribute names of
pyslurm 25.11's Job, Node and Partition; the backend has not talked to a real slurmctld."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tidal.slurm import JobFlag, JobState, NodeFlag, NodeState, PreemptMode, SlurmCommandFailed, SlurmVersion
from tidal.slurm.models import UnitOwner, UnitSubmission
from tidal.slurm.pyslurm_backend import (
    PyslurmSlurmClient,
    job_from_pyslurm,
    node_from_pyslurm,
    partition_from_pyslurm,
)


def pyslurm_job(**overrides: object) -> SimpleNamespace:
    fields = {"id": 7, "name": "unit-a", "user_name": "alice", "state": "RUNNING", "partition": "train",
                  "allocated_nodes": "n[1-2]", "num_nodes": 2, "priority": 100, "submit_time": 1795257906,
                  "start_time": 1795257907, "end_time": 1795257912, "preempt_time": 1795257907,
                  "requeue_count": 0, "state_reason": "None", "comment": "tidal:job-1"}
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_job_translation() -> None:
    job = job_from_pyslurm(pyslurm_job())
    assert job.job_id == 7 and job.user == "alice" and job.nodes == ("n1", "n2")
    assert job.state is JobState.RUNNING and job.is_being_preempted
    completing = job_from_pyslurm(pyslurm_job(state="COMPLETING", preempt_time=None, requeue_count=1))
    assert completing.flags == {JobFlag.COMPLETING} and completing.was_requeued


def test_node_and_partition_translation() -> None:
    node = node_from_pyslurm(SimpleNamespace(
        name="n4", state="IDLE+DRAIN", partitions=["train"], total_cpus=64,
        configured_gres={"gpu:a100": 8}, available_features=["a100"], reason="bad fan", address="10.0.0.4"))
    assert node.state is NodeState.IDLE and node.flags == {NodeFlag.DRAIN}
    assert node.gres_count("gpu") == 8 and not node.is_idle_and_usable
    partition = partition_from_pyslurm(SimpleNamespace(
        name="train", nodes="n[1-4]", priority_tier=1, preempt_mode="REQUEUE",
        preemption_grace_time=30, is_default=True, state="UP"))
    assert partition.preempt_mode == {PreemptMode.REQUEUE} and partition.grace_time_s == 30
    assert partition.nodes == ("n1", "n2", "n3", "n4")


def test_client_turns_pyslurm_errors_into_typed_errors() -> None:
    class RPCError(Exception):
        pass

    def refuse() -> None:
        raise RPCError("Unable to contact slurm controller")

    module = SimpleNamespace(__version__="25.11.0", Jobs=SimpleNamespace(load=refuse))
    client = PyslurmSlurmClient(module)
    assert client.version() == SlurmVersion(25, 11, 0)
    with pytest.raises(SlurmCommandFailed, match="Unable to contact"):
        client.list_jobs()


def test_client_lists_through_pyslurm_collections() -> None:
    jobs = {7: pyslurm_job(), 8: pyslurm_job(id=8, user_name="bob")}
    module = SimpleNamespace(__version__="25.11.1", Jobs=SimpleNamespace(load=lambda: jobs))
    assert [j.job_id for j in PyslurmSlurmClient(module).list_jobs(user="bob")] == [8]


def test_a_unit_of_another_user_is_submitted_with_that_users_ids_and_environment() -> None:
    """pyslurm's JobSubmitDescription takes user_id/group_id; the environment is the
    owner's own plus the unit's, none of the controller's."""
    described: list[dict[str, object]] = []

    class JobSubmitDescription:
        def __init__(self, **fields: object) -> None:
            described.append(fields)

        def submit(self) -> int:
            return 41

    module = SimpleNamespace(__version__="25.11.0", JobSubmitDescription=JobSubmitDescription)
    owner = UnitOwner(uid=os.geteuid() + 4242, gid=4242, groups=(4242, 27), name="alice", home="/home/alice")
    unit = UnitSubmission(name="tidal-j-u1", script="#!/bin/bash\nexec true\n", environment={"TIDAL_SECRET_FILE": "/s"},
                          owner=owner)
    assert PyslurmSlurmClient(module).submit(unit) == 41
    fields = described[0]
    assert (fields["user_id"], fields["group_id"]) == (owner.uid, 4242)
    environment = fields["environment"]
    assert isinstance(environment, dict)
    assert environment["HOME"] == "/home/alice" and environment["USER"] == "alice"
    assert environment["TIDAL_SECRET_FILE"] == "/s" and "SLURM_CONF" not in environment
    assert not set(environment) - {"HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG", "TIDAL_SECRET_FILE"}
    # The controller's own units keep its environment and its ids.
    PyslurmSlurmClient(module).submit(UnitSubmission(name="tidal-j-u2", script="#!/bin/bash\n"))
    assert "user_id" not in described[1]
