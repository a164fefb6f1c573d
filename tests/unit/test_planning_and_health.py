"""The pure deciders: generation planning, world decisions and health verdicts, with the clock
passed in."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.controller.core.health import Failure, HealthPolicy, UnitHealth, health_verdicts
from tidal.controller.core.planning import (
    Candidate,
    Form,
    Grow,
    Wait,
    WorldSnapshot,
    allowed_sizes,
    choose_world_size,
    decide_world,
    plan_generation,
)
from tidal.controller.ratelimit import TokenBucket


def candidate(unit: str, previous: int | None = None, port: int = 5000, registered: float = 0.0,
              procs: int = 1) -> Candidate:
    return Candidate(unit_id=unit, nodes=(f"n-{unit}",), procs_per_node=procs, address=f"host-{unit}",
                     store_port=port, previous_group_rank=previous, registered_at=registered)


def test_survivors_keep_their_order_and_joiners_follow() -> None:
    plan = plan_generation(job_id="j", number=4, candidates=[
        candidate("late", registered=9.0), candidate("c", previous=2), candidate("a", previous=0),
        candidate("early", registered=1.0)], replicas=4, reason="r", now=100.0, resume_step=17)
    assert plan.unit_ids == ("a", "c", "early", "late")
    assert [m.group_rank for m in plan.members] == [0, 1, 2, 3]
    assert plan.rendezvous_unit_id == "a" and plan.rendezvous_host == "host-a" and plan.rendezvous_port == 5000
    assert plan.resume_step == 17 and plan.world_size == 4


def test_ranks_count_every_process_of_every_unit() -> None:
    plan = plan_generation(job_id="j", number=1, candidates=[candidate("a", procs=2), candidate("b", procs=3)],
                      replicas=2, reason="r", now=0.0, resume_step=0)
    assert [(m.unit_id, m.first_rank) for m in plan.members] == [("a", 0), ("b", 2)]
    table = plan.rank_table()
    assert table.world_size == 5 and table.assignments[1].first_rank == 2


def test_rendezvous_moves_to_a_live_unit_when_the_old_host_is_gone() -> None:
    # Generation 1 was hosted by "a" (group rank 0); "a" failed; the survivors re-form.
    plan = plan_generation(job_id="j", number=2, candidates=[candidate("c", previous=2), candidate("b", previous=1)],
                      replicas=2, reason="r", now=0.0, resume_step=0)
    assert plan.rendezvous_unit_id == "b" and plan.members[0].unit_id == "b"


def test_a_unit_without_a_store_port_never_hosts() -> None:
    plan = plan_generation(job_id="j", number=1, candidates=[candidate("a", previous=0, port=0), candidate("b", 1)],
                      replicas=2, reason="r", now=0.0, resume_step=0)
    assert plan.rendezvous_unit_id == "b" and plan.members[0].unit_id == "b"
    with pytest.raises(ValueError, match="no member can host"):
        plan_generation(job_id="j", number=1, candidates=[candidate("a", port=0)], replicas=1, reason="r", now=0.0,
                   resume_step=0)


def test_allowed_sizes() -> None:
    assert allowed_sizes(1, 4) == [1, 2, 3, 4]
    assert allowed_sizes(2, 8, replica_step=2) == [2, 4, 6, 8]
    assert allowed_sizes(1, 8, allowed_replicas=[8, 4, 2, 16]) == [2, 4, 8]
    assert choose_world_size(5, [2, 4, 8]) == 4
    assert choose_world_size(1, [2, 4]) is None


def snapshot(*, running: bool, members: tuple[str, ...] = (), joiners: dict[str, float] | None = None,
             min_replicas: int = 2, max_replicas: int = 3, last_change_at: float | None = None,
             snooze: float = 0.0) -> WorldSnapshot:
    return WorldSnapshot(running=running, members=members, joiners=joiners or {}, min_replicas=min_replicas,
                         max_replicas=max_replicas, sizes=tuple(allowed_sizes(min_replicas, max_replicas)),
                         last_change_at=last_change_at, join_settle_s=2.0, scale_up_snooze_s=snooze)


def test_forming_waits_for_min_then_settles_then_forms() -> None:
    assert decide_world(snapshot(running=False, joiners={"a": 10.0}), now=10.5) == Wait("1 of min 2 replicas ready")
    waiting = decide_world(snapshot(running=False, joiners={"a": 10.0, "b": 11.0}), now=11.5)
    assert isinstance(waiting, Wait) and "waiting 1.5 s for more" in waiting.reason
    formed = decide_world(snapshot(running=False, joiners={"a": 10.0, "b": 11.0}), now=13.1)
    assert formed == Form(2, ("a", "b"), "2 replicas ready (min 2, max 3)")
    # At max, no need to wait for the settle window.
    full = decide_world(snapshot(running=False, joiners={"a": 10.0, "b": 10.0, "c": 10.0}), now=10.1)
    assert isinstance(full, Form) and full.replicas == 3


def test_replicas_of_two_nodes_decided_node_by_node_are_told_in_nodes_and_the_specs_replicas() -> None:
    """DataParallel replicas of 2 nodes, min 1 and max 2 replicas: the decision counts 2..4
    units, and its reasons say nodes and the spec's bounds, not "4 replicas (max 4)"."""
    two_node = dataclasses.replace(snapshot(running=False, members=("a",), min_replicas=2, max_replicas=4),
                                   scale=2)
    assert decide_world(two_node, now=50.0) == Wait("1 of 2 nodes ready (replicas of 2 nodes: min 1, max 2)")
    full = dataclasses.replace(two_node, members=("a", "b", "c", "d"))
    assert decide_world(full, now=50.0) == Form(4, (), "4 nodes ready (replicas of 2 nodes: min 1, max 2)")
    grow = dataclasses.replace(two_node, running=True, members=("a", "b"), joiners={"c": 1.0, "d": 1.0})
    assert decide_world(grow, now=50.0) == Grow(4, ("c", "d"), "grow 2 -> 4 nodes: c, d joined")
    at_max = dataclasses.replace(full, running=True, joiners={"e": 1.0})
    assert decide_world(at_max, now=50.0) == Wait("at max_replicas 2")


