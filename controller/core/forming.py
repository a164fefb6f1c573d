"""Forming generations: candidates and ranks, committing and sending a generation (at once, to
each member; or live mode's change at a step boundary), and what the workers report of
the state they formed with (first step, resumed from a checkpoint, state lost)."""

from __future__ import annotations

from tidal.controller.core import failure, finishing, leaving, messages, planning, replicas
from tidal.controller.core.progress import state_holders
from tidal.controller.core.state import (
    ChangeKind,
    GenerationCounted,
    InFlight,
    Note,
    Recovery,
    RecoveryTimed,
    SaveGeneration,
    SaveJob,
    SaveUnit,
    State,
)
from tidal.controller.core.step import Step
from tidal.controller.model import GenerationRecord, JobState, UnitState, join_ids
from tidal.proto import launcher_pb2


def candidates(t: Step, unit_ids: list[str]) -> list[planning.Candidate]:
    state = t.state
    previous = state.generation
    candidates = []
    for unit_id in unit_ids:
        unit = state.units[unit_id]
        member = previous.member(unit_id) if previous is not None else None
        store_port = unit.facts.store_port
        if (not state.live and previous is not None and previous.rendezvous_unit_id == unit_id
                and store_port == previous.rendezvous_port):
            # Restart mode: that store is the running generation's; the unit's fresh one
            # is not reported yet (it comes with STARTED), so it cannot host the next.
            store_port = 0
        candidates.append(planning.Candidate(
            unit_id=unit_id, nodes=tuple(unit.nodes), procs_per_node=unit.procs_per_node, address=unit.address,
            store_port=store_port,
            previous_group_rank=member.group_rank if member else None, registered_at=unit.registered_at,
            replica=unit.replica, node_index=unit.node_index))
    return candidates


def start_generation(t: Step, survivors: tuple[str, ...], form: planning.Form, now: float,
                     cause: str = "") -> None:
    """Commit the next generation of `survivors` + the form's joiners and send it to each, at
    once (a newer generation supersedes any change in flight). `cause` (failure, grow,
    leave) is set when it replaces a running generation in one message: the old workers'
    stop grace follows from it."""
    state = t.state
    chosen = list(dict.fromkeys([*survivors, *form.joiners]))
    try:
        plan = planning.plan_generation(job_id=t.job.job_id, number=t.job.generation + 1,
                                        candidates=candidates(t, chosen), replicas=form.replicas * t.replica_nodes,
                                        reason=form.reason, now=t.now.wall, resume_step=t.job.step)
    except ValueError as error:
        t.emit(Note("generation_not_formed", {"reason": str(error)}, warning=True))
        return
    t.job.generation = plan.number
    t.enter_state(JobState.RUNNING)
    # (Whole replicas of the spec, as `tidal status` counts them: a DataParallel replica of
    # K nodes that lost one is not counted, though its node trains on.)
    fields: dict[str, object] = {"world_size": plan.world_size,
                                 "replicas": len(plan.members) // replicas.nodes_per_replica(t.job.spec),
                                 "members": join_ids(list(plan.unit_ids)),
                                 "rendezvous": f"{plan.rendezvous_host}:{plan.rendezvous_port}"}
    if state.failure_detected_at is not None:
        fields["detection_to_started_s"] = f"{now - state.failure_detected_at:.3f}"
    fields.update(state_fields(t, plan))
    # Members of the previous generation that are not in this one (a replica of several
    # nodes that lost one) wait out of it, as joiners.
    in_plan = set(chosen)
    left_out = [u for u in (state.generation.unit_ids if state.generation is not None else ())
                if u not in in_plan and state.units[u].state is UnitState.ACTIVE]
    commit_generation(t, plan, chosen + left_out, "world_formed", form.reason, fields)
    if state.failure_detected_at is not None:
        t.emit(RecoveryTimed(now - state.failure_detected_at))
        state.failure_detected_at = None
    t.emit(GenerationCounted(t.job.job_id))
    state.generation = plan
    state.generation_started_at = now
    state.last_change_at = now
    state.in_flight = None
    for unit_id in plan.unit_ids:
        # Each is sent this generation now: nothing left to wait for from before.
        if state.units[unit_id].facts.back_without_workers_at is not None:
            t.note(state.units[unit_id], back_without_workers_at=None)
    for unit_id, message in messages.members(plan, plan.unit_ids, reason=form.reason,
                                             stop_grace_s=failure.stop_grace_s(t, cause) if cause else None):
        t.send(unit_id, message)


