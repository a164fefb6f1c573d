"""Where a live worker's shard rank comes from (`tidal.train.strategy.live_shard_place`)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": "/x", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2)),
    ({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": "/x", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "TIDAL_NODE_INDEX": "1", "TIDAL_NODES_PER_REPLICA": "2"}, (3, 4)),
    ({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": "/x", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
      "TIDAL_NODE_INDEX": "2", "TIDAL_NODES_PER_REPLICA": "4"}, (2, 4)),
    ({"TIDAL_MODE": "restart", "TIDAL_CONTROL_SOCKET": "/x", "LOCAL_RANK": "1"}, None),
])
def test_a_live_workers_shard_place_comes_from_its_launcher(env: dict[str, str],
                                                            expected: tuple[int, int] | None) -> None:
    from tidal.train.strategy import live_shard_place

    assert live_shard_place(env) == expected


def test_a_shard_rank_outside_its_replica_is_refused() -> None:
    from tidal.train.strategy import live_shard_place

    with pytest.raises(ValueError, match="node 2 of a replica of 2 nodes"):
        live_shard_place({"TIDAL_MODE": "live", "TIDAL_CONTROL_SOCKET": "/x", "TIDAL_NODE_INDEX": "2",
                          "TIDAL_NODES_PER_REPLICA": "2"})
