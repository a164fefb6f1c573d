"""The leader's decisions on the controller's messages, pure: a world change (one message,
`Generation`) and the end of a stop (its workers gone). Each is a function of a snapshot of
the leader (`LeaderView`) and the message, returning actions (`decisions.Action` and the
leader's own below) that `leader.Agent` carries out in one place (`node.NodeAgent.apply`).
No clock is read, no message sent, no process touched.

What the launcher does with a `Generation` follows from where the message puts this unit
(`placement`): in the new generation only (a joiner, or a member of a world formed afresh:
its workers start, or move to it), in the old one only (leaving: its workers stop, or
leave after the agreed step; or failed: they are killed), in both (a live member of a
change at a step boundary), or in the old one with no new generation at all (an empty
table: the old one stops). A table that neither names it nor lists it leaving is not its
change, and is logged and ignored.

Restart mode: a world message is the whole change; the old workers go first, then the new
generation's start. Live mode: the workers follow a world change in-process (a World over
the control channel), and only a failed unit's, or a finished one's, are stopped."""

from __future__ import annotations

import dataclasses
import enum

from tidal.launcher.decisions import Action, ClearLiveStopDeadline, Finish, Log, StopWorkers
from tidal.launcher.lifecycle import EXIT_OK, EXIT_UNIT_FAILED, LauncherState
from tidal.proto import common_pb2, launcher_pb2


@dataclasses.dataclass(frozen=True)
class LeaderView:
    """What the leader's decisions read. `workers_generation`: the generation of its
    workers still running (None: none runs). `live_workers_running`: live-mode workers
    that can follow a world change in-process (all alive, not being stopped);
    `workers_started`: workers were started once (running or not). `finished`:
    a worker of the unit committed the job's last step. `all_said_hello`: every worker
    started said hello on the control channel. `pending_start`: a generation waits for
    the old workers to stop (`pending_joining`: its workers join a running world)."""

    state: LauncherState
    generation: int
    stop_grace_s: float
    live_mode: bool = False
    live_workers_running: bool = False
    workers_generation: int | None = None
    # Workers were started once (running or not).
    workers_started: bool = False
    standby: bool = False
    failed_self: bool = False
    finished: bool = False
    all_said_hello: bool = False
    stopping_for_start: bool = False
    pending_start: launcher_pb2.Generation | None = None
    pending_joining: bool = False
    # Live mode: where each worker that left as the state's last holder wrote it, and at which step.
    saved: tuple[tuple[str, int], ...] = ()


# The leader's own actions.


@dataclasses.dataclass(frozen=True)
class DeclaredFailed:
    """The controller declared this unit failed: its workers go, the launcher exits 1, and
    the session with the controller ends."""


@dataclasses.dataclass(frozen=True)
class HoldStart:
    """Keep `start` (None: drop the one held) for when the old workers are gone;
    `replacing`: it replaces their generation (its STARTED is the one acknowledgment),
    None: leave that as it is; `joining`: its workers join a running world."""

    start: launcher_pb2.Generation | None
    replacing: bool | None = None
    joining: bool = False


@dataclasses.dataclass(frozen=True)
class StartWorkers:
    start: launcher_pb2.Generation
    joining: bool = False


@dataclasses.dataclass(frozen=True)
class LiveStop:
    """Live mode: the workers abandon the step in flight and wait, in-process."""

    generation: int


@dataclasses.dataclass(frozen=True)
class LeaveSavingState:
    """Live mode: the workers write the job's state after the step they agree on, then leave."""


@dataclasses.dataclass(frozen=True)
class SendWorlds:
    """Live mode: name the world to every worker (leaving it, if it does not name this unit)."""

    generation: int
    rank_table: common_pb2.RankTable
    rendezvous: common_pb2.Rendezvous
    joining: bool = False
    target_step: int = 0
    # False: the generation it replaces broke (the controller sent this one at once); the
    # workers abandon the step in flight rather than finish it.
    at_step_boundary: bool = True
    # Not in it, not leaving: out of that world after the agreed step, waiting for a later one.
    set_aside: bool = False


