"""Leaving: a unit asked to leave (drained, preempted, resized, released below min_replicas),
deferred behind a change in flight, saving the last copy of the state, overdue leavers."""

from __future__ import annotations

from collections.abc import Sequence

from tidal.controller.core import failure, finishing, forming, messages, planning, replicas, slurm_units
from tidal.controller.core.state import (
    PollSlurmSoon,
    SavePending,
    SaveUnit,
)
from tidal.controller.core.step import Step
from tidal.controller.model import JobState, UnitState, join_ids


def leave_all(t: Step, leavers: Sequence[tuple[str, str, str]]) -> None:
    """Units that leave in one decision, each as (unit, cause, detail): Slurm preempting
    several at once, a resize, the leaves deferred behind a change. In live mode one world
    change removes all of them, or, when the world left would fall below min_replicas,
    one stop; not a change each, one after the other, which kept the nodes from the job
    Slurm preempted them for a second or more per unit. Elsewhere each leaves as `leave`."""
    state = t.state
    generation = state.generation
    unique: dict[str, tuple[str, str]] = {}
    for unit_id, cause, detail in leavers:
        unique.setdefault(unit_id, (cause, detail))
    ids = tuple(unique)
    remaining = [u for u in generation.unit_ids if u not in unique] if generation is not None else []
    together = (len(ids) > 1 and state.live and t.replica_nodes == 1 and generation is not None
                and t.job.state is JobState.RUNNING and state.changing is None and state.stopping is None
                and all((unit := state.units.get(u)) is not None and unit.state is UnitState.ACTIVE
                        and t.connected(u) and u in generation.unit_ids for u in ids)
                # The world left holds the state; else one at a time, the last saving it.
                and bool(remaining) and (bool(forming.holders(t, tuple(remaining))) or t.job.step == 0))
    if not together or generation is None:
        for unit_id, (cause, detail) in unique.items():
            leave(t, unit_id, cause, detail)
        return
    why = f"units {join_ids(list(ids))} leave ({', '.join(dict.fromkeys(c for c, _ in unique.values()))})"
    for unit_id, (cause, detail) in unique.items():
        _mark_leaving(t, unit_id, cause, detail)
    if len(remaining) >= t.min_world and all(t.connected(u) for u in remaining):
        forming.reconfigure(t, (), ids, "leave", why, t.now.monotonic)
        return
    # The world left is below min_replicas (or not all of it in touch): one stop, each
    # leaver told to leave first (the stop waits for it too), as `leave` does for one.
    for unit_id in ids:
        t.send(unit_id, messages.leave(generation.number, unit_id, state.units[unit_id].reason, save_state=False))
    failure.begin_stop(t, "leave", why, t.now.monotonic)


def _mark_leaving(t: Step, unit_id: str, cause: str, detail: str) -> None:
    state = t.state
    unit = t.note(state.units[unit_id], leaving_since=t.now.monotonic)
    unit.state = UnitState.LEAVING
    unit.reason = f"{cause}: {detail}" if detail != cause else cause
    number = state.generation.number if state.generation is not None else 0
    t.emit(SaveUnit(unit))
    t.record("unit_leaving", unit.reason, unit_id=unit_id, generation=number, fields={"cause": cause})


