"""Live replicas of several nodes (`controller/core/replicas.py`): one-node units grouped into
replicas by the controller. The slot rules, then the job's state machine through a node's
loss, its replacement and a replica that waits too long."""

from __future__ import annotations

import dataclasses

from tests.unit.test_job_core import CONFIG, Driver, sent
from tidal.controller.core import job as core
from tidal.controller.core.replicas import Slot, assign_slot, complete, incomplete_replicas, slot_for, world_nodes
from tidal.controller.model import JobState, UnitRecord, UnitState
from tidal.proto import admin_pb2, common_pb2, launcher_pb2


def unit(unit_id: str, replica: int, node_index: int, state: UnitState = UnitState.ACTIVE) -> UnitRecord:
    return UnitRecord(job_id="j-1", unit_id=unit_id, state=state, replica=replica, node_index=node_index)


def test_a_registering_unit_fills_the_most_complete_replica_first_then_opens_a_new_one() -> None:
    assert assign_slot([], 2) == Slot(1, 0)
    assert assign_slot([unit("a", 1, 0)], 2) == Slot(1, 1)
    whole = [unit("a", 1, 0), unit("b", 1, 1)]
    assert assign_slot(whole, 2) == Slot(2, 0), "a whole replica takes no more; a new one opens"
    # Replica 1 lost node 0 (a failed unit is a hole); replica 2 is one node of three.
    units = [unit("a", 1, 0, UnitState.FAILED), unit("b", 1, 1), unit("c", 1, 2), unit("d", 2, 0)]
    assert assign_slot(units, 3) == Slot(1, 0), "the replica closest to whole, at its missing index"


def test_a_hole_is_filled_first_in_the_replica_whose_units_hold_the_newest_state() -> None:
    """Replicas 1 and 2 each lack node 1. Replica 1's node 0 was set aside steps ago (its
    shards are old); replica 2's node 0 holds the job's newest step, and node 1's shards
    of it are on disk. The new node goes to replica 2: filling replica 1 formed a world
    with old shards only, and the job failed (chaos, sharded, seed 2)."""
    units = [unit("a", 1, 0), unit("b", 1, 1, UnitState.FAILED), unit("c", 2, 0), unit("d", 2, 1, UnitState.LEFT)]
    assert assign_slot(units, 2) == Slot(1, 1), "the oldest replica, all else equal"
    assert assign_slot(units, 2, current={2}) == Slot(2, 1)
    # Fewer holes still come first: replica 3 lacks two of three nodes, replica 1 one.
    three = [unit("a", 1, 0), unit("b", 1, 1), unit("c", 2, 0), unit("d", 2, 1), unit("e", 2, 2), unit("f", 3, 0)]
    assert assign_slot(three, 3, current={3}) == Slot(1, 2)


def test_two_launchers_registering_at_once_are_told_different_slots() -> None:
    spec = admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_LIVE, nodes_per_replica=2)
    units = {"a": unit("a", 1, 0)}
    first = slot_for(units, spec, "b", {})
    second = slot_for(units, spec, "c", {"b": first} if first else {})
    assert (first, second) == (Slot(1, 1), Slot(2, 0))
    assert slot_for(units, spec, "a", {}) == Slot(1, 0), "a unit keeps its slot when it registers again"
    restart = admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_RESTART, nodes_per_replica=2)
    assert slot_for(units, restart, "b", {}) is None, "restart mode's K-node units are one Slurm job each"


def test_a_hole_told_to_a_launcher_whose_unit_then_failed_is_told_to_the_next_one() -> None:
    """Replica 1 lost node 1. Slurm unit x's launcher registers and is told that hole, but
    its session is never taken in (it died as it registered: the reservation stays) and
    Slurm then ends its job: x failed. The next launcher, y, was told a new replica, as if
    x still held the hole, and replica 1 waited for a node that never came (until
    replica_patch_wait_s gave it up). A failed or departed unit reserves nothing."""
    spec = admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_LIVE, nodes_per_replica=2)
    units = {"a": unit("a", 1, 0), "b": unit("b", 1, 1, UnitState.FAILED), "x": unit("x", 0, 0, UnitState.SUBMITTED)}
    told = slot_for(units, spec, "x", {})
    assert told == Slot(1, 1)
    reserved = {"x": told}
    assert slot_for(units, spec, "y", reserved) == Slot(2, 0), "held for x while it may still come"
    for gone in (UnitState.FAILED, UnitState.LEFT):
        units["x"] = unit("x", 0, 0, gone)
        assert slot_for(units, spec, "y", reserved) == Slot(1, 1)


