"""At submit, a job whose units could not give each worker a GPU of its own is refused,
naming the partition, its nodes' GPUs and procs_per_node; a partition without GPUs (a CPU
job) is not checked, and a Slurm that does not answer skips the check rather than refuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from tidal.controller import owners
from tidal.controller.config import ControllerConfig
from tidal.controller.jobs import SlurmUnits
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.server import Controller
from tidal.controller.spec import SpecError
from tidal.controller.store import StateStore
from tidal.controller.units import gpu_shortfall
from tidal.proto import admin_pb2
from tidal.slurm import SlurmCommandFailed, SlurmError, SlurmTimeout
from tidal.slurm.fake import FakeSlurmClient
from tidal.slurm.models import Gres, Node, NodeState, Partition, PreemptMode


def _node(name: str, gpus: int, partitions: tuple[str, ...] = ("gpu",)) -> Node:
    gres = (Gres("gpu", "h100", gpus),) if gpus else ()
    return Node(name, NodeState.IDLE, frozenset(), partitions, 64, gres, (), "")


def _partition(name: str, nodes: tuple[str, ...], default: bool = False) -> Partition:
    return Partition(name, nodes, 1, frozenset({PreemptMode.OFF}), 0, default, True)


NODES = [_node("g1", 8), _node("g2", 8), _node("g3", 4), _node("c1", 0, ("cpu",)), _node("c2", 0, ("cpu",))]
PARTITIONS = [_partition("gpu", ("g1", "g2", "g3")), _partition("cpu", ("c1", "c2"), default=True)]


def _spec(procs: int, partition: str = "gpu", *options: str) -> admin_pb2.JobSpec:
    return admin_pb2.JobSpec(name="lm", procs_per_node=procs, partition=partition, command=["python", "train.py"],
                             sbatch_options=list(options))


def test_more_workers_per_node_than_the_partitions_nodes_have_gpus_is_refused_by_name() -> None:
    problem = gpu_shortfall(_spec(16), PARTITIONS, NODES)
    assert problem == ("procs_per_node: 16 workers per node need a GPU each, but the nodes of partition 'gpu' have "
                       "4 or 8 GPUs (gres gpu): run at most 8 workers per node")
    assert gpu_shortfall(_spec(8), PARTITIONS, NODES) is None
    assert gpu_shortfall(_spec(1), PARTITIONS, NODES) is None


def test_a_partition_without_gpus_is_a_cpu_job_and_not_checked() -> None:
    assert gpu_shortfall(_spec(64, "cpu"), PARTITIONS, NODES) is None
    # No partition named: the cluster's default (here the CPU one).
    assert gpu_shortfall(_spec(64, ""), PARTITIONS, NODES) is None
    # ... or the one the sbatch options name.
    assert "partition 'gpu'" in (gpu_shortfall(_spec(9, "", "-p", "gpu"), PARTITIONS, NODES) or "")
    assert "partition 'gpu'" in (gpu_shortfall(_spec(9, "", "--partition=gpu"), PARTITIONS, NODES) or "")
    # No partition and no default: nothing to check against.
    assert gpu_shortfall(_spec(64, ""), [_partition("gpu", ("g1",))], NODES) is None


def test_units_that_ask_for_fewer_gpus_than_workers_are_refused() -> None:
    problem = gpu_shortfall(_spec(8, "gpu", "--gres=gpu:h100:4"), PARTITIONS, NODES)
    assert problem is not None
    assert "8 workers per node" in problem and "ask for 4 GPUs per node" in problem and "'gpu'" in problem
    assert gpu_shortfall(_spec(8, "gpu", "--gpus-per-node=4"), PARTITIONS, NODES) is not None
    assert gpu_shortfall(_spec(8, "gpu", "--gres=gpu:8"), PARTITIONS, NODES) is None
    # Asking for other resources only says nothing about GPUs.
    assert gpu_shortfall(_spec(8, "gpu", "--gres=nic:1"), PARTITIONS, NODES) is None


def test_the_controller_refuses_at_submit_and_skips_the_check_when_slurm_does_not_answer() -> None:
    fake = FakeSlurmClient.with_nodes(2)  # nodes with 2 (fake) GPUs, partition "train" the default
    with pytest.raises(SpecError, match=r"procs_per_node: 3 workers .* partition 'train' have 2 GPUs"):
        Controller._check_gpus(_spec(3, "train"), fake)
    Controller._check_gpus(_spec(2, "train"), fake)
    fake.fail_next("list_nodes", SlurmTimeout(["sinfo"], 10))
    with structlog.testing.capture_logs() as logged:
        Controller._check_gpus(_spec(3, "train"), fake)
    assert [entry["event"] for entry in logged] == ["gpu_check_skipped"]
    assert "Slurm did not answer" in logged[0]["reason"]


@pytest.mark.parametrize("said, refused", [
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", False),
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", False),
    ("sbatch: error: invalid partition specified: train", True),
])
def test_a_slurm_that_cannot_be_reached_at_the_check_is_not_the_specs_fault(tmp_path: Path, said: str,
                                                                             refused: bool) -> None:
    """`sbatch --test-only` exits 1 when slurmctld is down or overloaded, as when it refuses
    the job. The first was told to the user as 'invalid job spec: sbatch_options: Slurm would
    refuse the job's units' (INVALID_ARGUMENT), blaming options that were fine."""
    fake = FakeSlurmClient.with_nodes(2)
    controller = Controller(ControllerConfig(state_dir=tmp_path), StateStore(tmp_path / "tidal.db"),
                            ControllerMetrics())
    controller.enable_slurm_units(SlurmUnits(client=fake, launcher=("tidal-launcher",),
                                             controller_address="127.0.0.1:1", output_template=str(tmp_path / "units"),
                                             secrets_dir=tmp_path))
    fake.fail_next("check", SlurmCommandFailed(["sbatch", "--test-only"], 1, said + "\n"))
    with pytest.raises((SlurmError, SpecError)) as raised:
        controller.check_with_slurm(_spec(1, "train"), owners.account(os.geteuid()))
    assert isinstance(raised.value, SpecError) is refused, raised.value
    assert said in str(raised.value)
