"""Failure and stop: the one failure path, the next generation at once from the survivors, or
a stop round first."""

from __future__ import annotations

from collections.abc import Mapping

from tidal.controller.core import finishing, forming, leaving, messages, planning, replicas, slurm_units, tick
from tidal.controller.core.state import (
    ChangeKind,
    Close,
    CrashLoop,
    FailureCounted,
    GenerationStopped,
    InFlight,
    PollSlurmSoon,
    Record,
    Recovery,
    SaveJob,
    SaveUnit,
    StopTimed,
)
from tidal.controller.core.step import Step
from tidal.controller.model import JobState, UnitState, join_ids


def fail(t: Step, unit_id: str, reason: str, cause: str, detected_at: float,
         failed_at: float | None = None, regroup: bool = True,
         fields: Mapping[str, str] | None = None, own_error: bool = False, spare_node: bool = False,
         error: tuple[int, float] | None = None) -> bool:
    """The one failure path: record, tell the failed unit to kill its workers, and move
    the others to the next generation (`regroup_survivors`; with `regroup` False the caller does,
    once for failures found together). `failed_at` (wall clock) is when the failure
    happened, where known; the survivors' first step after it ends the recovery;
    `fields` go into the failure's event besides its cause (a worker's exception).
    Whether the running world must re-form without the unit. A member's failure other
    than a worker's own error (`own_error`: a kill, a silence, a lost session or node)
    ends any run of crashes (`count_crash`). `spare_node`: a worker was killed while its
    launcher stayed healthy, so the unit's nodes are spared unless they failed before
    (`slurm_units.cool_down`). `error`: the generation and time (wall clock) of the
    worker's own error, with which its nodes' exclusion can be lifted."""
    state = t.state
    unit = state.units.get(unit_id)
    if unit is None or unit.state.is_final:
        return False
    if t.job.state is JobState.FINISHING:
        # Training is over: nothing to recover; the unit is just gone.
        leaving.mark_left(t, unit_id, f"after the last step: {reason}")
        finishing.maybe_complete(t)
        return False
    number = state.generation.number if state.generation is not None else 0
    was_member = (state.generation is not None and state.generation.member(unit_id) is not None
                  and unit.state in (UnitState.ACTIVE, UnitState.LEAVING)
                  and t.job.state in (JobState.RUNNING, JobState.RECONFIGURING))
    if was_member and not own_error:
        state.crash_loop = None
    unit = t.own(unit)
    unit.state = UnitState.FAILED
    unit.reason = reason
    t.emit(SaveUnit(unit), Record("failure_detected", reason, unit_id=unit_id, generation=number,
                                  fields={"cause": cause, **(fields or {})}), FailureCounted(cause))
    if state.slurm_units:
        slurm_units.cool_down(t, unit, detected_at, spare_node=spare_node, error=error)
        # A failed unit never comes back: whatever is left of it (a hung launcher, a
        # node whose slurmd died) gives its allocation back.
        slurm_units.cancel_in_slurm(t, unit)
    if t.connected(unit_id):
        t.send(unit_id, messages.stop(number, reason, stop_grace_s(t, "failure"), failed_unit_id=unit_id))
        t.emit(Close(unit_id, f"unit {unit_id} failed: {reason}"))
    if not was_member:
        return False
    if state.stopping is not None:
        state.stopping.waiting_for.discard(unit_id)
        maybe_finish_stop(t)
        return False
    if state.recovery is None:
        # (A recovery still unmeasured keeps its start: the first failure's.)
        state.failure_detected_at = detected_at
        wall_detected = t.now.wall - (t.now.monotonic - detected_at)
        state.recovery = Recovery(failed_at=failed_at or wall_detected, detected_at=wall_detected,
                                  unit_id=unit_id, broken_generation=number)
    if regroup:
        regroup_survivors(t, [(unit_id, reason, detected_at)])
    return True


def count_crash(t: Step, generation: int, exited_at: float) -> int:
    """A worker of `generation` exited with its own error at `exited_at` (wall clock): how
    many generations in a row have now failed that way soon after forming with no step
    committed between them (`crash_loop_generations`); 0 when this one does not count: it
    ran `crash_loop_window_s` or longer, or it is the world a live change leaves (whose
    start this state no longer has), and the count starts again. A generation counts once,
    however many of its workers fail; any other failure of a member ends the run (`fail`),
    and so does a worker of the counted generation found killed before the error came
    (`uncount_crash`)."""
    state = t.state
    loop = state.crash_loop
    if loop is not None and t.job.step != loop.step:
        # (Up: a step committed. Down: the job resumed from a checkpoint; no crash loop either.)
        loop = None
    running = state.generation.number if state.generation is not None else None
    if generation != running or t.now.monotonic - state.generation_started_at >= t.config.crash_loop_window_s:
        state.crash_loop = None
        return 0
    if loop is not None and loop.last_generation == generation:
        return loop.generations
    count = (loop.generations if loop is not None else 0) + 1
    state.crash_loop = CrashLoop(generations=count, step=t.job.step, last_generation=generation, exited_at=exited_at)
    return count


