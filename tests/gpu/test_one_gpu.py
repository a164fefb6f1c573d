"""One GPU: CUDA tensors through the worker library. Where the library puts a worker's
tensors (its own GPU, made current), that a state's digest read from the GPU equals the
digest of the same state on the CPU (chunked reads, every stream waited for), and a live
single-replica run on the GPU under a real controller and launcher ending where the same
script ends alone on the GPU. With two GPUs, a state streamed between two processes over
NCCL, one GPU each, arrives bit-identical.

Ran on one H100 (a lent machine, torch 2.11.0+cu130, NCCL 2.28.9): on 2026-11-26 the one-GPU
tests passed, but for the test of the shard group's host waits, rewritten from that run's
measurements; on 2026-11-27 all six one-GPU tests passed, that one too, twice: with the
library at 49a6b9d, and again at 9bbc261 with the commit vote's host wait added to that
test (3 s of work queued: the shard group's waited all-gather returned in 0.0003 s, the
vote's wait on the shard group in 2.99 s, a blocking group's all-gather in 2.99 s). The
two-GPU test has not run."""

from __future__ import annotations

import copy
import datetime
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from tests.gpu.conftest import assert_close_to, environment_alone, run_alone, visible
from tests.integration.conftest import TidalRun
from tests.integration.test_hsdp import lm_command
from tests.integration.test_live_mode import commits, example_command, read_ledger
from tidal.proto import common_pb2
from tidal.train import Elastic
from tidal.train.backend import NCCL, Mode, abort_groups, apply_environment, close_groups, new_group, worker_device
from tidal.train.state import Counters, TrainingParts, capture, digest, tensor_buffers

HERE = Path(__file__).resolve().parent


def _model_and_data(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, TensorDataset]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=generator, dtype=torch.float64),
                         torch.randn(64, 1, generator=generator, dtype=torch.float64))
    return model, optimizer, data


def _loss(device: torch.device):  # type: ignore[no-untyped-def]
    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        inputs, targets = (t.to(device) for t in batch)
        return torch.nn.functional.mse_loss(model(inputs), targets, reduction="sum")
    return loss_fn


