"""What each input means: a launcher connecting, what it says (worker exits, leave requests,
reports), its session closing, and the admin's requests; the one place inputs are taken apart."""

from __future__ import annotations

from tidal.controller.core import failure, finishing, forming, leaving, messages, replicas, slurm_units, tick
from tidal.controller.core.queries import (
    alive_units,
    describe_worker_exit,
    unit_number,
    worker_error_fields,
)
from tidal.controller.core.replicas import Slot
from tidal.controller.core.state import (
    CancelFailed,
    CancelRequested,
    ClockTick,
    DrainRequested,
    Input,
    LauncherClosed,
    LauncherConnected,
    LauncherSaid,
    Note,
    PollSlurmSoon,
    ResizeRequested,
    SaveJob,
    SavePending,
    SaveUnit,
    SlurmObserved,
    StaleMessageCounted,
    UnitSubmitted,
)
from tidal.controller.core.step import Step
from tidal.controller.model import JobState, UnitRecord, UnitState, join_ids
from tidal.proto import admin_pb2, launcher_pb2
from tidal.proto.control import EXIT_STATE_LOST


def handle(t: Step, event: Input) -> None:
    match event:
        case ClockTick(links):
            t.state.links = {u: link for u, link in links.items() if t.connected(u)}
            tick.on_tick(t, t.now.monotonic)
        case LauncherConnected(unit_id, register, slot):
            on_connected(t, unit_id, register, slot)
        case LauncherSaid(unit_id, message):
            if t.connected(unit_id):
                on_said(t, unit_id, message)
        case LauncherClosed(unit_id, reason):
            on_disconnected(t, unit_id, reason)
        case CancelRequested(uid):
            if not t.job.state.is_final:
                finishing.end(t, JobState.CANCELLED, "job_cancelled", f"cancelled by uid {uid}")
        case DrainRequested(unit_ids, uid):
            for unit_id in unit_ids:
                leaving.leave(t, unit_id, "drained", f"drained by uid {uid}")
        case ResizeRequested(min_replicas, max_replicas, uid):
            on_resize(t, min_replicas, max_replicas, uid)
        case SlurmObserved(view, grow_allowance, yields, next_in_line):
            slurm_units.on_slurm(t, view, t.now.monotonic, grow_allowance, yields, next_in_line)
        case UnitSubmitted(unit_id, slurm_job_id, error, answer_lost):
            slurm_units.on_unit_submitted(t, unit_id, slurm_job_id, error, answer_lost)
        case CancelFailed(unit_id, slurm_job_id, error, unanswered):
            slurm_units.on_cancel_failed(t, unit_id, slurm_job_id, error, unanswered)


