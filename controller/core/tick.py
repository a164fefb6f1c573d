"""Each clock tick: the liveness verdicts (`health.judge`) applied in order, the committed
step, and the decision to form or grow a world."""

from __future__ import annotations

import dataclasses

from tidal.controller.core import (
    failure,
    finishing,
    forming,
    health,
    leaving,
    planning,
    replicas,
    slurm_units,
    stragglers,
)
from tidal.controller.core.progress import MemberProgress, committed_step
from tidal.controller.core.state import (
    Close,
    SaveJob,
    SaveUnit,
)
from tidal.controller.core.step import Step
from tidal.controller.model import JobState, UnitState


def on_tick(t: Step, now: float) -> None:
    """Apply the tick's liveness verdicts (`health.judge`, the one place liveness is judged)
    in order, then decide whether to form or grow a world."""
    state = t.state
    verdicts = health.judge(state, now)
    state.last_tick_at = now
    leaving.cancel_overdue_leavers(t, verdicts.leave_overdue, now)
    if t.job.state.is_final:
        return
    if t.job.state is JobState.FINISHING:
        for unit_id in verdicts.out_of_touch:
            unit = t.note(state.units[unit_id], disconnected_at=None)
            # Whatever is left of it gives its allocation back.
            slurm_units.cancel_in_slurm(t, unit)
            if t.connected(unit_id):
                # Its session open, silent: ended, so that a launcher that wakes up is told.
                leaving.mark_left(t, unit_id, "launcher silent after the last step: no heartbeat for more than "
                                  f"{t.config.heartbeat_timeout_s + t.config.reconnect_grace_s:g} s")
                t.emit(Close(unit_id, f"unit {unit_id} silent after the last step"))
            else:
                leaving.mark_left(t, unit_id, "launcher out of touch after the last step")
        for back in verdicts.back_without_workers:
            # Back with no workers, and some of their exits never came (lost with a
            # controller that died with them unread): nothing of this unit is left to wait
            # for, so the job does not wait for ever.
            unit = t.note(state.units[back.unit_id], back_without_workers_at=None)
            if not finishing.unit_done(unit):
                leaving.leave(t, back.unit_id, "finished", "came back with no workers after the last step; the "
                              "exits of some of them never came")
        finishing.maybe_complete(t)
        return
    observe_progress(t, now)
    observe_compute(t, now)
    # Members back without workers are taken together, as the members' verdicts below: the
    # world re-forms once, not once each (the first re-forming named the others, dead).
    back_failed = []
    for back in verdicts.back_without_workers:
        returned = t.note(state.units[back.unit_id], back_without_workers_at=None)
        if (returned.state is UnitState.ACTIVE and t.job.state is JobState.RUNNING
                and failure.fail(t, back.unit_id, back.reason, back.cause, now, regroup=False)):
            back_failed.append((back.unit_id, back.reason, now))
    if back_failed and t.job.state is JobState.RUNNING:
        failure.regroup_survivors(t, back_failed)
    for joiner in verdicts.joiners_out_of_touch:
        # (Not a member: it fails alone, and a unit replaces it.)
        failure.fail(t, joiner.unit_id, joiner.reason, joiner.cause, now)
    if state.stopping is not None:
        if verdicts.stop_overdue == (state.stopping.generation, state.stopping.deadline):
            for late in verdicts.stop_unconfirmed:
                failure.fail(t, late.unit_id, late.reason, late.cause, now)
            if state.stopping is not None:
                state.stopping.waiting_for.clear()
            failure.maybe_finish_stop(t)
        return
    if t.job.state is JobState.DEGRADED:
        leaving.release_below_min(t, now)
        if t.job.state.is_final:
            return
    if t.replica_nodes > 1:
        leaving.release_unpatched(t, now)
    generation = state.generation
    if (t.job.state is JobState.RUNNING and generation is not None and verdicts.members
            and generation.number == verdicts.members_of):
        # Failures found together are taken together: the world re-forms once. (Verdicts
        # about a generation this tick already replaced wait for the next tick's.)
        together = [(f.unit_id, f.reason, now) for f in verdicts.members
                    if failure.fail(t, f.unit_id, f.reason, f.cause, now, regroup=False)]
        if together and t.job.state is JobState.RUNNING:
            failure.regroup_survivors(t, together)
        if t.job.state is not JobState.RUNNING:
            return
    if state.changing is not None:
        if verdicts.change_overdue_of == state.changing.generation:
            for late in verdicts.change_late:
                failure.fail(t, late.unit_id, late.reason, late.cause, now)
        return
    if (state.deferred_leaves and t.job.state is JobState.RUNNING and state.generation is not None
            and (now > state.reconnect_deadline or all(t.connected(u) for u in state.generation.unit_ids))):
        # Deferred behind a world change that a controller restart cut short: once the
        # world's launchers are back, so that the leave is a change, not a failure.
        leaving.leave_all(t, [(unit_id, cause, detail)
                              for unit_id, (cause, detail) in t.take_deferred_leaves().items()])
        return
    decide(t, now)


