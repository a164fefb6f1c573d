"""The worker library's parts that need no process group: the global order and shares,
the state digest and its transport, the fallback checkpoint, batch policies, the control
channel, and whole training runs in a world of one (in this process)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import queue
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from tidal.launcher.control import LauncherChannel, WorkerSaid
from tidal.proto.control import (
    Beat,
    Coming,
    Finished,
    FirstStep,
    Formed,
    Hello,
    Left,
    Message,
    Resumed,
    StateLost,
    Stop,
    Stopped,
    World,
    decode,
    encode,
)
from tidal.train.channel import COMING_HOLDS_S, ChannelClosed, WorkerChannel
from tidal.train.checkpoint import AsyncCheckpointer, checkpoint_path
from tidal.train.data import GlobalOrder, micro_batches, share_bounds, step_samples
from tidal.train.elastic import AccountingError, Elastic, FixedBatch, ScaledBatch, check_accounting
from tidal.train.state import Counters, TrainingParts, capture, deserialize, digest, restore, serialize


def test_shares_cover_the_batch_without_overlap_and_differ_by_at_most_one() -> None:
    for total in (1, 7, 24, 25):
        for world_size in range(1, 6):
            bounds = [share_bounds(total, r, world_size) for r in range(world_size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == total
            assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world_size - 1))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="outside"):
        share_bounds(10, 3, 3)
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_global_order_is_seeded_and_each_data_epoch_is_a_permutation() -> None:
    order = GlobalOrder(10, seed=3)
    assert order.samples(0, 25) == GlobalOrder(10, seed=3).samples(0, 25)
    assert order.samples(0, 10) != GlobalOrder(10, seed=4).samples(0, 10)
    stream = order.samples(0, 30)
    for data_epoch in range(3):
        assert sorted(stream[10 * data_epoch:10 * (data_epoch + 1)]) == list(range(10))
    # Any split of a step's positions gives back the same samples.
    whole = order.samples(8, 6)
    pieces = [step_samples(order, step=1, start=8, global_batch=6, rank=r, world_size=4).indices for r in range(4)]
    assert [i for piece in pieces for i in piece] == whole
    with pytest.raises(ValueError, match="empty"):
        GlobalOrder(0, seed=0)


def _parts(seed: int = 0) -> TrainingParts:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return TrainingParts(model, optimizer, scheduler)


def test_digest_sees_one_flipped_bit_and_survives_transport() -> None:
    parts = _parts()
    counters = Counters(step=5, position=40, global_batch=8)
    state = capture(parts, counters)
    reference = digest(state)
    # Transport: another replica made from a different seed receives the state.
    other = _parts(seed=1)
    other_counters = Counters()
    assert digest(capture(other, other_counters)) != reference
    restore(other, other_counters, deserialize(serialize(state)))
    assert digest(capture(other, other_counters)) == reference
    assert other_counters == counters
    # One bit of one parameter, one optimizer moment, a counter: each changes the digest.
    weight = other.model[0].weight
    with torch.no_grad():
        weight.view(-1).view(torch.int32)[0] ^= 1
    assert digest(capture(other, other_counters)) != reference
    restore(other, other_counters, deserialize(serialize(state)))
    moment = next(iter(other.optimizer.state.values()))["exp_avg"]
    moment.view(-1)[0] += 1e-12
    assert digest(capture(other, other_counters)) != reference
    restore(other, other_counters, deserialize(serialize(state)))
    other_counters.position += 1
    assert digest(capture(other, other_counters)) != reference


def test_garbage_is_not_a_state() -> None:
    with pytest.raises(Exception):  # noqa: B017 - torch.load's own error for bytes that are no archive
        deserialize(b"not a torch archive")
    with pytest.raises(ValueError, match="not a Tidal training state"):
        deserialize(serialize({"something": torch.zeros(1)}))


def test_checkpoints_are_atomic_pruned_and_a_damaged_newest_is_skipped(tmp_path: Path) -> None:
    parts = _parts()
    checkpointer = AsyncCheckpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        assert checkpointer.save(capture(parts, Counters(step=step, position=8 * step, global_batch=8)), step)
        checkpointer.wait()
    assert checkpointer.steps() == [20, 30]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    assert checkpointer.latest()["manifest"]["counters"]["step"] == 30
    # A damaged newest file (one bit of a weight, say a disk error) fails its digest and
    # the one before is used; so is a torn one.
    path = checkpoint_path(tmp_path, 30)
    data = bytearray(path.read_bytes())
    weight = parts.model[0].weight.detach()
    where = bytes(data).find(ctypes.string_at(weight.data_ptr(), weight.numel() * weight.element_size()))
    assert where > 0
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    assert checkpointer.latest()["manifest"]["counters"]["step"] == 20
    checkpoint_path(tmp_path, 40).write_bytes(data[: len(data) // 2])
    assert checkpointer.latest()["manifest"]["counters"]["step"] == 20


def test_a_state_written_at_once_is_made_in_its_folder_and_loads_with_its_digest(tmp_path: Path) -> None:
    parts = _parts()
    folder = tmp_path / "tidal-state" / "job-1"
    checkpointer = AsyncCheckpointer(folder)
    assert not folder.exists() and checkpointer.latest() is None, "nothing is made before the first write"
    state = capture(parts, Counters(step=7, position=56, global_batch=8))
    checkpointer.write_now(state, 7)
    assert checkpointer.steps() == [7]
    loaded = checkpointer.latest()
    assert loaded is not None and loaded["manifest"]["counters"]["step"] == 7
    assert digest(loaded) == digest(state)


def test_a_checkpoint_copy_does_not_see_later_steps(tmp_path: Path) -> None:
    parts = _parts()
    checkpointer = AsyncCheckpointer(tmp_path)
    before = digest(capture(parts, Counters(step=1)))
    gate = threading.Event()
    original = checkpointer._write

    def slow_write(snapshot: dict, step: int) -> None:
        gate.wait(10)
        original(snapshot, step)

    checkpointer._write = slow_write  # type: ignore[method-assign]
    assert checkpointer.save(capture(parts, Counters(step=1)), 1)
    assert not checkpointer.save(capture(parts, Counters(step=2)), 2), "a second write while one is pending"
    with torch.no_grad():
        for parameter in parts.model.parameters():
            parameter.add_(1.0)
    gate.set()
    checkpointer.wait()
    assert digest(checkpointer.latest()) == before
    assert checkpointer.skipped == 1


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(50, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def _train(steps: int, *, micro_batch: int = 4, checkpoint_dir: Path | None = None, every: int = 0,
           ledger_dir: Path | None = None, policy: FixedBatch | ScaledBatch | None = None,
           max_grad_norm: float | None = None, norms: list[float | None] | None = None) -> Elastic:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1], reduction="sum")

    job = Elastic(model, optimizer, _dataset(), loss_fn=loss_fn, global_batch=None if policy else 12,
                  batch_policy=policy, micro_batch=micro_batch, seed=5, checkpoint_dir=checkpoint_dir,
                  checkpoint_every=every, ledger_dir=ledger_dir, max_grad_norm=max_grad_norm)
    for result in job.train(steps):
        if norms is not None:
            norms.append(result.grad_norm)
    return job


def test_the_gradient_is_clipped_to_its_global_norm_as_a_plain_loop_clips_it() -> None:
    norms: list[float | None] = []
    clipped = _train(12, micro_batch=5, max_grad_norm=0.05, norms=norms)
    # The same training by hand: the step's samples, the mean loss, clip_grad_norm_, step.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = _dataset().tensors
    expected = []
    for step in range(12):
        chosen = GlobalOrder(50, seed=5).samples(step * 12, 12)
        optimizer.zero_grad()
        (torch.nn.functional.mse_loss(model(inputs[chosen]), targets[chosen], reduction="sum") / 12).backward()
        expected.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
    assert norms == pytest.approx(expected, rel=1e-12)
    assert max(expected) > 0.05, "the test must clip"
    for a, b in zip(clipped.parts.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    unclipped = _train(12, micro_batch=5)
    assert any(not torch.allclose(a, b) for a, b in zip(clipped.parts.model.parameters(),
                                                         unclipped.parts.model.parameters(), strict=True))
    with pytest.raises(ValueError, match="max_grad_norm"):
        _train(1, max_grad_norm=0.0)


def test_micro_batching_does_not_change_the_update() -> None:
    whole = _train(15, micro_batch=12)
    pieces = _train(15, micro_batch=5)
    for a, b in zip(whole.parts.model.parameters(), pieces.parts.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_job_restarted_from_its_checkpoint_goes_on_at_the_exact_step_and_sample(tmp_path: Path) -> None:
    uninterrupted = _train(30)
    # Every replica lost after 25 steps; the newest checkpoint holds step 20, or step 10
    # when the write of step 10 was still running at step 20 on a loaded machine (a write
    # due meanwhile is skipped, not waited for).
    _train(25, checkpoint_dir=tmp_path / "ckpt", every=10)
    newest = max(int(path.name[5:17]) for path in (tmp_path / "ckpt").glob("step-*.tidal"))
    assert newest in (10, 20)
    resumed = _train(30, checkpoint_dir=tmp_path / "ckpt", every=10, ledger_dir=tmp_path / "ledger")
    assert resumed.step == 30
    assert digest(capture(resumed.parts, resumed.counters)) == digest(capture(uninterrupted.parts,
                                                                              uninterrupted.counters))
    records = [json.loads(line) for path in (tmp_path / "ledger").iterdir() for line in path.read_text().splitlines()]
    attempts = [r for r in records if r["kind"] == "attempt"]
    assert attempts[0]["step"] == newest
    assert attempts[0]["indices"] == GlobalOrder(50, seed=5).samples(newest * 12, 12)


def test_a_second_train_call_goes_on_from_the_first_not_from_the_checkpoint(tmp_path: Path) -> None:
    """A script that trains in two calls (`train(4)`, an evaluation, `train(6)`) computes
    what `train(6)` computes. The second call loaded the newest checkpoint again (step 3)
    over the state it held (step 4): step 4 was taken twice."""
    once = _train(6)
    job = _train(4, checkpoint_dir=tmp_path / "ckpt", every=3)
    steps = [result.step for result in job.train(6)]
    assert steps == [5, 6]
    assert digest(capture(job.parts, job.counters)) == digest(capture(once.parts, once.counters))


@pytest.mark.parametrize("content", [pytest.param(b"\0" * 4096, id="zeros"), pytest.param(b"", id="empty"),
                                     pytest.param(b"step 25\n", id="text")])
def test_a_newest_checkpoint_file_that_is_no_archive_is_skipped_when_a_job_restarts(tmp_path: Path,
                                                                                     content: bytes) -> None:
    """A file under a checkpoint's name that torch.load cannot even start on (zeros left by
    a disk error, an empty file, text) is skipped like a torn one: the job resumes from the
    checkpoint before it. torch.load raised UnpicklingError, EOFError or KeyError for these,
    which ended the worker at its start."""
    uninterrupted = _train(30)
    _train(20, checkpoint_dir=tmp_path / "ckpt", every=10)
    checkpoint_path(tmp_path / "ckpt", 25).write_bytes(content)
    resumed = _train(30, checkpoint_dir=tmp_path / "ckpt", every=10)
    assert resumed.step == 30
    assert digest(capture(resumed.parts, resumed.counters)) == digest(capture(uninterrupted.parts,
                                                                              uninterrupted.counters))


def test_a_live_job_whose_state_holds_its_last_step_says_it_finished_and_takes_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live mode, a world of one under a launcher (its control channel, a store): the job's
    state already holds its last step (its checkpoint of step 6, of `train(6)`). The worker
    takes no step, and says `finished` as when it commits the last step: the job is over and
    the script's code after the loop runs as after training. It said nothing and returned,
    so the job went on until its worker exited (no `job_finishing` at the step)."""
    # (Every 6: the one write is step 6's. Every 3, step 6's was skipped when step 3's was
    # still being written, as designed, and the job resumed at 3.)
    _train(6, checkpoint_dir=tmp_path / "ckpt", every=6)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    said: queue.Queue[WorkerSaid] = queue.Queue()
    loop = asyncio.new_event_loop()
    server = LauncherChannel(tmp_path / "control.sock", post=said.put)
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(5)
    for name, value in {"TIDAL_CONTROL_SOCKET": str(server.path), "TIDAL_GENERATION": "1", "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(store.port), "TIDAL_TARGET_STEP": "6"}.items():
        monkeypatch.setenv(name, value)
    results: list[float | None] = []
    messages: list[Message] = []
    try:
        job = _train(6, checkpoint_dir=tmp_path / "ckpt", every=6, norms=results)
        with contextlib.suppress(queue.Empty):
            while not messages or not isinstance(messages[-1], (Finished, Left)):
                messages.append(said.get(timeout=2).message)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)
    assert job.step == 6 and results == []
    assert Finished(generation=1, step=6) in messages, messages
    # Called again (steps in chunks): the job was told over; a clear error, no world.
    with pytest.raises(RuntimeError, match=r"train\(\) already ran this job to its end \(step 6"):
        next(job.train(8))


