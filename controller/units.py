"""Units as Slurm jobs: what to submit (a pure decision on one cluster view) and how a
unit's batch script reads.

A unit is one data-parallel replica: one Slurm batch job whose script starts a
tidal-launcher. Slurm cannot grow a running job, so the controller grows an elastic job
by submitting units, and keeps at least `min_replicas` by submitting replacements."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tidal.controller.core.planning import allowed_sizes
from tidal.controller.submission import sbatch_value
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm.models import Gres, Job, JobState, Node, NodeFlag, Partition, UnitOwner, UnitSubmission
from tidal.slurm.snapshot import ClusterView

# Slurm's pending reasons that mean "waits for nodes" (not a dependency, a hold, a limit).
WAITING_FOR_NODES = frozenset({"Resources", "Priority"})
UNIT_COMMENT_PREFIX = "tidal job="


@dataclasses.dataclass(frozen=True)
class UnitDemand:
    count: int
    reason: str
    # Submitted ahead of any free node, to wait in Slurm's queue (`units_to_queue`).
    queued_ahead: bool = False


@dataclasses.dataclass(frozen=True)
class NodeNeeds:
    """What one node must offer a unit of the job, read from the job's sbatch options:
    `--constraint`/`-C` (node features: names joined by `&` and `|`, with parentheses) and
    `--gres`/`--gpus-per-node` (counts per GRES name, and type where given). A constraint
    in syntax Tidal does not evaluate (counts `*N`, brackets) is left to Slurm: every node
    passes it, and the unit waits in Slurm's queue if none really fits.

    Account and QOS are not properties of a node: `sbatch --test-only` checks them when the
    job is submitted (`SlurmClient.check`), and Slurm enforces them on every unit."""

    constraint: str | None = None
    gres: tuple[Gres, ...] = ()

    def fits(self, node: Node) -> bool:
        return self._constraint_holds(set(node.features)) and all(
            sum(g.count for g in node.gres if g.name == need.name and (need.type is None or g.type == need.type))
            >= need.count for need in self.gres)

    def _constraint_holds(self, features: set[str]) -> bool:
        if not self.constraint or any(c in self.constraint for c in "*[]"):
            return True
        tokens = [t for t in re.split(r"([&|()])", self.constraint.replace(" ", "")) if t]
        position = 0

        def either() -> bool:  # a | b | …  (`&` binds tighter)
            nonlocal position
            value = both()
            while position < len(tokens) and tokens[position] == "|":
                position += 1
                value = both() | value
            return value

        def both() -> bool:
            nonlocal position
            value = term()
            while position < len(tokens) and tokens[position] == "&":
                position += 1
                value = term() & value
            return value

        def term() -> bool:
            nonlocal position
            if position >= len(tokens):
                raise ValueError("constraint ends early")
            token = tokens[position]
            position += 1
            if token == "(":
                value = either()
                if position >= len(tokens) or tokens[position] != ")":
                    raise ValueError("unbalanced parentheses")
                position += 1
                return value
            if token in "&|)":
                raise ValueError(f"unexpected {token!r}")
            return token in features

        try:
            result = either()
        except ValueError:
            return True  # Slurm refuses a malformed constraint itself (at submit, by --test-only)
        return result if position == len(tokens) else True


def node_needs(spec: admin_pb2.JobSpec) -> NodeNeeds:
    """The node requirements in `spec.sbatch_options` (the last value of each option wins,
    as in sbatch)."""
    options = list(spec.sbatch_options)
    values = {name: sbatch_value(options, short, name) or "" for short, name in
              (("-C", "constraint"), (None, "gres"), (None, "gpus-per-node"))}
    items = values["gres"].split(",") + ([f"gpu:{values['gpus-per-node']}"] if values["gpus-per-node"] else [])
    gres = tuple(parsed for parsed in map(_gres, items) if parsed is not None)
    return NodeNeeds(constraint=values["constraint"] or None, gres=gres)


def _gres(item: str) -> Gres | None:
    """`gpu`, `gpu:2`, `gpu:a100:2` (or `gres/gpu:…`) as a Gres; None for what is not one."""
    parts = item.strip().removeprefix("gres/").split(":")
    if not parts[0] or parts[0] == "none":
        return None
    count = 1
    if parts[-1].isdigit() and len(parts) > 1:
        count = int(parts.pop())
    return Gres(name=parts[0], type=parts[1] if len(parts) > 1 else None, count=count)


def gpu_shortfall(spec: admin_pb2.JobSpec, partitions: Sequence[Partition], nodes: Sequence[Node]) -> str | None:
    """Why the job's units cannot give each of their `procs_per_node` workers a GPU of its
    own (None: they can, or the job's partition has no GPU node: a CPU job, not checked).
    The partition is the job's (`partition`, or `-p`/`--partition` among its sbatch
    options), else the cluster's default; None too when there is neither.

    One worker per GPU because an NCCL communicator holds one rank per GPU (two ranks on
    one GPU is unsupported and may hang; `tidal.train.backend.worker_device` gives worker
    LOCAL_RANK the LOCAL_RANK-th GPU of its unit): a unit needs a node with at least
    `procs_per_node` GPUs (gres `gpu`), and, when the job asks for GPUs
    (`--gres=gpu:N`, `--gpus-per-node=N`), N of them."""
    name = spec.partition or sbatch_value(list(spec.sbatch_options), "-p", "partition") or next(
        (p.name for p in partitions if p.is_default), "")
    if not name:
        return None
    members = {n for p in partitions if p.name == name for n in p.nodes}
    gpus = sorted({n.gres_count("gpu") for n in nodes if n.name in members or name in n.partitions})
    most = max(gpus, default=0)
    if most == 0:
        return None
    procs = spec.procs_per_node or 1
    per_node = " or ".join(map(str, gpus))
    if procs > most:
        return (f"procs_per_node: {procs} workers per node need a GPU each, but the nodes of partition {name!r} have "
                f"{per_node} GPUs (gres gpu): run at most {most} workers per node")
    asked = sum(g.count for g in node_needs(spec).gres if g.name == "gpu")
    if asked and procs > asked:
        return (f"procs_per_node: {procs} workers per node need a GPU each, but the job's units ask for {asked} "
                f"GPUs per node (--gres/--gpus-per-node) on partition {name!r}, whose nodes have {per_node}: ask for "
                f"{procs}, or run at most {asked} workers per node")
    return None


def idle_nodes_for(spec: admin_pb2.JobSpec, nodes: Sequence[Node], excluded: frozenset[str] = frozenset()) -> list[str]:
    """Idle, usable nodes in the job's partition (any partition when it names none) that
    offer what the job's sbatch options ask of a node (features, GRES)."""
    needs = node_needs(spec)
    return sorted(n.name for n in nodes if n.is_idle_and_usable and n.name not in excluded
                  and (not spec.partition or spec.partition in n.partitions) and needs.fits(n))