def decide(t: Step, now: float, after: str = "") -> None:
    state = t.state
    generation = state.generation
    running = t.job.state is JobState.RUNNING and generation is not None
    if running and generation is not None:
        members = generation.unit_ids
    else:
        members = tuple(u for u, unit in state.units.items()
                        if unit.state is UnitState.ACTIVE and t.connected(u))
    joiners = {u: unit.facts.joined_at if unit.facts.joined_at is not None else now
               for u, unit in state.units.items()
               if unit.state is UnitState.JOINING and t.connected(u)}
    nodes = t.replica_nodes
    # Replicas of several nodes: the decision is taken over whole replicas (a replica
    # joins once every one of its nodes is ready), then expanded to their units.
    expand: dict[str, tuple[str, ...]] = {u: (u,) for u in joiners}
    member_keys = members
    if nodes > 1 and not running:
        merge_halves(t, (*members, *joiners))
    if nodes > 1:
        whole_members = replicas.whole_replicas_only(state.units, members, nodes)
        # A member of a replica that is not whole among the members (its lost node's place
        # taken by a joiner, the world stopped meanwhile) joins with that replica.
        # (It settles nothing: the replica's time to settle is its joiners'.)
        joiners.update({u: float("-inf") for u in members if u not in whole_members})
        members = tuple(whole_members)
        whole = replicas.complete(state.units, list(joiners), nodes)
        expand = {f"replica-{r}": tuple(units) for r, units in whole.items()}
        joiners = {key: max(joiners[u] for u in units) for key, units in expand.items()}
        member_keys = tuple(f"replica-{r}" for r in replicas.complete(state.units, members, nodes))
    # Units submitted to Slurm whose launcher has not registered.
    submitted = [u for u in state.units.values() if u.state is UnitState.SUBMITTED]
    expected = [u for u in submitted if not u.facts.queued_in_slurm]
    # Joiners Slurm started from its queue (`queued_units`) since the newest Slurm view.
    unseen_starts = [u.facts.joined_at for u in state.units.values()
                     if u.state is UnitState.JOINING and u.facts.queued_ahead and u.facts.joined_at is not None
                     and (state.slurm_seen_at is None or state.slurm_seen_at < u.facts.joined_at)]
    snapshot = planning.WorldSnapshot(
        running=running, members=member_keys, joiners=joiners,
        min_replicas=t.min_world,
        max_replicas=t.max_world, sizes=t.sizes(),
        last_change_at=state.last_change_at, join_settle_s=t.config.join_settle_s,
        scale_up_snooze_s=t.config.scale_up_snooze_s,
        expected=len(expected) if state.slurm_units else None,
        starting={u.unit_id: u.facts.started_seen_at for u in submitted if u.facts.started_seen_at is not None},
        expected_submitted_at=max((now - max(0.0, t.now.wall - u.facts.submitted_at) for u in expected
                                   if u.facts.submitted_at), default=None),
        unseen_start_at=max(unseen_starts, default=None) if state.slurm_units else None, scale=t.world_scale)
    action = planning.decide_world(snapshot, now)
    if isinstance(action, (planning.Form, planning.Grow)):
        action = dataclasses.replace(action, joiners=tuple(u for key in action.joiners for u in expand[key]))
    match action:
        case planning.Form():
            if not running and leaving.save_split_state_first(t, (*members, *action.joiners)):
                return
            if after:
                action = dataclasses.replace(action, reason=f"{after}; {action.reason}")
            forming.start_generation(t, members, action, now)
        case planning.Grow():
            if generation is None or not all(t.connected(u) for u in generation.unit_ids):
                # A member not back yet after a controller restart: grow once it is.
                return
            if state.live:
                forming.reconfigure(t, action.joiners, (), "grow", action.reason, now)
            elif not failure.next_generation_now(t, generation.unit_ids, action.joiners, "grow", action.reason):
                failure.begin_stop(t, "grow", action.reason, now)
        case planning.Wait():
            if not running and t.job.state is JobState.RUNNING:
                t.set_state(JobState.DEGRADED, action.reason)


