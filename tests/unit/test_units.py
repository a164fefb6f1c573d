"""Units as Slurm jobs: how many to submit on one cluster view, and the batch script."""

from __future__ import annotations

from pathlib import Path

from tidal.controller.units import idle_nodes_for, unit_submission, units_to_submit
from tidal.proto import admin_pb2
from tidal.slurm.models import Node, NodeFlag, NodeState


def node(name: str, state: NodeState = NodeState.IDLE, partitions: tuple[str, ...] = ("train",),
         flags: frozenset[NodeFlag] = frozenset()) -> Node:
    return Node(name=name, state=state, flags=flags, partitions=partitions, cpus=2, gres=(), features=(),
                reason="")


SPEC = admin_pb2.JobSpec(min_replicas=2, max_replicas=4, partition="train", nodes_per_replica=1)


def test_below_min_submits_the_difference_whatever_is_idle() -> None:
    demand = units_to_submit(SPEC, alive=0, idle_nodes=0, now=10.0, last_change_at=None, scale_up_snooze_s=0)
    assert (demand.count, demand.reason) == (2, "0 of min 2 replicas")


def test_growth_takes_idle_nodes_up_to_max_and_respects_the_snooze() -> None:
    grow = units_to_submit(SPEC, alive=2, idle_nodes=5, now=10.0, last_change_at=None, scale_up_snooze_s=0)
    assert grow.count == 2 and "toward max_replicas 4" in grow.reason
    assert units_to_submit(SPEC, alive=2, idle_nodes=1, now=10.0, last_change_at=None, scale_up_snooze_s=0).count == 1
    assert units_to_submit(SPEC, alive=4, idle_nodes=3, now=10.0, last_change_at=None,
                           scale_up_snooze_s=0).reason == "at max_replicas 4"
    assert units_to_submit(SPEC, alive=2, idle_nodes=0, now=10.0, last_change_at=None,
                           scale_up_snooze_s=0).reason == "no idle node fits"
    snoozed = units_to_submit(SPEC, alive=2, idle_nodes=3, now=10.0, last_change_at=8.0, scale_up_snooze_s=5.0)
    assert snoozed.count == 0 and snoozed.reason == "scale-up snoozed for 3.0 s"
    waiting = units_to_submit(SPEC, alive=2, idle_nodes=3, now=10.0, last_change_at=None, scale_up_snooze_s=0,
                              others_waiting=1)
    assert waiting.count == 0 and waiting.reason == "1 other Slurm job(s) wait for nodes"
    assert units_to_submit(SPEC, alive=1, idle_nodes=0, now=10.0, last_change_at=None, scale_up_snooze_s=0,
                           others_waiting=3).count == 1, "a replacement below min is never held back"
    two_node = admin_pb2.JobSpec(min_replicas=1, max_replicas=4, nodes_per_replica=2)
    assert units_to_submit(two_node, alive=1, idle_nodes=5, now=0, last_change_at=None, scale_up_snooze_s=0).count == 2


def test_only_idle_usable_nodes_of_the_jobs_partition_count() -> None:
    nodes = [node("n1"), node("n2", NodeState.ALLOCATED), node("n3", flags=frozenset({NodeFlag.DRAIN})),
             node("n4", partitions=("urgent",)), node("n5", partitions=("train", "urgent"))]
    assert idle_nodes_for(SPEC, nodes) == ["n1", "n5"]
    assert idle_nodes_for(admin_pb2.JobSpec(), nodes) == ["n1", "n4", "n5"]


def test_a_units_batch_script_starts_the_launcher_and_carries_no_secret(tmp_path: Path) -> None:
    spec = admin_pb2.JobSpec(partition="train", working_dir="/work", sbatch_options=["--time=10:00", "-A", "ml"])
    submission = unit_submission(spec, job_id="lm-1a2b3c", unit_id="u7", launcher=("/venv/bin/python", "-m",
                                 "tidal.launcher.agent"), controller="ctl:7420",
                                 secret_path=tmp_path / "lm-1a2b3c.secret", output_dir=tmp_path)
    assert submission.script.splitlines()[-1] == ("exec /venv/bin/python -m tidal.launcher.agent --controller "
                                                  "ctl:7420 --job lm-1a2b3c --unit u7")
    assert "secret" not in submission.script.lower().replace("lm-1a2b3c.secret", "")
    assert submission.environment == {"TIDAL_SECRET_FILE": str(tmp_path / "lm-1a2b3c.secret")}
    assert submission.name == "tidal-lm-1a2b3c-u7" and submission.exclusive and not submission.requeue
    assert submission.extra_options == ("--time=10:00", "-A", "ml") and submission.partition == "train"
