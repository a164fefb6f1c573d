"""bench/chaos.py's pure parts, without Slurm: the seeded fault draw (aims at the hard
moments, redraws) and the checks over recorded events and ledgers (a user's faults fail
them; what the harness did explains the rest)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench import chaos
from bench.chaos import AIM_ANY, HARD_AIMS, Harm, Hurt, Seen, Window
from tidal.slurm import SlurmError

T0 = 1000.0


def event(kind: str, at: float, unit_id: str = "", generation: int = 1, **fields: str) -> Seen:
    return Seen(kind=kind, at=T0 + at, unit_id=unit_id, generation=generation, reason=f"{kind} for the test",
                fields=fields)


# The draw.

@pytest.mark.parametrize("seed", range(1, 41))
def test_a_seeds_plan_is_one_sequence_with_todays_timings_and_aims_that_make_sense(seed: int) -> None:
    plan = chaos.plan_faults(seed)
    assert plan == chaos.plan_faults(seed)
    # The kinds and timings are still random.Random(seed)'s, as before aims existed.
    rng = random.Random(seed)
    drawn = [(rng.choice(chaos.FAULTS), rng.uniform(1.0, 3.5), rng.random(), rng.uniform(3.0, 8.0),
              rng.choice((2, 3))) for _ in range(rng.randint(4, 6))]
    assert sorted((f.gap_s, f.pick, f.duration_s) for f in plan) == sorted((d[1], d[2], d[3]) for d in drawn)
    for fault in plan:
        kind, _, _, _, nodes = next(d for d in drawn if d[1] == fault.gap_s)
        if fault.aim in chaos.AIM_KINDS:
            assert fault.kind in chaos.AIM_KINDS[fault.aim]
            assert fault.nodes == (chaos.NODES if fault.kind == "urgent" else nodes)
        else:
            assert (fault.kind, fault.nodes) == (kind, nodes)
    aims = [f.aim for f in plan]
    assert aims.count("last_steps") <= 1 and (aims[-1] == "last_steps" or "last_steps" not in aims)
    assert sum(a in chaos.AIM_KINDS for a in aims) <= 1


def test_a_share_of_faults_is_aimed_at_each_hard_moment() -> None:
    aims = [f.aim for seed in range(1, 201) for f in chaos.plan_faults(seed)]
    hard = sum(a != AIM_ANY for a in aims) / len(aims)
    assert 0.3 < hard < 0.6, hard
    for aim in HARD_AIMS:
        assert aims.count(aim) >= 20, (aim, aims.count(aim))
    # The 20 seeds of a full run hit every hard moment.
    assert {f.aim for seed in range(1, 21) for f in chaos.plan_faults(seed)} == {AIM_ANY, *HARD_AIMS}


def test_a_redraw_is_seeded_by_seed_slot_and_attempt_and_aimed_anywhere() -> None:
    assert chaos.redraw(3, 1, 1) == chaos.redraw(3, 1, 1)
    assert len({(chaos.redraw(3, slot, attempt).kind, chaos.redraw(3, slot, attempt).pick)
                for slot in range(4) for attempt in range(1, 4)}) > 6
    assert all(chaos.redraw(seed, 0, 1).aim == AIM_ANY for seed in range(50))


def test_a_landed_faults_label_names_its_aim() -> None:
    assert chaos.Landed("drain", AIM_ANY, 3.0, "training", 0).label() == "drain"
    assert chaos.Landed("drain", "last_holder", 3.0, "u1 the only replica", 2, 1).label() == "drain@last_holder"


# No healthy unit failed.

def test_a_failure_of_a_unit_the_harness_hurt_is_expected_and_of_another_is_a_problem() -> None:
    harm = Harm(hurt=[Hurt("u1", T0 + 10.0)])
    events = [event("failure_detected", 10.1, "u1"), event("failure_detected", 10.1, "u2")]
    problems = chaos.unhealthy_events(events, harm, T0)
    assert len(problems) == 1 and "failure_detected of u2" in problems[0], problems
    # Before the harness hurt it (beyond the half second the harness notes its act late):
    assert chaos.unhealthy_events([event("failure_detected", 5.0, "u1")], harm, T0)


@pytest.mark.parametrize("kind", ["unit_leave_overdue", "worker_failed_after_training"])
def test_an_overdue_leaver_or_a_worker_failing_after_training_is_a_problem_unless_its_unit_was_hurt(
        kind: str) -> None:
    harm = Harm(hurt=[Hurt("u1", T0 + 10.0, T0 + 20.0)])
    assert chaos.unhealthy_events([event(kind, 15.0, "u1")], harm, T0) == []
    assert chaos.unhealthy_events([event(kind, 15.0, "u2")], harm, T0)
    assert chaos.unhealthy_events([event(kind, 25.0, "u1")], harm, T0)


def test_a_lost_unit_is_a_problem_unless_an_urgent_job_or_a_node_failure_explains_it() -> None:
    lost = [event("unit_lost", 30.0, "u5")]
    assert chaos.unhealthy_events(lost, Harm(), T0)
    assert chaos.unhealthy_events(lost, Harm(windows=[Window("urgent", T0 + 20.0, T0 + 28.0)]), T0) == []
    assert chaos.unhealthy_events(lost, Harm(windows=[Window("node_down", T0 + 25.0)]), T0) == []
    # A lowered --max or a controller restart does not end a unit's Slurm job.
    assert chaos.unhealthy_events(lost, Harm(windows=[Window("shrink", T0 + 25.0),
                                                      Window("controller_down", T0 + 25.0)]), T0)
    # Long after the urgent job was cancelled:
    assert chaos.unhealthy_events(lost, Harm(windows=[Window("urgent", T0 + 1.0, T0 + 5.0)]), T0)


def test_a_refused_submission_is_always_a_problem() -> None:
    harm = Harm(hurt=[Hurt("u3", T0)], windows=[Window("urgent", T0)])
    assert chaos.unhealthy_events([event("unit_submit_failed", 5.0, "u3")], harm, T0)


def generation(kind: str, at: float, generation: int, members: str, holders: str) -> Seen:
    return event(kind, at, generation=generation, members=members, state_holders=holders)


def test_state_not_held_is_a_problem_while_a_holder_survives() -> None:
    events = [generation("world_formed", 1.0, 1, "u1,u2", "u1,u2"),
              event("failure_detected", 5.0, "u1"),
              generation("world_formed", 5.0, 2, "u2,u3", "-"),
              event("state_not_held", 5.0, generation=2)]
    problems = chaos.unhealthy_events(events, Harm(hurt=[Hurt("u1", T0 + 4.9)]), T0)
    assert len(problems) == 1 and problems[0].startswith("state_not_held"), problems


def test_state_not_held_after_the_last_holder_saved_it_or_every_holder_was_hurt_is_expected() -> None:
    saved = [generation("world_formed", 1.0, 1, "u1", "u1"), event("state_saving", 5.0, "u1"),
             event("unit_left", 5.5, "u1"), generation("world_formed", 9.0, 2, "u2", "-"),
             event("state_not_held", 9.0, generation=2)]
    assert chaos.unhealthy_events(saved, Harm(drained={"u1": T0 + 5.0}), T0) == []
    lost = [generation("world_formed", 1.0, 1, "u1,u2", "u1,u2"), event("failure_detected", 5.0, "u1"),
            event("failure_detected", 5.0, "u2"), generation("world_formed", 9.0, 2, "u3", "-"),
            event("state_not_held", 9.0, generation=2),
            event("resumed_from_checkpoint", 10.0, "u3", 2, steps_redone="40", checkpoint_step="100",
                  target_step="140")]
    assert chaos.unhealthy_events(lost, Harm(hurt=[Hurt("u1", T0 + 5.0), Hurt("u2", T0 + 5.0)]), T0) == []


def test_state_not_held_just_after_the_harness_hurt_every_holder_the_controller_knew_is_expected() -> None:
    """(The event comes just before the world_formed of its generation; the holders are
    the previous generation's, as the controller judged them from heartbeats.)"""
    events = [generation("world_reconfiguring", 1.0, 7, "u5,u6,u7,u8", "u5"),
              event("failure_detected", 5.0, "u5"), event("state_not_held", 5.05, generation=8),
              generation("world_formed", 5.05, 8, "u6,u7,u8", "-")]
    assert chaos.unhealthy_events(events, Harm(hurt=[Hurt("u5", T0 + 5.0)]), T0) == []
    assert chaos.unhealthy_events(events, Harm(hurt=[Hurt("u6", T0 + 5.0)]), T0)


def test_a_resume_from_a_checkpoint_that_redoes_steps_is_a_problem_while_a_holder_survives() -> None:
    events = [generation("world_formed", 1.0, 1, "u1,u2", "u1,u2"), event("failure_detected", 5.0, "u1"),
              generation("world_formed", 5.0, 2, "u2", "u2"),
              event("resumed_from_checkpoint", 6.0, "u2", 2, steps_redone="40", checkpoint_step="100",
                    target_step="140")]
    problems = chaos.unhealthy_events(events, Harm(hurt=[Hurt("u1", T0 + 5.0)]), T0)
    assert len(problems) == 1 and "40 step(s) redone" in problems[0], problems
    # Resumed at the target (a saved state): nothing redone, nothing to say.
    events[-1] = event("resumed_from_checkpoint", 6.0, "u2", 2, steps_redone="0")
    assert chaos.unhealthy_events(events, Harm(hurt=[Hurt("u1", T0 + 5.0)]), T0) == []


# No survivor restarted, and no healthy unit told to leave.

def leaving(at: float, unit_id: str, cause: str) -> Seen:
    return event("unit_leaving", at, unit_id, cause=cause)


def test_a_drained_unit_leaves_only_if_the_harness_drained_it() -> None:
    harm = Harm(drained={"u2": T0 + 10.0})
    assert chaos.unexplained_leaves([leaving(10.2, "u2", "drained")], harm, T0) == []
    problems = chaos.unexplained_leaves([leaving(10.2, "u3", "drained")], harm, T0)
    assert len(problems) == 1 and "u3" in problems[0] and "healthy unit was told to leave" in problems[0]


@pytest.mark.parametrize(("cause", "window"), [("preempted", "urgent"), ("requeued", "urgent"),
                                               ("requeued", "node_down"), ("resized", "shrink")])
def test_a_job_wide_cause_explains_a_leave_only_while_its_fault_is_in_force(cause: str, window: str) -> None:
    leave = [leaving(30.0, "u1", cause)]
    assert chaos.unexplained_leaves(leave, Harm(windows=[Window(window, T0 + 25.0, T0 + 29.0)]), T0) == []
    assert chaos.unexplained_leaves(leave, Harm(windows=[Window(window, T0 + 2.0, T0 + 5.0)]), T0)
    assert chaos.unexplained_leaves(leave, Harm(windows=[Window("controller_down", T0 + 25.0)]), T0)


def test_a_policys_leave_needs_its_policy_and_another_jobs_share_is_never_the_reason_here() -> None:
    released = [event("below_min_released", 20.0, units="u2,u3"), leaving(20.0, "u2", "released"),
                leaving(20.0, "u4", "released")]
    problems = chaos.unexplained_leaves(released, Harm(), T0)
    assert len(problems) == 1 and "u4" in problems[0], problems
    finished = [leaving(5.0, "u1", "finished"), event("job_finishing", 9.0, "u2"), leaving(9.5, "u3", "finished")]
    problems = chaos.unexplained_leaves(finished, Harm(), T0)
    assert len(problems) == 1 and "u1" in problems[0], problems
    assert chaos.unexplained_leaves([leaving(3.0, "u1", "yielded")], Harm(), T0)
    assert chaos.unexplained_leaves([leaving(3.0, "u1", "")], Harm(hurt=[Hurt("u1", T0)]), T0)


def test_a_member_dropped_from_the_next_generation_needs_a_failure_or_a_leave() -> None:
    events = [generation("world_formed", 1.0, 1, "u1,u2,u3", "-"),
              leaving(4.0, "u2", "resized"),
              generation("world_reconfiguring", 4.0, 2, "u1,u3", "u1,u3"),
              generation("world_formed", 8.0, 3, "u1", "u1")]
    problems = chaos.unexplained_leaves(events, Harm(windows=[Window("shrink", T0 + 3.9)]), T0)
    assert len(problems) == 1 and "member u3 of the previous generation was dropped" in problems[0], problems
    # A unit that left once and joined again is judged afresh.
    again = [generation("world_formed", 1.0, 1, "u1,u2", "-"), event("failure_detected", 2.0, "u2"),
             generation("world_formed", 2.0, 2, "u1", "u1"), generation("world_reconfiguring", 5.0, 3, "u1,u2", "u1"),
             generation("world_formed", 9.0, 4, "u1", "u1")]
    problems = chaos.unexplained_leaves(again, Harm(hurt=[Hurt("u2", T0 + 2.0)]), T0)
    assert len(problems) == 1 and "member u2" in problems[0], problems


def test_a_unit_saving_its_shards_of_a_split_state_is_explained_only_if_its_replica_lost_a_unit() -> None:
    """Sharded chaos seed 300: u10 (replica 5, node 0) was set aside when u11, node 1 of its
    replica, left saving node 1's shards; u10 then saved node 0's before a new replica's
    world formed. That leave is the controller's own, and explained by the replica's loss;
    the same cause of a unit whose replica lost nothing is not."""
    def registered(at: float, unit_id: str, replica: str) -> Seen:
        return event("unit_registered", at, unit_id, replica=replica)

    events = [registered(1.0, "u10", "5"), registered(1.0, "u11", "5"), registered(1.0, "u12", "6"),
              leaving(5.0, "u11", "drained"), leaving(6.0, "u10", "saving_shards"),
              leaving(7.0, "u12", "saving_shards")]
    problems = chaos.unexplained_leaves(events, Harm(drained={"u11": T0 + 4.9}), T0)
    assert len(problems) == 1 and "u12" in problems[0], problems


def test_a_unit_left_out_when_its_merged_replica_lost_a_node_is_explained_by_that_loss() -> None:
    """Sharded chaos seed 305 at bf39cfb: u2 (replica 1, node 0) and u3 (replica 2, node 1)
    were merged into replica 3; an urgent job later preempted u2, and u3 was left out of the
    next world, its replica incomplete. The checker took u2 for replica 1 still, and found
    u3's standby unexplained."""
    def registered(at: float, unit_id: str, replica: str) -> Seen:
        return event("unit_registered", at, unit_id, replica=replica)

    events = [registered(1.0, "u2", "1"), registered(1.0, "u3", "2"),
              event("replicas_merged", 5.0, replica="3", units="u2,u3"),
              leaving(20.0, "u2", "preempted"),
              event("unit_standby", 20.0, "u3", generation=7, cause="replica_incomplete", replica="3")]
    urgent = Harm(windows=[Window("urgent", T0 + 19.0, T0 + 27.0)])
    assert chaos.unexplained_leaves(events, urgent, T0) == []
    problems = chaos.unexplained_leaves([e for e in events if e.kind != "replicas_merged"], urgent, T0)
    assert len(problems) == 1 and "u3" in problems[0] and "left out of the world" in problems[0], problems


def test_a_member_left_out_by_the_sizes_the_job_allows_is_explained_only_by_a_lowered_max() -> None:
    """Chaos seed 8: a joiner of a world in flight was left out of the next one by a lowered
    --max; the controller says so (unit_standby), and that explains it while the harness had
    lowered --max, never otherwise."""
    events = [generation("world_reconfiguring", 1.0, 4, "u1,u2,u4,u5", "u1,u2,u4"),
              event("failure_detected", 1.9, "u1"),
              event("unit_standby", 2.0, "u5", generation=5, cause="size"),
              generation("world_formed", 2.0, 5, "u2,u4", "u2,u4")]
    harm = Harm(windows=[Window("shrink", T0 + 1.5)], hurt=[Hurt("u1", T0 + 1.8)])
    assert chaos.unexplained_leaves(events, harm, T0) == []
    problems = chaos.unexplained_leaves(events, Harm(hurt=[Hurt("u1", T0 + 1.8)]), T0)
    assert len(problems) == 1 and "left out of the world" in problems[0], problems


# The steps.

PER_STEP = 6
REFERENCE = [list(range(step * PER_STEP, (step + 1) * PER_STEP)) for step in range(6)]


def attempt(step: int, generation: int, rank: int, world: int, kind: str = "attempt") -> dict[str, Any]:
    share = PER_STEP // world
    return {"kind": kind, "step": step, "generation": generation, "rank": rank, "world_size": world, "pid": 100 + rank,
            "indices": REFERENCE[step][rank * share:(rank + 1) * share], "time": T0 + step + generation / 10}


def commit_step(step: int, generation: int, world: int, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    done = range(world) if ranks is None else ranks
    return [attempt(step, generation, r, world) for r in range(world)] + [
        attempt(step, generation, r, world, kind="commit") for r in done]


def abandon(step: int, generation: int, world: int) -> list[dict[str, Any]]:
    return [{"kind": "abandoned", "step": step, "generation": generation, "rank": r, "pid": 100 + r, "reason": "broken",
             "time": T0 + step + generation / 10} for r in range(world)]


def generations(*numbers: int) -> list[Seen]:
    return [generation("world_formed", float(n), n, "u1", "u1") for n in numbers]


def test_every_step_once_with_the_fixed_runs_samples_passes() -> None:
    records = [r for step in range(6) for r in commit_step(step, 1 if step < 3 else 2, 2 if step < 3 else 3)]
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2))
    assert verdict.problems == [], verdict