def test_survivors_reform_at_once_without_waiting() -> None:
    action = decide_world(snapshot(running=False, members=("a", "b")), now=50.0)
    assert action == Form(2, (), "2 replicas ready (min 2, max 3)")
    below = decide_world(snapshot(running=False, members=("a",)), now=50.0)
    assert below == Wait("1 of min 2 replicas ready")


def test_grow_needs_a_settled_joiner_and_respects_the_snooze() -> None:
    running = {"running": True, "members": ("a", "b")}
    assert decide_world(snapshot(**running), now=5.0) == Wait("no joiner")
    settling = decide_world(snapshot(**running, joiners={"c": 4.0}), now=5.0)
    assert isinstance(settling, Wait) and "more joiners" in settling.reason
    snoozed = decide_world(snapshot(**running, joiners={"c": 4.0}, last_change_at=3.0, snooze=10.0), now=7.0)
    assert isinstance(snoozed, Wait) and "snoozed for 6.0 s" in snoozed.reason
    grow = decide_world(snapshot(**running, joiners={"c": 4.0}), now=7.0)
    assert grow == Grow(3, ("c",), "grow 2 -> 3 replicas: c joined")
    at_max = decide_world(snapshot(running=True, members=("a", "b", "c"), joiners={"d": 0.0}), now=9.0)
    assert at_max == Wait("at max_replicas 3")


POLICY = HealthPolicy(heartbeat_timeout_s=3.0, progress_timeout_s=60.0)


def test_missing_heartbeats_fail_a_unit_after_the_timeout() -> None:
    units = [UnitHealth("a", True, last_heartbeat_at=100.0), UnitHealth("b", True, last_heartbeat_at=97.5)]
    assert health_verdicts(units, now=100.4, policy=POLICY, generation_started_at=0.0, reconnect_deadline=0.0) == []
    verdicts = health_verdicts(units, now=100.6, policy=POLICY, generation_started_at=0.0, reconnect_deadline=0.0)
    assert verdicts == [Failure("b", "no heartbeat for 3.1 s (timeout 3 s)", "heartbeat")]


def test_a_launcher_that_does_not_come_back_after_a_restart_fails_after_the_grace() -> None:
    units = [UnitHealth("a", connected=False, last_heartbeat_at=None)]
    assert health_verdicts(units, now=10.0, policy=POLICY, generation_started_at=0.0, reconnect_deadline=15.0) == []
    [failure] = health_verdicts(units, now=15.1, policy=POLICY, generation_started_at=0.0, reconnect_deadline=15.0)
    assert failure.cause == "reconnect" and "did not reconnect" in failure.reason


