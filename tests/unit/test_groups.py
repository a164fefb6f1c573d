"""A live HybridSharded world has no group of every rank: its world-wide collectives go in
two levels, over each replica's shard group and then over the replica groups
(`tidal.train.groups.form_groups`, `start_world_allreduce`, `gather_world`). Real gloo
groups over loopback, one thread per rank, as the live path forms them."""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.train.errors import WorldBroken
from tidal.train.groups import Collectives, Groups, form_groups, gather_world, start_world_allreduce
from tidal.train.shard_group import ShardGroup

TIMEOUT = datetime.timedelta(seconds=30)


def _run_ranks(world_size: int, shard_size: int, body: Any, *, two_levels: bool,
               timeout: datetime.timedelta = TIMEOUT) -> list[Any]:
    """`body(groups, collectives, rank)` on each rank of a world of `world_size` in replicas
    of `shard_size`, formed as `Membership.form` forms a generation; its results by rank."""
    store = dist.PrefixStore("gen/1", dist.HashStore())
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    # Every rank formed before any runs the body: a rank whose body ends at once (one that
    # stops mid-vote) closing its groups while a peer still connects would fail that
    # peer's connect ("Connection closed by peer"; seen once in make test on 2 busy cores).
    formed = threading.Barrier(world_size)

    def rank_main(rank: int) -> None:
        try:
            shard_rank, replica = rank % shard_size, rank // shard_size
            shard = ShardGroup(shard_rank, shard_size) if two_levels else None
            groups = form_groups("gloo", dist.PrefixStore("group", store), rank=rank, world_size=world_size,
                                 shard_size=shard_size, shard_rank=shard_rank, connect_timeout=TIMEOUT,
                                 timeout=timeout, shard=shard)
            if shard is not None:
                shard.connect("gloo", dist.PrefixStore(f"shard/{replica}", store), generation=1,
                              connect_timeout=TIMEOUT, timeout=timeout)
            formed.wait(TIMEOUT.total_seconds())
            results[rank] = body(groups, Collectives(), rank)
            if shard is not None:
                shard.disconnect(broken=False)
            groups.close(broken=False)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return results


def _world_sum(groups: Groups, collectives: Collectives, rank: int) -> tuple[bool, list[float]]:
    control = torch.tensor([1.0, float(rank), float(rank * rank)], dtype=torch.float64)
    with collectives.waiting_in():
        work = start_world_allreduce(groups, collectives, control)
        collectives.wait_work(work)
    return groups.world is None, control.tolist()


def _world_gather(groups: Groups, collectives: Collectives, rank: int) -> list[list[int]]:
    mine = torch.tensor([rank, 100 + rank], dtype=torch.int64)
    return [t.tolist() for t in gather_world(groups, collectives, mine)]


@pytest.mark.parametrize("two_levels", [True, False])
def test_a_world_wide_sum_counts_every_rank_once_with_or_without_a_world_group(two_levels: bool) -> None:
    """6 ranks in 3 replicas of 2: every rank ends with the sum over all 6, as one group of
    every rank gives it; with the shard groups given, no such group was made."""
    results = _run_ranks(6, 2, _world_sum, two_levels=two_levels)
    expected = [6.0, float(sum(range(6))), float(sum(r * r for r in range(6)))]
    for no_world_group, total in results:
        assert no_world_group is two_levels
        assert total == expected


@pytest.mark.parametrize("two_levels", [True, False])
def test_a_world_wide_gather_returns_every_ranks_tensor_in_world_rank_order(two_levels: bool) -> None:
    """8 ranks in 2 replicas of 4: rank r's tensor lands at place r on every rank (the rank
    holding shard k of replica j is rank 4j + k)."""
    results = _run_ranks(8, 4, _world_gather, two_levels=two_levels)
    expected = [[rank, 100 + rank] for rank in range(8)]
    assert results == [expected] * 8


class RankDied(Exception):
    """A rank stopped (its process died) before joining a collective."""


class DiesAfter:
    """One of a rank's groups that lets `budget[0]` more collectives of that rank through
    (shared by the rank's groups), then stops the rank: it never joins the next one."""

    def __init__(self, group: Any, budget: list[int]) -> None:
        self.group = group
        self.budget = budget

    def allreduce(self, *args: Any) -> Any:
        if self.budget[0] <= 0:
            raise RankDied
        self.budget[0] -= 1
        return self.group.allreduce(*args)


@pytest.mark.parametrize("collectives_before_it_stops", [0, 1])
def test_a_rank_of_another_replica_stopping_mid_vote_never_leaves_a_replicas_shards_at_two_steps(
        collectives_before_it_stops: int) -> None:
    """The world sum is the step's commit vote: a rank commits once its sum returns. 6 ranks
    in 3 replicas of 2; shard 1 of replica 2 (rank 5) stops after 0 or 1 of the vote's
    collectives, as a node dies mid-vote. The ranks of each other replica must all commit or
    all not: a replica holding shard 0 at one step and shard 1 at another has lost the
    state (the next world's agreement refuses to mix them). With the replica group last,
    rank 5 stopping between the two levels let shard 0's replica group finish and shard 1's
    not: replicas 0 and 1 committed shard 0 only."""

    def vote(groups: Groups, collectives: Collectives, rank: int) -> bool:
        if rank == 5:
            budget = [collectives_before_it_stops]
            groups = dataclasses.replace(groups, replica=DiesAfter(groups.replica, budget),
                                         shard=DiesAfter(groups.shard, budget))
        control = torch.ones(1, dtype=torch.float64)
        try:
            with collectives.waiting_in():
                collectives.wait_work(start_world_allreduce(groups, collectives, control))
        except (WorldBroken, RankDied):
            return False
        return control.item() == 6.0

    committed = _run_ranks(6, 2, vote, two_levels=True, timeout=datetime.timedelta(seconds=5))
    assert committed[0] == committed[1] and committed[2] == committed[3], committed
    # Stopped before the vote, nobody's vote completes; stopped after the first level, the
    # other two replicas commit (rank 5's replica is lost with it).
    assert committed[:4] == [collectives_before_it_stops == 1] * 4, committed
    assert committed[5] is False


def test_without_the_shard_group_connected_a_world_wide_collective_breaks_the_world() -> None:
    """Between a broken generation and the next, the shard group has no connection: a world
    collective then fails as a broken world (WorldBroken), not with an unrelated error."""

    class Finished:
        def allreduce(self, tensors: list[torch.Tensor]) -> Any:
            return self

        def wait(self, *timeout: Any) -> bool:
            return True

    groups = Groups(world=None, replica=Finished(), rank=0, world_size=4, shard_size=2, shard_rank=0,
                    shard=ShardGroup(0, 2))
    collectives = Collectives()
    with pytest.raises(WorldBroken, match="shard group is not connected"), collectives.waiting_in():
        start_world_allreduce(groups, collectives, torch.zeros(3))
