"""K-node replicas on a busy cluster: bench.cluster_sim's comparison of what a lost node
costs when a replica spans K nodes (HSDP: K nodes × 8 GPUs shard the model, replicas
all-reduce across), on a cluster where free nodes are scarce.

The three policies, played against the same seeded trace (failures at Llama 3's rate, other
jobs, repairs: bench.cluster_sim's `make_trace`):

- **One free node patches a lost node** (Tidal's new design: each node its own one-node
  Slurm job, grouped into replicas by the controller). A lost node takes its replica out of
  the world; the other replicas go on at once (they lose the step in flight and the
  measured recovery pause, as Tidal at K = 1). The replica's K−1 healthy nodes keep their
  processes and shards and wait, held but not training, while the job asks Slurm for one
  node. Once it runs, it starts (the measured grow time) and receives the lost node's
  shards from a live peer replica (a 1/K share of the replica's state), and the replica
  rejoins at a step boundary (every member pauses for the measured world change). If no
  node came within `replica_patch_wait_s` (default REPLICA_PATCH_WAIT_S), the healthy
  nodes are released (the job keeps its other replicas) and the replica comes back as in
  the next policy: on K nodes at once.
- **K free nodes at once** (today's design, and torchft's: a replica is one K-node Slurm
  job). A lost node ends its replica's job: the K−1 healthy nodes go back to Slurm, and
  the replica returns only when Slurm starts a new K-node job (all-or-nothing). Each of its
  nodes starts and receives its shard from a live peer in parallel: the same per-node time
  as a patch. Every other cost is the first policy's, so the two differ only in what Slurm
  must find: one node or K at once.
- **Checkpoint-restart in place** (the floor): a static job of the same R × K nodes that
  checkpoints every Young-optimal τ (bench.cluster_sim's figures); a failure loses the work
  since the last checkpoint, the job keeps its healthy nodes (held, idle) and asks for one
  node per lost node, then restarts from its checkpoint (RESTART_AT_SCALE_S). Kept
  allocations are the kind assumption: requeued whole, it would need every node at once.

The busy cluster (bench.cluster_sim's `Load` with `busy`): no idle spares; every node the
training job does not hold runs other jobs, from a queue that never empties (sizes uniform
1..BUSY_JOB_MAX_NODES, exponential run times of mean BUSY_JOB_MEAN_H, independent): a node
no training request claims is backfilled at once by the first queued job that fits. Slurm
starts the training job's requests first when they fit, all-or-nothing. Three variants
bracket what Slurm does for a K-node request:

- "busy": Slurm reserves free nodes for the training job's pending request (backfill's
  reservation for the top-priority job), but the K−1 healthy nodes a lost replica gives
  back reach other jobs first (its replacement is pending only after they are freed: Slurm
  holds a requeued job for the old job's credential lifetime, cred_expire, 120 s by default,
  and a new unit is submitted after detection). K at once waits for K nodes to free, one
  by one.
- "busy-no-reservation": no reservation; other jobs backfill onto every free node a
  K-node request cannot use yet, so it starts only when K nodes free together (the
  harsh bound: on a cluster of small jobs that almost never happens).
- "busy-requeue-keeps-nodes": as "busy", and the K−1 nodes are held for the replacement at
  once (the kind bound: K at once waits for one node, like patching).

Failed nodes are down for repair (exponential, mean REPAIR_MEAN_H) and return to Slurm.

Measured vs assumed. Measured here (bench/results/*.json, bench.cluster_sim's
`measured_costs`): the recovery pause per failure kind, a grow (node freed → first step
with its replica: a new node's start), a world change at a step boundary, and the state
transfer rate (bench.transfer: 4 GiB from a live peer, gloo over loopback). Assumed:
NODE_SHARD_GB, a node's shard of the replica's state (parameters and optimizer moments,
about half of 8 × 80 GB; the state a patch streams, and each node of a new replica);
streamed at the measured loopback rate (NCCL over InfiniBand moves it faster, for both
policies alike); the busy cluster's other work and Slurm's order above; the step time,
failure mix, repair, checkpoint write and restart of bench.cluster_sim. The controller's
functions that would decide patching do not exist yet: this module applies the policies
itself (the failure detection of a hung node is `health.health_verdicts`, as in
bench.cluster_sim).

Measures (bench.cluster_sim's): ETTR = time the job trains (at any number of replicas)
and keeps, over wall time; goodput = useful node-seconds (nodes in the world × kept
training time) / node-seconds the job held (healthy nodes of an incomplete replica and a
patch node that is starting count as held, not training); work = useful node-seconds /
those of the R × K-node job that never fails (ETTR weighted by the share of replicas in
the world)."""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Sequence
from typing import Any

