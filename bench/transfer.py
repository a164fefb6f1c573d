"""State transfer: how fast a joiner receives a replica's training state (model parameters and
AdamW's moments, 1 GiB and 4 GiB of float32) from a live source over gloo on loopback with
the worker library's streamed per-shard transfer (`tidal.train.transfer`: a manifest, then
every tensor of 64 KiB or more as messages of its own, slices of at most one 64 MiB bucket
sent straight from and into the live tensors, the smaller ones packed; 8 messages in flight),
and how much memory it adds on each side. Goals: at least 0.8 of the throughput of a plain
gloo broadcast of one flat uint8 tensor of the same size (what the wire gives), and peak RSS
growth of at most one bucket + 10 % (70.4 MiB) on the source and on the joiner.

Method: two processes (a source, rank 0, and a receiver, rank 1; OMP_NUM_THREADS=1,
GLOO_SOCKET_IFNAME=lo) meet at a TCPStore on 127.0.0.1 and form a raw
`ProcessGroupGloo`, as the worker library does. Each builds the same model (an embedding
of about 150 MB, then blocks of Linear(1024, 4096), Linear(4096, 1024) and LayerNorm: tensors
from 4 bytes to over two buckets, so both the direct path and the packed path of the
transfer are taken) with different values; the source takes one AdamW step (its state is
parameters + exp_avg + exp_avg_sq, 3× the parameters, sized to the target). A first,
untimed transfer makes the receiver a joiner whose AdamW has no state (its memory growth is
reported in the note). The joiner's optimizer state then exists, so the measured
repetitions show what the transfer itself adds, not the state a joiner must allocate anyway.
Each repetition runs three methods, in an order that rotates between repetitions:

- **Tidal**: `send_state` / `receive_state` with the default bucket; the receiver's tensors
  are overwritten with other values first, and after each transfer the two sides' SHA-256
  digests of the captured state must be equal (not timed);
- **flat broadcast** (the reference): one `broadcast` of a flat uint8 tensor of the same
  number of bytes, preallocated and touched on both sides before the clock starts;
- **whole-blob torch.save** (the path the streamed transfer replaced, as the library's
  `_broadcast_state` did it): `serialize(capture(...))` into one bytes buffer, broadcast of
  its length and of `torch.frombuffer(bytearray(payload))`, then `deserialize` of the
  received buffer's bytes and `restore` on the receiver; digests checked as for Tidal. (The
  old code took those bytes with `ctypes.string_at`, whose C int size truncated states over
  2 GiB: it could not move the 4 GiB state at all. The benchmark takes them with a copy of
  the same cost that has no such limit, to measure what the old design costs.)

A barrier (a one-element all-reduce) starts every timed section; the time is the
receiver's, from the start of its call until the state is in place; GB/s is the state's
tensor bytes (10^9 bytes) over it. Peak RSS growth is measured in each process: VmHWM is
reset (writing 5 to /proc/self/clear_refs) right before the barrier and read after the call;
growth = VmHWM after − VmRSS before (freed heap memory is trimmed first, so what one method
freed cannot hide the next one's growth). The whole-blob path adds about 3× the state at its
peak, so it runs only while that much + 1 GiB is free, and at 4 GiB in the first repetition
only. `--quick` moves a ~32 MiB state twice."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import REPO, Row, median, parser, workspace, write_result
from tidal.train.state import Counters, TrainingParts, capture, deserialize, digest, restore, serialize, state_bytes
from tidal.train.transfer import DEFAULT_BUCKET_BYTES, plan_items, receive_state, send_state

NAME = "transfer"
GIB = 1 << 30
MIB = 1 << 20
BUCKET = DEFAULT_BUCKET_BYTES
RSS_GOAL_BYTES = BUCKET * 1.1
THROUGHPUT_GOAL = 0.8
METHODS = ("tidal", "flat", "blob")
SOURCE, RECEIVER = 0, 1
TIMEOUT = datetime.timedelta(minutes=10)
# What the whole-blob path adds at its peak to the two processes' own states, in units of the
# state's size (measured at 1 GiB: the source grows 2× (the torch.save buffer and its bytes,
# then the bytes and the bytearray copy), the receiver 3× (the received buffer, its bytes and
# the loaded tensors), not both at once). It runs only while this much and a margin are free.
BLOB_EXTRA_STATES = 3.0
BLOB_MARGIN_BYTES = GIB
# Above this state size the whole-blob path runs in the first repetition only: at 4 GiB its
# peak leaves this shared machine about 1.5 GiB, and its figures vary little.
BLOB_ONCE_ABOVE_BYTES = 2 * GIB


# The model -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    width: int
    vocab: int
    blocks: int

    @property
    def parameters(self) -> int:
        block = 8 * self.width * self.width + 4 * self.width + self.width + 2 * self.width
        return self.vocab * self.width + self.blocks * block


def shape_for(target_bytes: int, width: int) -> Shape:
    """A model whose AdamW state (parameters, exp_avg, exp_avg_sq: 12 bytes a parameter) is
    about `target_bytes`: as many blocks as fit beside an embedding of at least 32 × width
    rows, then the embedding grown to fill the rest."""
    wanted = target_bytes // 12
    block = Shape(width, 0, 1).parameters
    blocks = max(1, (wanted - 32 * width * width) // block)
    vocab = max(1, (wanted - blocks * block) // width)
    return Shape(width, vocab, blocks)


def build_parts(shape: Shape, seed: int) -> TrainingParts:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Embedding(shape.vocab, shape.width)]
    for _ in range(shape.blocks):
        layers += [torch.nn.Linear(shape.width, 4 * shape.width), torch.nn.Linear(4 * shape.width, shape.width),
                   torch.nn.LayerNorm(shape.width)]
    model = torch.nn.Sequential(*layers)
    return TrainingParts(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def take_a_step(parts: TrainingParts) -> None:
    """One AdamW step on random gradients: the optimizer's state exists and is not constant."""
    for parameter in parts.model.parameters():
        parameter.grad = torch.randn_like(parameter)
    parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def overwrite(parts: TrainingParts, counters: Counters, value: float) -> None:
    """Make the receiver's state other than the source's, so a transfer that moved nothing
    cannot pass the digest check."""
    for tensor in capture(parts, counters)["tensors"]:
        tensor.fill_(value)
    counters.step = counters.position = counters.global_batch = counters.samples = -1


