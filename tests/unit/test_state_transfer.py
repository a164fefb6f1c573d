"""The streamed per-shard state transfer, the state's agreement when a world forms, and the
bucketed gradient reduction, between real gloo process groups in threads of this process
(a HashStore between them)."""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.proto.control import Resumed, World
from tidal.train.checkpoint import AsyncCheckpointer, checkpoint_path, deserialize_payload, write_atomically
from tidal.train.groups import Collectives, Groups
from tidal.train.ledger import Ledger
from tidal.train.state import Counters, StateDoesNotFit, TrainingParts, apply_manifest, capture, digest, serialize
from tidal.train.strategy import DataParallel
from tidal.train.sync import StateSync
from tidal.train.transfer import plan_items, receive_state, send_state


def test_items_are_bounded_large_tensors_sliced_and_small_ones_packed() -> None:
    items = plan_items([10, 30, 0, 100, 5, 5], bucket_bytes=40)
    assert [[(p.tensor, p.start, p.end) for p in item.pieces] for item in items] == [
        [(0, 0, 10), (1, 0, 30)], [(3, 0, 40)], [(3, 40, 80)], [(3, 80, 100)], [(4, 0, 5), (5, 0, 5)]]
    assert all(item.nbytes <= 40 for item in items)
    assert [item.direct for item in items] == [False, True, True, True, False]
    # Anything of direct_bytes or more travels alone, straight from and into its tensor.
    items = plan_items([10, 30, 5, 5, 9], bucket_bytes=40, direct_bytes=8)
    assert [[(p.tensor, p.start, p.end) for p in item.pieces] for item in items] == [
        [(0, 0, 10)], [(1, 0, 30)], [(2, 0, 5), (3, 0, 5)], [(4, 0, 9)]]
    with pytest.raises(ValueError, match="positive"):
        plan_items([1], 0)


def _parts(seed: int, steps: int) -> TrainingParts:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return parts_of(model, optimizer, scheduler)


def parts_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> TrainingParts:
    return TrainingParts(model=model, optimizer=optimizer, scheduler=scheduler)