def commit_generation(t: Step, plan: GenerationRecord, unit_ids: list[str], kind: str, reason: str,
                      fields: dict[str, object]) -> None:
    """What is persisted before any message about the generation leaves: the generation
    with its rank table, the job's generation number, each of `unit_ids` in its place (a
    member is active; a unit left out waits as a joiner, and one that was a member says so
    in `unit_standby`) and the event `kind`."""
    members = set(plan.unit_ids)
    t.emit(SaveGeneration(plan), SaveJob(t.job))
    for unit_id in unit_ids:
        unit = t.own(t.state.units[unit_id])
        member = plan.member(unit_id)
        if unit_id not in members and unit.state is UnitState.ACTIVE:
            incomplete = unit.replica > 0 and any(
                other.replica == unit.replica and (other.state.is_final or other.state is UnitState.LEAVING)
                for other in t.state.units.values())
            if incomplete:
                t.record("unit_standby", f"left out of generation {plan.number}: replica {unit.replica} lost a node; "
                         "this unit keeps its workers and their shards and waits for a node to take the lost one's "
                         "place", unit_id=unit_id, generation=plan.number,
                         fields={"cause": "replica_incomplete", "replica": str(unit.replica)})
            else:
                t.record("unit_standby", f"left out of generation {plan.number}: "
                         f"{len(plan.members) // t.replica_nodes} replica(s) is the size the job allows "
                         f"(min {t.job.spec.min_replicas}, max {t.job.spec.max_replicas}); it waits to join",
                         unit_id=unit_id, generation=plan.number, fields={"cause": "size"})
        unit.state = UnitState.ACTIVE if unit_id in members else UnitState.JOINING
        unit.group_rank = member.group_rank if member else -1
        t.emit(SaveUnit(unit))
    t.record(kind, reason, generation=plan.number, fields=fields)


def state_fields(t: Step, plan: GenerationRecord) -> dict[str, object]:
    """Decide and describe the state a new generation must be at: its target step (the
    watermark) and its holders. With none holding it past step 0 (live mode), the event
    says so: the workers load a checkpoint at or before it, or refuse to train."""
    state = t.state
    state.state_holders = holders(t, plan.unit_ids)
    unknown = unknown_steps(t, plan.unit_ids)
    if state.live and plan.resume_step > 0 and not state.state_holders and unknown:
        # Not heard from since this controller started: whether they hold it is not known
        # (the workers find out among themselves; a state truly gone is reported by them).
        t.emit(Note("state_holders_unknown", {"generation": plan.number, "target_step": plan.resume_step,
                                              "not_heard_from": join_ids(list(unknown))}))
    elif state.live and plan.resume_step > 0 and not state.state_holders:
        t.record("state_not_held",
                 f"no member of generation {plan.number} holds the training state at step "
                 f"{plan.resume_step}: its workers resume from a checkpoint at or before it, or "
                 "refuse to train", generation=plan.number, fields={"target_step": plan.resume_step})
    return {"target_step": plan.resume_step, "state_holders": join_ids(list(state.state_holders))}