def merge_halves(t: Step, ready: tuple[str, ...]) -> None:
    """No world runs: units of incomplete replicas that together make whole ones are put
    into new replicas (`replicas.merged_replicas`), so that the next world trains on them
    rather than waiting for their holes to fill, or giving their nodes back. Only on what
    is known: while a live unit of an incomplete replica is not connected, or has sent no
    heartbeat on its session yet (after a controller restart, or a stream that blipped),
    the newest shards of its node index may be its own, and nothing is merged. (A merge
    lasts: the merged replica is whole and never reconsidered. Picking by a step not heard
    yet, a unit steps behind was merged, the world resumed at the newer step, and the newer
    shards of its index were in no folder: state_lost.)"""
    state = t.state
    waiting = [u for ids in replicas.incomplete_replicas(state.units, t.replica_nodes).values() for u in ids
               if state.units[u].state is not UnitState.LEAVING]
    if not all(t.connected(u) and (link := state.links.get(u)) is not None and link.heard for u in waiting):
        return
    merged = replicas.merged_replicas(state.units, ready, t.replica_nodes,
                                      {u: leaving.held_step(t, u) for u in ready})
    for replica in sorted({slot.replica for slot in merged.values()}):
        moved = sorted((slot.node_index, unit_id) for unit_id, slot in merged.items() if slot.replica == replica)
        was = [state.units[unit_id].replica for _, unit_id in moved]
        for node_index, unit_id in moved:
            unit = t.note(state.units[unit_id], waiting_for_node_since=None)
            unit.replica, unit.node_index = replica, node_index
            t.emit(SaveUnit(unit))
        t.record("replicas_merged", f"units {', '.join(u for _, u in moved)} (of replicas "
                 f"{', '.join(str(r) for r in was)}) make replica {replica} together: each held the other's "
                 "missing node index", fields={"replica": str(replica), "units": ",".join(u for _, u in moved)})


def observe_progress(t: Step, now: float) -> None:
    """Raise the job's committed step from what the training world's ranks report;
    written at most once a second (and with every generation)."""
    state = t.state
    world = state.training_world
    if world is None:
        return
    reports = []
    for member in world.members:
        link = state.links.get(member.unit_id) if t.connected(member.unit_id) else None
        reports.append(MemberProgress(unit_id=member.unit_id, ranks=member.world_share,
                                      steps=link.steps if link is not None else {}))
    step = committed_step(t.job.step, reports)
    if step != t.job.step:
        t.job.step = step
        if now - state.step_persisted_at >= 1.0:
            state.step_persisted_at = now
            t.emit(SaveJob(t.job))


def straggler_policy(t: Step) -> stragglers.StragglerPolicy:
    config = t.config
    return stragglers.StragglerPolicy(ratio=config.straggler_ratio, clear_ratio=config.straggler_clear_ratio,
                                      window=config.straggler_window, confirm=config.straggler_confirm)


def observe_compute(t: Step, now: float) -> None:
    """Live mode: score the training world's workers' own compute (`stragglers`); say who
    became a straggler or stopped being one; with straggler_action "replace", ask one
    straggler's unit to leave."""
    state = t.state
    world = state.training_world
    if not state.live or world is None or t.job.state is not JobState.RUNNING:
        return
    totals: dict[stragglers.WorkerKey, stragglers.Totals] = {}
    ranks: dict[stragglers.WorkerKey, int] = {}
    for member in world.members:
        for local_rank in range(member.world_share):
            ranks[(member.unit_id, local_rank)] = member.first_rank + local_rank
        link = state.links.get(member.unit_id) if t.connected(member.unit_id) else None
        for local_rank, said in (link.compute.items() if link is not None else ()):
            totals[(member.unit_id, local_rank)] = said
    policy = straggler_policy(t)
    previous = state.compute
    windows = stragglers.observe(previous, totals, world.number, policy, ranks)
    state.compute, changes = stragglers.score(windows, policy)
    for change in changes:
        unit_id, local_rank = change.key
        unit = state.units.get(unit_id)
        node = unit.nodes[0] if unit is not None and unit.nodes else ""
        fields = {"rank": ranks.get(change.key, -1), "local_rank": local_rank, "node": node,
                  "ratio": f"{change.worker.ratio:.2f}", "self_ratio": f"{change.worker.self_ratio:.2f}",
                  "window": policy.window}
        if change.suspected:
            t.record("straggler_suspected", f"worker {local_rank} of unit {unit_id} (rank {fields['rank']}, node "
                     f"{node or '?'}) computes {change.worker.ratio:.2f}× its peers' median time per sample over "
                     f"its last {policy.window} intervals", unit_id=unit_id, generation=world.number, fields=fields)
        else:
            t.record("straggler_cleared", f"worker {local_rank} of unit {unit_id} computes {change.worker.ratio:.2f}× "
                     "its peers' median again", unit_id=unit_id, generation=world.number, fields=fields)
    for unit_id, local_rank in stragglers.cleared_by_leaving(previous, ranks):
        t.record("straggler_cleared", f"worker {local_rank} of unit {unit_id} is out of the world",
                 unit_id=unit_id, generation=world.number, fields={"local_rank": local_rank})
    if t.config.straggler_action == "replace":
        leaving.replace_straggler(t, now)