def _in_threads(size: int, body: Callable[[int, Any], Any]) -> list[Any]:
    """Run body(rank, group) in `size` threads, each with its own gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=30))
            results[rank] = body(rank, group)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 512, 100])
def test_a_joiner_receives_a_bit_identical_state_striped_across_two_sources(bucket_bytes: int) -> None:
    holders = [_parts(seed=1, steps=3), _parts(seed=1, steps=3)]
    joiner = _parts(seed=9, steps=0)
    counters = [Counters(step=3, position=12, global_batch=4, samples=12) for _ in range(2)] + [Counters()]
    parts = [*holders, joiner]
    expected = digest(capture(holders[0], counters[0]))
    assert digest(capture(joiner, counters[2])) != expected

    def body(rank: int, group: Any) -> Any:
        if rank < 2:
            return send_state(group, parts[rank], counters[rank], me=rank, sources=[0, 1], receivers=[2],
                              bucket_bytes=bucket_bytes)
        return receive_state(group, parts[rank], counters[rank], me=rank, sources=[0, 1], bucket_bytes=bucket_bytes)

    stats = _in_threads(3, body)
    assert digest(capture(joiner, counters[2])) == expected
    assert counters[2] == counters[0]
    assert joiner.scheduler.state_dict() == holders[0].scheduler.state_dict()
    assert joiner.optimizer.param_groups[0]["lr"] == holders[0].optimizer.param_groups[0]["lr"]
    # Striped: both sources sent a share when there is more than one item.
    if stats[2].items > 1:
        assert stats[0].bytes > 0 and stats[1].bytes > 0
    assert stats[0].bytes + stats[1].bytes == stats[2].bytes
    # The staging buffer is one bucket at most, and none when every tensor is sent in place.
    assert stats[2].staging_bytes <= bucket_bytes
    # The joiner trains on from there exactly as its source does.
    for one in (holders[0], joiner):
        torch.manual_seed(5)
        one.model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        one.optimizer.step()
    assert digest(capture(joiner, counters[2])) == digest(capture(holders[0], counters[0]))


def test_a_state_of_another_model_is_refused_and_nothing_is_applied() -> None:
    source = _parts(seed=1, steps=2)
    manifest = capture(source, Counters(step=2))["manifest"]
    torch.manual_seed(0)
    other_model = torch.nn.Sequential(torch.nn.Linear(6, 41), torch.nn.LayerNorm(41), torch.nn.Linear(41, 3)).double()
    other = parts_of(other_model, torch.optim.AdamW(other_model.parameters(), lr=0.5), None)
    counters = Counters()
    before = digest(capture(other, counters))
    with pytest.raises(StateDoesNotFit, match=r"model/0\.weight"):
        apply_manifest(other, counters, manifest)
    assert digest(capture(other, counters)) == before and counters == Counters()
    assert other.optimizer.param_groups[0]["lr"] == 0.5
    with pytest.raises(StateDoesNotFit, match="format"):
        apply_manifest(other, counters, {"format": "something else"})


# Buckets of a few kB: several, their gradients landing through hooks during the backward
# pass; 25 MB: the model in one bucket, its gradients taken once the backward pass returns.
BUCKET_SIZES = [pytest.param(0.004, id="several-buckets"), pytest.param(25.0, id="one-bucket")]


@pytest.mark.parametrize("bucket_mb", BUCKET_SIZES)
@pytest.mark.parametrize("overlap", [True, False])
def test_bucketed_reduction_during_backward_sums_every_ranks_gradients(overlap: bool, bucket_mb: float) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 30), torch.nn.Tanh(), torch.nn.Linear(30, 30),
                                    torch.nn.Tanh(), torch.nn.Linear(30, 2)).double()
    # Each rank's copy is made here: the threads must not share the global RNG.
    models = [copy.deepcopy(reference) for _ in range(2)]
    inputs = torch.randn(12, 5, dtype=torch.float64)
    reference(inputs).pow(2).sum().backward()

    def body(rank: int, group: Any) -> Any:
        model = models[rank]
        # Tiny buckets: several all-reduces, started as the backward pass finishes each.
        strategy = DataParallel(bucket_mb=bucket_mb, overlap=overlap)
        strategy.attach(model, list(model.parameters()))
        assert strategy.buckets > 2 if bucket_mb < 1 else strategy.buckets == 1
        strategy.begin_step(group, 12)
        share = inputs[rank * 6:(rank + 1) * 6]
        for number, chunk in enumerate((share[:4], share[4:])):
            strategy.before_backward(last=number == 1)
            model(chunk).pow(2).sum().backward()
            strategy.after_backward(last=number == 1)
        strategy.finish()
        return [p.grad.clone() for p in model.parameters()]

    for gradients in _in_threads(2, body):
        for got, parameter in zip(gradients, reference.parameters(), strict=True):
            torch.testing.assert_close(got, parameter.grad / 12, rtol=1e-12, atol=1e-15)


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(5, 8)
        self.unused = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, use_all: bool) -> torch.Tensor:
        hidden = torch.tanh(self.first(inputs))
        if use_all:
            hidden = torch.tanh(self.unused(hidden))
        return self.last(hidden)


@pytest.mark.parametrize("bucket_mb", [pytest.param(0.0005, id="several-buckets"), pytest.param(25.0, id="one-bucket")])
@pytest.mark.parametrize("overlap", [True, False])
def test_each_step_reduces_only_its_own_gradients_and_an_unused_parameter_gets_zero(overlap: bool,
                                                                                     bucket_mb: float) -> None:
    # Two steps on the same buckets: the second uses a parameter the first did not, and the
    # first a parameter the second does not. Nothing of step 1 may reach step 2's sums.
    torch.manual_seed(0)
    reference = _WithUnused().double()
    models = [copy.deepcopy(reference) for _ in range(2)]
    steps = [(torch.randn(8, 5, dtype=torch.float64), False), (torch.randn(8, 5, dtype=torch.float64), True),
             (torch.randn(8, 5, dtype=torch.float64), False)]
    expected = []
    for inputs, use_all in steps:
        reference.zero_grad(set_to_none=True)
        reference(inputs, use_all).pow(2).sum().backward()
        expected.append([torch.zeros_like(parameter) if parameter.grad is None else parameter.grad / 8
                         for parameter in reference.parameters()])

    def body(rank: int, group: Any) -> Any:
        model = models[rank]
        strategy = DataParallel(bucket_mb=bucket_mb, overlap=overlap)
        strategy.attach(model, list(model.parameters()))
        got = []
        for inputs, use_all in steps:
            strategy.begin_step(group, 8)
            share = inputs[rank * 4:(rank + 1) * 4]
            for number, chunk in enumerate((share[:1], share[1:])):
                strategy.before_backward(last=number == 1)
                model(chunk, use_all).pow(2).sum().backward()
                strategy.after_backward(last=number == 1)
            strategy.finish()
            got.append([p.grad.clone() for p in model.parameters()])
        return got

    for gradients in _in_threads(2, body):
        for step_got, step_expected in zip(gradients, expected, strict=True):
            for got, want in zip(step_got, step_expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert not expected[0][2].any() and expected[1][2].any()


def small_model_in_buckets(seed: int, bucket_mb: float = 0.0002) -> tuple[torch.nn.Module, torch.nn.Module,
                                                                           DataParallel]:
    """A float64 MLP under DataParallel (by default with buckets of a few parameters), and its copy."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    reference = copy.deepcopy(model)
    strategy = DataParallel(bucket_mb=bucket_mb)
    strategy.attach(model, list(model.parameters()))
    return model, reference, strategy


