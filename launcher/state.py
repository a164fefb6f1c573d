"""A replica's training state: what a joiner receives from a live peer, what a fallback
checkpoint holds, and a digest that proves two replicas hold the same state.

The state is the model's parameters and buffers, the optimizer's state, the LR
scheduler's, the RNG states and the library's counters (step, position in the global
order, global batch). It travels as one `torch.save` buffer; the digest is SHA-256 over
the exact bytes of every tensor of model, optimizer and scheduler plus the counters, so
equal digests mean bit-identical replicas. RNG states are moved but not part of the
digest: survivors that drew different amounts of randomness are still in step."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import random
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass
class Counters:
    """The library's own position: completed steps, position of the next sample in the
    global order, and the global batch in force."""

    step: int = 0
    position: int = 0
    global_batch: int = 0
    # Samples trained on since the job began (every committed step's B).
    samples: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TrainingParts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None


def capture(parts: TrainingParts, counters: Counters) -> dict[str, Any]:
    """The state as a dict of tensors and plain values (references, not copies)."""
    state: dict[str, Any] = {
        "model": parts.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "counters": counters.as_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    if parts.scheduler is not None:
        state["scheduler"] = parts.scheduler.state_dict()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def detached_copy(value: Any) -> Any:
    """A deep copy of a captured state whose tensors no longer share memory with the live
    ones (a checkpoint written in the background must not see later steps)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {key: detached_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [detached_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(detached_copy(item) for item in value)
    return value


def restore(parts: TrainingParts, counters: Counters, state: Mapping[str, Any]) -> None:
    parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    if parts.scheduler is not None and "scheduler" in state:
        parts.scheduler.load_state_dict(state["scheduler"])
    loaded = state["counters"]
    counters.step = int(loaded["step"])
    counters.position = int(loaded["position"])
    counters.global_batch = int(loaded["global_batch"])
    # (Absent from checkpoints written before the count existed.)
    counters.samples = int(loaded.get("samples", counters.step * counters.global_batch))
    rng = state.get("rng", {})
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(_as_random_state(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _as_random_state(value: Any) -> tuple[Any, ...]:
    version, internal, gauss = value
    return version, tuple(internal), gauss


def serialize(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def validate(loaded: Any) -> dict[str, Any]:
    if not isinstance(loaded, dict) or "model" not in loaded or "optimizer" not in loaded or "counters" not in loaded:
        raise ValueError("not a Tidal training state")
    return loaded


def deserialize(data: bytes) -> dict[str, Any]:
    return validate(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""


def _feed(hasher: Any, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        hasher.update(f"{name}:tensor:{value.dtype}:{tuple(value.shape)}:".encode())
        hasher.update(_tensor_bytes(value))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            _feed(hasher, f"{name}/{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _feed(hasher, f"{name}[{index}]", item)
    else:
        hasher.update(f"{name}={value!r};".encode())


def digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over model, optimizer, scheduler and counters of a captured state."""
    hasher = hashlib.sha256()
    for part in ("model", "optimizer", "scheduler", "counters"):
        if part in state:
            _feed(hasher, part, state[part])
    return hasher.hexdigest()
