"""A launcher's decisions, pure: what to do on a worker's exit, a signal and a tick, as
functions of a snapshot of the launcher (`NodeView`), the event and `now`, returning
actions that `node.NodeAgent.apply` carries out in one place. No clock is read, no
message sent, no process touched here.

The same functions serve every launcher of a unit: the leader (which answers to the
controller; a one-node unit is a leader with no followers) and a follower node (which
answers to its leader); where the two differ, the view says which one decides."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping

from tidal.launcher.lifecycle import EXIT_OK, EXIT_UNREACHABLE, LauncherState, exit_status
from tidal.launcher.liveness import Silence, Verdict, Watched


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What the decisions read of a launcher. `answers_to_controller`: the unit's leader
    (else a follower node). `group_*`: its current worker group (`group_generation` None:
    none started). `leave_requested_at`: when the first SIGTERM came (monotonic). The
    live-mode sets are by local rank: `left` (left a world after its last step, as asked),
    `finished` (committed the job's last step), `silenced` (killed for silence, with why)."""

    state: LauncherState
    generation: int
    answers_to_controller: bool
    stop_grace_s: float
    leave_timeout_s: float
    group_generation: int | None = None
    group_stopping: bool = False
    group_all_exited: bool = True
    # Local ranks of the group's workers still running.
    group_alive: frozenset[int] = frozenset()
    live_mode: bool = False
    link_connected: bool = False
    leave_requested_at: float | None = None
    left: frozenset[int] = frozenset()
    finished: frozenset[int] = frozenset()
    silenced: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # Live mode: the deadline of an in-process stop or leave (monotonic), if one is under way.
    live_stop_deadline: float | None = None


# Actions.


@dataclasses.dataclass(frozen=True)
class Log:
    """One structured event in the launcher's log (`warning`: at warning level)."""

    event: str
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
    warning: bool = False


@dataclasses.dataclass(frozen=True)
class ReportWorkerExit:
    """A worker of this node exited on its own: say so upward (to the controller, or to the
    leader), with its error file's account and `detail`."""

    local_rank: int
    exit_code: int
    signal: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class StopWorkers:
    """Stop the node's (the unit's, for its leader) workers and move to `next_state`
    (STOPPING or LEAVING); WorkersStopped follows once they are gone."""

    next_state: LauncherState
    grace_s: float


@dataclasses.dataclass(frozen=True)
class WorkersGone:
    """Every worker of `generation` is gone already: WorkersStopped follows at once."""

    generation: int


@dataclasses.dataclass(frozen=True)
class CheckLiveStopped:
    """Live mode: see whether every worker stopped in-process now."""


@dataclasses.dataclass(frozen=True)
class ReportLeft:
    """The leader: report GENERATION_PHASE_LEFT with `detail`."""

    detail: str


@dataclasses.dataclass(frozen=True)
class Finish:
    state: LauncherState
    exit_code: int
    reason: str
    # The controller must hear this unit's last reports (its training finished): a
    # controller away at the exit gets `finish_report_timeout_s` to come back for them.
    await_controller: bool = False


@dataclasses.dataclass(frozen=True)
class NoteLeaveRequested:
    at: float


@dataclasses.dataclass(frozen=True)
class RequestLeave:
    """The leader: ask the controller to let the unit leave (LeaveRequest PREEMPTED)."""


@dataclasses.dataclass(frozen=True)
class ExitAfterStop:
    """A follower: once its workers are gone, exit with this state and code."""

    state: LauncherState
    exit_code: int
    reason: str


@dataclasses.dataclass(frozen=True)
class ClearLiveStopDeadline:
    pass


@dataclasses.dataclass(frozen=True)
class KillWorker:
    """SIGKILL a frozen worker; its exit then goes the usual way, with `detail` attached."""

    local_rank: int
    reason: str
    silent_s: float

    @property
    def detail(self) -> str:
        return f"{self.reason}; killed by its launcher"


@dataclasses.dataclass(frozen=True)
class NoteSlowWorker:
    """A silent but busy worker: logged once a silent spell, its CPU reference slid."""

    local_rank: int
    reason: str
    silent_s: float


@dataclasses.dataclass(frozen=True)
class ForgetBeatSamples:
    """The launcher was held up: judge its workers from fresh samples at the next look."""


@dataclasses.dataclass(frozen=True)
class GiveUpLeader:
    """A follower's leader is given up on (the leader's followers are judged by its hub)."""

    reason: str


Action = (Log | ReportWorkerExit | StopWorkers | WorkersGone | CheckLiveStopped | ReportLeft | Finish
          | NoteLeaveRequested | RequestLeave | ExitAfterStop | ClearLiveStopDeadline | KillWorker | NoteSlowWorker
          | ForgetBeatSamples | GiveUpLeader)


def on_worker_exit(view: NodeView, generation: int, local_rank: int, returncode: int) -> tuple[Action, ...]:
    """A worker of this node's group of `generation` exited with `returncode` (negative: the
    signal that killed it)."""
    if view.group_generation is None or view.group_generation != generation or view.group_stopping:
        return ()  # an older group's, or one the launcher is stopping: no failure
    exit_code, signum = exit_status(returncode)
    if view.live_mode and returncode == 0 and (local_rank in view.left or view.state is LauncherState.LEAVING):
        # Left the world after its last step, as the controller asked.
        if view.group_all_exited and view.state is LauncherState.LEAVING:
            return (WorkersGone(generation),)
        return ()
    if view.leave_requested_at is not None and signum == signal.SIGTERM:
        # Slurm signals the whole allocation; a worker ended by that SIGTERM is leaving too.
        return (Log("worker_terminated_with_launcher", {"generation": generation, "local_rank": local_rank}),)
    actions: list[Action] = [ReportWorkerExit(local_rank, exit_code, signum, view.silenced.get(local_rank, ""))]
    if view.live_mode and view.state is LauncherState.STOPPING:
        actions.append(CheckLiveStopped())
    if view.live_mode and view.state is LauncherState.LEAVING and view.group_all_exited:
        # Out of the world already (the controller sent one without this unit): a worker
        # killed on its way out (judged frozen as it left) ends the leave like one that
        # exited 0, or the unit would linger until the controller called it overdue.
        actions.append(WorkersGone(generation))
    if view.finished and view.group_all_exited:
        # Training is over and every worker of this unit has exited: the unit is done,
        # whether or not the controller is there to say so.
        actions += [ReportLeft("training finished; every worker exited"),
                    Finish(LauncherState.SUCCEEDED, EXIT_OK, "training finished", await_controller=True)]
    return tuple(actions)


