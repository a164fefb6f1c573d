"""Streaming a shard's training state from live replicas to joiners, tensor by tensor.

Within one shard index (one process group over the replicas' workers that hold the same
shard), some ranks hold the state at the step the world resumes from (sources) and the
others receive it (receivers). The first source sends its manifest (a few KiB); each
receiver applies it, which allocates what it lacks and names the tensors to fill. The
tensors are then cut into items of at most `bucket_bytes`: a large tensor is sent in
slices straight from its memory and received straight into the receiver's own tensor; runs
of small tensors are packed into one staging buffer of at most one bucket on each side.
Item j comes from source j mod S, so with several sources the transfer is striped across
them. Nothing holds the whole state in a second copy: the memory a transfer adds is one
staging buffer on each side (none when every tensor is at least a bucket).

Gloo carries this on CPU; a NCCL group carries device tensors the same way (not exercised
in CI, which has no GPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch

from tidal.train.state import Counters, StateDoesNotFit, TrainingParts, apply_manifest, capture, local

DEFAULT_BUCKET_BYTES = 64 << 20
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


def plan_items(sizes: Sequence[int], bucket_bytes: int) -> list[Item]:
    """Cut tensors of `sizes` bytes (in order) into items of at most `bucket_bytes`: a tensor
    of a bucket or more alone, in bucket-sized slices; smaller ones packed together."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    items: list[Item] = []
    packed: list[Piece] = []
    packed_bytes = 0
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= bucket_bytes:
            if packed:
                items.append(Item(tuple(packed)))
                packed, packed_bytes = [], 0
            for start in range(0, size, bucket_bytes):
                items.append(Item((Piece(index, start, min(size, start + bucket_bytes)),)))
            continue
        if packed_bytes + size > bucket_bytes:
            items.append(Item(tuple(packed)))
            packed, packed_bytes = [], 0
        packed.append(Piece(index, 0, size))
        packed_bytes += size
    if packed:
        items.append(Item(tuple(packed)))
    return items


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
               receivers: Sequence[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferStats:
    """Run on every source: send this shard's state to every receiver (the share of items
    that falls to `me`, and the manifest if `me` is the first source)."""
    state = capture(parts, counters)
    tensors = state["tensors"]
    stats = TransferStats()
    # The group's tensors live where its backend wants them (NCCL: the GPU).
    device = tensors[0].device if tensors else torch.device("cpu")
    if me == sources[0]:
        encoded = _encode(state["manifest"])
        size = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
        payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
        works = []
        for receiver in receivers:
            works.append(group.send([size], receiver, MANIFEST_SIZE_TAG))
            works.append(group.send([payload], receiver, MANIFEST_TAG))
        for work in works:
            work.wait()
    staging: torch.Tensor | None = None
    for number, item in enumerate(plan_items(_sizes(tensors), bucket_bytes)):
        if sources[number % len(sources)] != me:
            continue
        if item.direct:
            piece = item.pieces[0]
            message = _flat_bytes(tensors[piece.tensor])[piece.start:piece.end]
        else:
            if staging is None:
                staging = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                stats.staging_bytes = bucket_bytes
            offset = 0
            for piece in item.pieces:
                length = piece.end - piece.start
                staging[offset:offset + length].copy_(_flat_bytes(tensors[piece.tensor])[piece.start:piece.end])
                offset += length
            message = staging[:offset]
        works = [group.send([message], receiver, ITEM_TAG + number) for receiver in receivers]
        for work in works:
            work.wait()
        stats.items += 1
        stats.bytes += item.nbytes * len(receivers)
    return stats


@torch.no_grad()
def receive_state(group: Any, parts: TrainingParts, counters: Counters, *, me: int, sources: Sequence[int],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferStats:
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
    staging: torch.Tensor | None = None
    for number, item in enumerate(plan_items(_sizes(destinations), bucket_bytes)):
        source = sources[number % len(sources)]
        if item.direct:
            piece = item.pieces[0]
            group.recv([_flat_bytes(destinations[piece.tensor])[piece.start:piece.end]], source,
                       ITEM_TAG + number).wait()
        else:
            if staging is None:
                staging = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                stats.staging_bytes = bucket_bytes
            message = staging[:item.nbytes]
            group.recv([message], source, ITEM_TAG + number).wait()
            offset = 0
            for piece in item.pieces:
                length = piece.end - piece.start
                _flat_bytes(destinations[piece.tensor])[piece.start:piece.end].copy_(message[offset:offset + length])
                offset += length
        stats.items += 1
        stats.bytes += item.nbytes
    return stats

