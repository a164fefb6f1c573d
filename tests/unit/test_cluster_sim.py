"""The cluster simulation (bench/cluster_sim.py): what a reader of its ETTR table relies
on. Without failures or other work nobody loses time; a failure costs checkpoint-restart
exactly the work since its last checkpoint plus its restart; Tidal's world decisions come
from the controller's own functions (replace one and the simulation follows it)."""

from __future__ import annotations

import math

import pytest

from bench import cluster_sim as sim
from tidal.controller.core import planning

COSTS = sim.Costs(worker_crash_s=0.1, node_lost_s=0.13, worker_hang_s=1.6, grow_s=5.0, world_change_s=0.11,
                  torchrun_restart_s=48.0)
DAYS = 2.0
QUIET = sim.Load(gpus=1_024, days=DAYS, urgent_per_day=0.0, windows_per_day=0.0)


def fault(at: float, node: int, how: str = "worker_crash", in_step: float = 0.5) -> sim.Fault:
    # Repaired after the end: the failed node stays away.
    return sim.Fault(at=at, node=node, how=how, repair_s=10 * sim.DAY_S, in_step=in_step)


def test_without_failures_or_other_work_every_policy_keeps_all_its_time() -> None:
    outcomes = {p.name: p.run() for p in sim.policies(QUIET, [], COSTS)}
    assert len(outcomes) == 6
    for name, outcome in outcomes.items():
        assert outcome.interruptions == 0, name
        if name.startswith("checkpoint-restart"):
            # Only the checkpoint writes stall it: τ / (τ + C) of the time, exactly.
            interval = sim.young_interval_s(QUIET) if "Young" in name else sim.FIXED_CHECKPOINT_MIN * 60
            expected = interval / (interval + sim.CHECKPOINT_WRITE_S)
            assert outcome.ettr == pytest.approx(expected, abs=2e-3), name
            assert outcome.goodput == pytest.approx(expected, abs=2e-3), name
        else:
            # Tidal pays one world change: growing onto the idle spares at the start.
            change_s = sim.world_change_at_scale(QUIET.gpus).change_s if "world changes" in name else 0.0
            assert outcome.ettr == pytest.approx(1.0 - change_s / QUIET.span_s, abs=1e-5), name
            # Tidal's units on the spares hold their nodes for the grow time before they train.
            assert outcome.goodput == pytest.approx(1.0 - change_s / QUIET.span_s, abs=1e-4), name
    tidal = outcomes["Tidal"]
    # Tidal grew onto the idle spares at once; the static policies stay at the home size.
    assert tidal.mean_world == pytest.approx(QUIET.home + QUIET.spares, rel=1e-3)
    assert outcomes["torchft-like"].mean_world == pytest.approx(QUIET.home)


def test_a_failure_costs_checkpoint_restart_the_work_since_its_checkpoint_and_the_restart() -> None:
    interval, restart = 3_600.0, 300.0
    cycle = interval + sim.CHECKPOINT_WRITE_S
    # In the 4th cycle, 1,000 s into its training: 3 checkpoints are on disk.
    at = 3 * cycle + 1_000.0
    job = sim.CheckpointRestart(QUIET, [fault(at, node=QUIET.background)], interval_s=interval, restart_s=restart,
                                name="checkpoint-restart")
    outcome = job.run()
    assert outcome.interruptions == 1
    span = QUIET.span_s
    # Restarted at once on a spare, trained again after the restart, kept to the end.
    after = span - at - restart
    kept_after = math.floor(after / cycle) * interval + min(after % cycle, interval)
    assert outcome.ettr == pytest.approx((3 * interval + kept_after) / span, rel=1e-9)
    lost = 1_000.0 + restart + (3 + math.floor(after / cycle)) * sim.CHECKPOINT_WRITE_S
    assert outcome.ettr == pytest.approx(1 - (lost + (after % cycle - min(after % cycle, interval))) / span,
                                         rel=1e-9)


def test_tidal_loses_the_step_in_flight_and_the_measured_recovery_not_a_checkpoint_interval() -> None:
    at = 10_000.0
    tidal = sim.Tidal(QUIET, [fault(at, node=QUIET.background, in_step=0.5)], COSTS)
    outcome = tidal.run()
    assert outcome.interruptions == 1
    # (and the pause of growing onto the spares at the start)
    lost_s = 0.5 * sim.STEP_S + COSTS.worker_crash_s + COSTS.world_change_s
    assert outcome.ettr == pytest.approx(1 - lost_s / QUIET.span_s, rel=1e-9)
    # It re-formed from the survivors (choose_world_size) and never dropped below them.
    assert tidal.running and len(tidal.members) == QUIET.home + QUIET.spares - 1


def test_a_hung_node_is_found_by_the_controllers_health_verdicts() -> None:
    tidal = sim.Tidal(QUIET, [fault(1_000.0, node=QUIET.background, how="node_hang", in_step=0.0)], COSTS)
    outcome = tidal.run()
    verdicts = [d for d in outcome.decisions if d.startswith("health_verdicts")]
    assert len(verdicts) == 1 and "no heartbeat for" in verdicts[0]
    # Found at the first heartbeat check past the controller's timeout (3 s, checks every 1 s).
    detected = tidal.config.heartbeat_timeout_s + tidal.config.heartbeat_interval_s
    lost_s = detected + COSTS.node_lost_s + COSTS.world_change_s
    assert outcome.ettr == pytest.approx(1 - lost_s / QUIET.span_s, rel=1e-9)