def test_scaled_batch_follows_the_world_size_with_its_learning_rate_rule() -> None:
    linear = ScaledBatch(per_rank=8, lr_rule="linear", reference_world_size=2)
    assert linear.batch_for(4) == 32 and linear.lr_factor(4) == 2.0
    assert ScaledBatch(per_rank=8, lr_rule="sqrt").lr_factor(4) == 2.0
    assert ScaledBatch(per_rank=8, lr_rule="none").lr_factor(4) == 1.0
    assert FixedBatch(64).batch_for(7) == 64
    job = _train(3, policy=ScaledBatch(per_rank=10, lr_rule="linear", reference_world_size=2))
    assert job.counters.global_batch == 10 and job.parts.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_scaled_learning_rate_keeps_the_schedulers_decay_across_world_changes() -> None:
    """ScaledBatch with a scheduler: each world formation set lr to the optimizer's first lr
    × the new factor, undoing the scheduler's decay (StepLR: 0.025 back to 0.1), and a
    scheduler that recomputes lr from its base_lrs (LambdaLR) undid the factor at its next
    step. Now the factor the state's lr holds is replaced by the new one, and a joiner that
    received the state (optimizer and scheduler) scales from what it received."""
    from tidal.train.batch import scale_learning_rates

    def parts(kind: str) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        scheduler = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if kind == "step"
                     else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch))
        return optimizer, scheduler

    for kind in ("step", "lambda"):
        optimizer, scheduler = parts(kind)
        scale_learning_rates(optimizer, scheduler, 2.0)  # a world of 4, reference 2
        optimizer.step()
        scheduler.step()
        optimizer.step()
        scheduler.step()  # decayed twice: 0.1 × 2 × 0.25
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05), kind
        scale_learning_rates(optimizer, scheduler, 1.0)  # the world shrinks to 2
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025), kind
        # A joiner: made with lr 0.1, it receives the state, then the world of 3 forms.
        joiner, joiner_scheduler = parts(kind)
        joiner.load_state_dict(optimizer.state_dict())
        joiner_scheduler.load_state_dict(scheduler.state_dict())
        for holder, its_scheduler in ((optimizer, scheduler), (joiner, joiner_scheduler)):
            scale_learning_rates(holder, its_scheduler, 1.5)
            assert holder.param_groups[0]["lr"] == pytest.approx(0.0375), kind
            holder.step()
            its_scheduler.step()  # the decay goes on from there, the factor kept
            assert holder.param_groups[0]["lr"] == pytest.approx(0.01875), kind


