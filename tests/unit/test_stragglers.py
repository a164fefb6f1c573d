"""Straggler scoring (tidal.controller.core.stragglers) and what the controller does about
one (events, straggler_action "replace")."""

from __future__ import annotations

import dataclasses

from tests.unit.test_job_core import CONFIG, Driver
from tidal.controller.core import job as core
from tidal.controller.core.stragglers import StragglerPolicy, Totals, WorkerCompute, WorkerKey, observe, score
from tidal.controller.model import UnitState
from tidal.proto import launcher_pb2

POLICY = StragglerPolicy(ratio=1.5, clear_ratio=1.2, window=4, confirm=2)


def play(per_sample: dict[WorkerKey, list[float]], samples: dict[WorkerKey, int] | None = None,
         generation: int = 1, overhead: float = 0.0) -> list[tuple[int, WorkerKey, bool]]:
    """Feed each worker's per-sample time (plus `overhead` seconds a step), one step of
    `samples` (4) an interval, one interval a heartbeat; the changes, with the heartbeat
    they came at."""
    windows: dict[WorkerKey, WorkerCompute] = {}
    totals = {key: Totals(generation, 0.0, 0, 0) for key in per_sample}
    changes = []
    for beat in range(len(next(iter(per_sample.values())))):
        for key, times in per_sample.items():
            count = (samples or {}).get(key, 4)
            before = totals[key]
            totals[key] = Totals(generation, before.seconds + times[beat] * count + overhead,
                                 before.samples + count, before.steps + 1)
        windows = observe(windows, totals, generation, POLICY, per_sample)
        windows, found = score(windows, POLICY)
        changes += [(beat, change.key, change.suspected) for change in found]
    return changes


def test_a_worker_persistently_slower_than_its_peers_is_suspected_then_cleared() -> None:
    slow = ("u2", 0)
    times = {("u1", 0): [0.10] * 12, ("u1", 1): [0.11] * 12, slow: [0.10] * 2 + [0.17] * 6 + [0.10] * 4,
             ("u3", 0): [0.10] * 12}
    changes = play(times)
    assert changes[0][1:] == (slow, True)
    # Beat 0 starts the count; at beat 4 the window of 4 holds three slow intervals (its
    # median is slow), and beat 5 is the second slow score in a row.
    assert changes[0][0] == 5
    assert changes[1][1:] == (slow, False) and changes[1][0] > changes[0][0]
    assert len(changes) == 2


def test_a_world_slowed_evenly_raises_nothing() -> None:
    times = {("u1", 0): [0.1] * 3 + [0.3] * 9, ("u2", 0): [0.1] * 3 + [0.31] * 9, ("u3", 0): [0.1] * 3 + [0.29] * 9}
    assert play(times) == []


def test_a_bigger_batch_share_is_more_samples_not_a_slower_worker() -> None:
    times = {("u1", 0): [0.1] * 10, ("u2", 0): [0.1] * 10, ("u3", 0): [0.1] * 10}
    assert play(times, samples={("u1", 0): 8, ("u2", 0): 4, ("u3", 0): 4}) == []


def test_fewer_samples_a_step_and_a_per_step_cost_do_not_make_a_rank_look_slow() -> None:
    """The first `batch % world` ranks take a sample more; where a step's cost hardly grows
    with its samples, per sample the ranks with fewer look slow. Compared per step with the
    ranks of their own share, nobody does."""
    keys = [("u1", 0), ("u2", 0), ("u3", 0), ("u4", 0)]
    times = {key: [0.01] * 12 for key in keys}
    shares = {("u1", 0): 3, ("u2", 0): 3, ("u3", 0): 1, ("u4", 0): 1}
    # (Per sample, u3 and u4 would be 0.51 s against u1's and u2's 0.177 s: 2.9 times.)
    assert play(times, samples=shares, overhead=0.5) == []
    # A rank slow at its own share is still named: u4 takes 1.0 s a step, u3 0.51 s.
    times[("u4", 0)] = [0.5] * 12
    assert [(key, suspected) for _, key, suspected in play(times, samples=shares, overhead=0.5)] == [
        (("u4", 0), True)]


def test_a_one_off_slow_interval_is_not_a_straggler() -> None:
    times = {("u1", 0): [0.1] * 10, ("u2", 0): [0.1] * 4 + [0.9] + [0.1] * 5, ("u3", 0): [0.1] * 10}
    assert play(times) == []