@dataclasses.dataclass(frozen=True)
class Enter:
    """Take `state` and `generation` (None: keep it)."""

    state: LauncherState
    generation: int | None = None


@dataclasses.dataclass(frozen=True)
class LeaveStandby:
    """Live mode: the workers started ahead are named in a world now."""


@dataclasses.dataclass(frozen=True)
class AwaitReady:
    """A joiner's live workers: report them ready (STARTED) for `generation` once all said hello."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Report:
    """An GenerationReport to the controller (`once`: at most once per generation and phase)."""

    generation: int
    phase: launcher_pb2.GenerationPhase
    step: int = 0
    detail: str = ""
    once: bool = False
    # With the port of the store this unit serves next.
    with_store_port: bool = False


LeaderAction = (Action | DeclaredFailed | HoldStart | StartWorkers | LiveStop | LeaveSavingState | SendWorlds | Enter
                | LeaveStandby | AwaitReady | Report)


class Place(enum.Enum):
    """Where a `Generation` puts a unit."""

    # Named in `failed_unit_id`: the controller declared it failed.
    FAILED = "failed"
    # In the new generation's rank table.
    MEMBER = "member"
    # In `leaving`: it leaves the job with this change.
    LEAVING = "leaving"
    # An empty rank table that names it nowhere: the stop of `from_generation`.
    STOPPED = "stopped"
    # A table that neither names it nor lists it leaving: not this unit's change.
    ELSEWHERE = "elsewhere"


def placement(generation: launcher_pb2.Generation, unit_id: str) -> Place:
    """Where `generation` puts unit `unit_id`: failed, a member of the new generation,
    leaving, stopped with the old one (an empty table), or nowhere."""
    if generation.failed_unit_id == unit_id:
        return Place.FAILED
    if any(assignment.unit_id == unit_id for assignment in generation.rank_table.assignments):
        return Place.MEMBER
    if unit_id in generation.leaving:
        return Place.LEAVING
    if not generation.rank_table.assignments:
        return Place.STOPPED
    return Place.ELSEWHERE


def on_generation(view: LeaderView, generation: launcher_pb2.Generation, unit_id: str) -> tuple[LeaderAction, ...]:
    """A world change: what this unit does follows from where the message puts it."""
    match placement(generation, unit_id):
        case Place.FAILED:
            return _stop(view, generation, unit_id)
        case Place.MEMBER:
            return _reconfigure(view, generation) if generation.at_step_boundary else _start(view, generation)
        case Place.LEAVING:
            if generation.at_step_boundary and generation.rank_table.assignments:
                # Live mode: the workers get the world without this unit and leave after the agreed step.
                return _reconfigure(view, generation)
            return _leave(view, generation)
        case Place.STOPPED:
            return _stop(view, generation, unit_id)
        case Place.ELSEWHERE:
            if (generation.at_step_boundary and view.live_workers_running and not view.standby
                    and view.generation == generation.from_generation and not view.state.is_final
                    and view.state is not LauncherState.LEAVING):
                # Live mode: a member of the world that changes, out of the next one but not
                # out of the job (its replica of several nodes lost a node, or one of its
                # nodes leaves): its workers finish the agreed step and wait, keeping the state.
                return (SendWorlds(generation.generation, generation.rank_table, generation.rendezvous,
                                   target_step=generation.target_step, set_aside=True),)
            return (Log("generation_not_for_this_unit", {"generation": generation.generation}, warning=True),)


def _grace_s(message: launcher_pb2.Generation, default_s: float) -> float:
    """The SIGTERM-to-SIGKILL grace a stop (or a start replacing a generation) names, else the default."""
    return message.stop_grace.ToNanoseconds() / 1e9 if message.HasField("stop_grace") else default_s


def _start(view: LeaderView, start: launcher_pb2.Generation) -> tuple[LeaderAction, ...]:
    """A member of generation `start.generation` (not at a step boundary): in restart mode its
    workers start; in live mode its workers move to it."""
    if view.state is LauncherState.LEAVING or view.state.is_final:
        return ()
    if view.finished:
        # Training is over here: no worker of this unit starts again.
        return (Log("start_after_finish_ignored", {"generation": start.generation}, warning=True),)
    if view.live_workers_running and view.state is not LauncherState.STOPPING:
        # Live mode: the workers that stopped in-process (or wait on standby) join the
        # new world. One still training in an older generation (a failure is this one
        # message) is not stopped: a rank in a collective with the lost one sees it fail
        # and takes the new world; the others move at the end of the step, none of which
        # is lost; a rank still forming the older world gives it up for the newer one.
        return (LeaveStandby(), Enter(view.state, max(view.generation, start.generation)),
                SendWorlds(start.generation, start.rank_table, start.rendezvous, target_step=start.target_step,
                           at_step_boundary=False),
                Enter(LauncherState.RUNNING),
                Report(start.generation, launcher_pb2.GENERATION_PHASE_STARTED, step=start.target_step))
    if view.workers_generation is not None:
        if view.workers_generation == start.generation:
            return ()
        # Restart mode: one message is the whole change; the old workers go first (with
        # the grace it names: short after a failure), then the new generation starts.
        return (HoldStart(start, replacing=True),
                StopWorkers(LauncherState.STOPPING, _grace_s(start, view.stop_grace_s)))
    if view.state is LauncherState.STOPPING:
        return (HoldStart(start),)
    return (StartWorkers(start),)


def _reconfigure(view: LeaderView, reconfigure: launcher_pb2.Generation) -> tuple[LeaderAction, ...]:
    """Live mode, at a step boundary: the world changes to `reconfigure.generation`, in-process
    (a unit it does not name leaves after the agreed step)."""
    if (view.state.is_final or view.state is LauncherState.LEAVING
            or (reconfigure.generation <= view.generation and view.workers_started)):
        return ()
    if view.finished:
        return (Log("reconfigure_after_finish_ignored", {"generation": reconfigure.generation}, warning=True),)
    world = SendWorlds(reconfigure.generation, reconfigure.rank_table, reconfigure.rendezvous,
                       target_step=reconfigure.target_step)
    if view.live_workers_running and view.standby:
        # A joiner whose workers wait on standby: ready as soon as all said hello.
        actions: list[LeaderAction] = [LeaveStandby(), Enter(LauncherState.RUNNING, reconfigure.generation),
                                       AwaitReady(reconfigure.generation), dataclasses.replace(world, joining=True)]
        if view.all_said_hello:
            actions.append(Report(reconfigure.generation, launcher_pb2.GENERATION_PHASE_STARTED, once=True,
                                  detail="workers ready to join (started ahead)"))
        return tuple(actions)
    if view.live_workers_running and view.generation < reconfigure.from_generation:
        # A joiner whose workers run, out of the world the change starts from (set aside, or
        # left out by a failure's next generation, keeping their state): ready at once.
        return (Enter(LauncherState.RUNNING, reconfigure.generation), dataclasses.replace(world, joining=True),
                Report(reconfigure.generation, launcher_pb2.GENERATION_PHASE_STARTED, once=True,
                       detail="workers ready to join (kept from an earlier world)"))
    if view.live_workers_running:
        return (world,)
    joiners = launcher_pb2.Generation(generation=reconfigure.generation, rank_table=reconfigure.rank_table,
                                      rendezvous=reconfigure.rendezvous, target_step=reconfigure.target_step)
    if view.state in (LauncherState.WAITING, LauncherState.CONNECTING):
        if view.workers_generation is not None:
            # Some of the joiner's workers run, not all (one started ahead exited before
            # its world came): they cannot join as they are, and a new group started
            # beside them would share their devices. They go first; then the joiners start.
            return (LeaveStandby(), HoldStart(joiners, replacing=True, joining=True),
                    StopWorkers(LauncherState.STOPPING, view.stop_grace_s))
        # A joiner: start the workers; they wait at the new world's rendezvous.
        return (StartWorkers(joiners, joining=True),)
    if view.state is LauncherState.STOPPING and view.pending_joining:
        # (Those workers still stop: the newer world's joiners start after them.)
        return (HoldStart(joiners, joining=True),)
    return ()


def _stop(view: LeaderView, stop: launcher_pb2.Generation, unit_id: str) -> tuple[LeaderAction, ...]:
    """The stop of generation `stop.generation` (naming this unit failed: its workers go for good)."""
    actions: list[LeaderAction] = []
    failed_self = view.failed_self
    if stop.failed_unit_id == unit_id:
        failed_self = True
        actions.append(DeclaredFailed())
    if stop.generation < view.generation:
        return (*actions, Log("stale_stop_ignored", {"stop_generation": stop.generation,
                                                     "generation": view.generation}))
    actions += [Log("generation_stop_ordered", {"generation": stop.generation, "reason": stop.reason}),
                HoldStart(None, replacing=False)]
    if stop.generation > view.generation:
        # The stop of a generation this unit has not started (restart mode: held while the
        # older one's workers stop): its STOPPED is what the controller waits for.
        actions.append(Enter(view.state, stop.generation))
    if view.finished and not failed_self:
        # Training is over here (a rank committed the last step): the workers run the
        # script's own code and exit by themselves; nothing to stop.
        return (*actions, Log("stop_after_finish_ignored", {"generation": stop.generation}))
    if view.live_workers_running and not failed_self and view.state is not LauncherState.LEAVING:
        return (*actions, LiveStop(stop.generation))
    grace_s = _grace_s(stop, view.stop_grace_s)
    if failed_self and view.live_mode:
        # Live mode: the survivors wait in a collective until this unit's workers
        # are gone (a hung rank must become a dead one), and nothing here is kept.
        grace_s = 0.0
    return (*actions, StopWorkers(LauncherState.STOPPING, grace_s))


def _leave(view: LeaderView, leave: launcher_pb2.Generation) -> tuple[LeaderAction, ...]:
    """The unit leaves the job (its live workers saving the job's state first, when it holds
    the last copy)."""
    logged = Log("leave_ordered", {"generation": leave.generation, "reason": leave.reason,
                                   "save_state": leave.save_state})
    if leave.save_state and view.live_workers_running and view.state is not LauncherState.LEAVING:
        return (logged, LeaveSavingState())
    return (logged, StopWorkers(LauncherState.LEAVING, view.stop_grace_s))


def left_detail(saved: tuple[tuple[str, int], ...]) -> str:
    """The LEFT report's detail: where the unit's workers wrote the job's state, if they did."""
    if not saved:
        return "left"
    steps = sorted({step for _, step in saved})
    folders = sorted({folder for folder, _ in saved})
    return f"left after saving the training state at step {','.join(map(str, steps))} to {', '.join(folders)}"


def on_workers_stopped(view: LeaderView) -> tuple[LeaderAction, ...]:
    """Every worker of the unit is gone after a stop: leave, fail, or wait for (or start)
    the next generation."""
    if view.state.is_final:
        return ()
    if view.state is LauncherState.LEAVING:
        # The step the state was saved at, if it was (the job's committed step).
        return (Report(view.generation, launcher_pb2.GENERATION_PHASE_LEFT, detail=left_detail(view.saved),
                       step=max((step for _, step in view.saved), default=0)),
                Finish(LauncherState.SUCCEEDED, EXIT_OK, "left the job"))
    if view.failed_self:
        return (Finish(LauncherState.FAILED, EXIT_UNIT_FAILED, "the controller declared this unit failed"),)
    actions: list[LeaderAction] = [ClearLiveStopDeadline(), Enter(LauncherState.WAITING),
                                   HoldStart(None, replacing=False)]
    if not view.stopping_for_start:
        # A generation replaced by the next one's start is acknowledged by its STARTED alone.
        actions.append(Report(view.generation, launcher_pb2.GENERATION_PHASE_STOPPED, with_store_port=True))
    if view.pending_start is not None:
        actions.append(StartWorkers(view.pending_start, joining=view.pending_joining))
    return tuple(actions)