def test_only_whole_replicas_are_complete() -> None:
    units = {u.unit_id: u for u in [unit("a", 1, 0), unit("b", 1, 1), unit("c", 2, 0)]}
    assert complete(units, ["a", "b", "c"], 2) == {1: ["a", "b"]}
    assert incomplete_replicas(units, 2) == {2: ["c"]}


class GroupedDriver(Driver):
    """A live job whose replicas are two one-node units."""

    def __init__(self, **config: object) -> None:
        super().__init__(min_replicas=1, max_replicas=2, config=dataclasses.replace(CONFIG, **config))  # type: ignore[arg-type]
        self.state.job.spec.nodes_per_replica = 2

    def two_replicas(self, replica_workers: int = 4) -> GroupedDriver:
        """a, b (replica 1) form the world; c, d (replica 2) join it."""
        self.form("ab", replica_workers=replica_workers)
        for u in "cd":
            self.join(u)
        self.tick()
        self.grow_completes(("c", "d"), replica_workers=replica_workers)
        return self

    def join(self, unit_id: str) -> Slot:
        slot = slot_for(self.state.units, self.state.job.spec, unit_id, {})
        assert slot is not None
        self.feed(core.LauncherConnected(unit_id, launcher_pb2.Register(
            job_id="j-1", unit_id=unit_id, nodes=[f"node-{unit_id}"], address="127.0.0.1",
            store_port=1000 + ord(unit_id[-1])), slot))
        self.links[unit_id] = core.Link(last_heartbeat_at=self.clock)
        return slot

    def form(self, units: str, replica_workers: int = 0) -> None:
        """`units` register and form the first world; its workers report what a replica
        spans (`replica_workers`, 0: nothing)."""
        for unit_id in units:
            self.join(unit_id)
        self.tick()
        if replica_workers:
            self.grow_completes((), replica_workers=replica_workers)

    def grow_completes(self, joiners: tuple[str, ...], replica_workers: int = 0) -> None:
        generation = self.state.generation
        assert generation is not None
        for joiner in joiners:
            self.report(joiner, generation.number, launcher_pb2.GENERATION_PHASE_STARTED)
        for member in generation.unit_ids:
            self.report(member, generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=10,
                        replica_workers=replica_workers)


def test_a_lost_node_takes_its_replica_out_and_one_new_node_brings_it_back() -> None:
    driver = GroupedDriver()
    assert [driver.join(u) for u in "ab"] == [Slot(1, 0), Slot(1, 1)]
    driver.tick()
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b")
    assert [driver.join(u) for u in "cd"] == [Slot(2, 0), Slot(2, 1)]
    driver.tick()
    driver.grow_completes(("c", "d"))
    assert driver.state.generation.unit_ids == ("a", "b", "c", "d")
    assert [m.first_rank for m in driver.state.generation.members] == [0, 1, 2, 3]

    effects = driver.exit("d", driver.state.generation.number, 9)
    assert driver.state.units["d"].state is UnitState.FAILED
    assert driver.state.generation.unit_ids == ("a", "b"), "replica 2 is out as a whole"
    assert driver.state.units["c"].state is UnitState.JOINING
    standby = driver.event("unit_standby")
    assert (standby.unit_id, standby.fields["cause"]) == ("c", "replica_incomplete")
    assert sent(effects, "c") == [], "c's workers keep their state; nothing stops them"

    assert driver.join("e") == Slot(2, 1), "the new node takes the lost one's place"
    effects = driver.tick()
    assert driver.event("world_reconfiguring").fields["joiners"] == "c,e"
    driver.grow_completes(("c", "e"))
    assert driver.state.generation.unit_ids == ("a", "b", "c", "e")
    assert driver.state.job.state is JobState.RUNNING


def test_whether_a_replicas_nodes_are_in_a_world_together_follows_what_its_workers_span() -> None:
    spec = admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_LIVE, nodes_per_replica=2, procs_per_node=4)
    assert world_nodes(spec, 0) == 2, "not said yet: together, the safe side"
    assert world_nodes(spec, 8) == 2, "HybridSharded over both nodes"
    assert world_nodes(spec, 1) == 1, "DataParallel: every worker is a replica"
    assert world_nodes(spec, 4) == 1, "a replica within one node"
    assert world_nodes(admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_RESTART, nodes_per_replica=2), 1) == 1