def leave(t: Step, unit_id: str, cause: str, detail: str, *, save: bool = False) -> None:
    """One unit leaves: in a live world that keeps min_replicas without it, by a world
    change at a step boundary; else its world stops (`leave_all`: several at once). `save`:
    it saves what it holds of the state as it goes, whoever else holds it
    (`save_split_state_first`); else only the last holder does."""
    state = t.state
    unit = state.units.get(unit_id)
    if unit is None or unit.state.is_final or unit.state is UnitState.LEAVING:
        return
    was_active = unit.state is UnitState.ACTIVE
    # A unit set aside (its replica lost a node) waits as a joiner with its shards in memory.
    was_set_aside = unit.state is UnitState.JOINING and held_step(t, unit_id) > 0
    connected = t.connected(unit_id)
    running = (was_active and t.job.state is JobState.RUNNING and state.generation is not None
               and state.stopping is None)
    changing = state.changing
    # One world change at a time: this leave follows the one in flight, for an active unit
    # and for one that change sets aside (the other node of a replica one of whose nodes
    # leaves): it trains in the old world until the step its ranks agree on, and leaving
    # at once would break that step for every rank.
    if (state.live and connected and changing is not None and t.job.state is JobState.RUNNING
            and state.stopping is None and (was_active or unit_id in changing.old_members)):
        if unit.facts.deferred_leave is None:
            t.note(unit, deferred_leave=(cause, detail))
        t.save_pending()
        return
    _mark_leaving(t, unit_id, cause, detail)
    unit = state.units[unit_id]
    number = state.generation.number if state.generation is not None else 0
    if running and state.live and connected:
        assert state.generation is not None
        # A replica of several nodes leaves the world whole: its other nodes stand aside,
        # keeping their workers and shards, until a node takes the leaver's place.
        aside = tuple(u for u in replicas.replica_units(state.units, unit.replica)
                      if u != unit_id and state.units[u].state is UnitState.ACTIVE) if t.replica_nodes > 1 else ()
        remaining = [m.unit_id for m in state.generation.members if m.unit_id != unit_id and m.unit_id not in aside]
        # Not when it holds the last copy of the state (the others formed no world with it
        # yet): a world of theirs would have none. It saves the state as it leaves instead.
        if (remaining and len(remaining) // t.replica_nodes >= t.min_world
                and all(t.connected(u) for u in remaining) and not holds_last_state(t, unit_id)):
            forming.reconfigure(t, (), (unit_id,), "leave", f"unit {unit_id} leaves ({cause})", t.now.monotonic,
                                set_aside=aside)
            return
    if connected:
        last_shard = (was_active or was_set_aside) and holds_last_shard(t, unit_id)
        save_state = (was_active and holds_last_state(t, unit_id)) or last_shard
        if save and not save_state and held_step(t, unit_id) > 0:
            save_state, last_shard = True, t.replica_nodes > 1
        if save_state:
            t.note(unit, saving_state=True)
            what = (f"the last copy of its shards of the training state (node index {unit.node_index} of "
                    f"replicas of {t.replica_nodes} nodes)" if last_shard else "the last copy of the training state")
            t.record("state_saving", f"unit {unit_id} holds {what}: its workers write it to disk before leaving, "
                     "and the next world resumes from it", unit_id=unit_id, generation=number)
        t.send(unit_id, messages.leave(number, unit_id, unit.reason, save_state=save_state))
    else:
        mark_left(t, unit_id, "not connected when asked to leave")
    if state.stopping is not None:
        if connected and state.stopping.generation == number and was_active:
            state.stopping.waiting_for.add(unit_id)
        return
    if was_active and t.job.state is JobState.RUNNING and state.generation is not None:
        staying = tuple(u for u in state.generation.unit_ids if state.units[u].state is UnitState.ACTIVE)
        why = f"unit {unit_id} leaves ({cause})"
        if (state.live or not all(t.connected(u) for u in staying)
                or not failure.next_generation_now(t, staying, (), "leave", why)):
            failure.begin_stop(t, "leave", why, t.now.monotonic)