def test_a_second_world_under_scaled_batch_keeps_the_decayed_learning_rate() -> None:
    """Through `Elastic`: a script that trains in two calls (each forms its world) under
    ScaledBatch with StepLR. The second world's formation set lr back to the first one
    (0.1), as if the scheduler had never stepped."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1], reduction="sum")

    job = Elastic(model, optimizer, _dataset(), loss_fn=loss_fn, batch_policy=ScaledBatch(per_rank=4),
                  lr_scheduler=scheduler, seed=5)
    list(job.train(2))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    list(job.train(3))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_a_step_that_miscounts_its_samples_fails_loudly() -> None:
    expected = GlobalOrder(50, seed=5).samples(12, 12)
    control = torch.tensor([11.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    with pytest.raises(AccountingError, match="consumed 11 samples"):
        check_accounting(1, control, expected)


def test_bad_arguments_are_named() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="global_batch"):
        Elastic(model, optimizer, _dataset(), loss_fn=lambda m, b: m(b[0]).sum())
    with pytest.raises(ValueError, match="global_batch must be positive"):
        Elastic(model, optimizer, _dataset(), loss_fn=lambda m, b: m(b[0]).sum(), global_batch=0)


def test_control_channel_carries_worlds_and_stops_both_ways(tmp_path: Path) -> None:
    async def scenario() -> None:
        said: asyncio.Queue[WorkerSaid] = asyncio.Queue()
        server = LauncherChannel(tmp_path / "control.sock", post=said.put_nowait)
        await server.start()
        # A message to a worker that has not connected yet waits for its hello.
        server.send(0, World(generation=2, rank=1, world_size=3, master_addr="127.0.0.1", master_port=1234,
                             target_step=40))
        worker = await asyncio.to_thread(WorkerChannel, str(server.path), 0, 4242)
        hello = await asyncio.wait_for(said.get(), 5)
        assert hello.local_rank == 0 and hello.message == Hello(local_rank=0, pid=4242)
        world = await asyncio.to_thread(worker.wait_world, 1, 5.0)
        assert (world.generation, world.rank, world.world_size, world.master_port, world.target_step) == (
            2, 1, 3, 1234, 40)
        assert worker.next_world(2) is None
        # Garbage on the wire is skipped, not fatal.
        server.writers[0].write(b"{not json\n")
        server.writers[0].write(b'{"op": "stop", "generation": "two"}\n')
        server.writers[0].write(b'{"op": "explode"}\n')
        # A change to generation 3 is coming (its joiners start): not a world, nothing breaks.
        assert not worker.change_coming(2)
        server.send(0, Coming(generation=3))
        await asyncio.to_thread(lambda: _wait(lambda: worker.change_coming(2)))
        assert not worker.change_coming(3) and worker.next_world(2) is None
        server.send(0, Stop(generation=2))
        await asyncio.to_thread(lambda: _wait(lambda: worker.stop_requested(2)))
        assert worker.next_world(1) is None, "a stopped generation's world is not joined"
        assert worker.change_coming(2), "the stop of 2 does not cancel 3"
        worker.coming_at -= COMING_HOLDS_S
        assert not worker.change_coming(2), "a word that a change is coming holds for COMING_HOLDS_S"
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(worker.wait_world, 2, 0.2)
        worker.send(Stopped(generation=2, step=7))
        stopped = await asyncio.wait_for(said.get(), 5)
        assert stopped.message == Stopped(generation=2, step=7)
        await server.close()
        with pytest.raises(ChannelClosed):
            await asyncio.to_thread(worker.wait_world, 2, 5.0)
        worker.close()

    asyncio.run(scenario())


def _wait(predicate: object, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("message", [
    World(generation=3, rank=-1, world_size=2, master_addr="h", master_port=1, joining=True, target_step=9),
    Stop(generation=3), Coming(generation=4), Hello(local_rank=1, pid=2), Formed(generation=3, step=4, digest="ab"),
    FirstStep(generation=3, step=5), Stopped(generation=3, step=4), Left(generation=3, step=4),
    Finished(generation=3, step=600),
    Resumed(generation=3, step=40, target_step=57, detail="steps 40..56 are redone"),
    StateLost(generation=3, target_step=57, detail="no state"), Beat(step=4, samples=96, waiting=True),
    Beat(step=4, samples=96, loss=0.125)])
def test_every_control_message_survives_the_codec(message: Message) -> None:
    assert decode(encode(message)) == message


def test_a_beat_with_a_loss_that_is_not_a_number_keeps_the_beat_and_drops_the_loss() -> None:
    """A beat is liveness: a bad loss must not make a worker look silent."""
    assert decode(b'{"op": "beat", "step": 4, "samples": 8, "loss": NaN}\n') == Beat(step=4, samples=8, loss=None)
    assert decode(b'{"op": "beat", "step": 4, "loss": 2}\n') == Beat(step=4, loss=2.0)
    assert decode(b'{"op": "beat", "step": 4, "loss": "low"}\n') is None
    assert decode(b'{"op": "beat", "step": 4}\n') == Beat(step=4, loss=None)
    assert decode(b'{"op": "beat", "step": 4, "loss": 1e999}\n') == Beat(step=4, loss=None)
    # An integer too large for a float is garbage, not the end of the channel.
    assert decode(b'{"op": "beat", "step": 4, "loss": 1' + b"0" * 400 + b"}\n") is None


def test_the_codec_refuses_lines_that_are_not_messages() -> None:
    for line in (b"not json", b"[1, 2]", b'{"op": "nope"}', b'{"op": "stop"}', b'{"op": "stop", "generation": true}',
                 b'{"op": "beat", "step": 1, "waiting": "yes"}'):
        assert decode(line) is None, line
    # A newer peer's extra fields are ignored; a long detail is cut.
    assert decode(b'{"op": "stop", "generation": 2, "reason": "new"}') == Stop(generation=2)
    assert json.loads(encode(Stop(generation=5))) == {"op": "stop", "generation": 5}
    lost = decode(b'{"op": "state_lost", "generation": 1, "target_step": 3, "detail": "' + b"x" * 5000 + b'"}')
    assert isinstance(lost, StateLost) and len(lost.detail) == 2000


def test_a_rank_counts_its_own_compute_per_generation_leaving_out_the_first_step() -> None:
    job = _train(5)
    generation, seconds, samples, steps = job.compute
    # Steps 2..5 of the world's one generation: 4 steps of the global batch of 12.
    assert samples == 4 * 12 and steps == 4 and seconds > 0
    beat = job._beat()
    assert (beat.compute_generation, beat.compute_seconds, beat.compute_samples, beat.compute_steps) == (
        generation, seconds, samples, steps)
