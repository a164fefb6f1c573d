"""The leader's decisions on the controller's messages, pure: a world change (`Generation`),
classified by where it puts the unit, and the end of a stop, asserted on the actions they return."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

from tidal.launcher.decisions import ClearLiveStopDeadline, Finish, Log, StopWorkers
from tidal.launcher.lifecycle import EXIT_OK, EXIT_UNIT_FAILED, LauncherState
from tidal.launcher.live import LiveMode
from tidal.launcher.worlds import (
    AwaitReady,
    DeclaredFailed,
    Enter,
    HoldStart,
    LeaderView,
    LeaveSavingState,
    LeaveStandby,
    LiveStop,
    Place,
    Report,
    SendWorlds,
    StartWorkers,
    left_detail,
    on_generation,
    on_workers_stopped,
    placement,
)
from tidal.proto import common_pb2, launcher_pb2
from tidal.proto.control import World

RESTART = LeaderView(state=LauncherState.RUNNING, generation=3, stop_grace_s=10.0, workers_generation=3,
                     workers_started=True)
WAITING = dataclasses.replace(RESTART, state=LauncherState.WAITING, workers_generation=None, workers_started=False)
LIVE = dataclasses.replace(RESTART, live_mode=True, live_workers_running=True)
TABLE = common_pb2.RankTable(world_size=2, assignments=[common_pb2.RankAssignment(unit_id="u1", first_rank=0,
                                                                                 procs_per_node=1)])
# A table without u1 (u2 alone), as a change that u1 leaves names it.
OTHERS = common_pb2.RankTable(world_size=1, assignments=[common_pb2.RankAssignment(unit_id="u2", first_rank=0,
                                                                                  procs_per_node=1)])
RENDEZVOUS = common_pb2.Rendezvous(host="h", port=29500, host_unit_id="u1")


def start(generation: int, grace_s: float | None = None) -> launcher_pb2.Generation:
    """A generation naming u1, not at a step boundary (a form, a restart, a failure's next world)."""
    message = launcher_pb2.Generation(generation=generation, rank_table=TABLE, rendezvous=RENDEZVOUS, target_step=40)
    if grace_s is not None:
        message.stop_grace.FromNanoseconds(int(grace_s * 1e9))
    return message


def reconfigure(generation: int, table: common_pb2.RankTable = TABLE, leaving: tuple[str, ...] = ()
                ) -> launcher_pb2.Generation:
    """Live mode: a change of a healthy world at a step boundary."""
    return launcher_pb2.Generation(generation=generation, from_generation=generation - 1, rank_table=table,
                                   rendezvous=RENDEZVOUS, target_step=40, leaving=leaving, at_step_boundary=True)


def stop(generation: int, failed: str = "", grace_s: float | None = None) -> launcher_pb2.Generation:
    """The stop of `generation`: an empty table (no assignments)."""
    message = launcher_pb2.Generation(generation=generation, from_generation=generation, reason="r",
                                      failed_unit_id=failed)
    if grace_s is not None:
        message.stop_grace.FromNanoseconds(int(grace_s * 1e9))
    return message


def leave(generation: int, save_state: bool = False, unit: str = "u1") -> launcher_pb2.Generation:
    """A unit leaves: named in `leaving`, not at a step boundary."""
    return launcher_pb2.Generation(generation=generation, from_generation=generation, leaving=[unit],
                                   reason="preempted", save_state=save_state)


def failed_member() -> launcher_pb2.Generation:
    """A table naming u1 that also names it failed."""
    message = start(4)
    message.failed_unit_id = "u1"
    return message


def kinds(actions: tuple[object, ...]) -> list[type]:
    return [type(action) for action in actions if not isinstance(action, Log)]


# Where a generation puts the unit.


def test_the_place_follows_from_the_failed_unit_the_table_and_the_leaving_list() -> None:
    assert placement(stop(3, failed="u1"), "u1") is Place.FAILED
    # Named failed wins over anything else the message says of it.
    assert placement(failed_member(), "u1") is Place.FAILED
    assert placement(start(4), "u1") is Place.MEMBER
    assert placement(reconfigure(4), "u1") is Place.MEMBER
    assert placement(leave(3), "u1") is Place.LEAVING
    assert placement(reconfigure(4, table=OTHERS, leaving=("u1",)), "u1") is Place.LEAVING
    assert placement(stop(3), "u1") is Place.STOPPED
    # Another unit failed: a stop, for this one.
    assert placement(stop(3, failed="u2"), "u1") is Place.STOPPED
    # An empty table that names this unit nowhere is a stop, whoever else it lists leaving.
    assert placement(leave(3, unit="u2"), "u1") is Place.STOPPED
    assert placement(reconfigure(4, table=OTHERS), "u1") is Place.ELSEWHERE


def test_a_live_member_out_of_the_next_world_but_not_leaving_is_set_aside() -> None:
    """A node of a replica of several nodes whose other node leaves: its workers finish the
    agreed step with the others and wait for a later world, keeping their state."""
    change = reconfigure(4, table=OTHERS)
    assert on_generation(LIVE, change, "u1") == (
        SendWorlds(4, OTHERS, RENDEZVOUS, target_step=40, set_aside=True),)
    # Not a member of the world that changes (it is on standby, or in another): not its change.
    assert kinds(on_generation(dataclasses.replace(LIVE, generation=2), change, "u1")) == []


def test_a_generation_that_neither_names_the_unit_nor_lists_it_leaving_is_logged_and_ignored() -> None:
    for message in (reconfigure(4, table=OTHERS), start(4)):
        actions = on_generation(RESTART, message, "u9")
        assert kinds(actions) == [] and len(actions) == 1
        [logged] = actions
        assert isinstance(logged, Log) and logged.warning and logged.fields == {"generation": 4}


# A member: the next world.


def test_restart_mode_starts_a_waiting_unit_at_once_and_replaces_running_workers_first() -> None:
    assert on_generation(WAITING, start(4), "u1") == (StartWorkers(start(4)),)
    # One message is the whole change: the old workers go (with the grace it names), then it starts.
    assert on_generation(RESTART, start(4, grace_s=1.5), "u1") == (HoldStart(start(4, grace_s=1.5), replacing=True),
                                                                   StopWorkers(LauncherState.STOPPING, 1.5))
    assert on_generation(RESTART, start(4), "u1")[-1] == StopWorkers(LauncherState.STOPPING, 10.0)
    # The same generation again: nothing; a stop under way: it waits.
    assert on_generation(RESTART, start(3), "u1") == ()
    assert on_generation(dataclasses.replace(WAITING, state=LauncherState.STOPPING), start(4), "u1") == (
        HoldStart(start(4)),)


def test_a_leaving_finished_or_final_unit_starts_nothing() -> None:
    for state in (LauncherState.LEAVING, LauncherState.SUCCEEDED, LauncherState.FAILED):
        assert on_generation(dataclasses.replace(WAITING, state=state), start(4), "u1") == ()
    assert kinds(on_generation(dataclasses.replace(LIVE, finished=True), start(4), "u1")) == []


def test_live_workers_move_to_the_new_world_in_process() -> None:
    actions = on_generation(LIVE, start(5), "u1")
    assert actions == (LeaveStandby(), Enter(LauncherState.RUNNING, 5),
                       SendWorlds(5, TABLE, RENDEZVOUS, target_step=40, at_step_boundary=False),
                       Enter(LauncherState.RUNNING),
                       Report(5, launcher_pb2.GENERATION_PHASE_STARTED, step=40))
    # While they stop (a stop round), a world message waits for them like a restart.
    stopping = dataclasses.replace(LIVE, state=LauncherState.STOPPING)
    assert kinds(on_generation(stopping, start(5), "u1")) == [HoldStart, StopWorkers]


def test_a_change_at_a_step_boundary_names_the_world_to_live_workers_and_starts_a_joiners() -> None:
    change = reconfigure(5)
    member = dataclasses.replace(LIVE, generation=4)
    assert on_generation(member, change, "u1") == (SendWorlds(5, TABLE, RENDEZVOUS, target_step=40),)
    # Workers kept out of the world the change starts from (their replica of several nodes
    # lost one, or one of its nodes left) join it: ready at once, their state kept.
    assert on_generation(LIVE, change, "u1") == (
        Enter(LauncherState.RUNNING, 5), SendWorlds(5, TABLE, RENDEZVOUS, joining=True, target_step=40),
        Report(5, launcher_pb2.GENERATION_PHASE_STARTED, once=True,
               detail="workers ready to join (kept from an earlier world)"))
    # An older one, or one to a leaving unit: nothing.
    assert on_generation(dataclasses.replace(LIVE, generation=5), change, "u1") == ()
    assert on_generation(dataclasses.replace(LIVE, state=LauncherState.LEAVING), change, "u1") == ()
    # Workers waiting on standby: named in it as joiners, ready once all said hello.
    standby = dataclasses.replace(LIVE, standby=True, state=LauncherState.WAITING)
    assert on_generation(standby, change, "u1") == (
        LeaveStandby(), Enter(LauncherState.RUNNING, 5), AwaitReady(5),
        SendWorlds(5, TABLE, RENDEZVOUS, joining=True, target_step=40))
    ready = on_generation(dataclasses.replace(standby, all_said_hello=True), change, "u1")
    assert ready[-1] == Report(5, launcher_pb2.GENERATION_PHASE_STARTED, once=True,
                               detail="workers ready to join (started ahead)")
    # A joiner with no workers yet starts them at the new world's rendezvous.
    [joining] = on_generation(dataclasses.replace(WAITING, live_mode=True), change, "u1")
    assert joining == StartWorkers(launcher_pb2.Generation(generation=5, rank_table=TABLE, rendezvous=RENDEZVOUS,
                                                           target_step=40), joining=True)


# A stop and a leave.


def test_a_stop_stops_the_workers_with_the_grace_it_names_and_forgets_a_held_start() -> None:
    assert kinds(on_generation(RESTART, stop(3, grace_s=2.0), "u1")) == [HoldStart, StopWorkers]
    assert on_generation(RESTART, stop(3, grace_s=2.0), "u1")[-1] == StopWorkers(LauncherState.STOPPING, 2.0)
    assert HoldStart(None, replacing=False) in on_generation(RESTART, stop(3), "u1")
    # A stale stop is ignored.
    assert kinds(on_generation(RESTART, stop(2), "u1")) == []


def test_the_stop_of_a_generation_held_while_the_older_one_stops_is_confirmed_for_that_generation() -> None:
    """Restart mode: generation 4 (a failure's next world) is held while generation 3's
    workers stop; a second failure stops 4. The controller takes only a STOPPED of 4: one
    of 3 left it waiting for its deadline, and it then failed this healthy unit."""
    stopping = dataclasses.replace(RESTART, state=LauncherState.STOPPING, stopping_for_start=True,
                                   pending_start=start(4))
    actions = on_generation(stopping, stop(4, grace_s=2.0), "u1")
    assert Enter(LauncherState.STOPPING, 4) in actions and HoldStart(None, replacing=False) in actions
    assert actions[-1] == StopWorkers(LauncherState.STOPPING, 2.0)
    # Once the workers are gone, with the generation the stop moved the unit to:
    after = dataclasses.replace(stopping, generation=4, stopping_for_start=False, pending_start=None)
    assert Report(4, launcher_pb2.GENERATION_PHASE_STOPPED, with_store_port=True) in on_workers_stopped(after)


def test_live_workers_stop_in_process_unless_their_unit_failed() -> None:
    assert on_generation(LIVE, stop(3), "u1")[-1] == LiveStop(3)
    failed = on_generation(LIVE, stop(3, failed="u1", grace_s=5.0), "u1")
    # This unit failed: its workers go at once (the survivors wait on them in a collective).
    assert kinds(failed) == [DeclaredFailed, HoldStart, StopWorkers]
    assert failed[-1] == StopWorkers(LauncherState.STOPPING, 0.0)
    # Another unit failed: in-process, as any stop.
    assert on_generation(LIVE, stop(3, failed="u2"), "u1")[-1] == LiveStop(3)
    # Past the last step, nothing to stop.
    assert kinds(on_generation(dataclasses.replace(LIVE, finished=True), stop(3), "u1")) == [HoldStart]


def test_a_failed_unit_is_stopped_for_good_whatever_else_the_message_says() -> None:
    # Restart mode, with the grace the message names; named failed even in a table.
    assert kinds(on_generation(RESTART, stop(3, failed="u1", grace_s=2.0), "u1")) == [DeclaredFailed, HoldStart,
                                                                                       StopWorkers]
    assert on_generation(RESTART, stop(3, failed="u1", grace_s=2.0), "u1")[-1] == StopWorkers(LauncherState.STOPPING,
                                                                                               2.0)
    assert kinds(on_generation(RESTART, failed_member(), "u1"))[0] is DeclaredFailed


def test_a_leave_saves_the_state_in_process_when_asked_else_stops_the_workers() -> None:
    saving = leave(3, save_state=True)
    assert kinds(on_generation(LIVE, saving, "u1")) == [LeaveSavingState]
    assert kinds(on_generation(RESTART, saving, "u1")) == [StopWorkers]
    assert on_generation(LIVE, leave(3), "u1")[-1] == StopWorkers(LauncherState.LEAVING, 10.0)


def test_a_joiner_with_only_some_of_its_workers_alive_stops_them_before_its_joiners_start() -> None:
    """Two workers started ahead; one exited before the unit's world came. The other
    cannot join alone, and a new group started beside it would share its devices: it goes
    first, then the joiners start (as joiners)."""
    standby = dataclasses.replace(WAITING, generation=0, live_mode=True, standby=True, workers_generation=0,
                                  workers_started=True)
    actions = on_generation(standby, reconfigure(4), "u1")
    assert kinds(actions) == [LeaveStandby, HoldStart, StopWorkers]
    held = actions[1]
    assert isinstance(held, HoldStart) and held.joining and held.replacing and held.start is not None
    assert held.start.generation == 4 and held.start.rank_table == TABLE
    stopped = dataclasses.replace(standby, state=LauncherState.STOPPING, standby=False, workers_generation=None,
                                  stopping_for_start=True, pending_start=held.start, pending_joining=True)
    assert on_workers_stopped(stopped)[-1] == StartWorkers(held.start, joining=True)
    # A join that comes while they stop is held for them too.
    assert on_generation(dataclasses.replace(stopped, pending_start=None), reconfigure(5), "u1") == (
        HoldStart(launcher_pb2.Generation(generation=5, rank_table=TABLE, rendezvous=RENDEZVOUS, target_step=40),
                  joining=True),)
    # None runs: the joiners start at once.
    assert kinds(on_generation(dataclasses.replace(standby, workers_generation=None), reconfigure(4), "u1")) == [
        StartWorkers]


def test_a_live_unit_leaving_at_a_step_boundary_gets_the_world_without_it() -> None:
    # Its workers are told the new world, which does not name them: they leave after the agreed step.
    change = reconfigure(4, table=OTHERS, leaving=("u1",))
    assert on_generation(LIVE, change, "u1") == (SendWorlds(4, OTHERS, RENDEZVOUS, target_step=40),)
    # At a step boundary but with no world left to name: a plain leave.
    alone = launcher_pb2.Generation(generation=3, from_generation=3, leaving=["u1"], at_step_boundary=True)
    assert kinds(on_generation(LIVE, alone, "u1")) == [StopWorkers]


# The end of a stop.


def test_once_stopped_a_leaving_unit_reports_where_it_saved_and_exits_0_a_failed_one_exits_1() -> None:
    leaving = dataclasses.replace(RESTART, state=LauncherState.LEAVING, saved=(("/ckpt", 120), ("/ckpt", 120)))
    report, finish = on_workers_stopped(leaving)
    assert report == Report(3, launcher_pb2.GENERATION_PHASE_LEFT, step=120,
                            detail="left after saving the training state at step 120 to /ckpt")
    assert finish == Finish(LauncherState.SUCCEEDED, EXIT_OK, "left the job")
    assert left_detail(()) == "left"
    failed = dataclasses.replace(RESTART, state=LauncherState.STOPPING, failed_self=True)
    assert on_workers_stopped(failed) == (
        Finish(LauncherState.FAILED, EXIT_UNIT_FAILED, "the controller declared this unit failed"),)


def test_once_stopped_the_unit_reports_stopped_or_starts_the_generation_that_replaced_it() -> None:
    stopped = dataclasses.replace(RESTART, state=LauncherState.STOPPING)
    assert on_workers_stopped(stopped) == (ClearLiveStopDeadline(), Enter(LauncherState.WAITING),
                                           HoldStart(None, replacing=False),
                                           Report(3, launcher_pb2.GENERATION_PHASE_STOPPED, with_store_port=True))
    replaced = dataclasses.replace(stopped, stopping_for_start=True, pending_start=start(4))
    assert kinds(on_workers_stopped(replaced)) == [ClearLiveStopDeadline, Enter, HoldStart, StartWorkers]
    assert on_workers_stopped(dataclasses.replace(stopped, state=LauncherState.FAILED)) == ()


class _Channel:
    """The worker channel's `send`, recorded (LauncherChannel's interface for this)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send(self, local_rank: int, message: object) -> None:
        self.sent.append((local_rank, message))


def test_a_unit_set_aside_and_then_asked_to_save_names_its_workers_a_world_after_the_set_aside_one() -> None:
    """A replica's node set aside (generation 2 names it out; it stays in generation 1)
    waits for a world after 2. Asked to leave saving the state, its launcher must name one
    after 2, not generation 1 + 1: that one the workers never read, and they hung unsaved
    (an urgent job took one node of each of two HybridSharded replicas)."""
    channel = _Channel()
    agent = SimpleNamespace(generation=1, state=LauncherState.RUNNING, log=logging.getLogger("test"),
                            options=SimpleNamespace(unit_id="u1", leave_timeout_s=30.0),
                            workers=SimpleNamespace(workers=[SimpleNamespace(local_rank=0, rank=0)]))
    live = LiveMode(agent, channel)  # type: ignore[arg-type]
    live.send_worlds(2, OTHERS, RENDEZVOUS, set_aside=True)
    assert agent.generation == 1, "set aside: still in generation 1"
    live.leave_saving_state()
    (_, aside), (_, save) = channel.sent
    assert isinstance(aside, World) and aside.set_aside and aside.generation == 2
    assert isinstance(save, World) and save.save and save.rank == -1
    assert save.generation > aside.generation, "a world the set-aside workers read (they wait for one after 2)"