def release_below_min(t: Step, now: float) -> None:
    """Live mode with Slurm units: below min_replicas for `below_min_release_s` since the
    last registration (or `below_min_blocked_release_s` while Slurm's views show nothing
    on its way: `slurm_units.note_blocked_below_min`), the units that are left (they
    train nothing) give their nodes back; the last holder of the training state saves it
    as it leaves (`leave`), the replacements queued in Slurm are cancelled (they would
    take the nodes given back), and the job submits units again only once min_replicas
    nodes are idle, resuming from the saved state."""
    state = t.state
    holding = sorted(u for u, unit in state.units.items()
                     if unit.state in (UnitState.ACTIVE, UnitState.JOINING) and t.connected(u))
    # A registration restarts the wait: more units may be on their way.
    since = max([state.degraded_since or now, *(state.units[u].facts.joined_at or 0.0 for u in holding)])
    if not (state.live and state.slurm_units):
        return
    if saves_in_flight(t):
        # A world waits for them (`save_split_state_first`), or the holders go anyway.
        return
    decision = planning.release_below_min(
        below_min_since=since, now=now, release_after_s=t.config.below_min_release_s, holding=len(holding),
        blocked_since=state.blocked_below_min_since, blocked_seen_at=state.blocked_below_min_seen_at,
        blocked_release_after_s=t.config.below_min_blocked_release_s)
    if decision is planning.BelowMin.POLL:
        # Released sooner only on a view taken after the blocked wait (the controller makes
        # one poll of many asks, `server.EARLY_POLL_GAP_S` after the last at the earliest).
        t.emit(PollSlurmSoon("below min_replicas with nothing on its way: a fresh view before giving the nodes "
                             "back"))
        return
    if decision not in (planning.BelowMin.RELEASE, planning.BelowMin.RELEASE_BLOCKED):
        return
    spec = t.job.spec
    queued = sorted(u for u, unit in state.units.items() if unit.state is UnitState.SUBMITTED)
    state.released_below_min = True
    # A restarted controller keeps waiting for min_replicas idle nodes rather than queueing.
    t.emit(SavePending("released_below_min", True))
    if decision is planning.BelowMin.RELEASE:
        why = f"below min_replicas {spec.min_replicas} for {t.config.below_min_release_s:g} s (below_min_release_s)"
    else:
        why = (f"below min_replicas {spec.min_replicas} with nothing on its way for "
               f"{t.config.below_min_blocked_release_s:g} s (below_min_blocked_release_s: no idle node it could "
               "take, no unit of its starting)")
    t.record("below_min_released",
             f"{why}: {len(holding)} unit(s) give their nodes back after {now - since:.0f} s; the last to hold "
             f"the training state saves it, and the job resumes from it once {spec.min_replicas} node(s) are idle",
             fields={"units": join_ids(holding), "cancelled_queued": join_ids(queued),
                     "below_min_release_s": f"{t.config.below_min_release_s:g}",
                     "below_min_blocked_release_s": f"{t.config.below_min_blocked_release_s:g}",
                     "below_min_s": f"{now - since:.1f}"})
    for unit_id in queued:
        slurm_units.cancel_in_slurm(t, state.units[unit_id])
        mark_left(t, unit_id, "cancelled while queued: the job gave its nodes back below min_replicas")
    # Those without the state first, so that the holder is the last to go and saves it
    # (under HybridSharded, the last of each node index saves its shards: `holds_last_shard`).
    holders = set(state.state_holders)
    for unit_id in sorted(holding, key=lambda u: (u in holders, u)):
        leave(t, unit_id, "released", f"{why}: nodes given back")


def holds_last_state(t: Step, unit_id: str) -> bool:
    """Live mode: whether `unit_id` is the running generation's last member that is
    still active and connected, or the others hold no state by their heartbeats (with
    it gone, no live process holds the state)."""
    state = t.state
    if not state.live or state.generation is None or unit_id not in state.generation.unit_ids:
        return False
    if t.job.state not in (JobState.RUNNING, JobState.RECONFIGURING, JobState.DEGRADED):
        return False
    others = tuple(u for u in state.generation.unit_ids
                   if u != unit_id and state.units[u].state is UnitState.ACTIVE and t.connected(u))
    # Another member counts only if it holds the state by its heartbeats: a joiner whose
    # workers never formed a world (or got the state) would take nothing with it.
    return not others or (not forming.holders(t, others) and t.job.step > 0)


def holds_last_shard(t: Step, unit_id: str) -> bool:
    """Live replicas whose model spans their K nodes (`HybridSharded`: a unit's workers hold
    only the shards of its node index): whether no other unit of `unit_id`'s node index
    keeps those shards as new as its own. With it gone they would be gone, and no world
    could resume whole: it saves them as it leaves (each node index its own folder), as
    `holds_last_state`'s last holder saves the whole state.

    While a generation runs, only a member of it counts (it trains on with the world); a
    unit set aside stopped at the step its replica lost a node, and the world's next step
    makes its shards old (the heartbeats, a step or two behind, cannot tell). With no
    generation running, every rank has stopped: a connected peer counts if it holds at
    least this unit's step. A unit whose workers never trained holds nothing to save, and
    nothing is saved once training is over."""
    state = t.state
    if not state.live or t.replica_nodes <= 1 or t.job.step <= 0 or t.job.state is JobState.FINISHING:
        return False
    unit = state.units.get(unit_id)
    if unit is None:
        return False
    mine = held_step(t, unit_id)
    if mine <= 0:
        return False
    generation = state.generation
    running = (generation is not None and state.stopping is None
               and t.job.state in (JobState.RUNNING, JobState.RECONFIGURING))
    for peer, other in state.units.items():
        if (peer == unit_id or other.node_index != unit.node_index or other.replica <= 0
                or other.state not in (UnitState.ACTIVE, UnitState.JOINING) or not t.connected(peer)):
            continue
        if running:
            assert generation is not None
            if other.state is UnitState.ACTIVE and peer in generation.unit_ids:
                return False
        elif held_step(t, peer) >= mine:
            return False
    return True


