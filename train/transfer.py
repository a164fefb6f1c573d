"""Streaming a shard's training state from live replicas to joiners, tensor by tensor.

Within one shard index (one process group over the replicas' workers that hold the same
shard), some ranks hold the state at the step the world resumes from (sources) and the
others receive it (receivers). The first source sends its manifest (a few KiB); each
receiver applies it, which allocates what it lacks and names the tensors to fill. The
tensors then travel as items of at most `bucket_bytes`: every tensor of `direct_bytes`
(64 KiB) or more is sent straight from its memory and received straight into the
receiver's own tensor (one message per tensor, or per bucket-sized slice of a larger one);
only runs of smaller tensors are packed, into one staging buffer on each side, sized to
the largest such run (a bucket at most). Up to `window` messages are in flight at once, so
the link never waits for the next item. Item j comes from source j mod S: with several
sources the transfer is striped across them. Nothing holds the whole state in a second
copy: the memory a transfer adds is that one staging buffer on each side.

Gloo carries this on CPU; a NCCL group carries device tensors the same way, the device
synchronized before a source reads its tensors and after a receiver's last item landed
(`tidal.train.backend.synchronize`; not exercised in CI, which has no GPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch

from tidal.train.backend import synchronize
from tidal.train.state import Counters, StateDoesNotFit, TrainingParts, apply_manifest, capture, local

DEFAULT_BUCKET_BYTES = 64 << 20
# Tensors this size or larger travel as messages of their own, never through staging.
DIRECT_BYTES = 64 << 10
# Messages in flight per peer pair.
WINDOW = 8
# Tags of the manifest's two messages; items use tags from ITEM_TAG on.
MANIFEST_SIZE_TAG = 1
MANIFEST_TAG = 2
ITEM_TAG = 16


@dataclasses.dataclass(frozen=True)
class Piece:
    tensor: int
    # Byte range [start, end) of the tensor's flat bytes.
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Item:
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.end - p.start for p in self.pieces)

    @property
    def direct(self) -> bool:
        """One piece: sent from and received into the tensor's own memory."""
        return len(self.pieces) == 1


def plan_items(sizes: Sequence[int], bucket_bytes: int, direct_bytes: int = DIRECT_BYTES) -> list[Item]:
    """Cut tensors of `sizes` bytes (in order) into items of at most `bucket_bytes`: a tensor
    of `direct_bytes` or more alone (in bucket-sized slices when larger than a bucket),
    consecutive smaller ones packed together."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    items: list[Item] = []
    packed: list[Piece] = []
    packed_bytes = 0

    def flush() -> None:
        nonlocal packed, packed_bytes
        if packed:
            items.append(Item(tuple(packed)))
            packed, packed_bytes = [], 0

    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= min(direct_bytes, bucket_bytes):
            flush()
            for start in range(0, size, bucket_bytes):
                items.append(Item((Piece(index, start, min(size, start + bucket_bytes)),)))
            continue
        if packed_bytes + size > bucket_bytes:
            flush()
        packed.append(Piece(index, 0, size))
        packed_bytes += size
    flush()
    return items


class _InFlight:
    """At most `window` messages outstanding; each one's follow-up (unpacking a received
    staging buffer) runs once it completed, in order."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self._pending: list[tuple[Any, Any]] = []

    def add(self, work: Any, then: Any = None) -> None:
        self._pending.append((work, then))
        while len(self._pending) > self.window:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        work, then = self._pending.pop(0)
        work.wait()
        if then is not None:
            then()

    def drain(self) -> None:
        while self._pending:
            self._complete_oldest()