def on_connected(t: Step, unit_id: str, register: launcher_pb2.Register, slot: Slot | None = None) -> None:
    state, now = t.state, t.now.monotonic
    t.forget_link(unit_id)
    unit = state.units.get(unit_id)
    fields = {"address": register.address, "nodes": join_ids(list(register.nodes)),
              "workers": join_ids([str(p) for p in register.worker_pids])}
    if register.HasField("started_at"):
        # When the launcher's process started: Slurm's start before it, the launcher's after.
        fields["launcher_started_at"] = f"{register.started_at.ToNanoseconds() / 1e9:.3f}"
    new = unit is None or unit.state is UnitState.SUBMITTED
    if unit is None:
        unit = UnitRecord(job_id=t.job.job_id, unit_id=unit_id, state=UnitState.JOINING)
        state.units[unit_id] = unit
        t.owned.add(unit_id)
    unit = t.note(unit, connected=True, store_port=register.store_port, disconnected_at=None)
    if new:
        unit.state = UnitState.JOINING
        unit.nodes = list(register.nodes) or [register.address]
        unit.address = register.address
        unit.procs_per_node = t.job.spec.procs_per_node or 1
        # The id Tidal submitted stays known when a launcher does not report one.
        unit.slurm_job_id = register.slurm_job_id or unit.slurm_job_id
        if unit.slurm_job_id:
            # Named here too: a controller stopped between sbatch's answer and its
            # unit_submitted record learns the id from the launcher alone.
            fields["slurm_job_id"] = str(unit.slurm_job_id)
        unit.registered_at = t.now.wall
        if slot is not None:
            # Its place in a replica of several nodes, as its Registered said (the node
            # index for life; the replica unless a merge takes another's number).
            slot = replicas.renumbered_if_taken(state.units, unit_id, slot, state.renumbered_replicas)
            unit.replica, unit.node_index = slot.replica, slot.node_index
            fields.update({"replica": str(slot.replica), "node_index": str(slot.node_index)})
        unit = t.note(unit, joined_at=now)
        t.emit(SaveUnit(unit))
        t.record("unit_registered", "launcher registered", unit_id=unit_id, fields=fields)
        if t.job.state is JobState.FINISHING:
            leaving.leave(t, unit_id, "finished", "training finished before this unit joined")
        elif unit.facts.queued_ahead and state.slurm_units:
            # Slurm started it from its queue: a node freed, perhaps with others (a job of
            # several nodes ended). A grow waits for the view that shows them
            # (`planning.decide_world`); ask for it now.
            t.emit(PollSlurmSoon(f"unit {unit_id}, queued in Slurm, started: nodes may have freed"))
        return
    unit.address = register.address or unit.address
    if t.job.state is JobState.FINISHING:
        if unit.state is UnitState.JOINING or not register.worker_pids:
            # Not part of the finished world, or its workers are gone (they exited while
            # the controller was away): nothing more to wait for here.
            leaving.leave(t, unit_id, "finished", "reconnected after the last step")
        return
    generation = state.generation
    member = generation.member(unit_id) if generation is not None else None
    if unit.state is UnitState.JOINING:
        t.note(unit, joined_at=now)
        t.record("launcher_reconnected", "joining unit reconnected", unit_id=unit_id, fields=fields)
        return
    if member is None or generation is None:
        return
    stop = state.stopping
    if stop is not None and stop.generation == generation.number:
        stop.waiting_for.add(unit_id)
        t.send(unit_id, messages.stop(stop.generation, stop.reason, failure.stop_grace_s(t, stop.cause)))
        t.record("launcher_reconnected", "told to stop the generation being stopped", unit_id=unit_id,
                 generation=generation.number, fields=fields)
    elif register.last_generation == generation.number and register.worker_pids:
        t.record("launcher_reattached", f"still running generation {generation.number}; workers untouched",
                 unit_id=unit_id, generation=generation.number, fields=fields)
    elif (register.last_generation and not register.worker_pids and t.job.state is JobState.RUNNING
          and (state.live or register.last_generation == generation.number)):
        # A member back with no workers lost them while the controller was away (live
        # mode; restart mode: those of this very generation): its queued reports (the
        # exits, or "finished") follow on this stream. No fresh worker goes into the running
        # world (in restart mode the script would run again, a finished one too); if those
        # reports do not settle it within heartbeat_timeout_s, the unit has failed
        # (`tick.on_tick`).
        t.note(unit, back_without_workers_at=now)
        t.record("launcher_reconnected", "back with no workers; waiting for its reports", unit_id=unit_id,
                 generation=generation.number, fields=fields)
    elif t.job.state is JobState.RUNNING:
        t.send(unit_id, messages.member(generation, unit_id, reason="sent again after a reconnection"))
        had = (f"at generation {register.last_generation}" if register.worker_pids
               else "without workers")
        t.record("generation_start_resent", f"reconnected {had}; sent generation {generation.number} again",
                 unit_id=unit_id, generation=generation.number, fields=fields)