# Measurements in the worker ---------------------------------------------------------------


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _release_freed_memory() -> None:
    """Give back to the kernel what the allocator keeps of freed memory (what an earlier method
    freed would otherwise hide the next one's growth)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakRss:
    """Peak resident memory growth of this process over a `with` block: VmHWM after reset
    (clear_refs 5), or, where the kernel refuses the reset, a thread sampling VmRSS."""

    def __init__(self) -> None:
        self.growth_bytes = 0
        self._before_kib = 0
        self._peak_kib = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._reset = False

    def __enter__(self) -> PeakRss:
        _release_freed_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        self._before_kib = _status_kib("VmRSS")
        self._peak_kib = self._before_kib
        if not self._reset:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak_kib = max(self._peak_kib, _status_kib("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        peak = _status_kib("VmHWM") if self._reset else self._peak_kib
        self.growth_bytes = max(0, peak - self._before_kib) * 1024


def buffer_bytes(buffer: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, in one copy: what the old path's `ctypes.string_at(ptr, n)` did,
    without its limit. string_at takes the size as a C int, so above 2 GiB the old path handed
    torch.load a truncated (or, between 2 and 4 GiB, NUL-terminated) state and failed; this
    benchmark found that at 4 GiB. The copy costs the same."""
    return bytes((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr()))


def barrier(group: Any) -> None:
    group.allreduce([torch.zeros(1)]).wait()