from bench.cluster_sim import (
    BUSY_JOB_MAX_NODES,
    BUSY_JOB_MEAN_H,
    RESTART_AT_SCALE_S,
    STEP_S,
    Cluster,
    Costs,
    Fault,
    Load,
    Outcome,
    Trace,
    hang_detected_after,
    kept_training_s,
    make_trace,
    young_interval_s,
)
from bench.common import Row
from tidal.controller.config import ControllerConfig

# How long a replica's healthy nodes wait for one free node before they are released: the
# controller's default (1,800 s; the figures in bench/results were taken at 600 s).
REPLICA_PATCH_WAIT_S = float(getattr(ControllerConfig(), "replica_patch_wait_s", 600.0))
NODE_SHARD_GB = 320.0  # ASSUMED: a node's shard of the replica's training state


class Phase(enum.Enum):
    """A replica's life. TRAINING: in the world. WAITING: incomplete, its healthy nodes held
    while one-node requests are pending (patching). JOINING: complete again, its new nodes
    starting and receiving their shards. ABSENT: no nodes; a K-node request is pending."""

    TRAINING = "training"
    WAITING = "waiting"
    JOINING = "joining"
    ABSENT = "absent"


@dataclasses.dataclass
class Replica:
    """One replica of K nodes: one record, one phase (its nodes, its pending requests)."""

    index: int
    nodes: set[int]
    phase: Phase = Phase.TRAINING
    requests: set[int] = dataclasses.field(default_factory=set)
    # Bumped when a wait or a join starts: a timer or a join of an earlier one is stale.
    episode: int = 0
    out_since: float = 0.0


def join_s(costs: Costs) -> float:
    """A new node's start (the measured grow) and its shard streamed from a live peer (the
    measured rate): a patch's, and every node's of a replica that comes back whole (in
    parallel)."""
    return costs.grow_s + NODE_SHARD_GB / costs.transfer_gb_s