def uncount_crash(t: Step, generation: int, exited_at: float) -> None:
    """A worker of `generation` turns out to have been killed (a signal) or ended by its
    launcher at `exited_at`: if that generation was counted as a crash by an error that
    came later (a restart-mode rank raises when a peer dies, and its report may arrive
    first), it was no crash, and the run ends. Peers aborted after the error (NCCL's
    async error handling) leave the count as it is."""
    loop = t.state.crash_loop
    if loop is not None and loop.last_generation == generation and exited_at <= loop.exited_at:
        t.state.crash_loop = None


def killed_before_the_errors(t: Step, unit_id: str, generation: int, killed_at: float, silent: bool) -> None:
    """A worker of `unit_id` in `generation` turns out to have been killed (a signal) or
    ended by its launcher at `killed_at` (wall clock), its report coming after that
    generation ended: errors of its peers in it after that time were their reaction to
    the lost peer (a restart-mode rank raises when a peer dies; `uncount_crash` takes them
    out of the crash count). The nodes they excluded are given back
    (`slurm_units.lift_error_exclusions`): a unit still waiting in Slurm's queue with one
    of them excluded is cancelled, so that the next poll submits it without, and the
    killed worker's nodes are judged as a kill reported first would have been."""
    if not t.state.slurm_units:
        return
    lifted = slurm_units.lift_error_exclusions(t, generation, killed_at, unit_id)
    if not lifted:
        return
    for unit in slurm_units.submitted_excluding(t.state, lifted):
        slurm_units.cancel_in_slurm(t, unit)
        leaving.mark_left(t, unit.unit_id, f"cancelled while queued: submitted without node(s) "
                          f"{', '.join(sorted(set(unit.facts.excluded) & set(lifted)))}, given back since")
    t.emit(PollSlurmSoon(f"node(s) {', '.join(lifted)} given back"))
    killed = t.state.units.get(unit_id)
    if killed is not None:
        slurm_units.cool_down(t, killed, t.now.monotonic, spare_node=not silent)


def end_crash_loop(t: Step, generations: int, last: str, fields: Mapping[str, str]) -> None:
    """The job fails: its workers failed by an error in `generations` generations in a row
    (the event carries the last worker's error and traceback, as `failure_detected` does)."""
    window = t.config.crash_loop_window_s
    finishing.end(t, JobState.FAILED, "job_failed",
                  f"workers exited with an error in {generations} generations in a row, each within {window:g} s "
                  f"of forming, with no step committed between (crash_loop_generations "
                  f"{t.config.crash_loop_generations}); the last: {last}", fields={"cause": "crash_loop", **fields})


def regroup_survivors(t: Step, failed: list[tuple[str, str, float]]) -> None:
    """After the failure of members of the running generation: the next one at once, or
    a stop round first."""
    what = "; ".join(f"unit {unit_id} failed: {reason}" for unit_id, reason, _ in failed)
    if not go_on_without(t, what):
        begin_stop(t, "failure", what, min(at for _, _, at in failed))