def _staging(current: torch.Tensor | None, items: Sequence[Item], stats: TransferStats, device: torch.device,
             in_flight: _InFlight) -> torch.Tensor:
    """The one staging buffer, made at its first use (sized to the largest packed item), or
    free again once every message in flight completed."""
    if current is not None:
        in_flight.drain()
        return current
    stats.staging_bytes = max((item.nbytes for item in items if not item.direct), default=0)
    return torch.empty(stats.staging_bytes, dtype=torch.uint8, device=device)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (it must be contiguous: local shards, optimizer
    state and parameters are)."""
    if not tensor.is_contiguous():
        raise ValueError("a state tensor is not contiguous; it cannot be streamed in place")
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8)


def _sizes(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def _encode(manifest: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(manifest, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> dict[str, Any]:
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many kinds on garbage
        raise StateDoesNotFit(f"the state manifest a peer sent cannot be read: {error}") from error
    if not isinstance(loaded, dict):
        raise StateDoesNotFit("the state manifest a peer sent is not a manifest")
    return loaded


@dataclasses.dataclass
class TransferStats:
    bytes: int = 0
    items: int = 0
    staging_bytes: int = 0


def send_state(group: Any, parts: TrainingParts, counters: Counters, *, me: int, sources: Sequence[int],
               receivers: Sequence[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               window: int = WINDOW) -> TransferStats:
    """Run on every source: send this shard's state to every receiver (the share of items
    that falls to `me`, and the manifest if `me` is the first source)."""
    state = capture(parts, counters)
    tensors = state["tensors"]
    stats = TransferStats()
    # The group's tensors live where its backend wants them (NCCL: the GPU).
    device = tensors[0].device if tensors else torch.device("cpu")
    # Sent from their own memory: nothing queued on any stream may still write them.
    synchronize(device)
    in_flight = _InFlight(window * len(receivers))
    if me == sources[0]:
        encoded = _encode(state["manifest"])
        size = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
        payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
        for receiver in receivers:
            in_flight.add(group.send([size], receiver, MANIFEST_SIZE_TAG))
            in_flight.add(group.send([payload], receiver, MANIFEST_TAG))
    items = plan_items(_sizes(tensors), bucket_bytes)
    staging: torch.Tensor | None = None
    for number, item in enumerate(items):
        if sources[number % len(sources)] != me:
            continue
        if item.direct:
            piece = item.pieces[0]
            message = _flat_bytes(tensors[piece.tensor])[piece.start:piece.end]
        else:
            # Refilled only once its last sends completed.
            staging = _staging(staging, items, stats, device, in_flight)
            offset = 0
            for piece in item.pieces:
                length = piece.end - piece.start
                staging[offset:offset + length].copy_(_flat_bytes(tensors[piece.tensor])[piece.start:piece.end])
                offset += length
            message = staging[:offset]
        for receiver in receivers:
            in_flight.add(group.send([message], receiver, ITEM_TAG + number))
        stats.items += 1
        stats.bytes += item.nbytes * len(receivers)
    in_flight.drain()
    return stats


@torch.no_grad()
def receive_state(group: Any, parts: TrainingParts, counters: Counters, *, me: int, sources: Sequence[int],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, window: int = WINDOW) -> TransferStats:
    """Run on every receiver: take the manifest from the first source, apply it, and receive
    every tensor into place (each item from the source it is striped to)."""
    del me
    # The model's device (NCCL groups carry device tensors); the manifest is read on the host.
    device = next((local(p).device for p in parts.model.parameters()), torch.device("cpu"))
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv([size], sources[0], MANIFEST_SIZE_TAG).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv([payload], sources[0], MANIFEST_TAG).wait()
    payload = payload.cpu()
    manifest = _decode(ctypes.string_at(payload.data_ptr(), payload.numel()))
    destinations = apply_manifest(parts, counters, manifest)
    stats = TransferStats()
    items = plan_items(_sizes(destinations), bucket_bytes)
    in_flight = _InFlight(window)
    staging: torch.Tensor | None = None
    for number, item in enumerate(items):
        source = sources[number % len(sources)]
        if item.direct:
            piece = item.pieces[0]
            in_flight.add(group.recv([_flat_bytes(destinations[piece.tensor])[piece.start:piece.end]], source,
                                     ITEM_TAG + number))
        else:
            # The previous packed item is unpacked before the buffer takes the next.
            staging = _staging(staging, items, stats, device, in_flight)
            message = staging[:item.nbytes]
            in_flight.add(group.recv([message], source, ITEM_TAG + number),
                          then=_unpacker(item, message, destinations))
        stats.items += 1
        stats.bytes += item.nbytes
    in_flight.drain()
    # Every item landed (and was unpacked) before anything reads the state.
    synchronize(device)
    return stats


def _unpacker(item: Item, message: torch.Tensor, destinations: Sequence[torch.Tensor]) -> Any:
    def unpack() -> None:
        offset = 0
        for piece in item.pieces:
            length = piece.end - piece.start
            _flat_bytes(destinations[piece.tensor])[piece.start:piece.end].copy_(message[offset:offset + length])
            offset += length
    return unpack