def broadcast(group: Any, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


@dataclasses.dataclass
class Sample:
    method: str
    repetition: int
    seconds: float
    growth_bytes: int


class Worker:
    def __init__(self, rank: int, store: Any, group: Any, parts: TrainingParts, counters: Counters) -> None:
        self.rank = rank
        self.store = store
        self.group = group
        self.parts = parts
        self.counters = counters

    @property
    def source(self) -> bool:
        return self.rank == SOURCE

    def timed(self, method: str, repetition: int, body: Callable[[], None]) -> Sample:
        barrier(self.group)
        with PeakRss() as peak:
            barrier(self.group)
            start = time.perf_counter()
            body()
            seconds = time.perf_counter() - start
        return Sample(method, repetition, seconds, peak.growth_bytes)

    def check_digests(self, label: str) -> None:
        """Both sides' digests of the captured state must be equal (the source posts its own)."""
        mine = digest(capture(self.parts, self.counters))
        key = f"digest/{label}"
        if self.source:
            self.store.set(key, mine)
        else:
            theirs = self.store.get(key).decode()
            assert mine == theirs, f"{label}: the receiver's state digest {mine} is not the source's {theirs}"
        barrier(self.group)

    def stream(self) -> None:
        """Tidal's transfer, one side of it."""
        if self.source:
            send_state(self.group, self.parts, self.counters, me=SOURCE, sources=[SOURCE], receivers=[RECEIVER],
                       bucket_bytes=BUCKET)
        else:
            receive_state(self.group, self.parts, self.counters, me=RECEIVER, sources=[SOURCE], bucket_bytes=BUCKET)

    def tidal(self, repetition: int) -> Sample:
        if not self.source:
            overwrite(self.parts, self.counters, float(repetition + 2))
        sample = self.timed("tidal", repetition, self.stream)
        self.check_digests(f"tidal/{repetition}")
        return sample

    def flat(self, repetition: int, total: int) -> Sample:
        value = 1 + repetition % 250
        flat = torch.full((total,), value if self.source else 0, dtype=torch.uint8)
        sample = self.timed("flat", repetition, lambda: broadcast(self.group, flat, SOURCE))
        if not self.source:
            assert int(flat.min()) == int(flat.max()) == value, "the flat broadcast did not arrive"
        return sample

    def blob_fits(self, repetition: int, total: int) -> bool:
        """Whether the machine has room for the whole-blob path now (the source decides)."""
        _release_freed_memory()
        barrier(self.group)  # both sides have freed what the method before this one held
        key = f"blob-fits/{repetition}"
        if self.source:
            fits = mem_available_bytes() >= BLOB_EXTRA_STATES * total + BLOB_MARGIN_BYTES
            self.store.set(key, "1" if fits else "0")
        return bool(self.store.get(key) == b"1")

    def blob(self, repetition: int) -> Sample:
        """The old path, as `_broadcast_state` in tidal.launcher.elastic did it."""
        if not self.source:
            overwrite(self.parts, self.counters, float(repetition + 2))

        def body() -> None:
            if self.source:
                payload = serialize(capture(self.parts, self.counters))
                size = torch.tensor([len(payload)], dtype=torch.int64)
            else:
                payload = b""
                size = torch.zeros(1, dtype=torch.int64)
            broadcast(self.group, size, SOURCE)
            buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.source
                      else torch.empty(int(size.item()), dtype=torch.uint8))
            broadcast(self.group, buffer, SOURCE)
            if not self.source:
                restore(self.parts, self.counters, deserialize(buffer_bytes(buffer)))

        sample = self.timed("blob", repetition, body)
        self.check_digests(f"blob/{repetition}")
        return sample


def worker(arguments: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    # If the machine runs out of memory, these processes are the ones to go (the machine is shared).
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")
    rank: int = arguments.worker
    shape = Shape(arguments.width, arguments.vocab, arguments.blocks)
    store = dist.TCPStore("127.0.0.1", arguments.port, 3, False, TIMEOUT)
    parts = build_parts(shape, seed=1 + rank)
    counters = Counters()
    if rank == SOURCE:
        take_a_step(parts)
        counters = Counters(step=1, position=64, global_batch=64, samples=64)
    group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, TIMEOUT)
    w = Worker(rank, store, group, parts, counters)
    report: dict[str, Any] = {"rank": rank, "samples": []}
    if rank == SOURCE:
        state = capture(parts, counters)
        report["state_bytes"] = state_bytes(state)
        report["tensors"] = len(state["tensors"])
        sizes = [t.numel() * t.element_size() for t in state["tensors"]]
        items = plan_items(sizes, BUCKET)
        report["items"] = len(items)
        report["direct_bytes"] = sum(i.nbytes for i in items if i.direct)
        del state
        store.set("total", str(report["state_bytes"]))
    total = int(store.get("total").decode())
    # The first transfer: the receiver is a joiner whose AdamW has no state; it allocates it
    # from the manifest. Untimed; its memory growth beyond the optimizer state is noted.
    before = state_bytes(capture(parts, counters))
    cold = w.timed("cold", -1, w.stream)
    w.check_digests("cold")
    report["cold"] = dataclasses.asdict(cold)
    report["cold_allocated_bytes"] = state_bytes(capture(parts, counters)) - before
    methods = list(arguments.methods.split(","))
    for repetition in range(arguments.repeat):
        shift = repetition % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method == "tidal":
                sample = w.tidal(repetition)
            elif method == "flat":
                sample = w.flat(repetition, total)
            elif total > BLOB_ONCE_ABOVE_BYTES and repetition > 0:
                continue
            elif w.blob_fits(repetition, total):
                sample = w.blob(repetition)
            else:
                report["blob_skipped"] = report.get("blob_skipped", 0) + 1
                if rank == RECEIVER:
                    print(f"{NAME}: {arguments.label} repetition {repetition + 1} blob: skipped, too little memory "
                          f"free", flush=True)
                continue
            gc.collect()
            report["samples"].append(dataclasses.asdict(sample))
            if rank == RECEIVER:
                print(f"{NAME}: {arguments.label} repetition {repetition + 1} {method}: {sample.seconds:.3f} s, "
                      f"{total / sample.seconds / 1e9:.2f} GB/s, receiver RSS +{sample.growth_bytes / MIB:.1f} MiB",
                      flush=True)
    Path(arguments.out).write_text(json.dumps(report) + "\n")
    barrier(group)