def go_on_without(t: Step, what: str) -> bool:
    """A failure is one message to each survivor: the next generation, formed from the
    survivors in this transition. In live mode the launcher hands it to the workers,
    which leave the broken world for it (a rank in a collective with the dead one sees
    the collective fail; the others move at the end of the step). In restart mode the
    launcher stops its workers with the failure's grace, then starts the new ones; each
    launcher hosting a generation has its next store ready, so no stop round is needed
    to learn where the next one meets. Whether it formed; if not (a live change in
    flight, or the survivors alone make no size the job allows), the generation is
    stopped first."""
    state = t.state
    generation = state.generation
    if state.changing is not None or generation is None or t.job.state is not JobState.RUNNING:
        return False
    nodes = t.replica_nodes
    # A replica of several nodes that lost one is out of the next world as a whole (its
    # other units wait for a node to take the hole, keeping their workers and shards).
    survivors = tuple(replicas.whole_replicas_only(
        state.units, [u for u in generation.unit_ids if state.units[u].state is UnitState.ACTIVE], nodes))
    if not all(t.connected(u) for u in survivors):
        # A survivor not back yet after a controller restart: a stop round waits for it.
        return False
    # Joiners that have settled come along, up to max_replicas: one change, not two.
    settled = sorted((at, u) for u, unit in state.units.items()
                     if unit.state is UnitState.JOINING and t.connected(u)
                     and (at := unit.facts.joined_at if unit.facts.joined_at is not None else t.now.monotonic)
                     <= t.now.monotonic - t.config.join_settle_s)
    room = max(0, t.max_world - len(survivors) // nodes)
    if nodes > 1:
        whole = replicas.complete(state.units, [u for _, u in settled], nodes)
        joiners = tuple(u for units in list(whole.values())[:room] for u in units)
    else:
        joiners = tuple(u for _, u in settled[:room])
    reason = f"{what}; the survivors go on without it"
    return (bool(joiners) and next_generation_now(t, survivors, joiners, "failure", reason)) or \
        next_generation_now(t, survivors, (), "failure", reason)


def next_generation_now(t: Step, members: tuple[str, ...], joiners: tuple[str, ...], cause: str,
                        reason: str) -> bool:
    """Form and send the next generation of `members` + `joiners` now, as one message to
    each (in restart mode the launcher stops the old workers first), if
    they make a size the job allows and one of them can host the rendezvous. Whether it
    formed."""
    state = t.state
    previous = state.generation
    count = (len(members) + len(joiners)) // t.replica_nodes
    if not members or planning.choose_world_size(count, t.sizes()) != count:
        return False
    forming.start_generation(t, members, planning.Form(replicas=count, joiners=joiners, reason=reason),
                             t.now.monotonic, cause=cause)
    if previous is None or t.job.generation == previous.number:
        return False
    t.emit(GenerationStopped(t.job.job_id, previous.number, t.now.wall))
    return True


def stop_grace_s(t: Step, cause: str) -> float:
    """Workers' SIGTERM-to-SIGKILL grace: short for a failure, longer for a planned change."""
    return t.config.failure_stop_grace_s if cause == "failure" else t.config.restart_grace_s


def begin_stop(t: Step, cause: str, reason: str, detected_at: float) -> None:
    """Send the stop (an empty generation) to every member of the running one and wait for
    each to confirm (or fail past the deadline); it supersedes any change in flight."""
    state = t.state
    assert state.generation is not None
    now = t.now.monotonic
    waiting = {m.unit_id for m in state.generation.members
               if state.units[m.unit_id].state in (UnitState.ACTIVE, UnitState.LEAVING)
               and (t.connected(m.unit_id) or now < state.reconnect_deadline)}
    # Live-mode workers stop in-process at their next check (a micro-batch boundary, or a
    # collective failing): they get the planned-change grace, not a failure's.
    grace_s = t.config.restart_grace_s if state.live else stop_grace_s(t, cause)
    deadline = max(now + grace_s + t.config.heartbeat_timeout_s, state.reconnect_deadline)
    stop = state.in_flight = InFlight(ChangeKind.STOP, generation=state.generation.number, cause=cause,
                                      reason=reason, decided_at=detected_at, waiting_for=waiting, deadline=deadline)
    t.enter_state(JobState.RECONFIGURING)
    t.emit(SaveJob(t.job))
    t.record("generation_stopping", reason, generation=state.generation.number,
             fields={"cause": cause, "waiting_for": join_ids(sorted(waiting))})
    message = messages.stop(stop.generation, reason, stop_grace_s(t, cause))
    for unit_id in sorted(waiting):
        if state.units[unit_id].state is not UnitState.LEAVING:
            t.send(unit_id, message)
    maybe_finish_stop(t)


def maybe_finish_stop(t: Step) -> None:
    state = t.state
    stop = state.stopping
    if stop is None or stop.waiting_for:
        return
    now = t.now.monotonic
    state.in_flight = None
    elapsed = now - stop.decided_at
    t.emit(GenerationStopped(t.job.job_id, stop.generation, t.now.wall))
    t.record("generation_stopped", f"every rank of generation {stop.generation} stopped",
             generation=stop.generation,
             fields={"cause": stop.cause, "detection_to_all_stopped_s": f"{elapsed:.3f}"})
    if stop.cause == "failure":
        t.emit(StopTimed(elapsed))
    if t.job.state.is_final:
        return
    # Leaves deferred behind a live change this stop replaced: no change is in flight any
    # more, so they are carried out now, before the next world is decided (else a drained
    # unit stayed while no world formed, and was put in the next one).
    deferred = t.take_deferred_leaves()
    if deferred:
        leaving.leave_all(t, [(unit_id, cause, detail) for unit_id, (cause, detail) in deferred.items()])
    tick.decide(t, now, after=stop.reason)
    if t.job.state is JobState.RECONFIGURING:
        alive = sum(1 for u in state.units.values() if u.state in (UnitState.ACTIVE, UnitState.JOINING))
        # (Units: nodes, where a replica spans several.)
        nodes = replicas.nodes_per_replica(t.job.spec)
        minimum = t.job.spec.min_replicas
        t.set_state(JobState.DEGRADED, f"{alive} replica(s) alive, below min_replicas {minimum}; waiting for more"
                    if nodes == 1 else f"{alive} node(s) of replicas of {nodes} alive, below min_replicas {minimum} "
                    f"({minimum * nodes} nodes of whole replicas); waiting for more")