def test_a_new_generation_starts_a_new_window_keeping_the_score_and_old_totals_are_not_mixed_in() -> None:
    key = ("u1", 0)
    members = [key]
    windows = observe({}, {key: Totals(1, 1.0, 10, 1)}, 1, POLICY, members)
    windows = observe(windows, {key: Totals(1, 2.0, 20, 2)}, 1, POLICY, members)
    assert windows[key].recent[0].per_sample == 0.1 and windows[key].recent[0].share == 10
    windows = {key: dataclasses.replace(windows[key], suspected=True, ratio=1.8)}
    # A heartbeat still carrying the previous generation's totals: what it had, kept.
    held = observe(windows, {key: Totals(1, 3.0, 30, 3)}, 2, POLICY, members)
    assert held[key].suspected and held[key].recent == windows[key].recent and not held[key].fresh
    restarted = observe(held, {key: Totals(2, 0.5, 4, 1)}, 2, POLICY, members)
    assert restarted[key].recent == () and restarted[key].totals == Totals(2, 0.5, 4, 1)
    assert restarted[key].suspected, "suspected until scored again, not cleared by a world change"
    assert observe(restarted, {}, 2, POLICY, []) == {}, "out of the world: dropped"


class StragglerDriver(Driver):
    """A live job of three one-node replicas whose launchers' heartbeats carry compute."""

    def __init__(self, action: str, min_replicas: int = 2) -> None:
        super().__init__(min_replicas=min_replicas, max_replicas=3,
                         config=dataclasses.replace(CONFIG, straggler_action=action, straggler_window=4,
                                                    straggler_confirm=2))
        self.totals: dict[str, tuple[float, int]] = {}
        self.steps: dict[str, int] = {}

    def compute_beat(self, per_sample: dict[str, float]) -> list[core.Effect]:
        """One heartbeat of every unit, each saying its worker's compute (`per_sample`
        seconds a sample over 4 more samples), then a tick a second later."""
        generation = self.state.generation
        assert generation is not None
        for unit_id, seconds in per_sample.items():
            before = self.totals.get(unit_id, (0.0, 0))
            self.totals[unit_id] = (before[0] + seconds * 4, before[1] + 4)
            self.steps[unit_id] = self.steps.get(unit_id, 0) + 1
            self.links[unit_id] = dataclasses.replace(
                self.links[unit_id], last_heartbeat_at=self.clock + 1.0,
                compute={0: Totals(generation.number, *self.totals[unit_id], self.steps[unit_id])})
        return self.tick(1.0)


def start(driver: StragglerDriver) -> None:
    for unit_id in ("a", "b", "c"):
        driver.connect(unit_id)
    driver.tick()
    assert driver.state.generation is not None and len(driver.state.generation.unit_ids) == 3


def test_report_names_the_straggler_and_leaves_the_world_alone() -> None:
    driver = StragglerDriver("report")
    start(driver)
    for _ in range(8):
        driver.compute_beat({"a": 0.1, "b": 0.1, "c": 0.2})
    suspected = driver.event("straggler_suspected")
    assert suspected.unit_id == "c" and float(suspected.fields["ratio"]) >= 1.5
    assert suspected.fields["local_rank"] == 0 and suspected.fields["rank"] == 2
    assert driver.state.units["c"].state is UnitState.ACTIVE
    assert "unit_leaving" not in driver.events()


def test_replace_asks_the_stragglers_unit_to_leave_and_cools_its_node_down() -> None:
    driver = StragglerDriver("replace")
    start(driver)
    for _ in range(8):
        driver.compute_beat({"a": 0.1, "b": 0.1, "c": 0.2})
    assert driver.state.units["c"].state is UnitState.LEAVING
    assert "straggler" in driver.state.units["c"].reason
    assert driver.event("node_excluded").unit_id == "c"
    assert driver.state.straggler_leaving == "c"


def test_replace_never_takes_the_job_below_min_replicas() -> None:
    driver = StragglerDriver("replace", min_replicas=3)
    start(driver)
    for _ in range(8):
        driver.compute_beat({"a": 0.1, "b": 0.1, "c": 0.2})
    assert driver.state.units["c"].state is UnitState.ACTIVE
    assert driver.event("straggler_kept").unit_id == "c"
    assert driver.events().count("straggler_kept") == 1


def test_a_heartbeat_carries_a_workers_compute_to_the_controller() -> None:
    progress = launcher_pb2.WorkerProgress(local_rank=1, compute_generation=3, compute_seconds=1.5,
                                           compute_samples=12)
    assert (progress.compute_generation, progress.compute_seconds, progress.compute_samples) == (3, 1.5, 12)


def test_tidal_status_shows_a_units_compute_ratio_and_its_straggler() -> None:
    from tidal.controller.cli import _compute
    from tidal.proto import admin_pb2

    assert _compute(admin_pb2.Unit(compute_ratio=1.714, straggler=True)) == "1.71x STRAGGLER"
    assert _compute(admin_pb2.Unit(compute_ratio=0.98)) == "0.98x"
    assert _compute(admin_pb2.Unit()) == "-", "not scored yet"


def test_a_peers_median_is_the_median_of_the_others() -> None:
    import random
    import statistics

    from tidal.controller.core.stragglers import median_without

    generator = random.Random(7)
    for count in range(2, 10):
        for _ in range(50):
            values = [generator.choice([1.0, 2.0, generator.random()]) for _ in range(count)]
            ordered = sorted(values)
            for index, value in enumerate(values):
                assert median_without(ordered, value) == statistics.median(values[:index] + values[index + 1:])