def test_a_worker_without_progress_is_hung_but_only_if_it_ever_reported() -> None:
    silent = UnitHealth("a", True, last_heartbeat_at=199.0)
    stalled = UnitHealth("b", True, last_heartbeat_at=199.0, progress_at={4: 130.0, 5: 190.0})
    verdicts = health_verdicts([silent, stalled], now=200.0, policy=POLICY, generation_started_at=100.0,
                               reconnect_deadline=0.0)
    assert verdicts == [Failure("b", "rank 4 made no progress for 70.0 s (timeout 60 s)", "progress")]
    # Progress from before this generation started does not count against it.
    assert health_verdicts([stalled], now=200.0, policy=POLICY, generation_started_at=135.0,
                           reconnect_deadline=0.0) == []


def test_a_hang_blames_its_cause_not_the_ranks_waiting_for_it() -> None:
    # Rank 1 hangs in its own code; ranks 0 and 2 wait for it in the all-reduce. None has
    # progressed for 70 s, but only the one not waiting is the cause.
    cause = UnitHealth("b", True, last_heartbeat_at=199.0, progress_at={1: 130.0}, beat_at={1: 199.5},
                       waiting={1: False})
    victims = [UnitHealth(unit, True, last_heartbeat_at=199.0, progress_at={rank: 130.0}, beat_at={rank: 199.5},
                          waiting={rank: True}) for unit, rank in (("a", 0), ("c", 2))]
    verdicts = health_verdicts([victims[0], cause, victims[1]], now=200.0, policy=POLICY, generation_started_at=0.0,
                               reconnect_deadline=0.0)
    assert verdicts == [Failure("b", "rank 1 made no progress for 70.0 s (timeout 60 s)", "progress")]