def on_signal(view: NodeView, signum: int, now: float) -> tuple[Action, ...]:
    """SIGTERM (Slurm's preemption notice) or SIGINT. The first one asks to leave: the
    leader asks the controller (or, away from it, leaves alone); a follower waits for its
    leader, which got the same signal, to stop it. A second one (or one before the leader
    registered, or while it leaves) leaves now."""
    name = signal.Signals(signum).name
    leave_now = (view.leave_requested_at is not None
                 or (view.answers_to_controller
                     and view.state in (LauncherState.LEAVING, LauncherState.CONNECTING)))
    if leave_now:
        actions: list[Action] = [Log("leaving_now", {"signal": name}, warning=True)]
        if not view.answers_to_controller:
            actions.append(ExitAfterStop(LauncherState.SUCCEEDED, EXIT_OK, f"{name} twice"))
        return (*actions, StopWorkers(LauncherState.LEAVING, 1.0))
    actions = [Log("leave_requested", {"signal": name}), NoteLeaveRequested(now)]
    if view.answers_to_controller:
        actions.append(RequestLeave() if view.link_connected
                       else StopWorkers(LauncherState.LEAVING, view.stop_grace_s))
    return tuple(actions)


def on_tick(view: NodeView, verdicts: tuple[Verdict, ...], now: float) -> tuple[Action, ...]:
    """A look at the clock: the liveness verdicts (`liveness.liveness_verdicts`), the live
    stop's deadline and the leave timeout."""
    actions: list[Action] = []
    for verdict in verdicts:
        match verdict.watched:
            case Watched.CONTROLLER:
                return (Finish(LauncherState.FAILED, EXIT_UNREACHABLE, verdict.reason),)
            case Watched.LEADER:
                return (GiveUpLeader(verdict.reason),)
    deadline = view.live_stop_deadline
    if (deadline is not None and now > deadline and view.group_generation is not None
            and view.group_alive <= view.finished):
        # Past the last step, a worker runs the script's own code (saving the model): no
        # stop or leave deadline cuts that short.
        actions.append(ClearLiveStopDeadline())
    elif deadline is not None and now > deadline:
        actions += [Log("live_stop_timed_out", {"generation": view.generation}, warning=True),
                    ClearLiveStopDeadline(),
                    StopWorkers(LauncherState.LEAVING if view.state is LauncherState.LEAVING
                                else LauncherState.STOPPING, view.stop_grace_s)]
    if (view.leave_requested_at is not None and view.state is not LauncherState.LEAVING
            and now - view.leave_requested_at > view.leave_timeout_s):
        if view.answers_to_controller:
            actions += [Log("leaving_without_controller", {"waited_s": view.leave_timeout_s}, warning=True),
                        StopWorkers(LauncherState.LEAVING, view.stop_grace_s)]
        else:
            actions += [Log("leaving_without_leader", {"waited_s": view.leave_timeout_s}, warning=True),
                        ExitAfterStop(LauncherState.SUCCEEDED, EXIT_OK, "left after SIGTERM"),
                        StopWorkers(LauncherState.LEAVING, view.stop_grace_s)]
    for verdict in verdicts:
        if verdict.watched is Watched.SELF:
            actions.append(ForgetBeatSamples())
        elif verdict.watched is Watched.WORKER and verdict.lost:
            actions.append(KillWorker(verdict.key, verdict.reason, verdict.silent_s))
        elif verdict.watched is Watched.WORKER and verdict.silence is Silence.SLOW:
            actions.append(NoteSlowWorker(verdict.key, verdict.reason, verdict.silent_s))
    return tuple(actions)


# A store server held while the unit's workers start (`launcher.store`) imports torch at
# the latest this long after the launcher opened.
STORE_HOLD_MAX_S = 30.0


def store_server_release(*, live_mode: bool | None, prestart: bool, trained: bool, named_host: bool,
                         held_s: float, max_hold_s: float = STORE_HOLD_MAX_S) -> str | None:
    """Why a held store server (one-node unit; `launcher.store`) should import torch now,
    or None to keep holding it: its stores are needed (this unit named the host of a
    generation's rendezvous), or the start it would slow is over (the unit's workers
    committed a step in a world: past their start, a joiner's state transfer and its
    world's forming), or nothing is gained by holding (restart mode, whose workers start
    with a generation that may meet at this unit's store; live mode without workers
    started ahead), or it was held `max_hold_s` already. `live_mode` None: not registered
    yet."""
    if named_host:
        return "this unit hosts a generation's rendezvous"
    if live_mode is False:
        return "restart mode: the workers start with their generation"
    if live_mode and not prestart:
        return "no workers started ahead"
    if trained:
        return "the workers trained"
    if held_s >= max_hold_s:
        return f"held {max_hold_s:g} s"
    return None
