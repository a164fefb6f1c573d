"""Units as Slurm jobs: what to submit (a pure decision on one cluster view) and how a
unit's batch script reads.

A unit is one data-parallel replica: one Slurm batch job whose script starts a
tidal-launcher. Slurm cannot grow a running job, so the controller grows an elastic job
by submitting units, and keeps at least `min_replicas` by submitting replacements."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path

from tidal.proto import admin_pb2
from tidal.slurm.models import Job, JobState, Node, UnitSubmission
from tidal.slurm.snapshot import ClusterView

# Slurm's pending reasons that mean "waits for nodes" (not a dependency, a hold, a limit).
WAITING_FOR_NODES = frozenset({"Resources", "Priority"})
UNIT_COMMENT_PREFIX = "tidal job="


@dataclasses.dataclass(frozen=True)
class UnitDemand:
    count: int
    reason: str


def idle_nodes_for(spec: admin_pb2.JobSpec, nodes: Sequence[Node], excluded: frozenset[str] = frozenset()) -> list[str]:
    """Idle, usable nodes in the job's partition (any partition when it names none)."""
    return sorted(n.name for n in nodes if n.is_idle_and_usable and n.name not in excluded
                  and (not spec.partition or spec.partition in n.partitions))


def is_tidal_unit(job: Job, job_id: str | None = None) -> bool:
    """Whether a Slurm job is a Tidal unit (of `job_id`, when given): by the comment Tidal
    sets, or the name where the comment is not shown."""
    if job.comment.startswith(UNIT_COMMENT_PREFIX):
        return job_id is None or job.comment.split()[1] == f"job={job_id}"
    return job.name.startswith(f"tidal-{job_id}-" if job_id else "tidal-")


def waiting_for_nodes(view: ClusterView) -> list[Job]:
    """Pending Slurm jobs that wait for nodes, Tidal's own units excluded."""
    return [j for j in view.jobs if j.state is JobState.PENDING and j.reason in WAITING_FOR_NODES
            and not is_tidal_unit(j)]


def others_waiting_for(view: ClusterView, job_id: str, nodes: frozenset[str]) -> list[Job]:
    """Slurm jobs other than `job_id`'s units that wait for any of `nodes` (any pending
    job, when Slurm's partitions are not known yet). Other Tidal jobs' pending units count:
    a replacement keeping another job at its minimum comes before growth."""
    pending = [j for j in view.jobs if j.state is JobState.PENDING and j.reason in WAITING_FOR_NODES
               and not is_tidal_unit(j, job_id)]
    if not view.partitions:
        return pending
    return [j for j in pending if view.partition_nodes(j.partition) & nodes]


def units_to_submit(spec: admin_pb2.JobSpec, *, alive: int, idle_nodes: int, now: float,
                    last_change_at: float | None, scale_up_snooze_s: float, others_waiting: int = 0) -> UnitDemand:
    """How many units to submit now, and why. `alive` counts units that hold or are
    waiting for a place (submitted, joining, active); `idle_nodes` the idle nodes that fit.

    - below min_replicas: submit the difference (replacements), whatever is idle: Slurm
      queues them;
    - otherwise grow onto idle nodes, up to max_replicas, one unit per node
      (`nodes_per_replica` nodes each), unless a world change was recent (snooze) or other
      Slurm jobs wait for nodes (`others_waiting`): an elastic job takes what nobody else
      wants, or it would be preempted again at once."""
    if alive < spec.min_replicas:
        return UnitDemand(spec.min_replicas - alive, f"{alive} of min {spec.min_replicas} replicas")
    room = spec.max_replicas - alive
    fits = idle_nodes // max(1, spec.nodes_per_replica)
    if room <= 0:
        return UnitDemand(0, f"at max_replicas {spec.max_replicas}")
    if fits <= 0:
        return UnitDemand(0, "no idle node fits")
    if others_waiting:
        return UnitDemand(0, f"{others_waiting} other Slurm job(s) wait for nodes")
    if last_change_at is not None and now < last_change_at + scale_up_snooze_s:
        return UnitDemand(0, f"scale-up snoozed for {last_change_at + scale_up_snooze_s - now:.1f} s")
    count = min(room, fits)
    return UnitDemand(count, f"{idle_nodes} idle node(s) fit; growing toward max_replicas {spec.max_replicas}")


def unit_script(launcher: Sequence[str], *, controller: str, job_id: str, unit_id: str) -> str:
    """The unit's batch script: the launcher, nothing else; the job's secret reaches it
    through the environment (a file path), never the script or argv."""
    command = [*launcher, "--controller", controller, "--job", job_id, "--unit", unit_id]
    return "\n".join([
        "#!/bin/bash",
        f"# Tidal unit {unit_id} of elastic job {job_id}: one data-parallel replica.",
        f"exec {shlex.join(command)}",
        "",
    ])


def unit_submission(spec: admin_pb2.JobSpec, *, job_id: str, unit_id: str, launcher: Sequence[str], controller: str,
                    secret_path: Path, output_dir: Path, exclude: Sequence[str] = ()) -> UnitSubmission:
    return UnitSubmission(
        name=f"tidal-{job_id}-{unit_id}", script=unit_script(launcher, controller=controller, job_id=job_id,
                                                             unit_id=unit_id),
        partition=spec.partition, nodes=max(1, spec.nodes_per_replica), exclusive=True,
        working_dir=spec.working_dir, output=str(output_dir / f"{job_id}-{unit_id}-%j.out"),
        comment=f"tidal job={job_id} unit={unit_id}", requeue=False, exclude_nodes=tuple(exclude),
        extra_options=tuple(spec.sbatch_options), environment={"TIDAL_SECRET_FILE": str(secret_path)})
