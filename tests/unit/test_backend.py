"""The backend rules (`tidal.train.backend`), run everywhere, no GPU needed: which device a
rank gets, which NCCL settings each mode imposes, when the launcher's word aborts a
generation's groups from outside the training thread (with fake groups whose collective
blocks until aborted, as an NCCL wait on a frozen peer does), and what closing a
generation's groups does per backend."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from tidal.proto.control import Hello, Stop, World, decode, encode
from tidal.train import backend
from tidal.train.backend import (
    LIVE_NCCL_ENVIRONMENT,
    DeviceError,
    Mode,
    abort_from_outside,
    aborts_from_outside,
    apply_environment,
    close_groups,
    device_mismatch,
    mode_of,
    nccl_environment,
    prepare_worker,
    visible_devices,
    worker_device,
)
from tidal.train.channel import WorkerChannel
from tidal.train.errors import WorldBroken
from tidal.train.groups import Collectives, Groups
from tidal.train.ledger import Ledger
from tidal.train.state import Counters, TrainingParts
from tidal.train.strategy import DataParallel
from tidal.train.sync import StateSync
from tidal.train.world import EVERY_GENERATION, Membership, breakage

# Device per rank.


def test_a_rank_gets_the_local_rank_th_gpu_it_sees() -> None:
    # Slurm gave the step GPUs 2 and 3: CUDA shows them as 0 and 1.
    env = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert visible_devices(env) == ["2", "3"]
    assert worker_device(env, "nccl", device_count=2) == torch.device("cuda", 1)
    assert worker_device({**env, "LOCAL_RANK": "0"}, "nccl", device_count=2) == torch.device("cuda", 0)
    # A process alone (no LOCAL_RANK) takes the first.
    assert worker_device({}, "nccl", device_count=4) == torch.device("cuda", 0)
    # UUIDs count as well; CUDA stops at the first empty entry.
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,,1"}) == ["0"]
    assert visible_devices({}) is None


def test_a_rank_past_the_gpus_it_sees_is_told_why() -> None:
    env = {"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(DeviceError) as raised:
        worker_device(env, "nccl", device_count=2)
    message = str(raised.value)
    assert "LOCAL_RANK 2 has no GPU of its own" in message and "CUDA_VISIBLE_DEVICES='2,3'" in message
    assert "procs_per_node" in message
    # The fewer of CUDA's count and the mask's counts.
    with pytest.raises(DeviceError, match="1 seen by CUDA"):
        worker_device({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, "nccl", device_count=1)
    with pytest.raises(DeviceError, match="0 named"):
        worker_device({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}, "nccl", device_count=8)


def test_without_cuda_nccl_has_no_device_and_gloo_is_on_the_cpu() -> None:
    with pytest.raises(DeviceError, match="LOCAL_RANK 0 has no GPU of its own: 0 GPUs seen by CUDA"):
        worker_device({"LOCAL_RANK": "0"}, "nccl", device_count=0)
    assert worker_device({"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": ""}, "gloo") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            worker_device({"LOCAL_RANK": "0"}, "nccl")
    # The CPU is never made current: no CUDA call on a machine without it.
    assert backend.select_device(torch.device("cpu")) == torch.device("cpu")


def test_a_model_on_another_gpu_than_the_workers_is_named() -> None:
    problem = device_mismatch([torch.device("cuda", 0), torch.device("cuda", 0)], torch.device("cuda", 1))
    assert problem is not None and problem.startswith("the model is on cuda:0 but this worker's GPU is cuda:1")
    assert device_mismatch([torch.device("cuda", 1)], torch.device("cuda", 1)) is None
    assert device_mismatch([torch.device("cpu")], torch.device("cuda", 1)) is None
    assert device_mismatch([torch.device("cuda", 0)], torch.device("cpu")) is None, "gloo takes any"


# Environment per mode.


def test_live_mode_makes_a_failed_collective_raise_in_the_worker_and_restart_mode_keeps_torchruns() -> None:
    assert mode_of({"TIDAL_CONTROL_SOCKET": "/run/tidal/control.sock"}) is Mode.LIVE
    assert mode_of({}) is Mode.RESTART and mode_of({"TIDAL_CONTROL_SOCKET": ""}) is Mode.RESTART
    assert nccl_environment(Mode.LIVE) == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert nccl_environment(Mode.RESTART) == {}
    # Restart mode: the launcher's torchrun default stands.
    restart = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert apply_environment(restart, Mode.RESTART) == [] and restart == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_live_mode_replaces_what_the_job_or_launcher_set_and_says_so() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1", "PATH": "/bin"}
    with structlog.testing.capture_logs() as logged:
        overrides = apply_environment(env, Mode.LIVE)
    assert env == {**LIVE_NCCL_ENVIRONMENT, "PATH": "/bin"}
    assert [(o.name, o.was, o.now) for o in overrides] == [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "0")]
    assert [(e["event"], e["variable"], e["job_value"]) for e in logged] == [
        ("nccl_environment_overridden", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")]


def test_a_gloo_worker_is_on_the_cpu_and_its_environment_untouched_in_either_mode() -> None:
    env = {"TIDAL_CONTROL_SOCKET": "/run/c.sock", "LOCAL_RANK": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert prepare_worker(env, "gloo") == torch.device("cpu")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_BLOCKING_WAIT" not in env


# When the launcher's word aborts a generation's groups.


def test_which_words_of_the_launcher_break_which_generations() -> None:
    assert breakage(Stop(generation=4)) == (4, "the launcher stopped generation 4")
    failure = World(generation=5, rank=0, world_size=2, master_addr="h", master_port=1, at_step_boundary=False)
    assert breakage(failure) == (4, "generation 5 replaced it after a failure")
    planned = World(generation=5, rank=0, world_size=3, master_addr="h", master_port=1)
    assert breakage(planned) is None, "a change at a step boundary breaks nothing"
    assert breakage(None) == (EVERY_GENERATION, "the launcher closed the control channel")
    # Missing on the wire (an older launcher): a change at a step boundary, today's reading.
    assert decode(b'{"op": "world", "generation": 5, "rank": 0, "world_size": 3, "master_addr": "h", '
                  b'"master_port": 1}') == planned
    assert decode(encode(failure)) == failure


def test_a_garbled_line_on_the_control_channel_is_refused_never_raised() -> None:
    for garbage in (b"not json\n", b'{"op": "nothing"}\n', b'{"op": "world", "generation": "5"}\n',
                    b"[" * 100_000 + b"\n", b'{"op": "hello", "local_rank": 1e999}\n'):
        assert decode(garbage) is None, garbage[:40]


def test_only_nccl_groups_are_aborted_from_outside_and_only_when_their_generation_broke() -> None:
    assert aborts_from_outside("nccl") and not aborts_from_outside("gloo")
    assert abort_from_outside("nccl", groups_generation=4, broken_through=4)
    assert abort_from_outside("nccl", groups_generation=3, broken_through=4)
    assert not abort_from_outside("nccl", groups_generation=5, broken_through=4), "a newer world's groups"
    assert not abort_from_outside("nccl", groups_generation=None, broken_through=4), "no groups held"
    assert not abort_from_outside("gloo", groups_generation=4, broken_through=4)


class FakeGroup:
    """A process group whose collective blocks until the group is aborted, as an NCCL
    collective with a frozen peer does; its wait then returns without raising, as a
    `WorkNCCL::wait` unblocked by an abort from another thread does."""

    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name
        self.aborted = threading.Event()
        self.calls: list[tuple[str, str]] = []

    def name(self) -> str:
        return self.backend_name

    def abort(self) -> None:
        self.calls.append(("abort", threading.current_thread().name))
        self.aborted.set()

    def shutdown(self) -> None:
        self.calls.append(("shutdown", threading.current_thread().name))

    def _group_start(self) -> None:
        self.calls.append(("group_start", threading.current_thread().name))

    def _group_end(self) -> None:
        self.calls.append(("group_end", threading.current_thread().name))

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        group = self

        class Work:
            def wait(self) -> bool:
                if not group.aborted.wait(10):
                    raise AssertionError("the blocked collective was never aborted")
                return True

        return Work()


def _membership(backend_name: str) -> Membership:
    def agree(groups: object, world: World) -> tuple[int, str]:
        raise AssertionError("no world is formed here")

    return Membership(backend=backend_name, shard_size=1, shard_rank=0, timeout_s=5.0, counters=Counters(step=3),
                      ledger=Ledger(None), agree=agree, before_leaving=lambda save: "")


def _groups(group: FakeGroup) -> Groups:
    return Groups(world=group, replica=group, rank=0, world_size=2, shard_size=1, shard_rank=0)


def _blocked_collective(membership: Membership, group: FakeGroup) -> tuple[threading.Thread, list[BaseException]]:
    """The training thread, blocked in a collective of `group` (through Collectives)."""
    raised: list[BaseException] = []

    def train() -> None:
        try:
            membership.collectives.wait(group.allreduce([torch.zeros(1)]))
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=train, name="training")
    thread.start()
    return thread, raised


def test_a_nccl_collective_blocked_on_a_frozen_peer_is_aborted_by_the_launchers_word_and_breaks_the_world() -> None:
    membership = _membership("nccl")
    group = FakeGroup("nccl")
    membership._adopt(_groups(group), generation=4)
    thread, raised = _blocked_collective(membership, group)
    time.sleep(0.05)
    assert thread.is_alive() and membership.collectives.waiting
    # The frozen peer's launcher killed it; the controller sent the survivors generation 5 at once.
    membership.on_launcher_word(World(generation=5, rank=0, world_size=1, master_addr="h", master_port=1,
                                      at_step_boundary=False))
    thread.join(5)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], WorldBroken)
    assert str(raised[0]) == ("generation 4's groups were aborted: generation 5 replaced it after a failure")
    # From a thread of its own, neither the training thread nor the channel's reader; once.
    assert [call for call, _ in group.calls] == ["abort"] and group.calls[0][1] == "tidal-abort"
    # The training thread then leaves the broken world: no second abort.
    membership.close_groups(broken=True)
    assert [call for call, _ in group.calls] == ["abort"] and membership.groups is None


def test_a_stop_aborts_too_but_a_change_at_a_step_boundary_or_an_older_stop_does_not() -> None:
    membership = _membership("nccl")
    group = FakeGroup("nccl")
    membership._adopt(_groups(group), generation=4)
    membership.on_launcher_word(World(generation=5, rank=0, world_size=3, master_addr="h", master_port=1))
    membership.on_launcher_word(Stop(generation=3))
    time.sleep(0.05)
    assert group.calls == [] and membership.collectives.broken is None
    membership.on_launcher_word(Stop(generation=4))
    assert group.aborted.wait(5)
    assert membership.collectives.broken == "generation 4's groups were aborted: the launcher stopped generation 4"


def test_gloo_is_not_aborted_from_outside_its_waits_are_told_instead_and_a_broken_group_closes_off_thread() -> None:
    membership = _membership("gloo")
    assert membership.collectives.sliced
    group = FakeGroup("gloo")
    membership._adopt(_groups(group), generation=4)
    membership.on_launcher_word(Stop(generation=3))
    membership.on_launcher_word(World(generation=5, rank=0, world_size=3, master_addr="h", master_port=1))
    assert membership.collectives.interrupted is None, "an older stop, a change at a step boundary: nothing"
    membership.on_launcher_word(Stop(generation=4))
    membership.on_launcher_word(None)
    time.sleep(0.05)
    assert group.calls == [] and membership.collectives.broken is None
    assert membership.collectives.interrupted == "generation 4 broke: the launcher stopped generation 4"
    membership.close_groups(broken=True)
    assert group.aborted.wait(5)
    assert group.calls == [("abort", "tidal-gloo-close")], "aborted off the training thread (it may block)"


def _gloo_pair(timeout_s: float) -> list[Any]:
    """Two ranks' gloo groups in this process (a real gloo connection over loopback)."""
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def connect(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2,
                                             datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(group is not None for group in groups)
    return groups


def test_a_gloo_wait_on_a_peer_that_left_the_collective_gives_up_once_the_launcher_says_the_world_broke() -> None:
    """Rank 1 is alive but never joins rank 0's all-reduce (it left that step: its own wait
    failed on a lost rank). Gloo would hold rank 0 until the group's timeout (120 s on the
    mini cluster); the launcher's word that generation 4 broke frees it at the next slice."""
    membership = _membership("gloo")
    pair = _gloo_pair(timeout_s=60)
    membership._adopt(Groups(world=pair[0], replica=pair[0], rank=0, world_size=2, shard_size=1, shard_rank=0),
                      generation=4)
    raised: list[BaseException] = []
    started = time.monotonic()

    def train() -> None:
        try:
            membership.collectives.wait(pair[0].allreduce([torch.ones(3)]))
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=train, name="training")
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and membership.collectives.waiting, "waiting for rank 1, slice after slice"
    membership.on_launcher_word(World(generation=5, rank=0, world_size=1, master_addr="h", master_port=1,
                                      at_step_boundary=False))
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert len(raised) == 1 and isinstance(raised[0], WorldBroken)
    assert str(raised[0]) == "generation 4 broke: generation 5 replaced it after a failure"
    # A collective both ranks join completes through the same sliced wait, and its result is whole.
    collectives = Collectives()
    collectives.sliced = True
    other = _gloo_pair(timeout_s=60)
    tensors = [torch.full((2,), float(rank + 1)) for rank in range(2)]
    late = threading.Timer(0.3, lambda: other[1].allreduce([tensors[1]]).wait())
    late.start()
    collectives.wait(other[0].allreduce([tensors[0]]))
    late.join()
    assert tensors[0].tolist() == [3.0, 3.0]