def test_under_data_parallel_a_lost_node_costs_only_its_own_workers() -> None:
    """Replicas of two nodes whose workers said a replica is one worker: a lost node's
    sibling stays in the world, the spec's max_replicas counts 2 nodes a replica, and the
    node that takes the hole joins alone."""
    driver = GroupedDriver()
    driver.form("ab", replica_workers=1)
    assert driver.state.replica_workers == 1
    for u in "cd":
        driver.join(u)
    driver.tick()
    driver.grow_completes(("c", "d"), replica_workers=1)
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b", "c", "d")

    grown = driver.event("world_reconfiguring")
    # Told in the spec's replicas and in nodes, as `tidal status` counts them (not "4 replicas").
    assert grown.fields["replicas"] == 2 and grown.reason == "grow 2 -> 4 nodes: c, d joined", grown

    effects = driver.exit("d", driver.state.generation.number, 9)
    assert driver.state.units["d"].state is UnitState.FAILED
    assert driver.state.generation.unit_ids == ("a", "b", "c"), "c stays in the world"
    assert driver.event("world_formed").fields["replicas"] == 1, "one whole replica (c's node trains on)"
    assert driver.state.units["c"].state is UnitState.ACTIVE
    assert "unit_standby" not in driver.events(effects)

    assert driver.join("e") == Slot(2, 1), "the new node takes the lost one's slot"
    driver.tick()
    assert driver.event("world_reconfiguring").fields["joiners"] == "e"
    driver.grow_completes(("e",), replica_workers=1)
    assert driver.state.generation.unit_ids == ("a", "b", "c", "e")
    assert driver.join("f") == Slot(3, 0)
    driver.tick()
    assert driver.state.generation.unit_ids == ("a", "b", "c", "e"), "at max_replicas 2: four nodes"