class KNodeReplicas(Cluster):
    """The training job as R replicas of K nodes; `patch`: a lost node is replaced by one
    free node (the healthy ones wait up to `patch_wait_s`), else its replica comes back only
    on K free nodes at once (see the module's docstring)."""

    def __init__(self, load: Load, trace: Trace, costs: Costs, *, patch: bool, patch_wait_s: float,
                 name: str) -> None:
        super().__init__(load, trace)
        self.name = name
        self.costs = costs
        self.patch = patch
        self.patch_wait_s = patch_wait_s
        self.config = ControllerConfig()
        self.k = load.nodes_per_replica
        self.minimum = max(1, load.replicas // 2)
        nodes = self.take_idle(load.home)
        self.replicas = [Replica(i, set(nodes[i * self.k:(i + 1) * self.k])) for i in range(load.replicas)]
        self.replica_of = {node: r.index for r in self.replicas for node in r.nodes}
        self.request_for: dict[int, int] = {}
        self.generation_started_at = 0.0
        self.out_s: list[float] = []
        self.released = 0

    def held(self) -> int:
        return len(self.replica_of)

    def world(self) -> int:
        training = sum(1 for r in self.replicas if r.phase is Phase.TRAINING)
        return training * self.k if training >= self.minimum else 0

    def run(self) -> Outcome:
        outcome = super().run()
        return dataclasses.replace(outcome, replica_out_s=tuple(self.out_s), released=self.released,
                                   out_at_end=sum(1 for r in self.replicas if r.phase is not Phase.TRAINING))

    # A replica's transitions.

    def lose(self, fault: Fault) -> None:
        replica = self.replicas[self.replica_of.pop(fault.node)]
        replica.nodes.discard(fault.node)
        if replica.phase is Phase.TRAINING:
            before = self.world()
            replica.phase = Phase.ABSENT  # out of the world; `recover` says how it comes back
            replica.out_since = self.now
            if before:
                # Every member drops the step in flight; the survivors re-form (measured pause).
                self.lose_time(before, fault.in_step * STEP_S)
                self.lose_time(self.world(), self.stalled_s(fault))
                self.generation_started_at = self.now
            self.recover(replica, new_episode=True)
        elif replica.phase is Phase.JOINING:
            self.recover(replica, new_episode=True)
        elif replica.phase is Phase.WAITING:
            self.recover(replica, new_episode=False)

    def stalled_s(self, fault: Fault) -> float:
        if fault.how == "node_hang":
            seconds, _ = hang_detected_after(self.config, f"n{fault.node:05d}", self.now, self.generation_started_at)
            return seconds + self.costs.node_lost_s
        return {"worker_crash": self.costs.worker_crash_s, "node_lost": self.costs.node_lost_s,
                "worker_hang": self.costs.worker_hang_s}[fault.how]

    def recover(self, replica: Replica, *, new_episode: bool) -> None:
        """Ask Slurm for what `replica` lacks: one node per lost node while patching (its
        healthy nodes wait, a timer set when a wait starts), else K nodes at once."""
        if new_episode:
            replica.episode += 1
        if not self.patch:
            self.give_up(replica)
            return
        replica.phase = Phase.WAITING
        missing = self.k - len(replica.nodes) - len(replica.requests)
        for _ in range(missing):
            self.ask(replica, 1)
        if new_episode and replica.nodes:
            self.at(self.patch_wait_s, "patch_timeout", (replica.index, replica.episode))

    def give_up(self, replica: Replica) -> None:
        """Release what `replica` holds and wants; ask for K nodes at once (the released
        nodes reach other work first unless `load.requeue_keeps_nodes`)."""
        self.withdraw(replica.requests)
        for request_id in replica.requests:
            del self.request_for[request_id]
        replica.requests.clear()
        for node in replica.nodes:
            del self.replica_of[node]
        self.release(sorted(replica.nodes))
        replica.nodes.clear()
        replica.phase = Phase.ABSENT
        if not self.load.requeue_keeps_nodes:
            self.backfill()
        self.ask(replica, self.k)

    def ask(self, replica: Replica, nodes: int) -> None:
        request_id = self.request(nodes)
        replica.requests.add(request_id)
        self.request_for[request_id] = replica.index

    def granted(self, request_id: int, nodes: list[int]) -> None:
        replica = self.replicas[self.request_for.pop(request_id)]
        replica.requests.discard(request_id)
        replica.nodes.update(nodes)
        self.replica_of.update(dict.fromkeys(nodes, replica.index))
        if not replica.requests:
            replica.phase = Phase.JOINING
            replica.episode += 1
            self.at(join_s(self.costs), "joined", (replica.index, replica.episode))

    def handle_own(self, kind: str, data: Any) -> None:
        index, episode = data
        replica = self.replicas[index]
        if replica.episode != episode:
            return  # a later loss or join superseded it
        match kind:
            case "joined" if replica.phase is Phase.JOINING:
                before = self.world()
                replica.phase = Phase.TRAINING
                self.out_s.append(self.now - replica.out_since)
                if before:
                    # The world re-forms at a step boundary with the replica: every member pauses.
                    self.lose_time(self.world(), self.costs.world_change_s)
                self.generation_started_at = self.now
            case "patch_timeout" if replica.phase is Phase.WAITING:
                self.released += 1
                self.decisions.append(f"replica {index}: no free node in {self.patch_wait_s:g} s; "
                                      f"{len(replica.nodes)} healthy nodes released")
                self.give_up(replica)
            case "joined" | "patch_timeout":
                raise AssertionError(f"{kind} for replica {index} in phase {replica.phase}")
            case _:
                raise ValueError(kind)


class CheckpointRestartInPlace(Cluster):
    """The static R × K-node job that checkpoints every `interval_s` and restarts in its
    allocation: a failure loses the work since the last checkpoint; the healthy nodes are
    held while one free node per lost node is asked for; then it restarts (`restart_s`)."""

    def __init__(self, load: Load, trace: Trace, *, interval_s: float, restart_s: float, name: str) -> None:
        super().__init__(load, trace)
        self.name = name
        self.interval_s = interval_s
        self.restart_s = restart_s
        self.nodes = set(self.take_idle(load.home))
        self.requests: set[int] = set()
        self.running = True
        self.training_from = 0.0  # no restart cost at the very start, as for every policy

    def held(self) -> int:
        return len(self.nodes)

    def world(self) -> int:
        return 0  # accounted per run in `stop`

    def stop(self, *, kept_all: bool) -> None:
        """End the run now: its checkpointed training is kept (all of it with `kept_all`)."""
        trained = max(0.0, self.now - self.training_from)
        kept = kept_training_s(trained, self.interval_s, kept_all=kept_all)
        self.productive_s += kept
        self.useful_node_s += self.load.home * kept
        self.world_node_s += self.load.home * trained
        self.running = False

    def lose(self, fault: Fault) -> None:
        self.nodes.discard(fault.node)
        if self.running:
            self.stop(kept_all=False)
        self.requests.add(self.request(1))

    def granted(self, request_id: int, nodes: list[int]) -> None:
        self.requests.discard(request_id)
        self.nodes.update(nodes)
        if not self.requests:
            self.running = True
            self.training_from = self.now + self.restart_s

    def finish(self) -> None:
        if self.running:
            self.stop(kept_all=True)


WHOLE_NAME = "K free nodes at once bring a replica back (Tidal today, torchft-like)"
SENSITIVITY = 3  # the tables add a patching row whose healthy nodes wait this many times longer


def patch_name(patch_wait_s: float) -> str:
    return f"Tidal, one free node patches a lost node (healthy nodes wait ≤ {patch_wait_s:g} s)"


def policies(load: Load, trace: Trace, costs: Costs, patch_wait_s: float = REPLICA_PATCH_WAIT_S) -> list[Cluster]:
    """One-node patching (with `patch_wait_s`, and with SENSITIVITY times it), K nodes at
    once, and checkpoint-restart in place, on `load` and `trace`."""
    young = young_interval_s(load)
    return [
        KNodeReplicas(load, trace, costs, patch=True, patch_wait_s=patch_wait_s, name=patch_name(patch_wait_s)),
        KNodeReplicas(load, trace, costs, patch=True, patch_wait_s=SENSITIVITY * patch_wait_s,
                      name=patch_name(SENSITIVITY * patch_wait_s)),
        KNodeReplicas(load, trace, costs, patch=False, patch_wait_s=patch_wait_s, name=WHOLE_NAME),
        CheckpointRestartInPlace(load, trace, interval_s=young, restart_s=RESTART_AT_SCALE_S,
                                 name=f"checkpoint-restart in place, Young τ {young / 60:.0f} min, restart "
                                      f"{RESTART_AT_SCALE_S:g} s"),
    ]


def simulate(load: Load, seeds: Sequence[int], costs: Costs,
             patch_wait_s: float = REPLICA_PATCH_WAIT_S) -> dict[str, list[Outcome]]:
    """Every K-node policy against the same trace, per seed."""
    results: dict[str, list[Outcome]] = {}
    for seed in seeds:
        trace = make_trace(load, seed)
        for policy in policies(load, trace, costs, patch_wait_s):
            outcome = policy.run()
            results.setdefault(outcome.policy, []).append(outcome)
    return results


def rows(name: str, load: Load, results: dict[str, list[Outcome]], seeds: Sequence[int]) -> list[Row]:
    """RESULTS.md's rows for one busy scenario and size: one-node patching (the first
    policy) against K nodes at once, in ETTR, work and goodput."""
    patch = next(iter(results.values()))
    whole = results[WHOLE_NAME]
    where = (f"{load.gpus:,} GPUs, K = {load.nodes_per_replica} nodes a replica ({load.replicas} replicas), "
             f"{load.days:g} simulated days, {name}")
    measures = (("ETTR", "ettr", "productive time / wall time"),
                ("work", "work", "useful node-seconds / the full-size job's: ETTR weighted by replicas in the world"),
                ("goodput", "goodput", "useful / held node-seconds; idle healthy nodes count as held"))
    result = []
    for label, key, meaning in measures:
        mine = [getattr(o, key) for o in patch]
        theirs = [getattr(o, key) for o in whole]
        result.append(Row(
            benchmark="cluster_sim", metric=f"{label} at {where}: one free node patches a lost node vs K at once",
            unit="fraction", tidal=statistics.median(mine), baseline=statistics.median(theirs),
            baseline_name=WHOLE_NAME, goal="reported", met=True, tidal_samples=mine, baseline_samples=theirs,
            ratio=statistics.median(mine) / statistics.median(theirs), ratio_meaning=f"patching / K at once {label}",
            note=f"{len(seeds)} seeds; {meaning}; the full table below"))
    return result


def assumptions(patch_wait_s: float) -> dict[str, Any]:
    return {"replica_patch_wait_s": patch_wait_s, "node_shard_gb": NODE_SHARD_GB,
            "busy_job_nodes": f"uniform 1..{BUSY_JOB_MAX_NODES}", "busy_job_mean_h": BUSY_JOB_MEAN_H,
            "busy_queue": "never empties: other jobs backfill every node the training job does not claim",
            "join": "measured grow_s + node_shard_gb / measured transfer_gb_s per node (a new replica's in parallel)",
            "priority": "the training job's requests start first when they fit; busy: free nodes held for them, "
                        "but nodes it gives back reach other jobs first; busy-no-reservation: nothing held; "
                        "busy-requeue-keeps-nodes: free nodes and the nodes it gives back held for them",
            "k_node_min_replicas": "replicas / 2",
            "checkpoint_restart_busy": "in place: healthy nodes kept, one free node per lost node, restart from the "
                                       "last checkpoint"}


def model_lines(nodes_per_replica: int, patch_wait_s: float, costs: Costs) -> list[str]:
    """What RESULTS.md says under the table about the busy scenarios."""
    return [
        f"Busy scenarios (K-node replicas, K = {nodes_per_replica}; bench/cluster_sim_knode.py): the job holds R "
        f"replicas of K nodes (home H in whole replicas); no idle spares; every other node runs other jobs (uniform "
        f"1..{BUSY_JOB_MAX_NODES} nodes, exponential mean {BUSY_JOB_MEAN_H:g} h) from a queue that never empties, "
        "backfilled onto any node the training job does not claim; the training job's requests start first when "
        "they fit. busy: Slurm holds free nodes for them (backfill's reservation for the top-priority job), but "
        "the K−1 healthy nodes of a lost replica reach other jobs first (the replacement is pending only after "
        "they are freed), so K at once waits for K nodes to free one by one; busy-no-reservation: nothing held, "
        "a K-node request starts only when K nodes free together (the harsh bound); busy-requeue-keeps-nodes: "
        "the K−1 are held for the replacement at once (the kind bound: K at once waits for one node).",
        f"One free node patches a lost node: the other replicas go on; the replica's K−1 healthy nodes wait, held "
        f"and idle, for one node (released after {patch_wait_s:g} s, the controller's replica_patch_wait_s; the "
        f"replica then comes back on K nodes at once; a second row waits {SENSITIVITY}× longer); the new node starts "
        f"(grow {costs.grow_s:.3g} s measured) and streams the lost node's shard ({NODE_SHARD_GB:g} GB assumed, at "
        f"{costs.transfer_gb_s:.3g} GB/s measured: {join_s(costs):.0f} s); the replica rejoins at a step boundary. "
        "K free nodes at once (Tidal today, torchft-like): the lost node's replica gives its K−1 healthy nodes "
        "back and returns when Slurm starts K nodes together, each node streaming its shard in parallel (the "
        "same per-node time); every other cost as patching's. Checkpoint-restart in place: healthy nodes kept, "
        "one free node per lost node, then a restart from the last checkpoint (the kind assumption).",
        "replica out = hours from a replica leaving the world to its rejoining, over every return (median, and "
        "mean: the tail is where K at once loses); released = replicas whose healthy nodes waited too long (median "
        "per run); out at end = replicas not in the world when the run ended (never back, or on their way). "
        "Time-based ETTR hardly tells the designs apart (the other replicas train on while one is out) unless so "
        "many replicas are out that the job falls below min_replicas (half): work and goodput do.",
    ]