def test_groups_that_connect_after_the_launcher_said_their_generation_broke_are_aborted_at_once() -> None:
    membership = _membership("nccl")
    membership.on_launcher_word(Stop(generation=6))  # while generation 6's groups were being made
    group = FakeGroup("nccl")
    with pytest.raises(WorldBroken, match="generation 6 broke while its groups connected"):
        membership._adopt(_groups(group), generation=6)
    assert [call for call, _ in group.calls] == ["abort"]
    # The next generation's groups are not touched by that word.
    newer = FakeGroup("nccl")
    membership._adopt(_groups(newer), generation=7)
    assert newer.calls == [] and membership.collectives.broken is None


def test_the_channel_hands_each_word_to_its_listener_on_the_reader_thread(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    heard: list[tuple[object, str]] = []
    channel = WorkerChannel(str(path), 0, 42, on_word=lambda m: heard.append((m, threading.current_thread().name)))
    connection, _ = server.accept()
    assert decode(connection.makefile("rb").readline()) == Hello(local_rank=0, pid=42)
    failure = World(generation=2, rank=0, world_size=1, master_addr="h", master_port=1, at_step_boundary=False)
    connection.sendall(encode(failure) + encode(Stop(generation=2)))
    connection.close()
    deadline = time.monotonic() + 5
    while len(heard) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard == [(failure, "tidal-control"), (Stop(generation=2), "tidal-control"), (None, "tidal-control")]
    assert channel.worlds[2] == failure and channel.stopped_generation == 2
    channel.close()
    server.close()


# Closing a generation's groups.


def test_nccl_groups_are_aborted_together_even_after_a_planned_change_and_gloo_ones_shut_down() -> None:
    world, replica = FakeGroup("nccl"), FakeGroup("nccl")
    groups: list[Any] = [world, replica]
    close_groups(groups, broken=False)
    assert groups == [], "no reference left"
    assert [call for call, _ in world.calls] == ["group_start", "abort", "group_end"]
    assert [call for call, _ in replica.calls] == ["abort"]
    gloo = FakeGroup("gloo")
    close_groups([gloo], broken=False)
    broken = FakeGroup("gloo")
    close_groups([broken], broken=True)
    assert broken.aborted.wait(5)
    assert [call for call, _ in gloo.calls] == ["shutdown"] and broken.calls == [("abort", "tidal-gloo-close")]
    # Already aborted from outside: only the references go.
    aborted = FakeGroup("nccl")
    close_groups([aborted], broken=True, aborted=True)
    assert aborted.calls == []


class DestroyedWhere:
    """A gloo group whose abort returns at once and whose destruction says on which thread
    it ran (a real gloo group's destruction waits for its work threads: minutes, if one is
    in a collective with a peer that left it)."""

    def __init__(self, destroyed: list[str]) -> None:
        self.destroyed = destroyed

    def name(self) -> str:
        return "gloo"

    def abort(self) -> None:
        pass

    def __del__(self) -> None:
        self.destroyed.append(threading.current_thread().name)


def test_a_broken_gloo_groups_last_reference_goes_on_the_closing_thread_never_the_training_thread() -> None:
    for _ in range(20):
        destroyed: list[str] = []
        groups: list[Any] = [DestroyedWhere(destroyed), DestroyedWhere(destroyed)]
        close_groups(groups, broken=True)
        assert groups == []
        deadline = time.monotonic() + 5
        while len(destroyed) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert destroyed == ["tidal-gloo-close"] * 2


def test_a_wait_that_returned_after_an_abort_from_outside_breaks_the_world() -> None:
    collectives = Collectives()
    with collectives.waiting_in():
        pass
    collectives.broken = "generation 3's groups were aborted: the launcher stopped generation 3"
    with pytest.raises(WorldBroken, match="the launcher stopped generation 3"), collectives.waiting_in():
        pass
    assert not collectives.waiting


class BrokenGroup:
    """A replica group whose peer is gone: every receive fails."""

    def recv(self, tensors: list[torch.Tensor], source: int, tag: int) -> Any:
        raise RuntimeError("Connection closed by peer")


def test_a_receiver_whose_transfer_broke_no_longer_counts_as_holding_state() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = StateSync(TrainingParts(model=model, optimizer=optimizer), Counters(step=5), strategy=DataParallel(),
                     checkpointer=None, checkpoint_every=0, state_folder=None, bucket_bytes=1 << 20,
                     device=torch.device("cpu"), collectives=Collectives(), ledger=Ledger(None))
    sync.has_state = True  # a survivor behind the most advanced replica: it receives
    groups = Groups(world=None, replica=BrokenGroup(), rank=1, world_size=2, shard_size=1, shard_rank=0)
    world = World(generation=3, rank=1, world_size=2, master_addr="h", master_port=1)
    with pytest.raises(WorldBroken, match="Connection closed by peer"):
        sync._transfer(groups, world, sources=[0], receivers=[1])
    assert not sync.has_state, "a transfer cut short leaves a mix of two states"


def test_synchronizing_the_cpu_is_nothing() -> None:
    backend.synchronize(torch.device("cpu"))
    backend.synchronize(None)
    backend.synchronize_tensors([torch.zeros(2)])
    backend.release_memory()