def test_under_data_parallel_a_node_leaving_sets_none_of_its_replica_aside() -> None:
    driver = GroupedDriver()
    driver.form("abcd", replica_workers=1)
    assert driver.state.generation is not None and len(driver.state.generation.unit_ids) == 4
    driver.say("d", leave_request=launcher_pb2.LeaveRequest(generation=driver.state.generation.number,
                                                            cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    change = driver.state.changing
    assert change is not None
    assert driver.state.generation.unit_ids == ("a", "b", "c")
    assert driver.state.units["c"].state is UnitState.ACTIVE


def test_a_resize_below_the_replicas_running_asks_whole_replicas_of_nodes_to_leave() -> None:
    driver = GroupedDriver()
    driver.form("abcd")
    assert driver.state.generation is not None and len(driver.state.generation.unit_ids) == 4
    driver.feed(core.ResizeRequested(0, 1, 0))
    leaving = sorted(u for u, unit in driver.state.units.items() if unit.state is UnitState.LEAVING)
    assert leaving == ["d"] and list(driver.state.deferred_leaves) == ["c"], \
        "max_replicas 1 keeps one replica of two nodes: d leaves at a step boundary; c, set aside, after it"
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b")
    for member in "ab":
        driver.report(member, driver.state.generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=11)
    leaving = sorted(u for u, unit in driver.state.units.items() if unit.state is UnitState.LEAVING)
    assert leaving == ["c", "d"]


def test_a_resize_leaves_replicas_of_nodes_waiting_outside_the_world_whole() -> None:
    """Replicas of two nodes, max 3 → 2: replica 1 (u1, u2) trains, replica 2 lost a node
    (u3 set aside, u4 gone), replica 3 (u5, u6) waits to join. Trimmed unit by unit, newest
    first, the resize sent u6 away and kept u5 and u3: neither replica could join, and the
    job stayed at one replica with room for two. Replica 3 joins whole."""
    driver = GroupedDriver(join_settle_s=30.0)
    driver.state.job.spec.max_replicas = 3
    for unit_id in ("u1", "u2", "u3", "u4"):
        driver.join(unit_id)
    driver.tick(31.0)
    generation = driver.state.generation
    assert generation is not None and generation.unit_ids == ("u1", "u2", "u3", "u4")
    for member in generation.unit_ids:
        driver.report(member, generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=10)
    driver.join("u5")
    driver.join("u6")
    driver.exit("u4", generation.number, 9)
    assert driver.state.units["u3"].state is UnitState.JOINING
    driver.feed(core.ResizeRequested(0, 2, 0))
    assert {u: driver.state.units[u].state for u in ("u5", "u6")} == {"u5": UnitState.JOINING,
                                                                      "u6": UnitState.JOINING}
    driver.tick(31.0)
    driver.tick(1.0)
    assert driver.state.generation is not None and len(driver.state.generation.unit_ids) == 4


def test_a_replica_waiting_too_long_for_a_node_gives_its_other_nodes_back() -> None:
    driver = GroupedDriver(replica_patch_wait_s=60.0)
    driver.form("abcd")
    assert driver.state.generation is not None and len(driver.state.generation.unit_ids) == 4
    driver.exit("d", driver.state.generation.number, 9)
    driver.tick(1.0)
    driver.tick(30.0)
    assert driver.state.units["c"].state is UnitState.JOINING, "still waiting within replica_patch_wait_s"
    driver.tick(31.0)
    released = driver.event("replica_released")
    assert released.fields["replica"] == "2"
    assert driver.state.units["c"].state in (UnitState.LEAVING, UnitState.LEFT)
    assert driver.state.generation.unit_ids == ("a", "b"), "the job keeps its other replica"


def test_a_hole_is_asked_of_slurm_once_a_node_is_idle_before_growth_and_whatever_waits() -> None:
    from tidal.controller.units import units_to_submit

    spec = admin_pb2.JobSpec(mode=common_pb2.JOB_MODE_LIVE, nodes_per_replica=2, min_replicas=1, max_replicas=2)
    waiting = units_to_submit(spec, alive=3, idle_nodes=0, now=0.0, last_change_at=None, scale_up_snooze_s=0.0,
                              holes=1)
    assert waiting.count == 0 and "waiting for an idle node" in waiting.reason
    patch = units_to_submit(spec, alive=3, idle_nodes=2, now=0.0, last_change_at=0.0, scale_up_snooze_s=60.0,
                            others_waiting=3, holes=1)
    assert patch.count == 1 and "take the place of lost ones" in patch.reason
    # Growth counts whole replicas of two one-node units.
    grow = units_to_submit(spec, alive=2, idle_nodes=3, now=0.0, last_change_at=None, scale_up_snooze_s=0.0)
    assert grow.count == 2
    assert units_to_submit(spec, alive=2, idle_nodes=1, now=0.0, last_change_at=None, scale_up_snooze_s=0.0).count == 0


def test_a_newest_state_missing_a_shard_is_not_whole() -> None:
    from tidal.train.sync import every_shard_held

    # One replica of two shard ranks: the survivor at step 40, the new node with nothing.
    assert not every_shard_held([40, -1], 2)
    # Two replicas: replica 1 at 40 holds both shards; replica 2's survivor is behind.
    assert every_shard_held([40, 40, 31, -1], 2)
    assert every_shard_held([-1, -1], 2), "a fresh job: nobody holds anything"
    assert every_shard_held([7], 1)


def test_a_lone_replica_that_lost_a_node_forms_again_once_a_node_takes_its_place() -> None:
    driver = GroupedDriver()
    driver.state.job.spec.max_replicas = 1
    driver.form("ab")
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b")
    driver.exit("b", driver.state.generation.number, 9)
    if driver.state.in_flight is not None:
        driver.report("a", driver.state.generation.number, launcher_pb2.GENERATION_PHASE_STOPPED)
    driver.tick(1.0)
    assert driver.state.job.state is JobState.DEGRADED
    assert driver.join("c") == Slot(1, 1)
    driver.tick(1.0)
    assert driver.state.job.state is JobState.RUNNING
    assert driver.state.generation.unit_ids == ("a", "c"), "the healthy node and the new one, in node order"


def test_what_a_replica_spans_is_kept_across_a_controller_restart() -> None:
    driver = GroupedDriver()
    driver.form("ab", replica_workers=1)
    saved = [e for e in driver.effects if isinstance(e, core.SavePending) and e.key == "replica_workers"]
    assert [e.value for e in saved] == [1], "said once, when it changed"
    restored = core.restore(driver.state.job, list(driver.state.units.values()), driver.state.generation,
                            generation_stopped=False, pending={"replica_workers": 1}, config=driver.state.config,
                            now=driver.now)
    assert restored.replica_workers == 1


def test_a_whole_replica_leaving_at_once_lets_its_set_aside_node_finish_the_old_worlds_step() -> None:
    """Both nodes of replica 1 are drained (or preempted) at once: the first leaves at a step
    boundary and sets its sibling aside; the sibling still trains in the old world until
    that step, so its own leave waits for the change (leaving at once broke the step for
    every rank: the live multi-node Slurm test lost step 171 this way)."""
    driver = GroupedDriver().two_replicas()
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b", "c", "d")

    effects = driver.feed(core.DrainRequested(("a", "b"), uid=0))
    assert driver.state.generation.unit_ids == ("c", "d")
    assert driver.event("world_reconfiguring").fields["leaving"] == "a"
    assert sent(effects, "b") == ["reconfigure:" + str(driver.state.generation.number)], \
        "b only hears of the step-boundary change: no leave before the old world's step ends"
    assert driver.state.deferred_leaves == {"b": ("drained", "drained by uid 0")}

    effects = []
    for member in driver.state.generation.unit_ids:
        effects += driver.report(member, driver.state.generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED,
                                 step=11, replica_workers=4)
    assert "world_reconfigured" in driver.events(effects)
    assert sent(effects, "b") == ["leave"], "once the change is done, b leaves"
    assert driver.state.units["b"].state is UnitState.LEAVING and not driver.state.deferred_leaves


def test_two_sharded_replicas_each_left_with_the_other_half_save_both_halves_as_they_leave() -> None:
    """HybridSharded replicas of two nodes (a unit holds only its node index's shards): an
    urgent job took replica 1's node 1 and replica 2's node 0. Their survivors, a (set
    aside, node 0) and d (node 1), hold the two halves of the state between them. When they
    leave (here drained; below min, released), each is the last of its node index: both
    save, or the next world finds one half and the job fails (state_lost). Before, only
    the last member of the world saved, and a set-aside unit never did. (Here c, node 0 of
    the world, leaves first and saves too: while a world runs, a set-aside peer is no
    holder.)"""
    driver = GroupedDriver().two_replicas()
    generation = driver.state.generation
    assert generation is not None and generation.unit_ids == ("a", "b", "c", "d")
    for u in "abcd":
        driver.beat(u, 40)
    driver.tick(0.25)

    def reconfigured() -> None:
        number = driver.state.generation.number
        for member in driver.state.generation.unit_ids:
            driver.report(member, number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=40, replica_workers=4)

    driver.feed(core.DrainRequested(("b",), uid=0))
    assert driver.state.generation.unit_ids == ("c", "d") and driver.state.units["a"].state is UnitState.JOINING
    reconfigured()
    effects = driver.feed(core.DrainRequested(("c",), uid=0))
    # a, set aside, stopped a step ago or more (the world trained on): c, the running
    # world's last node 0, saves (chaos, sharded, seed 10: a drained node 0 that counted on
    # a set-aside peer left node 0's newest shards nowhere, and the job failed).
    assert "state_saving" in driver.events(effects) and driver.event("state_saving").unit_id == "c"
    effects = driver.feed(core.DrainRequested(("a", "d"), uid=0))
    leaves = {e.unit_id: e.message.generation for e in effects
              if isinstance(e, core.Send) and e.message.WhichOneof("body") == "generation"
              and e.unit_id in ("a", "d") and e.message.generation.save_state}
    assert sorted(leaves) == ["a", "d"], driver.events(effects)
    saving = [e for e in effects if isinstance(e, core.Record) and e.kind == "state_saving"]
    assert [e.unit_id for e in saving] == ["a", "d"] and "node index 0" in saving[0].reason


def test_the_current_replicas_are_those_holding_the_newest_step_not_the_lagging_committed_one() -> None:
    from tidal.controller.core.forming import current_replicas

    driver = GroupedDriver().two_replicas()
    for unit_id, step in (("a", 356), ("b", 356), ("c", 358), ("d", 358)):
        driver.beat(unit_id, step)
    driver.tick(0.25)
    assert current_replicas(driver.state) == {2}, "replica 1 stopped two steps ago"
    driver.beat("a", 358)
    driver.beat("b", 358)
    driver.tick(0.25)
    assert current_replicas(driver.state) == {1, 2}


def test_a_new_replica_does_not_form_a_world_without_the_shards_a_set_aside_node_holds_it_saves_them_first() -> None:
    """HybridSharded, one replica (a: node 0, b: node 1) and a new replica (c, d) starting.
    a is drained: it holds the last copy of node 0's shards and saves them as it leaves; b
    is set aside with node 1's in memory. c and d registered meanwhile and make a whole
    replica, but they hold nothing, and the disk has node 0's half only: a world of c and d
    alone had to load a whole state that no folder held, and the job failed (chaos,
    sharded, seed 300: state_lost at step 385). b saves its half first (a leave with
    save_state); the world of c and d forms once it has left, and resumes from both halves
    at the step a saved."""
    driver = GroupedDriver()
    driver.form("ab", replica_workers=4)
    generation = driver.state.generation
    assert generation is not None and generation.unit_ids == ("a", "b")
    for u in "ab":
        driver.beat(u, 40)
    driver.tick(0.25)

    effects = driver.feed(core.DrainRequested(("a",), uid=0))
    assert driver.event("state_saving").unit_id == "a"
    assert "generation_stopping" in driver.events(effects)
    for u in "cd":
        driver.join(u)
    driver.tick(0.25)
    number = generation.number
    driver.report("b", number, launcher_pb2.GENERATION_PHASE_STOPPED, step=41)
    effects = driver.report("a", number, launcher_pb2.GENERATION_PHASE_LEFT, step=41)
    assert driver.state.units["a"].state is UnitState.LEFT and driver.state.job.step == 41
    assert driver.state.generation is not None and driver.state.generation.number == number, \
        "no world of c and d while b holds node 1's half of step 41 in memory only"
    saves = [e for e in effects if isinstance(e, core.Send) and e.unit_id == "b"
             and e.message.WhichOneof("body") == "generation" and e.message.generation.save_state]
    assert len(saves) == 1, driver.events(effects)
    assert driver.event("state_saving").unit_id == "b"
    assert "node index 1" in driver.event("state_saving").reason
    assert driver.state.units["b"].state is UnitState.LEAVING
    assert driver.event("unit_leaving").unit_id == "b"
    assert driver.event("unit_leaving").fields["cause"] == "saving_shards"
    assert "waiting for b to save" in driver.event("job_degraded").reason
    driver.tick(1.0)
    assert driver.state.generation.number == number, "nor while b writes them"

    driver.report("b", number, launcher_pb2.GENERATION_PHASE_LEFT, step=41)
    assert driver.state.units["b"].state is UnitState.LEFT
    effects = driver.tick(0.25)
    assert driver.state.generation.unit_ids == ("c", "d")
    assert driver.event("world_formed").fields["target_step"] == 41
    assert "state_not_held" in driver.events(effects), "c and d load both halves from disk"


def split_state(driver: GroupedDriver) -> int:
    """Replica 1 (a, b) trains at step 40; a is drained and saves node 0's half at 41 while
    c and d (replica 2) register; b is left with node 1's half. The stopped generation's
    number."""
    driver.form("ab", replica_workers=4)
    generation = driver.state.generation
    assert generation is not None
    for u in "ab":
        driver.beat(u, 40)
    driver.tick(0.25)
    driver.feed(core.DrainRequested(("a",), uid=0))
    for u in "cd":
        driver.join(u)
    driver.tick(0.25)
    driver.report("b", generation.number, launcher_pb2.GENERATION_PHASE_STOPPED, step=41)
    driver.report("a", generation.number, launcher_pb2.GENERATION_PHASE_LEFT, step=41)
    assert driver.state.units["b"].state is UnitState.LEAVING and driver.state.units["b"].facts.saving_state
    return generation.number


def test_while_a_split_state_is_saved_the_waiting_world_is_not_given_back_below_min() -> None:
    """The job is degraded while b saves; a release below min_replicas then would give back
    the new replica that only waits for the save (below_min_release_s here 3 s, Slurm units
    on, b slower than that)."""
    driver = GroupedDriver(below_min_release_s=3.0)
    driver.state.slurm_units = True
    split_state(driver)
    effects = []
    for _ in range(4):
        driver.beat("b", 40)
        effects += driver.tick(1.0)
    assert "below_min_released" not in driver.events(effects)
    assert {u: driver.state.units[u].state for u in "cd"} == {"c": UnitState.JOINING, "d": UnitState.JOINING}


def test_a_save_that_never_ends_holds_the_next_world_only_until_the_leave_is_overdue() -> None:
    """b's launcher stays connected but never says LEFT: once its leave is overdue (the grace
    a stop gets: `unit_leave_overdue`), the world of c and d forms without waiting on."""
    driver = GroupedDriver()
    number = split_state(driver)
    formed_at = None
    for second in range(1, 61):
        driver.beat("b", 40)
        effects = driver.tick(1.0)
        if "world_formed" in driver.events(effects):
            formed_at = second
            break
    assert formed_at is not None, "the next world waits for ever"
    assert "unit_leave_overdue" in driver.events()
    assert driver.state.generation is not None and driver.state.generation.number > number
    assert driver.state.generation.unit_ids == ("c", "d")


def test_a_set_aside_node_whose_shards_a_member_of_the_next_world_holds_as_new_is_not_asked_to_save() -> None:
    """Two replicas and min_replicas 2: a (node 0 of replica 1) is drained; c, node 0 of
    replica 2, holds the same shards, so a saves nothing and the world stops (one replica is
    below min). With a third replica (e, f) ready, the next world is c, d, e, f: it holds
    both node indices as new as b does, and b is set aside, not asked to leave."""
    driver = GroupedDriver().two_replicas()
    driver.state.job.spec.min_replicas = 2
    generation = driver.state.generation
    assert generation is not None
    for u in "abcd":
        driver.beat(u, 40)
    driver.tick(0.25)
    effects = driver.feed(core.DrainRequested(("a",), uid=0))
    assert "state_saving" not in driver.events(effects) and "generation_stopping" in driver.events(effects)
    for u in "ef":
        driver.join(u)
    driver.tick(0.25)
    for u in "bcd":
        driver.report(u, generation.number, launcher_pb2.GENERATION_PHASE_STOPPED, step=41)
    effects = driver.report("a", generation.number, launcher_pb2.GENERATION_PHASE_LEFT, step=41)
    assert driver.state.job.step == 40, "a saved nothing: its LEFT step does not move the target"
    assert driver.state.generation.unit_ids == ("c", "d", "e", "f")
    assert "saving_shards" not in [(e.fields or {}).get("cause") for e in effects if isinstance(e, core.Record)]
    assert driver.state.units["b"].state is UnitState.JOINING


def test_two_sharded_replicas_each_left_with_the_other_half_train_on_as_one() -> None:
    """HybridSharded replicas of two nodes: b (node 1 of replica 1) is drained, and a is set
    aside while c, d (replica 2) train on; then c (node 0 of replica 2) is drained and saves
    node 0's newest shards as it leaves. a (node 0) and d (node 1) are what is left, each
    the half its own replica lacks: they become one replica and the next world trains on
    them at the step c saved (a loads node 0's shards of that step from disk), rather than
    waiting for their holes to fill or giving their nodes back."""
    driver = GroupedDriver().two_replicas()
    for u in "abcd":
        driver.beat(u, 40)
    driver.tick(0.25)
    driver.feed(core.DrainRequested(("b",), uid=0))
    generation = driver.state.generation
    assert generation is not None and generation.unit_ids == ("c", "d")
    for member in generation.unit_ids:
        driver.report(member, generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=40,
                      replica_workers=4)
    driver.report("b", generation.number - 1, launcher_pb2.GENERATION_PHASE_LEFT, step=40)
    for u in "cd":
        driver.beat(u, 45)
    driver.tick(0.25)
    effects = driver.feed(core.DrainRequested(("c",), uid=0))
    assert driver.event("state_saving").unit_id == "c"
    number = driver.state.generation.number
    driver.report("d", number, launcher_pb2.GENERATION_PHASE_STOPPED, step=46)
    effects = driver.report("c", number, launcher_pb2.GENERATION_PHASE_LEFT, step=46)
    effects += driver.tick(0.25)
    merged = driver.event("replicas_merged")
    assert merged.fields["units"] == "a,d", driver.events(effects)
    assert (driver.state.units["a"].replica, driver.state.units["a"].node_index) == (3, 0)
    assert (driver.state.units["d"].replica, driver.state.units["d"].node_index) == (3, 1)
    assert driver.state.generation.unit_ids == ("a", "d")
    assert [m.first_rank for m in driver.state.generation.members] == [0, 1], "node 0 first: shard ranks stay"
    assert driver.event("world_formed").fields["target_step"] == 46
    assert "below_min_released" not in driver.events()


def e_set_aside_at_46_beside_a_at_40() -> GroupedDriver:
    """Three replicas (a, b), (c, d), (e, f); b is drained (a set aside at step 40), the
    world trains on to 46; f fails: e is set aside with node 0's step-46 shards."""
    driver = GroupedDriver(replica_patch_wait_s=60.0)
    driver.state.job.spec.max_replicas = 3
    driver.form("ab", replica_workers=4)
    for u in "cdef":
        driver.join(u)
    driver.tick()
    driver.grow_completes(tuple("cdef"), replica_workers=4)
    for u in "abcdef":
        driver.beat(u, 40)
    driver.tick(0.25)
    driver.feed(core.DrainRequested(("b",), uid=0))
    generation = driver.state.generation
    assert generation is not None
    for member in generation.unit_ids:
        driver.report(member, generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=40,
                      replica_workers=4)
    driver.report("b", generation.number - 1, launcher_pb2.GENERATION_PHASE_LEFT, step=40)
    for u in "cdef":
        driver.beat(u, 46)
    driver.tick(0.25)
    driver.exit("f", driver.state.generation.number, 9)
    assert driver.state.units["e"].state is UnitState.JOINING, "e is set aside with node 0 at 46"
    return driver


def c_fails_and_the_world_stops(driver: GroupedDriver) -> None:
    """c fails, and the world's stop completes: a (node 0, 40), e (node 0, 46) and d
    (node 1, 46) are left, no world runs."""
    driver.exit("c", driver.state.generation.number, 9)
    if driver.state.stopping is not None:
        for member in list(driver.state.stopping.waiting_for):
            driver.report(member, driver.state.stopping.generation, launcher_pb2.GENERATION_PHASE_STOPPED, step=46)


def test_halves_merge_with_the_newest_shards_of_each_node_index() -> None:
    """Three replicas; b is drained (a set aside at step 40), the world trains on to 46;
    f fails (e set aside with node 0's step-46 shards), then c fails. a (node 0, step 40),
    e (node 0, step 46) and d (node 1, step 46) are left: the merged replica is e and d.
    With a and d, the world resumed at 46 and node 0's step-46 shards were in no folder
    (e was never asked to save them): state_lost."""
    driver = e_set_aside_at_46_beside_a_at_40()
    c_fails_and_the_world_stops(driver)
    driver.tick(0.25)
    assert driver.event("replicas_merged").fields["units"] == "e,d"
    assert driver.state.generation.unit_ids == ("e", "d")
    assert driver.state.units["a"].replica == 1, "a, steps behind, waits in its own replica"


def test_halves_merge_only_once_every_unit_that_may_hold_an_index_is_heard_from() -> None:
    """The same three replicas as above, but e's stream breaks while it is set aside (a
    blip, or a controller restart: nothing of its steps is known). No merge while e is
    out of touch, nor after it is back until its first heartbeat: picked then, a (steps
    behind) and d merged for good, the world resumed at 46, and node 0's step-46 shards,
    in e's memory, were in no folder: state_lost (found by a review of 015844c)."""
    driver = e_set_aside_at_46_beside_a_at_40()
    driver.feed(core.LauncherClosed("e", "connection reset"))
    del driver.links["e"]
    c_fails_and_the_world_stops(driver)
    driver.tick(0.25)
    assert "replicas_merged" not in driver.events(), "e, out of touch, may hold node 0's newest shards"
    assert driver.state.units["a"].replica == 1 and driver.state.units["d"].replica == 2
    driver.join("e")
    driver.links["e"] = core.Link(last_heartbeat_at=driver.clock, heard=False)
    driver.tick(0.25)
    assert "replicas_merged" not in driver.events(), "e is back, but what it holds is not said yet"
    driver.beat("e", 46)
    driver.tick(0.25)
    assert driver.event("replicas_merged").fields["units"] == "e,d"
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("e", "d")
    assert driver.state.units["a"].replica == 1, "a, steps behind, waits in its own replica"


def test_a_launcher_told_a_replica_number_a_merge_took_meanwhile_takes_a_new_one_at_its_node_index() -> None:
    """b and c are drained together; a launcher x registers and is told slot (3, 0); before
    its connection is taken in, c's leave ends the stop and a, d merge into replica 3. x
    takes (4, 0): two live units at (3, 0) made complete() pick x over a, which holds the
    state."""
    driver = GroupedDriver().two_replicas()
    for u in "abcd":
        driver.beat(u, 40)
    driver.tick(0.25)
    driver.feed(core.DrainRequested(("b", "c"), uid=0))
    generation = driver.state.generation
    assert generation is not None and driver.state.changing is not None
    for member in generation.unit_ids:
        driver.report(member, generation.number, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=41,
                      replica_workers=4)
    assert driver.state.stopping is not None
    for member in list(driver.state.stopping.waiting_for):
        if driver.state.units[member].state is UnitState.ACTIVE:
            driver.report(member, driver.state.stopping.generation, launcher_pb2.GENERATION_PHASE_STOPPED, step=41)
    told = slot_for(driver.state.units, driver.state.job.spec, "x", {})
    assert told == Slot(3, 0)
    driver.report("c", driver.state.stopping.generation, launcher_pb2.GENERATION_PHASE_LEFT, step=41)
    assert driver.event("replicas_merged").fields["replica"] == "3"
    driver.feed(core.LauncherConnected("x", launcher_pb2.Register(
        job_id="j-1", unit_id="x", nodes=["node-x"], address="127.0.0.1", store_port=1200), told))
    assert (driver.state.units["x"].replica, driver.state.units["x"].node_index) == (4, 0)
    assert complete(driver.state.units, ["a", "d", "x"], 2) == {3: ["a", "d"]}
    assert incomplete_replicas(driver.state.units, 2) == {4: ["x"]}, "b, leaving, leaves no hole in replica 1"


def test_a_replica_whose_every_unit_is_leaving_takes_no_new_node() -> None:
    leaving = [unit("b", 1, 1, UnitState.LEAVING), unit("a", 2, 0), unit("d", 2, 1)]
    assert assign_slot(leaving, 2) == Slot(3, 0), "replica 1 is going: a new node starts a replica"
    assert incomplete_replicas({u.unit_id: u for u in leaving}, 2) == {}
    staying = [unit("a", 1, 0, UnitState.JOINING), unit("b", 1, 1, UnitState.LEFT)]
    assert assign_slot(staying, 2) == Slot(1, 1), "a set-aside unit's replica is still filled"
