"""What a world change costs at scale (bench/world_scale.py) and the paths it measures: the
arrival barrier every rank goes through (`train.world.await_peers`, on a real TCPStore on
port 0), the store operations NCCL's connect makes per rank, a generation's tables at
thousands of launchers, and how bench.cluster_sim takes the measured figures."""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from bench import cluster_sim as sim
from bench import world_scale
from tidal.controller.core import messages, planning
from tidal.proto.control import World
from tidal.train.errors import WorldBroken
from tidal.train.world import await_peers


def world(size: int) -> World:
    return World(generation=3, rank=0, world_size=size, master_addr="127.0.0.1", master_port=1)


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def client(server: Any) -> Any:
    connected = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore("gen/3", connected)


def test_every_rank_returns_once_the_last_arrives_and_not_before(store: Any) -> None:
    size, returned = 6, []

    def rank(index: int) -> None:
        await_peers(client(store), world(size), deadline=time.monotonic() + 10, timeout_s=10,
                    check_interrupted=lambda: None)
        returned.append((index, time.monotonic()))

    early = [threading.Thread(target=rank, args=(i,)) for i in range(size - 1)]
    for thread in early:
        thread.start()
    time.sleep(0.4)
    assert returned == []
    last_arrived_at = time.monotonic()
    rank(size - 1)
    for thread in early:
        thread.join(5)
    assert sorted(i for i, _ in returned) == list(range(size))
    # Woken by the key the last rank set, not by a poll long after.
    assert max(t for _, t in returned) - last_arrived_at < 0.2
    assert client(store).add("arrived", 0) == size


def test_a_missing_peer_breaks_the_world_at_the_deadline_and_a_stop_at_once(store: Any) -> None:
    started = time.monotonic()
    with pytest.raises(WorldBroken, match=r"did not arrive within 0\.3 s"):
        await_peers(client(store), world(4), deadline=started + 0.3, timeout_s=0.3, check_interrupted=lambda: None)
    assert 0.3 <= time.monotonic() - started < 2.0

    def stopped() -> None:
        raise WorldBroken("stopped while waiting for the peers of generation 3")

    with pytest.raises(WorldBroken, match="stopped"):
        await_peers(dist.PrefixStore("gen/4", client(store)), world(4), deadline=time.monotonic() + 10, timeout_s=10,
                    check_interrupted=stopped)


class RecordingStore:
    def __init__(self) -> None:
        self.ops: list[tuple[str, Any]] = []

    def set(self, key: str, value: bytes) -> None:
        self.ops.append(("set", key))

    def get(self, key: str) -> bytes:
        self.ops.append(("get", key))
        return b""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops.append(("multi_get", tuple(keys)))
        return [b""] * len(keys)


def test_nccl_ids_are_one_broadcast_in_a_small_group_and_a_gather_of_root_ids_in_a_large_one() -> None:
    ops = {}
    for rank in (0, 5):
        recording = RecordingStore()
        world_scale.nccl_connect(recording, rank, 8, b"x" * 128)
        ops[rank] = recording.ops
    assert ops == {0: [("set", "0")], 5: [("get", "0")]}
    keys = tuple(f"UniqueNCCLID:{r}" for r in range(8))  # 1,024 ranks: 8 roots of 128
    for rank, expected in ((0, [("set", "UniqueNCCLID:0"), ("multi_get", keys)]),
                           (128, [("set", "UniqueNCCLID:1"), ("multi_get", keys)]),
                           (129, [("multi_get", keys)])):
        recording = RecordingStore()
        world_scale.nccl_connect(recording, rank, 1_024, b"x" * 128)
        assert recording.ops == expected, rank


def test_a_generation_of_2048_launchers_is_planned_and_told_in_well_under_a_second() -> None:
    result = world_scale.measure_controller(16_384, 1)
    assert result["launchers"] == 2_048
    # The failure path's per-launcher tables are one lookup each (was a scan of all: 0.66 s).
    assert result["failure_messages_s"][0] < 0.5
    relay = world_scale.measure_relay(16_384, 3)
    assert max(relay["total_s"]) < 0.1


def test_a_generations_lookups_find_each_member_and_its_own_table() -> None:
    candidates = [planning.Candidate(unit_id=f"u{i}", nodes=(f"n{i}",), procs_per_node=8, address="a", store_port=1,
                                     previous_group_rank=i, registered_at=0.0) for i in range(5)]
    plan = planning.plan_generation(job_id="j", number=2, candidates=candidates, replicas=5, reason="r", now=0.0,
                                    resume_step=0)
    assert plan.world_size == 40 and plan.member("u3") is not None and plan.member("u3").first_rank == 24
    assert plan.member("absent") is None
    table = messages.member(plan, "u3").generation.rank_table
    assert [a.unit_id for a in table.assignments] == ["u3"] and table.world_size == 40 and table.groups == 5


def test_cluster_sim_takes_the_measured_parts_at_the_nearest_size_and_says_so(tmp_path: Path) -> None:
    fallback = sim.world_change_at_scale(16_384, tmp_path)
    assert "fallback" in fallback.source
    # A result file's own communicator figure (an older citation) is not what is charged:
    # the code's citation is (5 s, a live HybridSharded world's replica groups).
    parts = {"store_s": 2.0, "controller_s": 0.5, "relay_s": 0.001, "communicator_s": 30.0}
    (tmp_path / "world_scale.json").write_text(json.dumps({"code": "abc1234",
                                                           "results": {"16384": {"parts_s": parts}}}))
    measured = sim.world_change_at_scale(16_384, tmp_path)
    assert measured.change_s == pytest.approx(2.501 + world_scale.COMMUNICATOR_CITED["seconds"])
    assert "world_scale.json (abc1234), 16,384 ranks" in measured.source
    assert "7.5 s: store 2.0 + controller 0.50 + relay 1.0 ms + communicator 5 cited" in measured.label
    # Every Tidal world change costs at least that in the at-scale row.
    quiet = sim.Load(gpus=1_024, days=1.0, urgent_per_day=0.0, windows_per_day=0.0)
    names = [p.name for p in sim.policies(quiet, [], sim.Costs(0.1, 0.1, 1.0, 5.0, 0.1, 48.0), measured)]
    assert measured.label in names
