"""A live HybridSharded world has no group of every rank: its world-wide collectives go in
two levels, over each replica's shard group and then over the replica groups
(`tidal.train.groups.form_groups`, `start_world_allreduce`, `gather_world`). Real gloo
groups over loopback, one thread per rank, as the live path forms them."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.train.groups import Collectives, Groups, form_groups, gather_world, start_world_allreduce
from tidal.train.shard_group import ShardGroup

TIMEOUT = datetime.timedelta(seconds=30)


def _run_ranks(world_size: int, shard_size: int, body: Any, *, two_levels: bool) -> list[Any]:
    """`body(groups, collectives, rank)` on each rank of a world of `world_size` in replicas
    of `shard_size`, formed as `Membership.form` forms a generation; its results by rank."""
    store = dist.PrefixStore("gen/1", dist.HashStore())
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            shard_rank, replica = rank % shard_size, rank // shard_size
            shard = ShardGroup(shard_rank, shard_size) if two_levels else None
            groups = form_groups("gloo", dist.PrefixStore("group", store), rank=rank, world_size=world_size,
                                 shard_size=shard_size, shard_rank=shard_rank, connect_timeout=TIMEOUT,
                                 timeout=TIMEOUT, shard=shard)
            if shard is not None:
                shard.connect("gloo", dist.PrefixStore(f"shard/{replica}", store), generation=1,
                              connect_timeout=TIMEOUT, timeout=TIMEOUT)
            results[rank] = body(groups, Collectives(), rank)
            if shard is not None:
                shard.disconnect(broken=False)
            groups.close(broken=False)
        except BaseException as error:  # noqa: BLE001 (handed to the test's thread)
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


def test_without_the_shard_group_connected_a_world_wide_collective_breaks_the_world() -> None:
    """Between a broken generation and the next, the shard group has no connection: a world
    collective then fails as a broken world (WorldBroken), not with an unrelated error."""
    from tidal.train.errors import WorldBroken

    groups = Groups(world=None, replica=object(), rank=0, world_size=4, shard_size=2, shard_rank=0,
                    shard=ShardGroup(0, 2))
    collectives = Collectives()
    with pytest.raises(WorldBroken, match="shard group is not connected"):
        with collectives.waiting_in():
            start_world_allreduce(groups, collectives, torch.zeros(3))
