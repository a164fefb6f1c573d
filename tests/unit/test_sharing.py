"""Cluster-wide decisions across elastic jobs: idle nodes shared by weight, and units
yielding to a waiting higher-priority Slurm job."""

from __future__ import annotations

from tidal.controller.core.sharing import (
    GrowingJob,
    WaitingJob,
    YieldableUnit,
    YieldingJob,
    next_in_line,
    plan_yields,
    share_idle_nodes,
)

NODES = frozenset(f"n{i}" for i in range(1, 9))


def test_idle_nodes_follow_the_weights() -> None:
    # 8 idle nodes, two empty jobs with room for all of them, weights 3 and 1.
    granted = share_idle_nodes([GrowingJob("a", 3, 0, 8, NODES), GrowingJob("b", 1, 0, 8, NODES)])
    assert granted == {"a": 6, "b": 2}


def test_the_share_counts_what_each_job_already_runs() -> None:
    # Equal weights; a already runs 4: the 4 idle nodes go to b until both have 4.
    granted = share_idle_nodes([GrowingJob("a", 1, 4, 8, frozenset({"n1", "n2", "n3", "n4"})),
                                GrowingJob("b", 1, 0, 8, frozenset({"n1", "n2", "n3", "n4"}))])
    assert granted == {"a": 0, "b": 4}


def test_a_job_at_max_or_without_a_fitting_node_leaves_the_nodes_to_others() -> None:
    granted = share_idle_nodes([GrowingJob("a", 10, 2, 3, NODES), GrowingJob("b", 1, 0, 8, NODES),
                                GrowingJob("c", 5, 0, 8, frozenset())])
    assert granted == {"a": 1, "b": 7, "c": 0}
    # A node only one job fits goes to it, whatever the weights.
    only_b = share_idle_nodes([GrowingJob("a", 9, 0, 8, frozenset({"n1"})),
                               GrowingJob("b", 1, 0, 8, frozenset({"n1", "n2"}))])
    assert only_b == {"a": 1, "b": 1}


def test_one_job_at_a_time_queues_a_unit_for_the_next_free_node_in_the_order_of_the_weights() -> None:
    # No idle node. Weights 3 and 1: a (3 replicas, its queued unit counted) is at 1 per
    # unit of weight, b (0) at 0: b is next; once b's unit is queued (1), a (1.0) and b
    # (1.0) tie, to the job id.
    def line(a: int, b: int) -> frozenset[str]:
        return next_in_line([GrowingJob("a", 3, a, 8, frozenset(), NODES),
                             GrowingJob("b", 1, b, 8, frozenset(), NODES)])
    assert line(3, 0) == {"b"}
    assert line(3, 1) == {"a"}
    assert line(4, 1) == {"b"}
    # A job at max_replicas is out of line; a job alone on its nodes is always in line.
    assert next_in_line([GrowingJob("a", 1, 8, 8, frozenset(), NODES), GrowingJob("b", 1, 5, 8, frozenset(), NODES)]) \
        == {"b"}
    apart = next_in_line([GrowingJob("a", 1, 0, 8, frozenset(), frozenset({"n1"})),
                          GrowingJob("b", 1, 5, 8, frozenset(), frozenset({"n2"}))])
    assert apart == {"a", "b"}


def units(*nodes: str, rank: tuple[int, int] = (1, 100)) -> tuple[YieldableUnit, ...]:
    return tuple(YieldableUnit(f"u{i}", (node,), rank, i) for i, node in enumerate(nodes, start=1))


def test_units_yield_to_a_higher_priority_job_newest_first_and_never_below_min() -> None:
    job = YieldingJob("lm", 1, min_replicas=1, units=units("n1", "n2", "n3", "n4"))
    waiter = WaitingJob(slurm_job_id=50, nodes_needed=2, could_use=NODES, rank=(1, 500))
    orders = plan_yields([waiter], [job], idle=frozenset(), releasing={})
    assert [(o.job_id, o.unit_id, o.slurm_job_id) for o in orders] == [("lm", "u4", 50), ("lm", "u3", 50)]
    assert "Slurm job 50" in orders[0].reason and "waits for 2 node(s)" in orders[0].reason
    # An idle node counts first; nodes already being released for it are not asked twice.
    assert [o.unit_id for o in plan_yields([waiter], [job], idle=frozenset({"n8"}), releasing={})] == ["u4"]
    assert plan_yields([waiter], [job], idle=frozenset(), releasing={50: 2}) == []
    # min_replicas 3 leaves one unit to give: not enough for a job needing 2, so none.
    keep_three = YieldingJob("lm", 1, min_replicas=3, units=units("n1", "n2", "n3", "n4"))
    assert plan_yields([waiter], [keep_three], idle=frozenset(), releasing={}) == []


def test_only_lower_ranked_units_on_nodes_the_waiter_can_use_yield() -> None:
    job = YieldingJob("lm", 1, min_replicas=1, units=units("n1", "n2", "n3", rank=(1, 100)))
    assert plan_yields([WaitingJob(7, 1, NODES, rank=(1, 50))], [job], frozenset(), {}) == []
    assert plan_yields([WaitingJob(7, 1, frozenset({"n5"}), rank=(1, 500))], [job], frozenset(), {}) == []
    # A higher partition tier outranks any priority within a lower tier.
    orders = plan_yields([WaitingJob(7, 1, frozenset({"n2"}), rank=(2, 1))], [job], frozenset(), {})
    assert [o.unit_id for o in orders] == ["u2"]


def test_the_job_with_most_replicas_per_weight_yields_first() -> None:
    heavy = YieldingJob("heavy", 4, min_replicas=1, units=units("n1", "n2", "n3", "n4"))
    light = YieldingJob("light", 1, min_replicas=1,
                        units=tuple(YieldableUnit(f"v{i}", (n,), (1, 100), i) for i, n in enumerate(["n5", "n6"])))
    orders = plan_yields([WaitingJob(9, 2, NODES, rank=(5, 0))], [heavy, light], frozenset(), {})
    # light has 2 replicas per unit of weight, heavy 1: light gives its newest, then stands
    # at its min, so heavy gives the second.
    assert [(o.job_id, o.unit_id) for o in orders] == [("light", "v1"), ("heavy", "u4")]