def test_a_step_committed_by_every_rank_and_again_later_went_back_unless_a_resume_covers_it() -> None:
    records = [r for step in range(6) for r in commit_step(step, 1, 2)] + commit_step(4, 2, 2) + commit_step(5, 2, 2)
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2))
    assert verdict.problems == ["step(s) 4-5 committed by every rank of generation 1 and again in generation 2 "
                                "(training went back)"], verdict
    resumed = [*generations(1, 2), event("resumed_from_checkpoint", 3.0, "u1", 2, checkpoint_step="4",
                                         target_step="6", steps_redone="2")]
    verdict = chaos.step_verdict(records, REFERENCE, resumed)
    assert verdict.problems == [] and any("after a resumed_from_checkpoint" in n for n in verdict.notes), verdict


def test_an_abandoned_attempt_at_a_step_already_done_went_back() -> None:
    records = ([r for step in range(6) for r in commit_step(step, 1, 2)]
               + [attempt(3, 2, rank, 2) for rank in range(2)] + abandon(3, 2, 2))
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2, 3))
    assert verdict.problems == ["step(s) 3 committed by every rank of generation 1 and attempted again (abandoned) in "
                                "generation 2 (training went back)"], verdict


def test_a_joiner_that_abandons_before_it_attempted_a_step_redoes_nothing() -> None:
    """(Seen on the mini cluster: a joiner still at step 0, waiting for the state, wrote
    `abandoned` at step 0 when a newer generation was announced while its own formed.)"""
    records = [r for step in range(6) for r in commit_step(step, 1, 2)] + abandon(0, 2, 1)
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2, 3))
    assert verdict.problems == [], verdict