@pytest.mark.parametrize("bucket_mb", [pytest.param(0.0002, id="several-buckets"), pytest.param(25.0, id="one-bucket")])
def test_a_step_abandoned_between_micro_batches_leaves_nothing_for_the_next(bucket_mb: float) -> None:
    model, reference, strategy = small_model_in_buckets(seed=1, bucket_mb=bucket_mb)
    strategy.begin_step(None, 4)
    strategy.before_backward(last=False)
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    strategy.abandon()
    assert all(parameter.grad is None for parameter in model.parameters())
    inputs = torch.randn(4, 4, dtype=torch.float64)
    strategy.begin_step(None, 4)
    strategy.before_backward(last=True)
    model(inputs).sum().backward()
    strategy.finish()
    reference(inputs).sum().backward()
    for got, parameter in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, parameter.grad / 4, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("bucket_mb", [pytest.param(0.0002, id="several-buckets"), pytest.param(25.0, id="one-bucket")])
def test_a_backward_pass_outside_a_step_is_plain_autograd_and_leaves_the_next_step_alone(bucket_mb: float) -> None:
    model, reference, strategy = small_model_in_buckets(seed=2, bucket_mb=bucket_mb)
    probe = torch.randn(3, 4, dtype=torch.float64)
    # Before any step, then again after one: gradients accumulate as autograd's own would.
    for _ in range(2):
        model(probe).sum().backward()
        reference(probe).sum().backward()
    for got, parameter in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, parameter.grad, rtol=1e-12, atol=1e-15)
    inputs = torch.randn(4, 4, dtype=torch.float64)
    strategy.begin_step(None, 4)
    strategy.before_backward(last=True)
    model(inputs).sum().backward()
    strategy.finish()
    model(probe).sum().backward()
    reference.zero_grad(set_to_none=True)
    reference(inputs).sum().backward()
    step_grads = [parameter.grad / 4 for parameter in reference.parameters()]
    reference.zero_grad(set_to_none=True)
    reference(probe).sum().backward()
    for got, step_grad, probe_param in zip(model.parameters(), step_grads, reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, step_grad + probe_param.grad, rtol=1e-12, atol=1e-15)
    strategy.begin_step(None, 4)
    strategy.before_backward(last=True)
    model(inputs).sum().backward()
    strategy.finish()
    for got, step_grad in zip(model.parameters(), step_grads, strict=True):
        torch.testing.assert_close(got.grad, step_grad, rtol=1e-12, atol=1e-15)


def test_a_garbled_manifest_from_a_peer_is_refused_with_a_clear_error() -> None:
    from tidal.train.transfer import _decode

    with pytest.raises(StateDoesNotFit, match="cannot be read"):
        _decode(b"\x00not a torch archive")


class _SaidToLauncher:
    """A worker's control channel, as far as the state's agreement uses it: what it says."""

    def __init__(self) -> None:
        self.said: list[Any] = []

    def send(self, message: Any) -> None:
        self.said.append(message)


def test_ranks_that_kept_an_older_state_resume_from_the_newer_one_saved_on_disk(tmp_path: Path) -> None:
    """Live mode: two units left out of the world (the size the job allowed) kept their
    workers and state at step 5, while the world trained on to step 12; its last replica
    then left saving the state at step 12 (the job's committed step, the next world's
    target). The next world is the two kept units. Each rank held a state, so none looked
    at the disk: they resumed at step 5 (steps 5..11 redone, said to be "resumed from the
    checkpoint at step 5") with the step-12 state unread. Each rank behind the newest
    checkpoint now loads it, and the world goes on at step 12."""
    folder = tmp_path / "tidal-state" / "job-1"
    saved_counters = Counters(step=12, position=48, global_batch=4, samples=48)
    saved = _parts(seed=1, steps=12)
    AsyncCheckpointer(folder).write_now(capture(saved, saved_counters), 12)
    expected = digest(capture(saved, saved_counters))
    channels = [_SaidToLauncher(), _SaidToLauncher()]
    kept = [_parts(seed=1, steps=5), _parts(seed=1, steps=5)]

    def body(rank: int, group: Any) -> tuple[int, str]:
        sync = StateSync(kept[rank], Counters(step=5, position=20, global_batch=4, samples=20),
                         strategy=DataParallel(), checkpointer=AsyncCheckpointer(folder), checkpoint_every=0,
                         state_folder=folder, bucket_bytes=1 << 20, device=torch.device("cpu"),
                         collectives=Collectives(), ledger=Ledger(None))
        sync.has_state = True
        groups = Groups(world=group, replica=group, rank=rank, world_size=2, shard_size=1, shard_rank=0)
        world = World(generation=9, rank=rank, world_size=2, master_addr="h", master_port=1, joining=True,
                      target_step=12)
        _, state_digest = sync.agree(groups, world, channels[rank])  # type: ignore[arg-type]
        return sync.counters.step, state_digest

    assert _in_threads(2, body) == [(12, expected), (12, expected)]
    assert not [m for channel in channels for m in channel.said if isinstance(m, Resumed)], \
        "the world holds the target step: nothing was redone"


