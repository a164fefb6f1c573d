"""The end of training: FINISHING once a rank committed the last step, then COMPLETED once;
and the end of a job for any reason (`end`)."""

from __future__ import annotations

from collections.abc import Mapping

from tidal.controller.core import leaving, messages, slurm_units
from tidal.controller.core.completion import FinishingMember, completion_verdict
from tidal.controller.core.queries import (
    describe_worker_exit,
    worker_error_fields,
)
from tidal.controller.core.state import (
    GenerationStopped,
    SaveJob,
    SavePending,
    SaveUnit,
)
from tidal.controller.core.step import Step
from tidal.controller.model import GenerationRecord, JobState, UnitRecord, UnitState
from tidal.proto import launcher_pb2


def begin_finishing(t: Step, unit_id: str, generation: int, step: int, reason: str) -> None:
    """A rank committed the job's last step (or, in restart mode, exited 0): training is
    over. No generation forms from here; a world change or stop in flight is dropped;
    units that are not in the finished world leave; exits and silences are no longer
    failures."""
    state = t.state
    if t.job.state.is_final or t.job.state is JobState.FINISHING:
        return
    t.job.state = JobState.FINISHING
    t.job.step = max(t.job.step, step)
    finished_world = world_of(t, generation)
    state.in_flight = None
    t.take_deferred_leaves()
    t.emit(SaveJob(t.job))
    t.record("job_finishing", reason, unit_id=unit_id, generation=generation, fields={"step": t.job.step})
    members = {m.unit_id: m.world_share for m in finished_world.members} if finished_world is not None else {}
    for member_id, unit in list(state.units.items()):
        if unit.facts.finishing_workers != members.get(member_id):
            t.note(unit, finishing_workers=members.get(member_id))
    t.emit(SavePending("finishing_members", members))
    for other_id, unit in list(state.units.items()):
        if unit.state.is_final or other_id in members:
            continue
        if unit.state is UnitState.SUBMITTED:
            slurm_units.cancel_in_slurm(t, unit)
            leaving.mark_left(t, other_id, "training finished before it registered")
        else:
            leaving.leave(t, other_id, "finished", "training finished")
    maybe_complete(t)


def world_of(t: Step, generation: int) -> GenerationRecord | None:
    """The generation numbered `generation`, if it is the newest one, the one a live change
    in flight leaves, or the one before the newest as SQLite held it at this controller's
    start (a live change a restart cut short: its joiners were never in the world that
    finished, and waiting for them kept the job FINISHING for ever, sharded chaos seed
    302); else the newest one."""
    state = t.state
    pending = state.changing
    if pending is not None and pending.previous is not None and pending.previous.number == generation:
        return pending.previous
    before = state.restored_previous
    if (before is not None and before.number == generation and state.generation is not None
            and state.generation.number == generation + 1):
        return before
    return state.generation


def on_exit_after_finish(t: Step, unit_id: str, exited: launcher_pb2.WorkerExited) -> None:
    unit = t.state.units[unit_id]
    if exited.exit_code == 0 and exited.signal == 0:
        t.note(unit, exited_ok=unit.facts.exited_ok | {exited.local_rank})
        t.record("worker_finished", f"local rank {exited.local_rank} (pid {exited.pid}) exited 0",
                 unit_id=unit_id)
    else:
        how = describe_worker_exit(exited)
        t.note(unit, exited_failed={**unit.facts.exited_failed, exited.local_rank: how})
        t.record("worker_failed_after_training",
                 f"local rank {exited.local_rank} (pid {exited.pid}) {how} after the last step; "
                 "training is complete, so nothing re-forms", unit_id=unit_id,
                 fields=worker_error_fields(exited))
    maybe_complete(t)


def finishing_member(unit: UnitRecord) -> FinishingMember | None:
    """What the completion verdict reads of a unit of the finished world (None: not one)."""
    if unit.facts.finishing_workers is None:
        return None
    return FinishingMember(unit_id=unit.unit_id, workers=unit.facts.finishing_workers,
                           exited_ok=unit.facts.exited_ok, exited_failed=dict(unit.facts.exited_failed),
                           gone=unit.state.is_final)


def unit_done(unit: UnitRecord) -> bool:
    """Whether nothing more of `unit` is waited for before the job completes."""
    member = finishing_member(unit)
    return member is None or member.done


def maybe_complete(t: Step) -> None:
    state = t.state
    if t.job.state is not JobState.FINISHING:
        return
    members = [m for m in map(finishing_member, state.units.values()) if m is not None]
    verdict = completion_verdict(t.job.step, members)
    if verdict is not None:
        end(t, JobState.COMPLETED, "job_completed", verdict.reason)


def end(t: Step, job_state: JobState, kind: str, reason: str, fields: Mapping[str, object] | None = None) -> None:
    state = t.state
    t.job.state = job_state
    state.in_flight = None
    number = state.generation.number if state.generation is not None else 0
    t.emit(SaveJob(t.job))
    if state.generation is not None:
        t.emit(GenerationStopped(t.job.job_id, number, t.now.wall))
    t.record(kind, reason, generation=number, fields=fields)
    for unit_id, unit in state.units.items():
        if unit.state.is_final:
            continue
        if not t.connected(unit_id):
            # Waiting in Slurm's queue (it would start for nothing), or running with its
            # launcher out of touch: the job is over, so its Slurm job goes too.
            slurm_units.cancel_in_slurm(t, unit)
            leaving.mark_left(t, unit_id, reason)
            continue
        if unit.state is UnitState.LEAVING:
            continue
        unit = t.note(unit, leaving_since=t.now.monotonic)
        unit.state = UnitState.LEAVING
        t.emit(SaveUnit(unit))
        t.send(unit_id, messages.leave(number, unit_id, reason))