def held_step(t: Step, unit_id: str) -> int:
    """The step every rank of `unit_id` holds (heartbeats or reports; 0: none trained)."""
    steps = forming.unit_steps(t.state, unit_id)
    return min(steps) if steps else 0


def mark_left(t: Step, unit_id: str, reason: str) -> None:
    unit = t.state.units.get(unit_id)
    if unit is None or unit.state.is_final:
        return
    unit = t.own(unit)
    unit.state = UnitState.LEFT
    # Why it left, after why it was asked to (a preemption, a drain), if it was.
    unit.reason = f"{unit.reason}; {reason}" if unit.reason and unit.reason != reason else reason
    t.emit(SaveUnit(unit))
    t.record("unit_left", reason, unit_id=unit_id)


def gone(t: Step, unit_id: str, reason: str) -> None:
    """The unit has left (its session closed after it was asked to leave, or its Slurm job
    ended while it was out of touch): a stop waiting for it goes on without it, and a
    finishing job may be complete."""
    mark_left(t, unit_id, reason)
    state = t.state
    if state.stopping is not None:
        state.stopping.waiting_for.discard(unit_id)
        failure.maybe_finish_stop(t)
    elif t.job.state is JobState.FINISHING:
        finishing.maybe_complete(t)


def cancel_overdue_leavers(t: Step, overdue: tuple[tuple[str, float], ...], now: float) -> None:
    """Units asked to leave that are still there after the grace a stop gets
    (`restart_grace_s` + `heartbeat_timeout_s`: their launcher or workers hung; judged in
    `health.judge`) have their Slurm job cancelled, so that they never hold a node for
    nothing; Slurm then signals and kills what runs there, and the closed session marks the
    unit left. Each is said once."""
    state = t.state
    for unit_id, since in overdue:
        unit = t.note(state.units[unit_id], leaving_since=None)
        cancelled = (f"; Slurm job {unit.slurm_job_id} cancelled"
                     if state.slurm_units and unit.slurm_job_id else "")
        t.record("unit_leave_overdue", f"still there {now - since:.0f} s after it was asked to leave" + cancelled,
                 unit_id=unit_id)
        slurm_units.cancel_in_slurm(t, unit)


def release_unpatched(t: Step, now: float) -> None:
    """Live mode, replicas of several nodes: a replica that has lacked a node for
    `replica_patch_wait_s` gives its other nodes back (they train nothing meanwhile); the
    job keeps its other replicas. Its units leave (the last holder of the state among them
    saves it, as any leave)."""
    state = t.state
    wait_s = t.config.replica_patch_wait_s
    incomplete = replicas.incomplete_replicas(state.units, t.replica_nodes)
    for unit in state.units.values():
        if unit.facts.waiting_for_node_since is not None and unit.replica not in incomplete:
            t.note(unit, waiting_for_node_since=None)
    for replica, unit_ids in incomplete.items():
        since = [state.units[u].facts.waiting_for_node_since for u in unit_ids]
        if any(at is None for at in since):
            for unit_id in unit_ids:
                if state.units[unit_id].facts.waiting_for_node_since is None:
                    t.note(state.units[unit_id], waiting_for_node_since=now)
            continue
        started = min(at for at in since if at is not None)
        if wait_s <= 0 or now - started < wait_s:
            continue
        t.record("replica_released", f"replica {replica} waited {now - started:.0f} s for a node to take a lost "
                 f"one's place (replica_patch_wait_s {wait_s:g}): its {len(unit_ids)} other node(s) are given back",
                 fields={"replica": str(replica), "units": join_ids(unit_ids)})
        for unit_id in unit_ids:
            leave(t, unit_id, "released", f"replica {replica} waited {now - started:.0f} s for a node")