def test_a_step_broken_by_a_failure_and_redone_in_the_next_generation_is_noted_not_failed() -> None:
    records = ([r for step in range(3) for r in commit_step(step, 1, 2)] + commit_step(3, 1, 2, ranks=[0])
               + abandon(3, 1, 1) + [r for step in range(3, 6) for r in commit_step(step, 2, 1)])
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2))
    assert verdict.problems == [], verdict
    assert any("generation 1 broke at it (ranks [0] of 2 committed" in n for n in verdict.notes), verdict
    assert any("abandoned step attempt(s)" in n for n in verdict.notes), verdict


def test_a_world_that_broke_and_was_never_changed_is_a_problem() -> None:
    records = [r for step in range(6) for r in commit_step(step, 1, 2)] + abandon(6, 1, 2)
    verdict = chaos.step_verdict(records, REFERENCE, generations(1))
    assert verdict.problems == ["step(s) 6 abandoned in generation 1, and no newer generation formed: the world broke "
                                "and was not changed"], verdict


def test_a_world_change_in_flight_when_the_last_step_was_committed_needs_no_newer_generation() -> None:
    """(Sharded chaos seed 302, 2026-12-07: a grow's joiner was forming generation 11 when
    the survivors committed the last step in generation 10; the job's end told it to leave,
    its forming broke at step 0, and the job completed. Nothing is stuck there.)"""
    records = [r for step in range(6) for r in commit_step(step, 1, 2)] + abandon(0, 2, 1)
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2))
    assert verdict.problems == [], verdict
    assert any("abandoned in generation 2: a world change the job's end dropped" in n for n in verdict.notes), verdict
    # Before the last step, the same broken generation is a stuck world.
    records = [r for step in range(5) for r in commit_step(step, 1, 2)] + abandon(0, 2, 1)
    verdict = chaos.step_verdict(records, REFERENCE, generations(1, 2))
    assert "step(s) 0 abandoned in generation 2, and no newer generation formed: the world broke and was not " \
           "changed" in verdict.problems, verdict


def test_missing_steps_and_wrong_samples_are_problems() -> None:
    records = [r for step in range(5) for r in commit_step(step, 1, 2)]
    records[0] = {**records[0], "indices": [99]}
    verdict = chaos.step_verdict(records, REFERENCE, generations(1))
    assert "steps never committed: 5" in verdict.problems
    assert any(p.startswith("step(s) 0: the samples are not the fixed run's") for p in verdict.problems), verdict


# Nothing left.

def test_nothing_left_fails_when_slurm_answers_with_an_error_or_a_unit_is_still_there() -> None:
    assert chaos.slurm_leftover_problems([], 60) == []
    assert chaos.slurm_leftover_problems([12, 13], 60) == [
        "units' Slurm jobs still active 60 s after the job ended: [12, 13] (cancelled here)"]
    problems = chaos.slurm_leftover_problems(SlurmError("squeue: error: Unable to contact slurm controller"), 60)
    assert len(problems) == 1 and "Slurm did not answer" in problems[0] and "Unable to contact" in problems[0]
