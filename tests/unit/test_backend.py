"""The backend rules (`tidal.train.backend`), run everywhere, no GPU needed: which device a
rank gets, which NCCL settings each mode imposes, when a generation's groups are aborted
from outside the training thread, and what closing a generation's groups does per backend."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import structlog
import torch

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
    assert [call for call, _ in gloo.calls] == ["shutdown"] and [call for call, _ in broken.calls] == ["abort"]


def test_synchronizing_the_cpu_is_nothing() -> None:
    backend.synchronize(torch.device("cpu"))
    backend.synchronize(None)
    backend.synchronize_tensors([torch.zeros(2)])
    backend.release_memory()
