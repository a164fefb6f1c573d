"""Replicas of several nodes (live mode, `nodes_per_replica` K > 1): one-node units grouped
into replicas by the controller. Pure: queries over the unit records and a spec.

A unit of such a job is one node, its own Slurm job. When its launcher registers it is given
a slot, (replica, node index), kept for its life: its workers' shard ranks are
`node_index × P + local rank` of `K × P` (`TIDAL_NODE_INDEX`, `TIDAL_NODES_PER_REPLICA`). Only a
complete replica (K live units, one at each node index) can be in a world; a replica that
lost a node waits, its healthy units keeping their processes and shards, until a new unit
takes the hole (`assign_slot` puts a registering unit into the most complete replica that
lacks a node first). A job whose replicas are one node (K = 1) is not grouped: each unit is
a replica of its own and nothing here applies."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from tidal.controller.model import UnitRecord, UnitState
from tidal.proto import admin_pb2, common_pb2


def nodes_per_replica(spec: admin_pb2.JobSpec) -> int:
    """K: the nodes of one replica whose units the controller groups (1: no grouping;
    restart mode's K-node units are one Slurm job each and are not grouped here)."""
    if spec.mode != common_pb2.JOB_MODE_LIVE:
        return 1
    return max(1, spec.nodes_per_replica)


def world_nodes(spec: admin_pb2.JobSpec, replica_workers: int) -> int:
    """The nodes that are in or out of a world together: K when a replica's model spans its
    nodes (HybridSharded: the workers report a replica of K × P, `replica_workers` > P) or
    the workers have not said yet (0: the safe side); 1 when every replica fits in one node
    (DataParallel: each worker holds the whole model), so that a lost or leaving node costs
    only its own workers and its replica's other nodes stay in the world. Slots, Slurm's
    holes and the patch wait keep K (`nodes_per_replica`)."""
    nodes = nodes_per_replica(spec)
    if nodes > 1 and 0 < replica_workers <= max(1, spec.procs_per_node):
        return 1
    return nodes


@dataclasses.dataclass(frozen=True)
class Slot:
    replica: int
    node_index: int


def assign_slot(units: Iterable[UnitRecord], nodes: int, current: Collection[int] = ()) -> Slot:
    """The slot of a unit registering now: the lowest missing node index of the most
    complete replica that lacks one (the fewest holes; of those, one in `current` first:
    its units hold the job's newest state, where another's may have been set aside steps
    ago; then the oldest replica), so that a lost node is replaced before a new replica is
    started; else node 0 of a new replica. A replica counts the units that are not final
    (a failed or departed unit leaves a hole)."""
    taken: dict[int, set[int]] = {}
    staying: set[int] = set()
    highest = 0
    for unit in units:
        if unit.replica <= 0:
            continue
        highest = max(highest, unit.replica)
        if not unit.state.is_final:
            taken.setdefault(unit.replica, set()).add(unit.node_index)
            if unit.state is not UnitState.LEAVING:
                staying.add(unit.replica)
    # (A replica whose every unit is leaving is not filled: it is going.)
    open_replicas = [(nodes - len(indices), replica not in current, replica)
                     for replica, indices in taken.items() if len(indices) < nodes and replica in staying]
    if open_replicas:
        *_, replica = min(open_replicas)
        missing = min(set(range(nodes)) - taken[replica])
        return Slot(replica, missing)
    return Slot(highest + 1, 0)


def replica_units(units: Mapping[str, UnitRecord], replica: int) -> list[str]:
    """The units of `replica` that are not final, by node index."""
    found = [(u.node_index, unit_id) for unit_id, u in units.items()
             if u.replica == replica and not u.state.is_final]
    return [unit_id for _, unit_id in sorted(found)]


def complete(units: Mapping[str, UnitRecord], unit_ids: Iterable[str], nodes: int) -> dict[int, list[str]]:
    """The replicas that `unit_ids` make whole: replica → its K units by node index (one at
    each index 0..K−1). Units of replicas they leave incomplete are not in it."""
    by_replica: dict[int, dict[int, str]] = {}
    for unit_id in unit_ids:
        unit = units[unit_id]
        by_replica.setdefault(unit.replica, {})[unit.node_index] = unit_id
    return {replica: [found[i] for i in range(nodes)] for replica, found in sorted(by_replica.items())
            if replica > 0 and sorted(found) == list(range(nodes))}


def whole_replicas_only(units: Mapping[str, UnitRecord], unit_ids: Iterable[str], nodes: int) -> list[str]:
    """`unit_ids` less the units of replicas they do not make whole, in their order."""
    ids = list(unit_ids)
    if nodes <= 1:
        return ids
    whole = {u for members in complete(units, ids, nodes).values() for u in members}
    return [u for u in ids if u in whole]


def incomplete_replicas(units: Mapping[str, UnitRecord], nodes: int) -> dict[int, list[str]]:
    """Replicas with some live units but not K, not all of them leaving: replica → its live
    units (they wait for a node to take the hole)."""
    if nodes <= 1:
        return {}
    found: dict[int, list[str]] = {}
    for unit_id, unit in units.items():
        if unit.replica > 0 and not unit.state.is_final and unit.state is not UnitState.SUBMITTED:
            found.setdefault(unit.replica, []).append(unit_id)
    # (A replica whose every unit is leaving is going, not waiting: after a merge moved its
    # other units away, a hole counted there had a node submitted for nothing.)
    return {replica: sorted(ids, key=lambda u: units[u].node_index) for replica, ids in sorted(found.items())
            if len(ids) < nodes and any(units[u].state is not UnitState.LEAVING for u in ids)}


def merged_replicas(units: Mapping[str, UnitRecord], unit_ids: Iterable[str], nodes: int,
                    held: Mapping[str, int]) -> dict[str, Slot]:
    """Of `unit_ids` (live units outside any running world), those of incomplete replicas
    that together make whole ones: unit → its new slot, in a replica numbered after every
    one the job has had (never a number a leaving unit still holds). Node index by node
    index, the unit holding the newest shards first (`held`: the step each unit's ranks
    hold), then the lowest replica; what is left waits as before. A unit
    keeps its node index, so its workers' shard ranks do not change (`TIDAL_NODE_INDEX`):
    only the replica they are grouped in does, which the workers take from each world's
    rank table. Two replicas each left with the other's half then train on as one
    rather than give their nodes back; the newest shards of each index come from the
    units that hold them, in memory or saved as they left (`leaving.save_split_state_first`)."""
    if nodes <= 1:
        return {}
    ids = list(unit_ids)
    whole = {u for members in complete(units, ids, nodes).values() for u in members}
    by_index: dict[int, list[tuple[int, int, str]]] = {}
    for unit_id in ids:
        unit = units[unit_id]
        if unit_id not in whole and unit.replica > 0 and 0 <= unit.node_index < nodes:
            by_index.setdefault(unit.node_index, []).append((-held.get(unit_id, 0), unit.replica, unit_id))
    # (A set-aside unit of an index may hold shards steps older than another's: a world
    # of the older beside a newer index resumed at the newer step from disk, where the
    # newer shards of its own index were in no folder.)
    merged: dict[str, Slot] = {}
    highest = max((u.replica for u in units.values()), default=0)
    while all(by_index.get(index) for index in range(nodes)):
        picked = [min(by_index[index]) for index in range(nodes)]
        if len({replica for _, replica, _ in picked}) == 1:
            break  # a replica whole on its own (not here: `whole` took it)
        highest += 1
        for index, choice in enumerate(picked):
            by_index[index].remove(choice)
            merged[choice[2]] = Slot(highest, index)
    return merged


def renumbered_if_taken(units: Mapping[str, UnitRecord], unit_id: str, slot: Slot,
                        renumbered: dict[int, int]) -> Slot:
    """The slot a registering unit takes: the one it was told, unless another live unit
    holds it now (a merge took that replica's number while its launcher registered, the
    reservation unknown to the merge): then the same node index (its workers' shard ranks
    were set from it) of a replica numbered after every one the job has had, the same one
    for every newcomer told that replica (`renumbered`, kept by the caller)."""
    def taken(candidate: Slot) -> bool:
        return any(u.unit_id != unit_id and not u.state.is_final and u.replica == candidate.replica
                   and u.node_index == candidate.node_index for u in units.values())

    if not taken(slot):
        return slot
    replica = renumbered.get(slot.replica)
    if replica is None or taken(Slot(replica, slot.node_index)):
        replica = max((u.replica for u in units.values()), default=0) + 1
        renumbered[slot.replica] = replica
    return Slot(replica, slot.node_index)


def slot_for(units: Mapping[str, UnitRecord], spec: admin_pb2.JobSpec, unit_id: str,
             reserved: Mapping[str, Slot], current: Collection[int] = ()) -> Slot | None:
    """The slot a registering launcher of `unit_id` is told (None: the job is not grouped):
    the one it holds, the one reserved for it by an earlier registration not yet taken in,
    or a new one, counting the slots reserved for other launchers registering meanwhile
    whose units are not final (`current`: replicas whose units hold the job's newest
    state, preferred for a hole)."""
    nodes = nodes_per_replica(spec)
    if nodes <= 1:
        return None
    unit = units.get(unit_id)
    if unit is not None and unit.replica > 0:
        return Slot(unit.replica, unit.node_index)
    if unit_id in reserved:
        return reserved[unit_id]
    others = [u for u in units.values() if u.unit_id != unit_id]
    # (A reservation lasts until its session is taken in; one never taken in, its launcher
    # gone as it registered, is void once its unit is final: failed, or cancelled.)
    others += [UnitRecord(job_id="", unit_id=u, state=UnitState.JOINING, replica=s.replica, node_index=s.node_index)
               for u, s in reserved.items()
               if u not in units or (units[u].replica <= 0 and not units[u].state.is_final)]
    return assign_slot(others, nodes, current)
