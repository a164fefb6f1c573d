"""Units as Slurm jobs: what a Slurm view means for the job's units (gone, requeued,
preempted), growth onto idle nodes, submissions and their answers, node cool-downs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tidal.controller import units as unit_rules
from tidal.controller.core import leaving, replicas, sharing
from tidal.controller.core.queries import (
    alive_units,
)
from tidal.controller.core.state import (
    CancelInSlurm,
    ErrorExclusion,
    PollSlurmSoon,
    SavePending,
    SaveUnit,
    State,
    Submit,
)
from tidal.controller.core.step import Step
from tidal.controller.model import JobState, UnitRecord, UnitState
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.models import NodeFlag, NodeState
from tidal.slurm.snapshot import ClusterView


def on_slurm(t: Step, view: ClusterView, now: float, grow_allowance: int | None,
             yields: tuple[sharing.YieldOrder, ...], next_in_line: bool = True) -> None:
    """Reconcile units with what Slurm shows, yield what the cluster-wide plan asks,
    then submit what the job needs. A stale view (Slurm did not answer) decides
    nothing."""
    state = t.state
    if view.stale:
        # Slurm did not answer: what its views said below min, or of units queued in it, no
        # longer holds.
        state.blocked_below_min_since = state.blocked_below_min_seen_at = None
        for unit in list(state.units.values()):
            if unit.state is UnitState.SUBMITTED and unit.facts.queued_in_slurm:
                t.note(unit, queued_in_slurm=False)
    if not state.slurm_units or view.stale:
        return
    retry_cancels(t, view)
    if t.job.state.is_final:
        return
    # When the view was taken, on the monotonic clock.
    seen = now - max(0.0, t.now.wall - view.observed_at)
    state.slurm_seen_at = seen
    # Units that leave on this view: those Slurm preempts, then those yielding; together
    # (`leaving.leave_all`: one world change, or one stop, for all of them).
    leavers: list[tuple[str, str, str]] = []
    for unit in list(state.units.values()):
        if unit.state is UnitState.SUBMITTED and not unit.slurm_job_id and not unit.facts.sbatch_in_flight:
            find_unanswered(t, unit, view)
        if not unit.slurm_job_id or unit.state.is_final:
            continue
        found = view.job(unit.slurm_job_id)
        if unit.state is UnitState.LEAVING:
            if not unit.facts.connected and view.observed_at >= unit.facts.submitted_at + 1.0 and (
                    found is None or found.state.is_finished or found.was_requeued):
                # Asked to leave, and its Slurm job is over (it left while the controller was
                # away, or Slurm ended it): it is gone now, not at the overdue deadline.
                if found is not None and found.was_requeued and found.state is SlurmJobState.PENDING:
                    cancel_in_slurm(t, unit)  # (the requeued copy: Tidal places replacements itself)
                what = found.state.value.lower() if found else "gone from squeue"
                leaving.gone(t, unit.unit_id, f"its Slurm job {unit.slurm_job_id} is {what}, with its launcher "
                             "out of touch")
            continue
        if found is not None and found.was_requeued and found.state is SlurmJobState.PENDING:
            # Slurm requeued the unit (an sbatch option allowed it): its processes are
            # gone, and a copy that started later would hold a node Tidal did not ask
            # for. Tidal places replacements itself, so the copy is cancelled.
            on_requeued(t, unit, found.job_id)
        elif unit.state in (UnitState.ACTIVE, UnitState.JOINING):
            # Slurm chose the unit for preemption: it has until its end time (GraceTime),
            # and SIGTERM reaches the launcher only at the end of it. Leave now; but after
            # the last step, a member of the finished world stays for that time: its
            # workers run the script's own code after train(), which under HybridSharded
            # gathers the sharded tensors with the unit's peers (a final save). Asked to
            # leave, its workers were stopped in it, and a peer's gather broke (sharded
            # chaos, seed 300: no final parameters).
            if found is not None and found.is_being_preempted:
                if t.job.state is JobState.FINISHING and unit.facts.finishing_workers is not None:
                    if not unit.facts.preempted_after_training:
                        t.note(unit, preempted_after_training=True)
                        # Persisted: a restarted controller would record it again.
                        t.emit(SavePending("preempted_after_training", sorted(
                            u.unit_id for u in state.units.values() if u.facts.preempted_after_training)))
                        t.record("unit_preempted_after_training", f"Slurm preempts job {unit.slurm_job_id} after "
                                 "the last step: its workers finish the script's code after train() until Slurm's "
                                 "grace time ends, rather than leave now", unit_id=unit.unit_id)
                else:
                    leavers.append((unit.unit_id, "preempted", f"Slurm preempts job {unit.slurm_job_id}"))
        elif view.observed_at >= unit.facts.submitted_at + 1.0 and (
                found is None or found.state.is_finished):
            # (A view taken before the submission proves nothing.)
            what = found.state.value.lower() if found else "gone from squeue"
            unit_lost(t, unit, f"Slurm job {unit.slurm_job_id} {what} before its launcher registered")
        elif found is not None and unit.state is UnitState.SUBMITTED:
            started = (seen - max(0.0, view.observed_at - found.start_time.timestamp())
                       if found.start_time is not None else seen)
            note_submitted_unit(t, unit, found.state, started)
    leavers.extend((order.unit_id, "yielded", order.reason) for order in yields)
    leaving.leave_all(t, leavers)
    spec = t.job.spec
    alive = alive_units(state)
    excluded = state.excluded_nodes(now)
    # Idle nodes are for others first: grow only while no other Slurm job waits for
    # nodes this job could take.
    usable = unit_rules.partition_nodes(spec, view.nodes)
    others_waiting = unit_rules.others_waiting_for(view, t.job.job_id, usable)
    note_blocked_below_min(t, view, seen, alive, frozenset(excluded), bool(others_waiting))
    if now < state.next_submit_at or state.stopping is not None or t.job.state is JobState.FINISHING:
        return
    # Units Slurm has not placed yet will take idle nodes (a unit's nodes each: K of a
    # replica in restart mode); running ones already hold theirs.
    waiting = sum(1 for u in alive if u.state is UnitState.SUBMITTED
                  and ((found := view.job(u.slurm_job_id)) is None or found.state is SlurmJobState.PENDING))
    idle = unit_rules.idle_nodes_for(spec, view.nodes, frozenset(excluded))
    taken = waiting * unit_rules.unit_nodes(spec)
    # Replicas of several nodes: the nodes missing from replicas that lost one, less the
    # units submitted and not registered yet (each takes a hole first when it registers).
    # In nodes of Slurm's, whatever the world makes of them (`replicas.world_nodes`).
    nodes = replicas.nodes_per_replica(spec)
    holes = max(0, sum(nodes - len(units) for units in replicas.incomplete_replicas(state.units, nodes).values())
                - sum(1 for u in alive if u.state is UnitState.SUBMITTED))

    def demand_within(allowance: int | None) -> unit_rules.UnitDemand:
        return unit_rules.units_to_submit(spec, alive=len(alive), idle_nodes=max(0, len(idle) - taken), now=now,
                                          last_change_at=state.last_change_at,
                                          scale_up_snooze_s=t.config.scale_up_snooze_s,
                                          others_waiting=len(others_waiting),
                                          released=state.released_below_min, holes=holes, allowance=allowance)
    demand = demand_within(None)
    if grow_allowance is not None and not holes:
        # Other elastic jobs share the idle nodes by weight: growth (beyond min_replicas)
        # stops at the largest size the job allows within its share.
        shared = demand_within(grow_allowance)
        if shared.count < demand.count:
            note_growth_held(t, f"{demand.count - shared.count} of {demand.count} idle node(s) go to other "
                             f"elastic jobs by weight (this job's weight {spec.weight or 1})")
        demand = shared
    count = demand.count
    if count == 0 and not holes:
        queued = unit_rules.units_to_queue(spec, alive=len(alive), pending=waiting, idle_nodes=len(idle),
                                           others_waiting=len(others_waiting), released=state.released_below_min,
                                           queued_units=t.config.queued_units, next_in_line=next_in_line)
        count, demand = queued.count, queued
    for _ in range(count):
        submit_unit(t, demand.reason, excluded, queued_ahead=demand.queued_ahead)


def note_blocked_below_min(t: Step, view: ClusterView, seen: float, alive: list[UnitRecord],
                           excluded: frozenset[str], others_waiting: bool) -> None:
    """Live mode, below min_replicas: whether this view shows anything on its way to bring
    the job back (an idle node it could take with no other job waiting for it, or a unit
    of its whose Slurm job started, or is not known yet, and whose launcher has not
    registered). Nothing on its way on every view since `blocked_below_min_since`:
    the job gives its nodes back after `below_min_blocked_release_s`
    (`leaving.release_below_min`). `seen`: when the view was taken, on the monotonic
    clock."""
    state = t.state
    if (not state.live or t.job.state is not JobState.DEGRADED or state.released_below_min
            or leaving.saves_in_flight(t)):
        # (While a save is in flight the next world waits for it: not blocked.)
        state.blocked_below_min_since = state.blocked_below_min_seen_at = None
        return
    # A node whose last job is completing (IDLE+COMPLETING) is idle in a moment.
    freeing = [dataclasses.replace(n, flags=n.flags - {NodeFlag.COMPLETING}) for n in view.nodes
               if n.state is NodeState.IDLE and NodeFlag.COMPLETING in n.flags]
    idle = unit_rules.idle_nodes_for(t.job.spec, [*view.nodes, *freeing], excluded)
    # (A unit whose sbatch has not answered, or that this view does not show yet, counts.)
    starting = any(u.state is UnitState.SUBMITTED and (
        not u.slurm_job_id or (found := view.job(u.slurm_job_id)) is None
        or (found.state is not SlurmJobState.PENDING and not found.state.is_finished))
        for u in alive)
    on_its_way = starting or (bool(idle) and not others_waiting)
    if on_its_way:
        state.blocked_below_min_since = state.blocked_below_min_seen_at = None
        return
    if state.blocked_below_min_since is None:
        state.blocked_below_min_since = seen
    state.blocked_below_min_seen_at = seen


def poll_after_units_ended(t: Step, before: State) -> None:
    """Units of a running job ended in this transition (failed, preempted, left), or the
    stop that held its replacements back finished: what replaces them (below
    min_replicas, or onto idle nodes) is decided on the next Slurm view, so ask for it now
    rather than up to `slurm_poll_interval_s` later. Not after a Slurm view (`on_slurm`
    decided on that one), not for a job past its last step; the controller makes one
    poll of many asks (`server.EARLY_POLL_GAP_S` after the last poll at the earliest)."""
    state = t.state
    if not state.slurm_units or t.job.state.is_final or t.job.state is JobState.FINISHING:
        return
    # (From this transition's saved units, not a scan of every unit: this runs on every
    # input, ticks and heartbeats included.)
    ended = sorted({e.unit.unit_id for e in t.effects if isinstance(e, SaveUnit) and e.unit.state.is_final
                    and ((was := before.units.get(e.unit.unit_id)) is None or not was.state.is_final)})
    if ended:
        t.emit(PollSlurmSoon(f"unit(s) {', '.join(ended)} ended"))
    elif before.stopping is not None and state.stopping is None:
        t.emit(PollSlurmSoon("the stop before the next generation finished"))


def note_submitted_unit(t: Step, unit: UnitRecord, slurm_state: SlurmJobState, started: float) -> None:
    """What a view says of a unit whose launcher has not registered: a unit queued ahead
    (`queued_units`) still waiting in Slurm's queue for a node (not on its way soon:
    forming and growing do not settle for it), or one Slurm started, and when (`started`,
    monotonic: its Slurm start time, else when the view was taken), so that forming a
    world waits a little for its launcher (`planning.decide_world`)."""
    queued = unit.facts.queued_ahead and slurm_state is SlurmJobState.PENDING
    started_seen_at = unit.facts.started_seen_at
    if slurm_state is SlurmJobState.RUNNING and started_seen_at is None:
        started_seen_at = started
    if queued != unit.facts.queued_in_slurm or started_seen_at != unit.facts.started_seen_at:
        t.note(unit, queued_in_slurm=queued, started_seen_at=started_seen_at)


def note_growth_held(t: Step, reason: str) -> None:
    """An event when growth is held back for a new reason (not on every poll)."""
    if reason != t.state.growth_held_reason:
        t.state.growth_held_reason = reason
        t.record("growth_shared", reason)


def on_requeued(t: Step, unit: UnitRecord, slurm_job_id: int) -> None:
    t.record("unit_requeued", f"Slurm requeued job {slurm_job_id}; Tidal cancels the requeued copy and "
             "places replacements itself", unit_id=unit.unit_id, fields={"slurm_job_id": slurm_job_id})
    cancel_in_slurm(t, unit)
    if unit.state is UnitState.SUBMITTED:
        unit_lost(t, unit, f"Slurm job {slurm_job_id} requeued before its launcher registered")
    else:
        leaving.leave(t, unit.unit_id, "requeued", f"Slurm requeued job {slurm_job_id}")


def cool_down(t: Step, unit: UnitRecord, now: float, why: str = "", spare_node: bool = False,
              error: tuple[int, float] | None = None) -> None:
    """No unit of this job on the failed unit's nodes for a while (doubling with each
    failure there), so a bad node does not eat every replacement. A failure of a worker
    alone (`spare_node`: it was killed while its launcher stayed healthy, as torchrun
    restarts in place) spares a node with no failure on record (a spared kill is forgotten
    after `node_cooldown_s`): the node stays in use, and another failure there within
    `node_cooldown_s` excludes it. `error`: the failure was a worker's own error, in that
    generation at that time (wall clock); kept so that the exclusion can be lifted
    (`lift_error_exclusions`)."""
    for node in unit.nodes:
        before = t.state.node_cooldown.get(node)
        failures, until = before or (0, 0.0)
        if spare_node and failures == 0 and now >= until:
            t.state.node_cooldown[node] = (0, now + t.config.node_cooldown_s)
            t.save_pending()
            t.record("node_suspect", f"a worker of unit {unit.unit_id} was killed there while its launcher stayed "
                     f"healthy: the node stays in use; another failure there within node_cooldown_s "
                     f"({t.config.node_cooldown_s:g} s) excludes it", unit_id=unit.unit_id, fields={"node": node})
            continue
        failures += 1
        seconds = t.config.node_cooldown_s * min(8, 2 ** (failures - 1))
        t.state.node_cooldown[node] = (failures, now + seconds)
        if error is not None:
            t.state.error_exclusions[node] = ErrorExclusion(error[0], error[1], before)
        else:
            t.state.error_exclusions.pop(node, None)
        t.save_pending()
        t.record("node_excluded", f"unit {unit.unit_id} {why or 'failed there'}", unit_id=unit.unit_id,
                 fields={"node": node, "failures": failures, "for_s": f"{seconds:.0f}"})


def lift_error_exclusions(t: Step, generation: int, killed_at: float, killed: str) -> list[str]:
    """A worker of `generation` turns out to have been killed at `killed_at` (wall clock;
    its report came after its peers'): nodes excluded for a worker's own error in that
    generation at or after it get their cool-down back as it was. A restart-mode rank
    raises when a peer dies, and its error may reach the controller first; its node is
    not at fault (`failure.uncount_crash` does the same for the crash count). Returns the
    nodes given back."""
    lifted = []
    for node, exclusion in sorted(t.state.error_exclusions.items()):
        if exclusion.generation != generation or exclusion.exited_at < killed_at:
            continue
        del t.state.error_exclusions[node]
        if exclusion.before is None:
            t.state.node_cooldown.pop(node, None)
        else:
            t.state.node_cooldown[node] = exclusion.before
        lifted.append(node)
        t.record("node_exclusion_lifted", f"its worker's error in generation {generation} came after a worker of "
                 f"unit {killed} was killed: a reaction to the lost peer, not the node's fault",
                 unit_id=killed, fields={"node": node})
    if lifted:
        t.save_pending()
    return lifted


def submitted_excluding(state: State, nodes: Sequence[str]) -> list[UnitRecord]:
    """Units waiting in Slurm's queue (submitted, not started as far as Slurm's views
    said, no launcher yet) whose sbatch excluded any of `nodes`."""
    return [unit for unit in state.units.values()
            if unit.state is UnitState.SUBMITTED and not unit.facts.connected and unit.facts.started_seen_at is None
            and set(unit.facts.excluded) & set(nodes)]


def submit_unit(t: Step, reason: str, excluded: tuple[str, ...], queued_ahead: bool = False) -> None:
    state = t.state
    numbers = [int(u[1:]) for u in state.units if u.startswith("u") and u[1:].isdigit()]
    unit_id = f"u{max(numbers, default=0) + 1}"
    unit = UnitRecord(job_id=t.job.job_id, unit_id=unit_id, state=UnitState.SUBMITTED,
                      procs_per_node=t.job.spec.procs_per_node or 1)
    # A unit queued ahead waits in Slurm's queue from its submission (no node was idle for
    # it): forming and growing do not settle for it before a view shows it, which could come
    # a poll later; a view that shows Slurm started it makes it one on its way.
    unit.facts = dataclasses.replace(unit.facts, queued_ahead=queued_ahead, queued_in_slurm=queued_ahead,
                                     excluded=tuple(excluded), sbatch_in_flight=True)
    state.units[unit_id] = unit
    t.emit(SaveUnit(unit))
    t.record("unit_submitting", reason, unit_id=unit_id)
    t.emit(Submit(unit_id, excluded))


def on_unit_submitted(t: Step, unit_id: str, slurm_job_id: int, error: str, answer_lost: bool = False) -> None:
    """sbatch's answer for a unit. Its answer lost (`answer_lost`: sbatch timed out, or
    printed no job id), the job may exist all the same: the unit stays SUBMITTED with no
    Slurm job id, and the first view taken after it finds the job by its name or loses the
    unit (`find_unanswered`); failing it at once put a second unit beside the job that ran."""
    state = t.state
    unit = state.units.get(unit_id)
    if unit is None:
        return
    unit = t.note(unit, sbatch_in_flight=False)
    if error:
        state.submit_failures += 1
        backoff = min(60.0, t.config.slurm_poll_interval_s * 2 ** state.submit_failures)
        state.next_submit_at = t.now.monotonic + backoff
        if answer_lost and not (t.job.state.is_final or unit.state.is_final):
            t.note(unit, submitted_at=t.now.wall)
            t.record("unit_submit_unanswered", f"sbatch's answer was lost: {error}; its Slurm job may exist, and the "
                     f"next Slurm view finds it by its name ({unit_rules.unit_job_name(t.job.job_id, unit_id)}) "
                     "or loses the unit", unit_id=unit_id, fields={"retry_in_s": f"{backoff:.0f}"})
            return
        unit_lost(t, unit, f"sbatch refused the unit: {error}", kind="unit_submit_failed",
                  fields={"retry_in_s": f"{backoff:.0f}"})
        return
    state.submit_failures = 0
    unit = t.note(unit, submitted_at=t.now.wall)
    unit.slurm_job_id = slurm_job_id
    t.emit(SaveUnit(unit))
    t.record("unit_submitted", f"Slurm job {slurm_job_id}", unit_id=unit_id,
             fields={"slurm_job_id": slurm_job_id})
    if t.job.state.is_final or unit.state.is_final:
        cancel_in_slurm(t, unit)


def find_unanswered(t: Step, unit: UnitRecord, view: ClusterView) -> None:
    """A unit SUBMITTED with no Slurm job id, whose sbatch this controller did not run: an
    earlier controller decided it and stopped before it read sbatch's answer (or before
    sbatch ran). Its Slurm job is found by its name, and its id kept; none there (or only
    a finished one): sbatch never ran, or its job is over, and the unit is lost (one
    replaces it). Without this it counted as alive, and on its way, for good. The same for
    a unit whose sbatch answer this controller lost (`on_unit_submitted`), on a view taken
    after it."""
    if view.observed_at < unit.facts.submitted_at + 1.0:
        return  # (A view taken before sbatch's answer was lost proves nothing.)
    name = unit_rules.unit_job_name(t.job.job_id, unit.unit_id)
    found = next((job for job in view.jobs if job.name == name and not job.state.is_finished), None)
    if found is None:
        why = ("sbatch's answer was lost" if unit.facts.submitted_at
               else "the controller that submitted it stopped before sbatch answered")
        unit_lost(t, unit, f"no Slurm job {name}: {why}, and none ran")
        return
    unit = t.own(unit)
    unit.slurm_job_id = found.job_id
    t.note(unit, submitted_at=view.observed_at - 1.0)
    t.emit(SaveUnit(unit))
    t.record("unit_submitted", f"Slurm job {found.job_id} (found by its name after a controller restart)",
             unit_id=unit.unit_id, fields={"slurm_job_id": found.job_id})


def unit_lost(t: Step, unit: UnitRecord, reason: str, kind: str = "unit_lost",
              fields: dict[str, object] | None = None) -> None:
    """A unit that never registered is gone (Slurm ended it, or sbatch refused it)."""
    unit = t.own(unit)
    unit.state = UnitState.FAILED
    unit.reason = reason
    t.emit(SaveUnit(unit))
    t.record(kind, reason, unit_id=unit.unit_id, fields=fields)


def on_cancel_failed(t: Step, unit_id: str, slurm_job_id: int, error: str, unanswered: bool) -> None:
    """scancel of a unit's Slurm job failed: said; when Slurm did not answer, made again on
    the next view that shows the job active (`retry_cancels`). Logged alone, the cancel was
    never made again, and what was left of the unit (a hung launcher) held its node until
    Slurm's time limit. (A refusal is not asked again: it would be refused again.)"""
    then = "made again on the next Slurm view that shows the job" if unanswered else "not asked again"
    if unanswered:
        t.state.cancels_to_retry = {**t.state.cancels_to_retry, slurm_job_id: unit_id}
    t.record("unit_cancel_failed", f"scancel of Slurm job {slurm_job_id} failed: {error}; {then}", unit_id=unit_id,
             fields={"slurm_job_id": slurm_job_id})


def retry_cancels(t: Step, view: ClusterView) -> None:
    """The cancels that failed, made again where this (fresh) view shows the job active; a
    job it shows finished, or no longer shows, needs none."""
    retries, t.state.cancels_to_retry = t.state.cancels_to_retry, {}
    for slurm_job_id, unit_id in sorted(retries.items()):
        found = view.job(slurm_job_id)
        if found is not None and found.is_active:
            t.emit(CancelInSlurm(unit_id, slurm_job_id))


def cancel_in_slurm(t: Step, unit: UnitRecord) -> None:
    if t.state.slurm_units and unit.slurm_job_id:
        t.emit(CancelInSlurm(unit.unit_id, unit.slurm_job_id))