def replace_straggler(t: Step, now: float) -> None:
    """straggler_action "replace": one straggler's unit leaves at a step boundary (0 steps
    lost) when the world keeps min_replicas without it, and its node is cooled down, so that
    growth puts the replacement on another node. One at a time per job: the next waits until
    this unit is gone."""
    state = t.state
    if state.straggler_leaving is not None:
        unit = state.units.get(state.straggler_leaving)
        if unit is not None and not unit.state.is_final:
            return
        state.straggler_leaving = None
    generation = state.generation
    if (state.in_flight is not None or generation is None or t.job.state is not JobState.RUNNING
            or state.deferred_leaves or not all(t.connected(u) for u in generation.unit_ids)):
        # (A leave with a member out of touch would be a stop round, not a step boundary.)
        return
    suspected = sorted({unit_id for (unit_id, _), worker in state.compute.items() if worker.suspected})
    for unit_id in suspected:
        unit = state.units.get(unit_id)
        if unit is None or unit.state is not UnitState.ACTIVE or unit_id not in generation.unit_ids:
            continue
        remaining = (len(generation.unit_ids) - t.replica_nodes) // t.replica_nodes
        why = ""
        if t.replica_nodes > 1:
            # The replica's workers wait on each other inside their passes: all of them look
            # slow, and which node is the slow one is not known (docs/limits.md).
            why = "its replica spans several nodes, whose workers all look as slow: reported, not replaced"
        elif remaining < t.min_world:
            why = (f"the job has no replica to spare: without it the world would be below min_replicas "
                   f"{t.job.spec.min_replicas}")
        if why:
            if state.straggler_kept != unit_id:
                state.straggler_kept = unit_id
                t.record("straggler_kept", f"unit {unit_id} stays: {why}", unit_id=unit_id)
            return
        state.straggler_kept = ""
        state.straggler_leaving = unit_id
        slurm_units.cool_down(t, unit, now, why="it was a straggler there")
        leave(t, unit_id, "straggler", "its workers compute slower than their peers (straggler_action replace)")
        return


def saves_in_flight(t: Step) -> list[str]:
    """Units whose leave carries save_state and whose save is not done: leaving, connected,
    and not overdue (`cancel_overdue_leavers` gives up on a leaver: its save ends no wait)."""
    return sorted(u for u, unit in t.state.units.items()
                  if unit.state is UnitState.LEAVING and unit.facts.saving_state
                  and unit.facts.leaving_since is not None and t.connected(u))


def save_split_state_first(t: Step, world: Sequence[str]) -> bool:
    """Live mode: whether a new world of `world` (no generation running) must wait because
    part of the state it resumes from is being written, or is held only by units outside it.

    Under HybridSharded a unit holds only its node index's shards. When a world's last
    holder of node 0 leaves it saves node 0's shards, and its replica's other nodes are set
    aside with theirs in memory: the state is then half on disk, half in those processes.
    A world none of whose members holds node 1's shards that new resumes from disk, where
    that half is not: the job failed with `state_lost` (chaos, sharded, seed 300). Such a
    node of the stopped generation is asked to leave saving its shards (per node index, the
    most advanced), and the world forms once every save in flight newer than what it holds
    is done (`saves_in_flight`): from both halves, at the step they were saved at.

    Steps are compared per node index, as `holds_last_shard` does: an outside unit is asked
    only if it holds a newer step than every member of its node index (a heartbeat a step
    behind may ask one needlessly; never too few). A unit set aside earlier, while the world
    trained on, is not asked: the world's own last holder of its node index saved newer
    shards. A saver not heard from since a controller restart (step 0) is waited for."""
    state = t.state
    if not state.live:
        return False
    nodes = t.replica_nodes

    def index(unit_id: str) -> int:
        return state.units[unit_id].node_index if nodes > 1 else 0

    in_world: dict[int, int] = {}
    for unit_id in world:
        if t.connected(unit_id):
            in_world[index(unit_id)] = max(in_world.get(index(unit_id), 0), held_step(t, unit_id))

    def newer(unit_id: str) -> bool:
        step = held_step(t, unit_id)
        return step == 0 or step > in_world.get(index(unit_id), 0)

    saving = [u for u in saves_in_flight(t) if newer(u)]
    if not saving:
        if nodes <= 1 or state.generation is None or t.job.step <= 0:
            return False
        chosen: dict[int, str] = {}
        outside = [u for u in state.generation.unit_ids
                   if u not in world and state.units[u].state is UnitState.ACTIVE and t.connected(u)
                   and held_step(t, u) > 0 and newer(u)]
        for unit_id in sorted(outside, key=lambda u: (-held_step(t, u), u)):
            chosen.setdefault(index(unit_id), unit_id)
        if not chosen:
            return False
        detail = (f"the next world ({join_ids(list(world))}) holds no shards of node index(es) "
                  f"{', '.join(str(i) for i in sorted(chosen))} as new as this unit's (step "
                  f"{max(held_step(t, u) for u in chosen.values())}); they are saved first and it resumes from them")
        for unit_id in sorted(chosen.values()):
            leave(t, unit_id, "saving_shards", detail, save=True)
        saving = saves_in_flight(t) or sorted(chosen.values())
    t.set_state(JobState.DEGRADED, f"waiting for {join_ids(saving)} to save the training state: the next world "
                "resumes from it")
    return True