def partition_nodes(spec: admin_pb2.JobSpec, nodes: Sequence[Node]) -> frozenset[str]:
    """Every node of the job's partition (any partition when it names none), idle or not."""
    return frozenset(n.name for n in nodes if not spec.partition or spec.partition in n.partitions)


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


def releasing(view: ClusterView, yielded: Mapping[int, Iterable[int]]) -> dict[int, int]:
    """For each waiting Slurm job, how many of the units that yielded to it still hold
    their node. A unit's node counts until it is idle or another job runs on it: its Slurm
    job may have ended while the node still shows COMPLETING, or still shows allocated (a
    poll's sinfo taken before its squeue), neither idle nor released; counting it as gone
    then made one unit too many yield."""
    settled = {n.name for n in view.nodes if n.is_idle_and_usable and NodeFlag.COMPLETING not in n.flags}
    taken = {node for j in view.jobs if j.state is JobState.RUNNING for node in j.nodes}

    def holds(job: Job) -> bool:
        nodes = set(job.nodes)
        return not job.state.is_finished or bool(nodes - settled - taken)

    return {waiting: sum(1 for slurm_job_id in held if (j := view.job(slurm_job_id)) is not None and holds(j))
            for waiting, held in yielded.items()}


def unit_nodes(spec: admin_pb2.JobSpec) -> int:
    """The nodes of one unit (one Slurm job): a replica's K in restart mode (one job of K
    nodes); 1 in live mode, where a replica of K nodes is K one-node units grouped by the
    controller (`core.replicas`)."""
    if spec.mode == common_pb2.JOB_MODE_LIVE:
        return 1
    return max(1, spec.nodes_per_replica)