def test_growth_comes_from_decide_world(monkeypatch: pytest.MonkeyPatch) -> None:
    load = sim.Load(gpus=1_024, days=DAYS, urgent_per_day=0.0, windows_per_day=4.0)
    trace = sim.make_trace(load, seed=3)
    grown = sim.Tidal(load, trace, COSTS).run()
    grows = [d for d in grown.decisions if d.startswith("decide_world: Grow: grow ")]
    assert grows, grown.decisions
    assert any(d.startswith("plan_yields: ") for d in grown.decisions)
    assert grown.mean_world > load.home

    # With the controller's decision replaced by one that always waits, no joiner ever trains
    # (and the home units yield to the background's reclaims in their place).
    monkeypatch.setattr(planning, "decide_world", lambda snapshot, now: planning.Wait("held"))
    held = sim.Tidal(load, trace, COSTS).run()
    assert not [d for d in held.decisions if d.startswith("decide_world")]
    assert held.mean_world <= load.home < grown.mean_world
    assert held.goodput < 0.95 < grown.goodput


def test_urgent_jobs_make_tidal_units_yield_without_losing_steps() -> None:
    load = sim.Load(gpus=1_024, days=DAYS, urgent_per_day=6.0, windows_per_day=0.0)
    trace = [e for e in sim.make_trace(load, seed=5) if isinstance(e, sim.Demand)]
    assert trace
    outcome = sim.Tidal(load, trace, COSTS).run()
    yields = [d for d in outcome.decisions if d.startswith("plan_yields: ")]
    assert len(yields) >= len(trace)
    # Only the measured pause per world change (a yield, a grow back, the first grow), no lost work.
    assert outcome.ettr >= 1 - (2 * len(trace) + 1) * COSTS.world_change_s / load.span_s - 1e-9
    assert outcome.interruptions == 0


def test_the_yield_shortcut_gives_plan_yields_own_answer() -> None:
    load = sim.Load(gpus=1_024, days=DAYS, urgent_per_day=0.0, windows_per_day=0.0)
    tidal = sim.Tidal(load, [], COSTS)
    tidal.run()
    waiting = [sim.sharing.WaitingJob(7, 5, tidal.everywhere, (3, 0))]
    idle = frozenset[str]()
    full = sim.sharing.plan_yields(waiting, [tidal.yielding_job()], idle, {})
    short = sim.sharing.plan_yields(waiting, [tidal.yielding_job(5)], idle, {})
    assert [o.unit_id for o in full] == [o.unit_id for o in short] and len(full) == 5


def test_the_same_seed_gives_the_same_table_and_failures_follow_llama3s_rate() -> None:
    load = sim.scenario("shared", 16_384, 1.0)
    assert load.nodes == 2_048 and load.home == 2_048 - 128 - 32
    # 419 interruptions in 54 days on 16,384 GPUs: about 7.8 a day over the whole cluster.
    assert load.failure_rate_per_node_s * load.nodes * sim.DAY_S == pytest.approx(419 / 54)
    first = sim.simulate(sim.scenario("shared", 1_024, 1.0), [1], COSTS)
    again = sim.simulate(sim.scenario("shared", 1_024, 1.0), [1], COSTS)
    assert {k: [o.ettr for o in v] for k, v in first.items()} == {k: [o.ettr for o in v] for k, v in again.items()}


def test_the_largest_world_change_cost_that_keeps_the_goal_is_found_to_its_precision() -> None:
    # ETTR falling 0.1 % a second of world change: 97 % holds up to 30 s.
    tried: list[float] = []

    def ettr_at(change_s: float) -> float:
        tried.append(change_s)
        return 1.0 - 0.001 * change_s

    largest = sim.largest_change_keeping(ettr_at, 0.97, high_s=44.8, precision_s=0.5)
    assert largest is not None and 29.5 <= largest <= 30.0
    assert all(0.0 <= t <= 44.8 for t in tried) and len(tried) <= 10
    assert sim.largest_change_keeping(ettr_at, 0.97, high_s=20.0) == 20.0
    assert sim.largest_change_keeping(lambda _: 0.9, 0.97, high_s=20.0) is None


def test_the_break_even_row_brackets_the_cost_at_which_the_simulated_ettr_crosses_the_goal() -> None:
    load = sim.scenario("shared", 16_384, 1.0)
    scale = sim.WorldChangeAtScale(store_s=10.0, controller_s=1.0, relay_s=0.001, communicator_s=30.0, source="test")
    row = sim.break_even_row(load, [1], COSTS, scale)
    # A simulated day at 16,384 GPUs with these costs crosses 97 % near 29.5 s.
    assert row.tidal == pytest.approx(41.001) and row.baseline is not None and 0.0 < row.baseline < row.tidal
    assert not row.met
    trace = sim.make_trace(load, 1)
    below = sim.Tidal(load, trace, sim.at_scale(COSTS, row.baseline)).run().ettr
    above = sim.Tidal(load, trace, sim.at_scale(COSTS, row.baseline + 0.5)).run().ettr
    assert below >= sim.GOAL_ETTR > above