def on_said(t: Step, unit_id: str, message: launcher_pb2.LauncherMessage) -> None:
    state = t.state
    kind = message.WhichOneof("body")
    if kind == "worker_exited":
        on_worker_exited(t, unit_id, message.worker_exited)
    elif kind == "leave_request":
        request = message.leave_request
        cause = launcher_pb2.LeaveCause.Name(request.cause).removeprefix("LEAVE_CAUSE_").lower()
        leaving.leave(t, unit_id, cause, request.detail or cause)
    elif kind == "generation_report":
        report = message.generation_report
        if (report.phase == launcher_pb2.GENERATION_PHASE_RECONFIGURED and report.replica_workers > 0
                and report.replica_workers != state.replica_workers):
            state.replica_workers = report.replica_workers
            # Kept across a controller restart: a world decided node by node must not be
            # taken for whole replicas by the next controller (`replicas.world_nodes`).
            t.emit(SavePending("replica_workers", report.replica_workers))
        if report.store_port and unit_id in state.units:
            t.note(state.units[unit_id], store_port=report.store_port)
        if report.phase == launcher_pb2.GENERATION_PHASE_LEFT:
            unit = state.units.get(unit_id)
            if (state.live and report.step > t.job.step and report.generation == t.job.generation
                    and unit is not None and unit.state is UnitState.LEAVING and unit.facts.saving_state):
                # It saved the state at that step before leaving (save_state): every rank
                # had committed it, and the next world's target is that step, not the
                # heartbeats' older figure.
                t.job.step = report.step
                t.emit(SaveJob(t.job))
            leaving.mark_left(t, unit_id, report.detail or "left")
            if t.job.state is JobState.FINISHING:
                finishing.maybe_complete(t)
        elif report.phase == launcher_pb2.GENERATION_PHASE_FINISHED:
            finishing.begin_finishing(t, unit_id, report.generation, report.step,
                                      f"unit {unit_id} committed the last step, {report.step}")
        elif report.phase == launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT:
            if report.generation in current_generations(t):
                forming.on_resumed_from_checkpoint(t, unit_id, report)
            else:
                # Of a world already replaced (said again in a later session): the
                # watermark has moved on since, and its step is no longer the job's.
                stale(t, unit_id, "generation_report", report.generation)
        elif report.phase == launcher_pb2.GENERATION_PHASE_STATE_LOST:
            if report.generation in current_generations(t):
                forming.on_state_lost(t, report.detail or f"no member of generation {report.generation} holds "
                                      f"step {report.step} and there is no checkpoint")
            else:
                # Of a world already replaced: a state truly lost is said again by the
                # workers of the world that lacks it.
                stale(t, unit_id, "generation_report", report.generation)
        elif report.phase == launcher_pb2.GENERATION_PHASE_FIRST_STEP:
            forming.on_first_step(t, unit_id, report)
        elif state.changing is not None and report.generation == state.changing.generation:
            forming.on_reconfigure_report(t, unit_id, report)
        stop = state.stopping
        if (report.phase in (launcher_pb2.GENERATION_PHASE_STOPPED, launcher_pb2.GENERATION_PHASE_LEFT)
                and stop is not None and report.generation == stop.generation):
            stop.waiting_for.discard(unit_id)
            failure.maybe_finish_stop(t)


# Exit codes a shell gives a child killed by a signal (128 + N): a worker started through a
# wrapper (`bash -c`, a run script) that was killed exits so, with no signal of its own.
SIGNALLED_EXIT_CODES = (129, 128 + 64)


def current_generations(t: Step) -> set[int]:
    """The generations a worker's message is about the running world in: the newest, and
    while a live change is in flight the one it leaves."""
    state = t.state
    current = {state.generation.number} if state.generation is not None else set()
    if state.changing is not None:
        current.add(state.changing.from_generation)
    return current


def stale(t: Step, unit_id: str, kind: str, generation: int) -> None:
    """A message of a world already replaced: counted, logged, and nothing decided on it."""
    t.emit(StaleMessageCounted(),
           Note("stale_message_ignored", {"unit": unit_id, "kind": kind, "message_generation": generation}))


def on_worker_exited(t: Step, unit_id: str, exited: launcher_pb2.WorkerExited) -> None:
    state = t.state
    if t.job.state is JobState.FINISHING:
        finishing.on_exit_after_finish(t, unit_id, exited)
        return
    current = current_generations(t)
    if state.live and exited.exit_code == EXIT_STATE_LOST and exited.generation in current:
        # The worker refused to train: no state at the target and no checkpoint (its
        # own report says more, and normally comes first).
        forming.on_state_lost(t, f"a worker of unit {unit_id} exited {EXIT_STATE_LOST}: no replica holds the "
                              f"training state at step {t.job.step} and there is no checkpoint")
        return
    # An error of the worker's own (not a signal, not its launcher ending it) may be one a
    # replacement would hit again: enough generations in a row end the job
    # (`failure.count_crash`).
    own_error = (exited.exit_code != 0 and exited.signal == 0 and not exited.detail
                 and not SIGNALLED_EXIT_CODES[0] <= exited.exit_code <= SIGNALLED_EXIT_CODES[1])
    reported_at = exited.exited_at.ToNanoseconds() / 1e9 if exited.HasField("exited_at") else None
    exited_at = reported_at if reported_at is not None else t.now.wall
    if state.generation is None or exited.generation not in current or t.job.state is not JobState.RUNNING:
        if not own_error:
            # (A worker of a generation counted as a crash was in fact killed: the error
            # that came first was its peers' reaction, as a restart-mode rank raises when a
            # peer dies. Nor is the erring worker's node at fault.)
            failure.uncount_crash(t, exited.generation, exited_at)
            if exited.signal != 0 or exited.exit_code != 0:
                failure.killed_before_the_errors(t, unit_id, exited.generation, exited_at, bool(exited.detail))
        stale(t, unit_id, "worker_exited", exited.generation)
        return
    member = state.generation.member(unit_id)
    if member is None:
        return
    rank = member.first_rank + exited.local_rank
    if exited.exit_code == 0 and exited.signal == 0:
        # A rank that exits 0 is done training (restart mode's only sign of the end;
        # live mode says "finished" first): the job finishes, nothing re-forms.
        finishing.begin_finishing(t, unit_id, exited.generation, t.job.step, f"rank {rank} (pid {exited.pid}) exited 0")
        finishing.on_exit_after_finish(t, unit_id, exited)
        return
    reason = f"worker rank {rank} (pid {exited.pid}) {describe_worker_exit(exited)}"
    crashes = failure.count_crash(t, exited.generation, exited_at) if own_error else 0
    limit = t.config.crash_loop_generations
    ending = limit > 0 and crashes >= limit
    fields = worker_error_fields(exited)
    # A worker killed (a signal, not its own error: crashes count towards a crash loop,
    # and their node is excluded at once) while its launcher is healthy spares the node
    # the first time, as torchrun restarts in place; a silent one does not.
    failure.fail(t, unit_id, reason, "silent" if exited.detail else "worker_exit", t.now.monotonic,
                 failed_at=reported_at, fields=fields, regroup=not ending, own_error=own_error,
                 spare_node=not own_error and not exited.detail,
                 error=(exited.generation, exited_at) if own_error else None)
    if ending:
        failure.end_crash_loop(t, crashes, f"unit {unit_id} {reason}", fields)