def units_to_submit(spec: admin_pb2.JobSpec, *, alive: int, idle_nodes: int, now: float,
                    last_change_at: float | None, scale_up_snooze_s: float, others_waiting: int = 0,
                    released: bool = False, holes: int = 0, allowance: int | None = None,
                    words: SizeWords | None = None) -> UnitDemand:
    """How many units to submit now, and why. `alive` counts units that hold or are
    waiting for a place (submitted, joining, active); `idle_nodes` the idle nodes that fit;
    `allowance` (None: no bound) the idle nodes the job may grow onto when other elastic
    jobs share them by weight (`sharing.share_idle_nodes`): growth stops at the largest
    allowed size within it, never below min_replicas.

    - below min_replicas: submit the difference (replacements), whatever is idle: Slurm
      queues them; or more, where growth as below takes more (a new job starts on every
      idle node it may take, not at min to grow onto them a poll later); but a job that
      gave its nodes back below min (`released`) waits until enough nodes to reach
      min_replicas are idle, then grows as below;
    - otherwise grow onto idle nodes, up to max_replicas, one unit per node
      (`nodes_per_replica` nodes each), unless a world change was recent (snooze) or other
      Slurm jobs wait for nodes (`others_waiting`): an elastic job takes what nobody else
      wants, or it would be preempted again at once.

    Live mode with replicas of K > 1 nodes: units are one node each and every count is in
    nodes (sizes in whole replicas of K); a replica that lost a node (`holes`: nodes missing
    from incomplete replicas, less those already submitted) gets its replacement as soon as a
    node is idle, before any growth and whatever other jobs wait: its other nodes wait for it."""
    nodes = max(1, spec.nodes_per_replica) if spec.mode == common_pb2.JOB_MODE_LIVE else 1
    if nodes > 1:
        if holes > 0:
            # As soon as a node is free: a request queued now would carry today's exclusions
            # (the lost node cools down) for good, and could wait for ever on a small cluster.
            if idle_nodes <= 0:
                return UnitDemand(0, f"{holes} node(s) missing from replicas of {nodes} nodes: waiting for an idle "
                                     "node")
            count = min(holes, idle_nodes)
            return UnitDemand(count, f"{count} node(s) to take the place of lost ones in replicas of {nodes} nodes")
        in_nodes = admin_pb2.JobSpec()
        in_nodes.CopyFrom(spec)
        in_nodes.min_replicas, in_nodes.max_replicas = spec.min_replicas * nodes, spec.max_replicas * nodes
        in_nodes.replica_step = max(1, spec.replica_step) * nodes
        del in_nodes.allowed_replicas[:]
        in_nodes.allowed_replicas.extend(n * nodes for n in spec.allowed_replicas)
        # One node a unit: counted in nodes, the same rules apply.
        in_nodes.nodes_per_replica = 1
        demand = units_to_submit(in_nodes, alive=alive, idle_nodes=idle_nodes, now=now, last_change_at=last_change_at,
                                 scale_up_snooze_s=scale_up_snooze_s, others_waiting=others_waiting,
                                 released=released, allowance=allowance, words=SizeWords(spec, nodes))
        return UnitDemand(demand.count, f"{demand.reason}; replicas of {nodes} nodes")
    words = words or SizeWords(spec)
    fits = idle_nodes // max(1, spec.nodes_per_replica)
    growth = growth_onto_idle_nodes(spec, alive=alive, fits=fits, idle_nodes=idle_nodes, now=now,
                                    last_change_at=last_change_at, scale_up_snooze_s=scale_up_snooze_s,
                                    others_waiting=others_waiting, allowance=allowance, words=words)
    if alive < spec.min_replicas:
        needed = spec.min_replicas - alive
        if not released:
            # The difference whatever is idle; more at once where idle nodes take them (a
            # job starts at the size the cluster allows, rather than growing onto them later).
            if growth.count > needed:
                return UnitDemand(growth.count, f"{words.of_min(alive)}; {growth.reason}")
            return UnitDemand(needed, words.of_min(alive))
        if fits < needed:
            return UnitDemand(0, f"nodes given back {words.below_min()}: waiting for {needed} idle node(s) "
                                 f"({fits} fit)")
    return growth