def test_beat_silence_is_the_launchers_to_judge_and_a_silent_hang_meets_the_progress_timeout() -> None:
    # A worker stops beating inside a collective: its last beat said "waiting", like its
    # victims'. Whether it is frozen (killed) or busy (left alone) is its launcher's verdict;
    # the controller judges no beat silence, whatever its heartbeat timeout.
    def units(now: float) -> list[UnitHealth]:
        # Both launchers heartbeat; the victim beats, the silent worker last beat at 196.5.
        victim = UnitHealth("a", True, last_heartbeat_at=now - 0.1, progress_at={0: 196.0}, beat_at={0: now - 0.2},
                            waiting={0: True})
        silent = UnitHealth("b", True, last_heartbeat_at=now - 0.1, progress_at={1: 196.0}, beat_at={1: 196.5},
                            waiting={1: True})
        return [victim, silent]

    for now in (199.0, 200.0, 250.0, 256.0):
        assert health_verdicts(units(now), now=now, policy=POLICY, generation_started_at=0.0,
                               reconnect_deadline=0.0) == []
    # Left alone by its launcher and still silent, it is hung once the progress timeout
    # passes: its stale "waiting" does not shield it. The victim, beating and waiting for
    # it, is not blamed.
    verdicts = health_verdicts(units(257.0), now=257.0, policy=POLICY, generation_started_at=0.0,
                               reconnect_deadline=0.0)
    assert verdicts == [Failure("b", "rank 1 made no progress for 61.0 s (timeout 60 s)", "progress")]


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=10.0, burst=5, now=0.0)
    assert [bucket.allow(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert bucket.allow(0.05) is False
    assert bucket.allow(0.1) is True
    assert bucket.allow(10.0) and bucket.tokens == pytest.approx(4.0)


def test_no_settling_when_every_submitted_unit_has_registered() -> None:
    def snapshot(expected: int | None) -> WorldSnapshot:
        return WorldSnapshot(running=True, members=("a", "b"), joiners={"c": 10.0}, min_replicas=1, max_replicas=4,
                             sizes=(1, 2, 3, 4), last_change_at=None, join_settle_s=2.0, scale_up_snooze_s=0.0,
                             expected=expected)

    assert isinstance(decide_world(snapshot(1), now=10.5), Wait)
    assert isinstance(decide_world(snapshot(None), now=10.5), Wait)
    grow = decide_world(snapshot(0), now=10.5)
    assert isinstance(grow, Grow) and grow.joiners == ("c",)


def test_forming_afresh_waits_for_a_unit_slurm_started_until_its_launcher_registers_or_the_settle_ends() -> None:
    """Two launchers registered at 10.0; a third unit's Slurm job was seen running at
    10.8: forming at 12.0 (the settle after the registrations) would only grow onto it
    moments later, so the world waits until 12.8 for it; once it registers, it forms at
    once with all three. A running world waits for it too before it grows."""
    def snapshot(joiners: dict[str, float], starting: dict[str, float], expected: int,
                 running: bool = False) -> WorldSnapshot:
        return WorldSnapshot(running=running, members=("a", "b") if running else (), joiners=joiners,
                             min_replicas=2, max_replicas=4, sizes=(2, 3, 4), last_change_at=None,
                             join_settle_s=2.0, scale_up_snooze_s=0.0, expected=expected, starting=starting)

    two = {"a": 10.0, "b": 10.0}
    assert isinstance(decide_world(snapshot(two, {}, expected=1), now=12.1), Form)
    waiting = decide_world(snapshot(two, {"c": 10.8}, expected=1), now=12.1)
    assert isinstance(waiting, Wait) and "0.7 s" in waiting.reason, waiting
    formed = decide_world(snapshot(two, {"c": 10.8}, expected=1), now=12.8)
    assert isinstance(formed, Form) and formed.replicas == 2
    # It registered at 12.3: nothing else is on its way (a unit queued in Slurm for a node
    # does not count as expected), so the world forms at once with all three.
    three = decide_world(snapshot({**two, "c": 12.3}, {}, expected=0), now=12.3)
    assert isinstance(three, Form) and three.replicas == 3 and three.joiners == ("a", "b", "c")
    assert isinstance(decide_world(snapshot({"c": 5.0}, {"d": 10.8}, expected=1, running=True), now=11.0), Wait)
    grow = decide_world(snapshot({"c": 5.0}, {"d": 10.8}, expected=1, running=True), now=12.8)
    assert isinstance(grow, Grow) and grow.joiners == ("c",)


def test_a_grow_onto_a_unit_slurm_started_from_its_queue_waits_for_the_view_of_nodes_freed_with_it() -> None:
    """Two nodes free at 20.0 (a 2-node job ended). Slurm starts the unit queued ahead on
    one; it registers at 20.7, before any view shows the other node idle. Growing at once
    would take it alone, and the unit the next view submits for the other node would make a
    second world change. So the grow waits for a view taken after 20.7 (join_settle_s at
    most); that view's unit, submitted at 21.1, is waited for join_settle_s from its
    submission (it registers at 21.9, later than the settle after the first registration);
    then both join in one grow."""
    def snapshot(joiners: dict[str, float], *, unseen_start_at: float | None = None, expected: int = 0,
                 expected_submitted_at: float | None = None) -> WorldSnapshot:
        return WorldSnapshot(running=True, members=("a", "b"), joiners=joiners, min_replicas=2, max_replicas=4,
                             sizes=(2, 3, 4), last_change_at=None, join_settle_s=1.0, scale_up_snooze_s=0.0,
                             expected=expected, expected_submitted_at=expected_submitted_at,
                             unseen_start_at=unseen_start_at)

    waiting = decide_world(snapshot({"c": 20.7}, unseen_start_at=20.7), now=20.8)
    assert isinstance(waiting, Wait) and "Slurm view" in waiting.reason, waiting
    # No view within join_settle_s: it grows alone.
    alone = decide_world(snapshot({"c": 20.7}, unseen_start_at=20.7), now=21.7)
    assert isinstance(alone, Grow) and alone.joiners == ("c",)
    # The view came (21.1) and submitted a unit for the other node: wait for it from its
    # submission, past the settle after c's registration (21.7).
    settling = decide_world(snapshot({"c": 20.7}, expected=1, expected_submitted_at=21.1), now=21.8)
    assert isinstance(settling, Wait) and "0.3 s" in settling.reason, settling
    both = decide_world(snapshot({"c": 20.7, "d": 21.9}), now=21.9)
    assert both == Grow(4, ("c", "d"), "grow 2 -> 4 replicas: c, d joined")
    # The view showed no other node: nothing expected, it grows at once.
    assert decide_world(snapshot({"c": 20.7}), now=21.0) == Grow(3, ("c",), "grow 2 -> 3 replicas: c joined")
    # Survivors of a failure re-form at once, though their replacement was just submitted.
    survivors = WorldSnapshot(running=False, members=("a", "b"), joiners={}, min_replicas=2, max_replicas=4,
                              sizes=(2, 3, 4), last_change_at=None, join_settle_s=1.0, scale_up_snooze_s=0.0,
                              expected=1, expected_submitted_at=30.0)
    assert decide_world(survivors, now=30.0) == Form(2, (), "2 replicas ready (min 2, max 4)")