# The run ---------------------------------------------------------------------------------


@dataclasses.dataclass
class SizeResult:
    label: str
    shape: Shape
    source: dict[str, Any]
    receiver: dict[str, Any]
    methods: list[str]
    skipped: str = ""

    @property
    def total(self) -> int:
        return int(self.source["state_bytes"])

    def seconds(self, method: str) -> list[float]:
        return [s["seconds"] for s in self.receiver["samples"] if s["method"] == method]

    def gbps(self, method: str) -> list[float]:
        return [self.total / s / 1e9 for s in self.seconds(method)]

    def growth_mib(self, method: str, side: str) -> list[float]:
        report = self.source if side == "source" else self.receiver
        return [s["growth_bytes"] / MIB for s in report["samples"] if s["method"] == method]


@contextlib.contextmanager
def processes(commands: list[list[str]], env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [subprocess.Popen(command, cwd=REPO, env=env) for command in commands]
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


def run_size(folder: Path, label: str, target: int, width: int, repeat: int) -> SizeResult:
    shape = shape_for(target, width)
    methods = list(METHODS)
    print(f"{NAME}: {label}: {shape.parameters / 1e6:.1f} M parameters (vocab {shape.vocab}, {shape.blocks} blocks "
          f"of width {shape.width}), {repeat} repetitions of {', '.join(methods)}", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    outputs = [folder / f"{label.replace(' ', '')}-rank{rank}.json" for rank in (SOURCE, RECEIVER)]
    commands = [[sys.executable, "-m", f"bench.{NAME}", "--worker", str(rank), "--port", str(store.port),
                 "--width", str(shape.width), "--vocab", str(shape.vocab), "--blocks", str(shape.blocks),
                 "--repeat", str(repeat), "--methods", ",".join(methods), "--label", label,
                 "--out", str(outputs[rank])] for rank in (SOURCE, RECEIVER)]
    with processes(commands, env) as started:
        deadline = time.monotonic() + 3600
        while any(p.poll() is None for p in started):
            failed = [p for p in started if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a {label} worker exited with {failed[0].returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {label} workers did not finish within an hour")
            time.sleep(0.2)
        codes = [p.returncode for p in started]
        if codes != [0, 0]:
            raise RuntimeError(f"the {label} workers exited with {codes}")
    source, receiver = (json.loads(path.read_text()) for path in outputs)
    skipped = receiver.get("blob_skipped", 0)
    reasons = []
    if target > BLOB_ONCE_ABOVE_BYTES and repeat > 1:
        reasons.append(f"whole-blob path run in the first repetition only at {label} (its memory peak)")
    if skipped:
        reasons.append(f"whole-blob path skipped in {skipped} of {repeat} repetitions at {label}: fewer than "
                       f"{BLOB_EXTRA_STATES:g}× the state + {BLOB_MARGIN_BYTES / GIB:g} GiB free")
    reason = "; ".join(reasons)
    return SizeResult(label, shape, source, receiver, methods, reason)


def rows_for(result: SizeResult) -> list[Row]:
    label = result.label
    tidal, flat, blob = result.gbps("tidal"), result.gbps("flat"), result.gbps("blob")
    pairs = [t / f for t, f in zip(tidal, flat, strict=True)]
    ratio = median(pairs)
    cold = result.receiver["cold"]
    cold_beyond = (cold["growth_bytes"] - result.receiver["cold_allocated_bytes"]) / MIB
    where = (f"state {result.total / GIB:.3f} GiB in {result.source['tensors']} tensors "
             f"({result.shape.parameters / 1e6:.1f} M parameters + AdamW moments), {result.source['items']} items of "
             f"≤ 64 MiB, {result.source['direct_bytes'] / result.total:.0%} of the bytes sent straight from the "
             f"tensors, the rest packed through the staging buffer")
    blob_text = "; ".join(part for part in (f"whole-blob torch.save path median {median(blob):.3g} GB/s" if blob
                                            else "", result.skipped) if part)
    rows = [Row(benchmark=NAME, metric=f"state transfer {label}: GB/s", unit="GB/s", tidal=median(tidal),
                goal=f"≥ {THROUGHPUT_GOAL:g} of the flat broadcast", met=ratio >= THROUGHPUT_GOAL,
                baseline=median(flat), baseline_name="gloo broadcast of one flat uint8 tensor",
                tidal_samples=tidal, baseline_samples=flat, ratio=ratio,
                ratio_meaning="Tidal / flat broadcast GB/s (median of per-repetition pairs)",
                note=f"{where}; receiver's time, digests equal after every transfer; {blob_text}")]
    if blob:
        rows.append(Row(benchmark=NAME, metric=f"state transfer {label}: GB/s vs the old whole-blob path",
                        unit="GB/s", tidal=median(tidal), goal="faster than the whole-blob path",
                        met=median(tidal) > median(blob), baseline=median(blob),
                        baseline_name="whole-blob torch.save (serialize, broadcast, deserialize, restore)",
                        tidal_samples=tidal, baseline_samples=blob, ratio=median(tidal) / median(blob),
                        ratio_meaning="Tidal / whole-blob GB/s: Tidal is N× faster",
                        note="; ".join(part for part in (
                            "the path the streamed transfer replaced, timed the same way (serialization included)",
                            result.skipped) if part)))
    for side, who in (("source", "source"), ("receiver", "joiner")):
        growth = result.growth_mib("tidal", side)
        old = result.growth_mib("blob", side)
        flat_growth = result.growth_mib("flat", side)
        note = (f"VmHWM − VmRSS before, in the process; met when every repetition is within; "
                f"flat broadcast adds {median(flat_growth):.1f} MiB")
        if side == "receiver":
            note = (f"the joiner's AdamW state already allocated (an untimed first transfer into a fresh AdamW "
                    f"allocated {result.receiver['cold_allocated_bytes'] / MIB:.0f} MiB of optimizer state and grew "
                    f"{cold['growth_bytes'] / MIB:.0f} MiB: {cold_beyond:+.1f} MiB beyond that state, in "
                    f"{cold['seconds']:.2f} s); " + note)
        rows.append(Row(benchmark=NAME, metric=f"peak RSS growth, {who}, {label}", unit="MiB", tidal=median(growth),
                        goal=f"≤ {RSS_GOAL_BYTES / MIB:.1f} MiB (one 64 MiB bucket + 10 %)",
                        met=max(growth) <= RSS_GOAL_BYTES / MIB,
                        baseline=median(old) if old else None,
                        baseline_name="whole-blob torch.save (old path)" if old else "",
                        tidal_samples=growth, baseline_samples=old,
                        ratio=median(old) / max(median(growth), 1e-9) if old else None,
                        ratio_meaning="whole-blob / Tidal growth" if old else "",
                        note=f"{note}; {result.skipped}" if result.skipped else note))
    return rows


def main() -> None:
    command = parser(__doc__.split("\n\n")[0])
    hidden = argparse.SUPPRESS
    command.add_argument("--worker", type=int, default=None, help=hidden)
    command.add_argument("--port", type=int, default=0, help=hidden)
    command.add_argument("--width", type=int, default=0, help=hidden)
    command.add_argument("--vocab", type=int, default=0, help=hidden)
    command.add_argument("--blocks", type=int, default=0, help=hidden)
    command.add_argument("--methods", default=",".join(METHODS), help=hidden)
    command.add_argument("--label", default="", help=hidden)
    command.add_argument("--out", default="", help=hidden)
    args = command.parse_args()
    if args.worker is not None:
        worker(args)
        return
    if args.quick:
        sizes = [("32 MiB", 32 * MIB, 256, args.repeat or 2)]
    else:
        sizes = [("1 GiB", GIB, 1024, args.repeat or 5), ("4 GiB", 4 * GIB, 1024, args.repeat or 3)]
    rows: list[Row] = []
    settings: dict[str, Any] = {"bucket_bytes": BUCKET, "backend": "gloo, 2 processes on 127.0.0.1",
                                "omp_num_threads": 1, "optimizer": "AdamW", "sizes": {}}
    with workspace(args.keep, NAME) as folder:
        for label, target, width, repeat in sizes:
            # One size's processes at a time: they have exited (and freed everything) before the next.
            result = run_size(folder, label, target, width, repeat)
            rows += rows_for(result)
            settings["sizes"][label] = {"state_bytes": result.total, "repeat": repeat, "methods": result.methods,
                                        **dataclasses.asdict(result.shape), "items": result.source["items"]}
            del result
            gc.collect()
    write_result(NAME, rows, quick=args.quick, settings=settings)


if __name__ == "__main__":
    main()