@pytest.mark.gpu(devices=1)
def test_a_worker_trains_on_its_own_gpu_and_its_state_digests_as_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("TIDAL_CONTROL_SOCKET", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    device = worker_device({"LOCAL_RANK": "0"}, "nccl")
    model, optimizer, data = _model_and_data(device)
    job = Elastic(model, optimizer, data, loss_fn=_loss(device), global_batch=16, micro_batch=4, seed=0)
    assert job.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    results = list(job.train(5))
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    assert all(p.device == device for p in model.parameters())
    assert all(v.device == device for s in optimizer.state.values() for v in s.values() if v.dim() > 0)

    # The same state on the CPU, copied exactly: the same digest.
    on_gpu = capture(job.parts, job.counters)
    cpu_model = copy.deepcopy(model).cpu()
    cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=0.01)
    cpu_optimizer.load_state_dict(optimizer.state_dict())
    on_cpu = capture(TrainingParts(model=cpu_model, optimizer=cpu_optimizer), Counters(**job.counters.as_dict()))
    assert [t.device.type for t in on_gpu["tensors"]][:1] == ["cuda"]
    assert [t.device.type for t in on_cpu["tensors"]][:1] == ["cpu"]
    assert digest(on_gpu) == digest(on_cpu)
    # Read in chunks smaller than a tensor, the bytes are the host copy's.
    for gpu_tensor, cpu_tensor in zip(on_gpu["tensors"], on_cpu["tensors"], strict=True):
        assert b"".join(bytes(b) for b in tensor_buffers(gpu_tensor, chunk_bytes=7)) == b"".join(
            bytes(b) for b in tensor_buffers(cpu_tensor))

    # The same run on the CPU ends at the same parameters (float64; reduction order aside).
    cpu_model_run, cpu_optimizer_run, data = _model_and_data(torch.device("cpu"))
    cpu_job = Elastic(cpu_model_run, cpu_optimizer_run, data, loss_fn=_loss(torch.device("cpu")), global_batch=16,
                      micro_batch=4, seed=0)
    list(cpu_job.train(5))
    for (name, gpu_value), (_, cpu_value) in zip(model.state_dict().items(), cpu_model_run.state_dict().items(),
                                                 strict=True):
        torch.testing.assert_close(gpu_value.cpu(), cpu_value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.gpu(devices=1)
def test_a_digest_waits_for_every_stream_still_writing_the_state() -> None:
    device = torch.device("cuda", 0)
    tensor = torch.zeros(1 << 20, dtype=torch.float32, device=device)
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # a few hundred ms of GPU time on the side stream, then the write
        tensor.fill_(1.0)
    state = {"manifest": {"format": "x"}, "tensors": [tensor]}
    expected = {"manifest": {"format": "x"}, "tensors": [torch.ones(1 << 20, dtype=torch.float32)]}
    # Without synchronizing every stream, the host copy (on the current stream) would read zeros.
    assert digest(state) == digest(expected)


@pytest.mark.gpu(devices=1)
def test_a_live_single_replica_run_on_the_gpu_ends_where_the_script_ends_alone(tidal_run: TidalRun,
                                                                              tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    steps = 120
    command = [*example_command(tmp_path / "elastic.pt", ledger, steps), "--device", "cuda"]
    tidal_run.submit(min_replicas=1, max_replicas=1, command=command, mode=common_pb2.JOB_MODE_LIVE)
    tidal_run.start_launcher("a", environment=visible(0))
    tidal_run.controller.wait_event(tidal_run.job_id, "job_completed", timeout=300)
    records = read_ledger(ledger)
    assert sorted(r["step"] for r in commits(records)) == list(range(steps))
    assert [r for r in records if r["kind"] == "formed"], "the world formed and its state was digested"
    saved = torch.load(tmp_path / "elastic.pt", weights_only=True)["model"]
    assert all(value.device.type == "cpu" for value in saved.values())  # the example saves host copies
    run_alone([*example_command(tmp_path / "fixed.pt", tmp_path / "fixed-ledger", steps, step_time=0.0),
               "--device", "cuda"], 0)
    assert_close_to(tmp_path / "elastic.pt", tmp_path / "fixed.pt")


@pytest.mark.gpu(devices=1)
def test_a_live_hsdp_replica_on_one_gpu_shards_through_its_nccl_shard_group_and_ends_where_one_process_ends(
        tidal_run: TidalRun, tmp_path: Path) -> None:
    """HybridSharded in live mode: FSDP2's group is the replica's ShardGroup, whose
    collectives go to a ProcessGroupNCCL made for the generation (here of one rank): FSDP2's
    all-gathers and reduce-scatters run on its streams, through the ShardGroup's works."""
    steps = 150
    ledger = tmp_path / "ledger"
    command = [*lm_command(tmp_path / "elastic.pt", ledger, "hsdp", steps), "--device", "cuda"]
    tidal_run.submit(min_replicas=1, max_replicas=1, command=command, mode=common_pb2.JOB_MODE_LIVE)
    tidal_run.start_launcher("a", environment=visible(0))
    tidal_run.controller.wait_event(tidal_run.job_id, "job_completed", timeout=300)
    assert sorted(r["step"] for r in commits(read_ledger(ledger))) == list(range(steps))
    fixed = tmp_path / "fixed.pt"
    run_alone([*lm_command(fixed, tmp_path / "fixed-ledger", "dp", steps), "--device", "cuda"], 0)
    assert_close_to(tmp_path / "elastic.pt", fixed, relative_to_scale=True)


def _sleep_cycles_per_second(device: torch.device) -> float:
    """How many `torch.cuda._sleep` cycles this GPU runs in a second (timed with CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 200_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / (start.elapsed_time(end) / 1000)


@pytest.mark.gpu(devices=1)
def test_an_abort_from_another_thread_does_not_free_a_wait_stuck_behind_this_gpus_own_hung_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose own GPU hangs (a kernel that never ends) cannot be freed by aborting its
    NCCL groups: the collective is queued behind that kernel, and a blocking wait returns
    only when the kernel ends (measured on an H100, torch 2.11: 19.97 s for a 20 s kernel,
    the abort sent after 1 s). So the launcher must kill such a worker; what an abort frees
    is a survivor whose NCCL kernel waits for a lost peer (ncclCommAbort makes it exit). The
    next generation's group on the same GPU then works."""
    environ: dict[str, str] = {}
    apply_environment(environ, Mode.LIVE)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)
    store = dist.HashStore()
    group = new_group(NCCL, dist.PrefixStore("generation-1", store), 0, 1, timeout)
    tensor = torch.ones(1024, device=device)
    group.allreduce([tensor]).wait()  # the communicator connects
    torch.cuda.synchronize(device)

    hang_s = 20.0
    torch.cuda._sleep(int(hang_s * _sleep_cycles_per_second(device)))  # the hung kernel, on the current stream
    aborted_at: list[float] = []

    def abort_soon() -> None:
        time.sleep(1.0)
        aborted_at.append(time.monotonic())
        abort_groups([group])

    aborter = threading.Thread(target=abort_soon)
    started = time.monotonic()
    aborter.start()
    outcome = "returned"
    try:
        group.allreduce([tensor]).wait()
    except RuntimeError as error:
        outcome = f"raised: {str(error).splitlines()[0]}"
    ended = time.monotonic()
    aborter.join(30)
    print(f"wait {outcome} {ended - started:.2f} s after the collective, "
          f"{ended - aborted_at[0]:.2f} s after the abort")
    assert aborted_at and ended - started > hang_s - 3.0, (outcome, ended - started)
    close_groups([group], broken=True, aborted=True)

    following = new_group(NCCL, dist.PrefixStore("generation-2", store), 0, 1, timeout)
    fresh = torch.full((1024,), 2.0, device=device)
    following.allreduce([fresh]).wait()
    torch.cuda.synchronize(device)
    assert float(fresh.sum()) == 2048.0
    close_groups([following], broken=False)


@pytest.mark.gpu(devices=1)
def test_the_shard_groups_collectives_return_to_the_host_while_the_gpu_is_still_busy(tmp_path: Path) -> None:
    """The replica's shard group (NCCL) is made with waits that do not block the host
    (`new_group(..., host_waits=False)`): with 3 s of earlier work still on the GPU, its
    all-gathers and reduce-scatters return at once, issued as FSDP2 issues them
    (async_op=False) or waited on (async_op=True, wait()). Made with live mode's blocking
    waits, a waited one returns only when the GPU has done it; one issued with
    async_op=False returns at once either way (measured on an H100, torch 2.11: 0.0003 s
    blocking and not; a blocking group's waited all-gather 0.995 s of 1 s).

    The commit vote's last level (an all-reduce on the shard group, waited through
    `HostWaited`) must stop the host until the GPU has done it either way: its result is
    read on the host.

    Passed on an H100 (torch 2.11, 2026-11-27, with 3 s of work queued): the shard group's
    all-gathers and reduce-scatters returned in 0.0003-0.0006 s, waited or not; the vote's
    wait in 2.99 s; a blocking group's waited ones in 2.99 s."""
    timings = {}
    for kind in ("shard", "blocking"):
        out = tmp_path / f"{kind}.json"
        subprocess.run([sys.executable, str(HERE / "shard_overlap.py"), kind, str(out)], check=True, timeout=300,
                       env={**environment_alone(), **visible(0)})
        timings[kind] = json.loads(out.read_text())
    print(timings)
    shard, blocking = timings["shard"], timings["blocking"]
    for name in ("all_gather_s", "reduce_scatter_s", "all_gather_wait_s", "reduce_scatter_wait_s"):
        assert shard[name] < 0.5, (name, shard)
    assert shard["vote_wait_s"] > shard["busy_s"] - 0.5, shard
    assert blocking["vote_wait_s"] > blocking["busy_s"] - 0.5, blocking
    assert blocking["all_gather_s"] < 0.5 and blocking["reduce_scatter_s"] < 0.5, blocking
    assert blocking["all_gather_wait_s"] > blocking["busy_s"] - 0.5, blocking
    assert blocking["reduce_scatter_wait_s"] > blocking["busy_s"] - 0.5, blocking


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.gpu(devices=2)
def test_a_state_streamed_over_nccl_between_two_gpus_arrives_bit_identical(tmp_path: Path) -> None:
    """Two processes, one GPU each (LOCAL_RANK 0 and 1), a ProcessGroupNCCL made as a
    generation's is in live mode: rank 0 sends its trained state, rank 1 receives it into
    its own (fresh) model and optimizer; both digests, and rank 1's CPU digest, agree."""
    port = _free_port()
    processes = [subprocess.Popen([sys.executable, str(HERE / "transfer_pair.py"), str(rank), str(port),
                                   str(tmp_path / f"rank-{rank}.json")]) for rank in (0, 1)]
    for process in processes:
        assert process.wait(300) == 0
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["device"] == "cuda:0" and results[1]["device"] == "cuda:1"
    assert results[1]["role"] == "receiver" and results[1]["bytes"] > 0
    assert results[0]["digest"] == results[1]["digest"] == results[1]["cpu_digest"]

