"""One rank of bench/reduction.py: a wide MLP (its gradients large, its compute per step
small, so that the gradient all-reduce is a large part of a step on gloo over loopback),
trained for --steps steps in one of these modes:

- `tidal-overlap`: `Elastic` with `DataParallel(bucket_mb, overlap=True)` (each bucket's
  all-reduce starts during the last micro-batch's backward pass);
- `tidal-no-overlap`: the same with `overlap=False` (the same buckets, reduced after the
  backward pass);
- `ddp`: the same model, data, loss and optimizer in a plain torch.distributed script:
  `DistributedDataParallel(bucket_cap_mb=bucket_mb)` over gloo's default group, `no_sync`
  for every micro-batch but the last, each rank taking the same samples as under Tidal;
- `interleaved`: the three above step by step in one process (a Tidal job whose strategy's
  `overlap` is switched between its steps, and a DDP copy of the model), --steps cycles of
  one step each, the order rotated from cycle to cycle; then, with --probe-steps, the probe;
- `probe`: the parts of a step, measured apart in the same world: forward + backward with
  no communication, the all-reduce of the same gradient buckets with no compute, the
  optimizer step, and a micro-batch's forward + backward with that all-reduce beside it
  (what the reduction could at best hide on this machine, and what it costs alone).

Start it as rank RANK of WORLD_SIZE with the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE); without a Tidal launcher `Elastic`
trains in that fixed world. Each rank writes a JSON file to --out: per step its wall time
(from one step's end to the next's, as the training loop sees it), its process CPU time
(every thread: the main one and gloo's) and its main thread's CPU time; under Tidal also
the last micro-batch's backward pass and the wait for the reduction after it."""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from tidal.train import DataParallel, Elastic
from tidal.train.data import GlobalOrder, micro_batches, step_samples

MODES = ("tidal-overlap", "tidal-no-overlap", "ddp", "probe", "interleaved")
OUTPUTS = 16


def wide_mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, OUTPUTS))
    return nn.Sequential(*layers)


def make_dataset(size: int, width: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, width, generator=generator)
    targets = torch.randn(size, OUTPUTS, generator=generator)
    return torch.utils.data.TensorDataset(inputs, targets)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The SUM over the batch of each sample's mean squared error (what `Elastic` wants)."""
    inputs, targets = batch
    return functional.mse_loss(model(inputs), targets, reduction="sum") / OUTPUTS


class Clock:
    """Per-step wall time, process CPU time (all threads) and main-thread CPU time."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.main_cpu: list[float] = []
        self._threads_at = thread_cpu()
        self._threads: list[dict[str, Any]] = []
        self._last = self.now()

    @staticmethod
    def now() -> tuple[float, float, float]:
        process = resource.getrusage(resource.RUSAGE_SELF)
        thread = resource.getrusage(resource.RUSAGE_THREAD)
        return (time.perf_counter(), process.ru_utime + process.ru_stime, thread.ru_utime + thread.ru_stime)

    def tick(self) -> None:
        now = self.now()
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self.main_cpu.append(now[2] - self._last[2])
        self._last = now

    def stop(self) -> None:
        """The last step is done (while the process groups and their threads still live)."""
        self._threads = thread_cpu(since=self._threads_at)

    def record(self) -> dict[str, Any]:
        return {"step_s": self.wall, "cpu_s": self.cpu, "main_cpu_s": self.main_cpu, "threads": self._threads}


class TimedDataParallel(DataParallel):
    """`DataParallel` as it is, with two timings per step: the last micro-batch's backward
    pass (from `before_backward(last=True)` to `finish`) and `finish` itself (the wait for
    what is left of the reduction)."""

    def __init__(self, bucket_mb: float, overlap: bool) -> None:
        super().__init__(bucket_mb=bucket_mb, overlap=overlap)
        self.last_backward_s: list[float] = []
        self.finish_s: list[float] = []
        self._backward_at = 0.0

    def before_backward(self, last: bool) -> None:
        super().before_backward(last)
        if last:
            self._backward_at = time.perf_counter()

    def finish(self) -> None:
        started = time.perf_counter()
        self.last_backward_s.append(started - self._backward_at)
        super().finish()
        self.finish_s.append(time.perf_counter() - started)


def train_tidal(args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = wide_mlp(args.width, args.depth)
    dataset = make_dataset(args.samples, args.width, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    strategy = TimedDataParallel(bucket_mb=args.bucket_mb, overlap=overlap)
    job = Elastic(model, optimizer, dataset, loss_fn=loss_fn, global_batch=args.global_batch,
                  micro_batch=args.micro_batch, seed=args.seed, strategy=strategy)
    clock: Clock | None = None
    losses: list[float] = []
    for result in job.train(args.steps):
        # The first step's interval would include forming the world; timing starts after it.
        if clock is None:
            clock = Clock()
        else:
            clock.tick()
        losses.append(result.loss)
        if result.step == args.steps:
            clock.stop()
    assert clock is not None
    return {**clock.record(), "loss": losses, "buckets": strategy.buckets,
            "last_backward_s": strategy.last_backward_s[1:], "finish_s": strategy.finish_s[1:]}


def ddp_step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, dataset: Any, order: GlobalOrder,
             step: int, args: argparse.Namespace) -> tuple[float, float]:
    """One step of the plain script: this rank's share of the step's samples (the one Tidal
    gives it) in micro-batches, `no_sync` for all but the last. Returns the step's loss
    (over every rank) and the last micro-batch's backward pass, in seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = step_samples(order, step=step, start=step * args.global_batch, global_batch=args.global_batch,
                           rank=rank, world_size=world)
    chunks = micro_batches(samples.indices, args.micro_batch)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    last_backward = 0.0
    for number, chunk in enumerate(chunks):
        batch = [torch.stack(column) for column in zip(*(dataset[i] for i in chunk), strict=True)]
        if number == len(chunks) - 1:
            loss = loss_fn(ddp, batch)
            backward_at = time.perf_counter()
            # DDP averages over the ranks: scaled so that the result is the sum over the
            # global batch divided by it, as under Tidal.
            (loss * world / args.global_batch).backward()
            last_backward = time.perf_counter() - backward_at
        else:
            with ddp.no_sync():
                loss = loss_fn(ddp, batch)
                (loss * world / args.global_batch).backward()
        loss_sum += loss.detach().to(torch.float64)
    optimizer.step()
    # What a plain script reports: the step's loss over every rank (Tidal's control
    # all-reduce carries the same number).
    dist.all_reduce(loss_sum)
    return loss_sum.item() / args.global_batch, last_backward