def holders(t: Step, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
    """Live mode: which of `unit_ids` hold the state at the job's committed step, as
    their heartbeats said by the last tick, or their reports said since (`holds_step`: a
    joiner's heartbeats still say step 0 a moment after it reached the world)."""
    state = t.state
    if not state.live:
        return ()
    return state_holders(t.job.step, {u: unit_steps(state, u) for u in unit_ids if t.connected(u)})


def unit_steps(state: State, unit_id: str) -> list[int]:
    """What `unit_id`'s ranks hold, by their last heartbeat, or by a report since (its
    `holds_step`), whichever is newer."""
    link = state.links.get(unit_id)
    reported = state.units[unit_id].facts.holds_step
    beats = list(link.steps.values()) if link is not None else []
    return [max(step, reported) for step in beats] or ([reported] if reported else [])


def current_replicas(state: State) -> frozenset[int]:
    """Live mode, replicas of several nodes: the replicas with a unit whose ranks hold the
    newest step any live unit holds (a hole is filled there first: `replicas.assign_slot`).
    The newest, not the job's committed step: that lags the ranks, and a unit set aside a
    step ago would pass for current."""
    if not state.live:
        return frozenset()
    held = {u: min(steps) for u, unit in state.units.items()
            if unit.replica > 0 and not unit.state.is_final and (steps := unit_steps(state, u))}
    newest = max(held.values(), default=0)
    if newest <= 0:
        return frozenset()
    return frozenset(state.units[u].replica for u, step in held.items() if step == newest)


def unknown_steps(t: Step, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
    """Live mode: which of `unit_ids`, members of the running generation, have said nothing
    of their steps since this controller started (no heartbeat with steps, no report): a
    launcher back after a controller restart whose first heartbeat is still on its way.
    Whether they hold the state is unknown, not no."""
    state = t.state
    previous = state.generation
    if not state.live or previous is None:
        return ()
    unknown = []
    for unit_id in unit_ids:
        if previous.member(unit_id) is None or not t.connected(unit_id):
            continue
        link = state.links.get(unit_id)
        if (link is None or not link.steps) and state.units[unit_id].facts.holds_step == 0:
            unknown.append(unit_id)
    return tuple(unknown)


def reconfigure(t: Step, joiners: tuple[str, ...], leaving: tuple[str, ...], cause: str, reason: str,
                now: float, set_aside: tuple[str, ...] = ()) -> None:
    """Plan the next generation from the running one plus `joiners` minus `leaving` and
    `set_aside` (members out of the next world but not out of the job: the other nodes of a
    replica one of whose nodes leaves), commit it, and tell the joiners (or, with none,
    every old member) to move there."""
    state = t.state
    previous = state.generation
    assert previous is not None
    kept = [m.unit_id for m in previous.members if m.unit_id not in leaving and m.unit_id not in set_aside]
    # A member is never its own joiner (each unit once, members first).
    joiners = tuple(u for u in dict.fromkeys(joiners) if u not in kept)
    chosen = kept + list(joiners)
    try:
        plan = planning.plan_generation(job_id=t.job.job_id, number=t.job.generation + 1,
                                        candidates=candidates(t, chosen), replicas=len(chosen), reason=reason,
                                        now=t.now.wall, resume_step=t.job.step)
    except ValueError as error:
        t.emit(Note("reconfigure_not_planned", {"reason": str(error)}, warning=True))
        return
    old_members = tuple(m.unit_id for m in previous.members)
    # The state's source: the new world's rank 0, a survivor (survivors keep their order).
    source = min(plan.members, key=lambda m: m.group_rank).unit_id
    fields_of_state = state_fields(t, plan)
    message = messages.at_step_boundary(plan, previous.number, leaving, reason)
    t.job.generation = plan.number
    fields: dict[str, object] = {"cause": cause, "from_generation": previous.number, "world_size": plan.world_size,
                                 "replicas": len(plan.members) // replicas.nodes_per_replica(t.job.spec),
                                 "members": join_ids(list(plan.unit_ids)),
                                 "joiners": join_ids(list(joiners)), "leaving": join_ids(list(leaving)),
                                 "state_source": source, **fields_of_state}
    commit_generation(t, plan, chosen + list(set_aside), "world_reconfiguring", reason, fields)
    t.emit(GenerationCounted(t.job.job_id))
    state.in_flight = InFlight(
        ChangeKind.STEP_BOUNDARY, generation=plan.number, cause=cause, reason=reason, decided_at=now,
        deadline=now + t.config.reconfigure_timeout_s, waiting_for=set(plan.unit_ids),
        from_generation=previous.number, previous=previous, message=message, old_members=old_members,
        joiners_waiting=set(joiners))
    state.generation = plan
    state.generation_started_at = now
    state.last_change_at = now
    if joiners:
        for unit_id in joiners:
            t.send(unit_id, message)
        # The old members train on until the joiners are up; told that the change is on
        # its way, their ranks vote at each step's end too, and move right after the step
        # in which its world reaches them.
        coming = messages.change_coming(plan.number)
        for unit_id in old_members:
            if not state.units[unit_id].state.is_final:
                t.send(unit_id, coming)
    else:
        tell_old_members(t)


def tell_old_members(t: Step) -> None:
    pending = t.state.changing
    assert pending is not None and pending.message is not None
    pending.told_old_members = True
    for unit_id in pending.old_members:
        if not t.state.units[unit_id].state.is_final:
            t.send(unit_id, pending.message)


def on_reconfigure_report(t: Step, unit_id: str, report: launcher_pb2.GenerationReport) -> None:
    state = t.state
    pending = state.changing
    assert pending is not None
    now = t.now.monotonic
    if report.phase == launcher_pb2.GENERATION_PHASE_STARTED and unit_id in pending.joiners_waiting:
        pending.joiners_waiting.discard(unit_id)
        if not pending.joiners_waiting and not pending.told_old_members:
            t.record("joiners_ready", "every joiner's workers are up", generation=pending.generation,
                     fields={"decision_to_ready_s": f"{now - pending.decided_at:.3f}"})
            tell_old_members(t)
    elif report.phase == launcher_pb2.GENERATION_PHASE_RECONFIGURED:
        pending.waiting_for.discard(unit_id)
        if unit_id in state.units and report.step > state.units[unit_id].facts.holds_step:
            t.note(state.units[unit_id], holds_step=report.step)
        if pending.waiting_for or not pending.told_old_members:
            return
        state.in_flight = None
        # (The watermark rises from heartbeats only, so that it never runs ahead of the
        # steps the state holders are judged by.)
        t.emit(SaveJob(t.job))
        t.record("world_reconfigured", f"every rank moved from generation {pending.from_generation} "
                 "in-process", generation=pending.generation,
                 fields={"cause": pending.cause, "at_step": report.step,
                         "world_size": state.generation.world_size if state.generation else 0,
                         "decision_to_reconfigured_s": f"{now - pending.decided_at:.3f}"})
        leaving.leave_all(t, [(unit_id, cause, detail)
                              for unit_id, (cause, detail) in t.take_deferred_leaves().items()])


def on_first_step(t: Step, unit_id: str, report: launcher_pb2.GenerationReport) -> None:
    """The first step of a generation committed (every rank commits it together): the
    end of a recovery, or of a planned change."""
    state = t.state
    generation = state.generation
    if generation is None or report.generation in state.first_step_generations:
        return
    if report.generation != generation.number:
        # The world the survivors formed after a failure, already being replaced (a grow
        # decided before its first step was heard of): its first step still ends the
        # recovery, at that step's time, not at the next world's.
        recovery = state.recovery
        if recovery is not None and recovery.broken_generation < report.generation < generation.number:
            state.first_step_generations.add(report.generation)
            state.recovery = None
            previous = state.in_flight.previous if state.in_flight is not None else None
            record_recovered(t, unit_id, report, recovery, previous.world_size
                             if previous is not None and previous.number == report.generation else None)
        return
    state.first_step_generations.add(report.generation)
    # The step committed collectively: every member holds it.
    for member in generation.unit_ids:
        if report.step > state.units[member].facts.holds_step:
            t.note(state.units[member], holds_step=report.step)
    recovery = state.recovery
    if recovery is not None:
        state.recovery = None
        record_recovered(t, unit_id, report, recovery, world_size=generation.world_size)
        return
    t.record("first_step", f"first step of generation {report.generation} completed", unit_id=unit_id,
             generation=report.generation, fields={"step": report.step, "world_size": generation.world_size})


def record_recovered(t: Step, unit_id: str, report: launcher_pb2.GenerationReport, recovery: Recovery,
                     world_size: int | None) -> None:
    """The `recovered` event: from the failure (and its detection) to `report`'s step, at
    the step's own time (`world_size` None: not known any more, left out)."""
    at = report.at.ToNanoseconds() / 1e9 if report.HasField("at") else t.now.wall
    fields: dict[str, object] = {"step": report.step, "failed_unit": recovery.unit_id,
                                 "failure_to_first_step_s": f"{at - recovery.failed_at:.3f}",
                                 "detection_to_first_step_s": f"{at - recovery.detected_at:.3f}"}
    where = ""
    if world_size is not None:
        fields["world_size"] = world_size
        where = f" at world size {world_size}"
    t.record("recovered", f"survivors completed step {report.step}{where}", unit_id=unit_id,
             generation=report.generation, fields=fields)


def on_state_lost(t: Step, reason: str) -> None:
    """The workers refuse to train from nothing: the job fails, loudly. A job already
    past its last step is not failed by a late report."""
    if not t.job.state.is_final and t.job.state is not JobState.FINISHING:
        finishing.end(t, JobState.FAILED, "state_lost", reason)


def on_resumed_from_checkpoint(t: Step, unit_id: str, report: launcher_pb2.GenerationReport) -> None:
    """No member of a generation held the state at its target step; the workers loaded a
    checkpoint at `report.step`. The watermark goes back to it, loudly."""
    target = t.job.step
    t.job.step = report.step
    t.emit(SaveJob(t.job))
    t.record("resumed_from_checkpoint", report.detail or f"resumed from the checkpoint at step {report.step}",
             unit_id=unit_id, generation=report.generation,
             fields={"checkpoint_step": report.step, "target_step": target,
                     "steps_redone": max(0, target - report.step)})