def on_disconnected(t: Step, unit_id: str, reason: str) -> None:
    state = t.state
    t.forget_link(unit_id)
    unit = state.units.get(unit_id)
    if unit is None:
        return
    unit = t.note(unit, connected=False)
    if unit.state.is_final:
        return
    if t.job.state is JobState.FINISHING:
        # Past the last step a closed session is no failure; it may be a blip, so the
        # unit has reconnect_grace_s to come back before it counts as gone (`tick.on_tick`).
        t.note(unit, disconnected_at=t.now.monotonic)
        return
    if unit.state is UnitState.LEAVING or t.job.state.is_final:
        leaving.gone(t, unit_id, f"session closed ({reason})")
        return
    if unit.state is UnitState.ACTIVE and state.generation is not None and state.generation.member(unit_id):
        failure.fail(t, unit_id, f"launcher stream broke: {reason}", "stream", t.now.monotonic)
        return
    # (A joining unit out of touch past reconnect_grace_s fails: `health.judge`.)
    t.note(unit, joined_at=None, disconnected_at=t.now.monotonic)
    t.record("launcher_disconnected", reason, unit_id=unit_id)


def on_resize(t: Step, min_replicas: int, max_replicas: int, uid: int) -> None:
    state = t.state
    if t.job.state.is_final:
        # (The admin call refuses an ended job; one that ended while the resize was queued
        # keeps the bounds it ended with.)
        return
    spec = admin_pb2.JobSpec()
    spec.CopyFrom(t.job.spec)
    t.job.spec = spec
    spec.min_replicas = min_replicas or spec.min_replicas
    spec.max_replicas = max_replicas or spec.max_replicas
    t.emit(SaveJob(t.job))
    t.record("job_resized", f"by uid {uid}",
             fields={"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas})
    # In units: a replica of K nodes is K members.
    limit = spec.max_replicas * replicas.nodes_per_replica(spec)
    detail = f"max_replicas is now {spec.max_replicas}"
    generation = state.generation
    alive = alive_units(state)
    members = {u.unit_id for u in alive if generation is not None and generation.member(u.unit_id) is not None}
    # Units not in the world beyond the new max: those Slurm has not started yet (cancelled
    # there), then those waiting to join (asked to leave), the newest first. At max they
    # would never join, and a started one held its node for good. (One-node replicas only:
    # with replicas of K nodes, trimmed unit by unit, a whole replica waiting to join lost
    # a node while half of another was kept, and neither could join.)
    outside = sorted((u for u in alive if u.unit_id not in members),
                     key=lambda u: (u.state is not UnitState.SUBMITTED, -unit_number(u.unit_id), -u.registered_at)
                     ) if replicas.nodes_per_replica(spec) == 1 else []
    for unit in outside[:max(0, len(outside) - max(0, limit - len(members)))]:
        if unit.state is UnitState.SUBMITTED:
            slurm_units.cancel_in_slurm(t, unit)
            leaving.mark_left(t, unit.unit_id, f"resized: {detail}")
        else:
            leaving.leave(t, unit.unit_id, "resized", detail)
    if generation is not None and t.job.state is JobState.RUNNING:
        surplus = len(generation.members) - limit
        leaving.leave_all(t, [(member.unit_id, "resized", detail)
                              for member in sorted(generation.members, key=lambda m: -m.group_rank)[:max(0, surplus)]])