def make_ddp(args: argparse.Namespace) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = wide_mlp(args.width, args.depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.ddp_bucket_view)
    return ddp, optimizer


def close_default_group() -> None:
    """Destroy the default group once every rank is done with it, after the caller dropped
    its DDP wrappers: DDP's module and reducer hold the group in reference cycles, so without
    the collection the gloo group outlives `destroy_process_group` and is freed during the
    interpreter's finalization, where a rank can abort ("terminate called without an active
    exception", seen in CI as exit -6)."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def train_ddp(args: argparse.Namespace) -> dict[str, Any]:
    dist.init_process_group("gloo")
    ddp, optimizer = make_ddp(args)
    dataset = make_dataset(args.samples, args.width, args.seed)
    order = GlobalOrder(len(dataset), args.seed)
    clock: Clock | None = None
    losses: list[float] = []
    last_backward: list[float] = []
    for step in range(args.steps):
        loss, backward = ddp_step(ddp, optimizer, dataset, order, step, args)
        losses.append(loss)
        last_backward.append(backward)
        if clock is None:
            clock = Clock()
        else:
            clock.tick()
    assert clock is not None
    clock.stop()
    del ddp, optimizer
    close_default_group()
    return {**clock.record(), "loss": losses, "last_backward_s": last_backward[1:]}


def interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """The three modes step by step in one process: a Tidal job (`Elastic`, `DataParallel`)
    whose strategy reduces with overlap on one step and without on another (its `overlap`
    is read at each step's last backward pass), and a DDP copy of the model beside it. Each
    cycle runs one step of each, in an order rotated from cycle to cycle, so that the
    machine's load changes alike for all three. --steps is the number of cycles."""
    dist.init_process_group("gloo")
    dataset = make_dataset(args.samples, args.width, args.seed)
    torch.manual_seed(args.seed)
    model = wide_mlp(args.width, args.depth)
    strategy = TimedDataParallel(bucket_mb=args.bucket_mb, overlap=True)
    # Without a launcher, Elastic meets the other ranks at the default group's store.
    job = Elastic(model, torch.optim.SGD(model.parameters(), lr=args.lr), dataset, loss_fn=loss_fn,
                  global_batch=args.global_batch, micro_batch=args.micro_batch, seed=args.seed, strategy=strategy)
    ddp, ddp_optimizer = make_ddp(args)
    order = GlobalOrder(len(dataset), args.seed)
    tidal_steps = job.train(1 + 2 * args.steps)
    # Untimed: the first Tidal step forms its world, DDP's first step lays out its buckets.
    next(tidal_steps)
    ddp_step(ddp, ddp_optimizer, dataset, order, 0, args)
    modes = MODES[:3]
    record: dict[str, dict[str, list[float]]] = {
        key: {mode: [] for mode in modes} for key in ("step_s", "cpu_s", "main_cpu_s", "last_backward_s")}
    record["finish_s"] = {mode: [] for mode in modes[:2]}
    for cycle in range(args.steps):
        for mode in modes[cycle % 3:] + modes[:cycle % 3]:
            wall, cpu, main_cpu = Clock.now()
            if mode == "ddp":
                _, backward = ddp_step(ddp, ddp_optimizer, dataset, order, cycle + 1, args)
            else:
                strategy.overlap = mode == "tidal-overlap"
                next(tidal_steps)
                backward = strategy.last_backward_s[-1]
                record["finish_s"][mode].append(strategy.finish_s[-1])
            after = Clock.now()
            record["step_s"][mode].append(after[0] - wall)
            record["cpu_s"][mode].append(after[1] - cpu)
            record["main_cpu_s"][mode].append(after[2] - main_cpu)
            record["last_backward_s"][mode].append(backward)
    # The Tidal job's last step is done: let it close its groups.
    next(tidal_steps, None)
    result: dict[str, Any] = {"interleaved": record}
    del job, model, ddp, ddp_optimizer
    if args.probe_steps:
        result["probe"] = probe(args, args.probe_steps)
    close_default_group()
    return result


def probe(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """The parts of a step apart, each between barriers: a step's forward and backward passes
    with no communication; the all-reduce of the same gradient buckets with no compute; the
    optimizer step; and one micro-batch's forward and backward passes with that all-reduce
    running beside them (the overlap this machine allows at best: its wall time against the
    two apart). In the default process group, which the caller made."""
    torch.manual_seed(args.seed)
    model = wide_mlp(args.width, args.depth)
    dataset = make_dataset(args.samples, args.width, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    # The same buckets as DataParallel's (it lays them out on attach).
    layout = DataParallel(bucket_mb=args.bucket_mb)
    layout.attach(model, list(model.parameters()))
    buckets = [bucket.flat for bucket in layout._buckets]
    share = args.global_batch // dist.get_world_size()
    chunks = [[torch.stack(column) for column in zip(*(dataset[i] for i in chunk), strict=True)]
              for chunk in micro_batches(list(range(share)), args.micro_batch)]
    names = ("compute_s", "micro_batch_s", "allreduce_s", "allreduce_cpu_s", "optimizer_s", "concurrent_s",
             "concurrent_micro_batch_s", "concurrent_cpu_s")
    parts: dict[str, list[float]] = {name: [] for name in names}

    def cpu_now() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def reduce_all() -> list[Any]:
        return [dist.all_reduce(flat, async_op=True) for flat in buckets]

    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        started = micro_at = time.perf_counter()
        for chunk in chunks:
            micro_at = time.perf_counter()
            loss_fn(model, chunk).backward()
        ended = time.perf_counter()
        parts["compute_s"].append(ended - started)
        parts["micro_batch_s"].append(ended - micro_at)
        dist.barrier()
        cpu_at, started = cpu_now(), time.perf_counter()
        for work in reduce_all():
            work.wait()
        parts["allreduce_s"].append(time.perf_counter() - started)
        parts["allreduce_cpu_s"].append(cpu_now() - cpu_at)
        dist.barrier()
        started = time.perf_counter()
        optimizer.step()
        parts["optimizer_s"].append(time.perf_counter() - started)
        dist.barrier()
        cpu_at, started = cpu_now(), time.perf_counter()
        works = reduce_all()
        loss_fn(model, chunks[-1]).backward()
        parts["concurrent_micro_batch_s"].append(time.perf_counter() - started)
        for work in works:
            work.wait()
        parts["concurrent_s"].append(time.perf_counter() - started)
        parts["concurrent_cpu_s"].append(cpu_now() - cpu_at)
    dist.barrier()
    return {name: values[1:] for name, values in parts.items()} | {"buckets": len(buckets), "threads": thread_cpu()}


def thread_cpu(since: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """CPU seconds of each of this process's live threads (the main one first), so far or
    since the snapshot `since`."""
    before = {thread["tid"]: thread["cpu_s"] for thread in since or []}
    ticks = os.sysconf("SC_CLK_TCK")
    threads = []
    for task in sorted(Path("/proc/self/task").iterdir(), key=lambda p: int(p.name)):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        threads.append({"tid": int(task.name), "name": name, "cpu_s": round(cpu - before.get(int(task.name), 0.0), 3)})
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1024, help="dataset size")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-steps", type=int, default=0, help="interleaved: then run the probe this many steps")
    parser.add_argument("--ddp-bucket-view", action="store_true",
                        help="ddp: gradient_as_bucket_view=True (not plain DDP's default; for comparisons by hand)")
    parser.add_argument("--out", type=Path, required=True, help="this rank's JSON record")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "probe":
        dist.init_process_group("gloo")
        record = probe(args, args.steps)
        close_default_group()
    elif args.mode == "ddp":
        record = train_ddp(args)
    elif args.mode == "interleaved":
        record = interleaved(args)
    else:
        record = train_tidal(args, overlap=args.mode == "tidal-overlap")
    parameters = args.depth * (args.width + 1) * args.width + (args.width + 1) * OUTPUTS
    record |= {"mode": args.mode, "rank": int(os.environ.get("RANK", "0")), "parameters": parameters,
               "torch_threads": torch.get_num_threads()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