@pytest.mark.parametrize(("damaged", "resumed"), [({(1, 20)}, 15), ({(0, 15), (1, 20)}, 10)])
def test_a_sharded_replicas_shards_resume_from_one_step_when_a_shards_checkpoints_do_not_read_back(
        tmp_path: Path, damaged: set[tuple[int, int]], resumed: int) -> None:
    """One replica of two shards (HybridSharded: each shard index its own checkpoint
    folder) holds step 10 in memory; the disk has steps 15 and 20 of both shards, some of
    which do not verify (a damaged file, a read that failed). Nobody holds the target, 20.
    Each shard alone would take the newest it can read, and the replica's shards would
    hold different steps: the world refused them (StateMismatch). They take one step
    together: with shard 1's 20 damaged, 15; with shard 1's 20 and shard 0's 15 damaged,
    no step both can read, so neither loads and both stay at 10."""
    folders = [tmp_path / f"shard-{k}-of-2" for k in range(2)]
    saved = _parts(seed=1, steps=3)
    for step in (15, 20):
        for folder in folders:
            AsyncCheckpointer(folder).write_now(capture(saved, Counters(step=step, position=4 * step,
                                                                        global_batch=4, samples=4 * step)), step)
    for shard, step in damaged:
        path = checkpoint_path(folders[shard], step)
        payload = deserialize_payload(path.read_bytes())
        write_atomically(path, serialize({"state_digest": "0" * 64, "state": payload["state"]}))
        assert AsyncCheckpointer(folders[shard]).at(step) is None

    def body(rank: int, group: Any) -> int:
        sync = StateSync(_parts(seed=1, steps=2), Counters(step=10, position=40, global_batch=4, samples=40),
                         strategy=DataParallel(), checkpointer=AsyncCheckpointer(folders[rank],
                                                                                 siblings=(folders[1 - rank],)),
                         checkpoint_every=0, state_folder=None, bucket_bytes=1 << 20, device=torch.device("cpu"),
                         collectives=Collectives(), ledger=Ledger(None))
        sync.has_state = True
        groups = Groups(world=group, replica=group, rank=rank, world_size=2, shard_size=2, shard_rank=rank)
        world = World(generation=9, rank=rank, world_size=2, master_addr="h", master_port=1, target_step=20)
        sync.agree(groups, world, _SaidToLauncher())  # type: ignore[arg-type]
        return sync.counters.step

    assert _in_threads(2, body) == [resumed, resumed]


def test_a_leaving_replica_saves_the_state_even_when_an_earlier_checkpoint_failed_to_write(tmp_path: Path) -> None:
    """A periodic checkpoint failed (a file in the way, the disk full at the time); later
    the unit is asked to leave holding the job's last copy. Waiting for the checkpoint in
    flight raised that old error out of the leave: no state written, no `left`, the worker
    ended with the error (exit 1) and the job lost its state. The leave says the old error
    and writes the state."""
    folder = tmp_path / "ckpt"
    parts = _parts(seed=1, steps=5)
    counters = Counters(step=5, position=20, global_batch=4, samples=20)
    checkpointer = AsyncCheckpointer(folder)
    sync = StateSync(parts, counters, strategy=DataParallel(), checkpointer=checkpointer, checkpoint_every=5,
                     state_folder=None, bucket_bytes=1 << 20, device=torch.device("cpu"), collectives=Collectives(),
                     ledger=Ledger(None))
    sync.has_state = True
    folder.write_text("a file where the checkpoint folder goes")
    sync.after_commit(5, rank=0)
    assert checkpointer._thread is not None
    checkpointer._thread.join(10)
    assert checkpointer.error is not None, "the periodic write failed"
    folder.unlink()
    assert sync.before_leaving(True) == str(folder)
    saved = checkpointer.latest()
    assert saved is not None and digest(saved) == digest(capture(parts, counters))