@dataclasses.dataclass(frozen=True)
class SizeWords:
    """How a reason names the job's sizes, in the user's words: in replicas; or, for live
    replicas of `nodes` > 1 nodes (decided node by node, `units_to_submit`), in nodes, with
    the spec's min/max replicas and the nodes they make."""

    spec: admin_pb2.JobSpec
    nodes: int = 1

    def count(self, n: int) -> str:
        return f"{n} {'replicas' if self.nodes == 1 else 'nodes'}"

    def of_min(self, alive: int) -> str:
        if self.nodes == 1:
            return f"{alive} of min {self.spec.min_replicas} replicas"
        return f"{alive} of {self.spec.min_replicas * self.nodes} nodes (min_replicas {self.spec.min_replicas})"

    def below_min(self) -> str:
        if self.nodes == 1:
            return f"below min_replicas {self.spec.min_replicas}"
        return f"below min_replicas {self.spec.min_replicas} ({self.spec.min_replicas * self.nodes} nodes)"

    def max(self) -> str:
        if self.nodes == 1:
            return f"max_replicas {self.spec.max_replicas}"
        return f"max_replicas {self.spec.max_replicas} ({self.spec.max_replicas * self.nodes} nodes)"


def growth_onto_idle_nodes(spec: admin_pb2.JobSpec, *, alive: int, fits: int, idle_nodes: int, now: float,
                           last_change_at: float | None, scale_up_snooze_s: float,
                           others_waiting: int, allowance: int | None = None,
                           words: SizeWords | None = None) -> UnitDemand:
    """Units onto idle nodes (`fits` replicas' worth, at most `allowance` when shared)
    up to max_replicas, to a size the job allows; none while other Slurm jobs wait for
    nodes or within the snooze. `words`: how the reason names sizes (default: in the
    spec's replicas)."""
    words = words or SizeWords(spec)
    room = spec.max_replicas - alive
    if room <= 0:
        return UnitDemand(0, f"at {words.max()}")
    if fits <= 0:
        return UnitDemand(0, "no idle node fits")
    if others_waiting:
        return UnitDemand(0, f"{others_waiting} other Slurm job(s) wait for nodes")
    if last_change_at is not None and now < last_change_at + scale_up_snooze_s:
        return UnitDemand(0, f"scale-up snoozed for {last_change_at + scale_up_snooze_s - now:.1f} s")
    # Grow only to a world size the job allows (replica_step, allowed_replicas): a unit that
    # could not join would hold a node for nothing.
    sizes = allowed_sizes(spec.min_replicas, spec.max_replicas, spec.replica_step, spec.allowed_replicas)
    bound = min(room, fits) if allowance is None else min(room, fits, allowance)
    reachable = [n for n in sizes if alive < n <= alive + bound]
    if not reachable:
        following = next((n for n in sizes if n > alive), None)
        return UnitDemand(0, f"{idle_nodes} idle node(s) fit, too few for the next allowed size "
                             f"{words.count(following)}"
                          if following is not None else f"no allowed size above {words.count(alive)}")
    count = max(reachable) - alive
    return UnitDemand(count, f"{idle_nodes} idle node(s) fit; growing toward {words.max()}")


def units_to_queue(spec: admin_pb2.JobSpec, *, alive: int, pending: int, idle_nodes: int, others_waiting: int,
                   released: bool, queued_units: int, next_in_line: bool = True) -> UnitDemand:
    """How many units to queue in Slurm ahead of a free node (`queued_units`), and why:
    live mode with one-node replicas, at or above min_replicas (below it replacements are
    queued anyway) and below max_replicas, no idle node to grow onto, no other Slurm job
    waiting for the job's nodes, no other elastic job next in line for them by weight
    (`sharing.next_in_line`), `pending` (units Slurm has not started) short of
    `queued_units`, and a world one unit larger allowed."""
    if queued_units <= 0 or spec.mode != common_pb2.JOB_MODE_LIVE or max(1, spec.nodes_per_replica) > 1:
        return UnitDemand(0, "no units queued ahead (queued_units 0, or not live mode with one-node replicas)")
    if released or alive < spec.min_replicas or alive >= spec.max_replicas or idle_nodes > 0 or others_waiting:
        return UnitDemand(0, "no unit to queue ahead now")
    if not next_in_line:
        return UnitDemand(0, "another elastic job is next in line for a node by weight")
    sizes = allowed_sizes(spec.min_replicas, spec.max_replicas, spec.replica_step, spec.allowed_replicas)
    count = 0
    while (count < queued_units - pending and alive + count < spec.max_replicas
           and alive + count + 1 in sizes):
        count += 1
    return UnitDemand(count, f"queued in Slurm for the next free node ({pending + count} of queued_units "
                             f"{queued_units}; {alive} of max_replicas {spec.max_replicas})", queued_ahead=True)


def unit_script(launcher: Sequence[str], *, controller: str, job_id: str, unit_id: str, nodes: int = 1) -> str:
    """The unit's batch script: the launcher, nothing else; the job's secret reaches it
    through the environment (a file path), never the script or argv.

    A unit spanning `nodes` > 1 nodes runs one launcher per node with srun (the one on the
    job's first node, where this script runs, leads the unit; `launcher.nodes`). srun does
    not kill the other launchers when one fails (`--kill-on-bad-exit=0`): the leader must
    live to report a lost node, and a follower that loses its leader exits by itself;
    `--wait` ends the step should one launcher outlive the others by a minute."""
    command = [*launcher, "--controller", controller, "--job", job_id, "--unit", unit_id]
    if nodes <= 1:
        return "\n".join([
            "#!/bin/bash",
            f"# Tidal unit {unit_id} of elastic job {job_id}: one data-parallel replica.",
            f"exec {shlex.join(command)}",
            "",
        ])
    step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            "--wait=60"]
    return "\n".join([
        "#!/bin/bash",
        f"# Tidal unit {unit_id} of elastic job {job_id}: one data-parallel replica over {nodes} nodes,",
        "# one launcher per node; the first node's leads the unit.",
        f"exec {shlex.join([*step, *command, '--unit-nodes', str(nodes)])}",
        "",
    ])


def unit_job_name(job_id: str, unit_id: str) -> str:
    """The name of a unit's Slurm job (what squeue shows of it)."""
    return f"tidal-{job_id}-{unit_id}"


def unit_submission(spec: admin_pb2.JobSpec, *, job_id: str, unit_id: str, launcher: Sequence[str], controller: str,
                    secret_path: Path, output_dir: Path, exclude: Sequence[str] = (),
                    owner: UnitOwner | None = None) -> UnitSubmission:
    return UnitSubmission(
        name=unit_job_name(job_id, unit_id), script=unit_script(launcher, controller=controller, job_id=job_id,
                                                             unit_id=unit_id, nodes=unit_nodes(spec)),
        partition=spec.partition, nodes=unit_nodes(spec), exclusive=True,
        working_dir=spec.working_dir, output=str(output_dir / f"{job_id}-{unit_id}-%j.out"),
        comment=f"tidal job={job_id} unit={unit_id}", requeue=False, exclude_nodes=tuple(exclude),
        extra_options=tuple(spec.sbatch_options), environment={"TIDAL_SECRET_FILE": str(secret_path)}, owner=owner)
