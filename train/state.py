"""A replica's training state, one shard at a time: what a joiner receives from a live peer,
what a fallback checkpoint holds, and a digest that proves two shards are bit-identical.

A worker's state is its *local* tensors (parameters and persistent buffers, the optimizer's
tensors; under FSDP2 each DTensor's local shard) plus a small **manifest** of plain values:
the library's counters, the optimizer's hyperparameters and non-tensor state, the LR
scheduler's state, the RNG states, and the name, shape and dtype of every tensor. A captured
state is `{"manifest": ..., "tensors": [...]}` whose tensors are the live ones (views, no
copy). A peer that has the manifest can allocate what it lacks (a joiner's optimizer holds no
state before its first step) and receive every tensor straight into place (`transfer`).

The digest is SHA-256 over the manifest (RNG states left out: survivors that drew
different amounts of randomness are still in step) and the exact bytes of every tensor,
read in place through the buffer protocol, a bounded chunk at a time for GPU tensors: no
copy of the model is made to compute it. Equal digests mean bit-identical shards."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tidal.train.backend import synchronize_tensors

# Digests of device tensors are computed through a host buffer of at most this size.
DIGEST_CHUNK_BYTES = 16 << 20
FORMAT = "tidal-local-state-1"


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


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds: a DTensor's local shard (a view of its
    storage), a plain tensor itself. Detached: writing into it writes the live tensor."""
    to_local = getattr(tensor, "to_local", None)
    value = to_local() if to_local is not None else tensor
    return value.detach()


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, local(value)) for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)]


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def _fits(tensor: torch.Tensor, description: Mapping[str, Any]) -> bool:
    return _describe(tensor) == {"shape": description["shape"], "dtype": description["dtype"]}


def capture(parts: TrainingParts, counters: Counters) -> dict[str, Any]:
    """This worker's state: the manifest and its live local tensors (references, not copies)."""
    tensors: list[torch.Tensor] = []
    described: list[dict[str, Any]] = []
    for name, tensor in _model_tensors(parts.model):
        tensors.append(tensor)
        described.append({"name": f"model/{name}", **_describe(tensor)})
    optimizer_state: list[dict[str, Any]] = []
    for index, parameter in enumerate(optimizer_parameters(parts.optimizer)):
        for key, value in sorted(parts.optimizer.state.get(parameter, {}).items(), key=lambda item: str(item[0])):
            if isinstance(value, torch.Tensor):
                value_local = local(value)
                tensors.append(value_local)
                described.append({"name": f"optimizer/{index}/{key}", **_describe(value_local)})
                # Shaped like its parameter (Adam's moments): allocated with empty_like(parameter),
                # so a DTensor parameter's state is a DTensor again.
                optimizer_state.append({"param": index, "key": key, "tensor": True,
                                        "like_param": tuple(value.shape) == tuple(parameter.shape)
                                        and type(value) is type(parameter)})
            else:
                optimizer_state.append({"param": index, "key": key, "tensor": False, "value": value})
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "counters": counters.as_dict(),
        "tensors": described,
        "optimizer_groups": [{k: v for k, v in group.items() if k != "params"}
                             for group in parts.optimizer.param_groups],
        "optimizer_state": optimizer_state,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    if parts.scheduler is not None:
        manifest["scheduler"] = parts.scheduler.state_dict()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        manifest["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return {"manifest": manifest, "tensors": tensors}


class StateDoesNotFit(ValueError):
    """A state's manifest does not describe this model and optimizer (another script, another
    shard layout): nothing of it is applied."""


def apply_manifest(parts: TrainingParts, counters: Counters, manifest: Mapping[str, Any]) -> list[torch.Tensor]:
    """Make this worker's optimizer, scheduler, counters and RNG what `manifest` says, and
    return the local tensors the manifest's tensors go into, in its order (allocating the
    optimizer state this worker lacks). Their contents are the caller's to fill."""
    if manifest.get("format") != FORMAT:
        raise StateDoesNotFit(f"not a Tidal state manifest (format {manifest.get('format')!r})")
    model_tensors = _model_tensors(parts.model)
    parameters = optimizer_parameters(parts.optimizer)
    described = list(manifest["tensors"])
    groups = list(manifest["optimizer_groups"])
    if len(groups) != len(parts.optimizer.param_groups):
        raise StateDoesNotFit(f"the state has {len(groups)} optimizer parameter groups, this optimizer "
                              f"{len(parts.optimizer.param_groups)}")
    destinations: list[torch.Tensor] = [tensor for _, tensor in model_tensors]
    expected_names = [f"model/{name}" for name, _ in model_tensors]
    new_state: dict[torch.Tensor, dict[Any, Any]] = {}
    for entry in manifest["optimizer_state"]:
        index = int(entry["param"])
        if not 0 <= index < len(parameters):
            raise StateDoesNotFit(f"optimizer state for parameter {index}; this optimizer has {len(parameters)}")
        parameter = parameters[index]
        slot = new_state.setdefault(parameter, {})
        if not entry["tensor"]:
            slot[entry["key"]] = entry["value"]
            continue
        description = described[len(destinations)]
        current = parts.optimizer.state.get(parameter, {}).get(entry["key"])
        if isinstance(current, torch.Tensor) and _fits(local(current), description):
            value = current
        elif entry["like_param"]:
            value = torch.empty_like(parameter.detach(), dtype=getattr(torch, description["dtype"]))
        else:
            value = torch.empty(description["shape"], dtype=getattr(torch, description["dtype"]),
                                device=local(parameter).device if description["shape"] else "cpu")
        slot[entry["key"]] = value
        destinations.append(local(value))
        expected_names.append(f"optimizer/{index}/{entry['key']}")
    names = [d["name"] for d in described]
    if names != expected_names:
        raise StateDoesNotFit("the state's tensors do not match this model and optimizer: "
                              + _first_difference(names, expected_names))
    for description, tensor in zip(described, destinations, strict=True):
        if not _fits(tensor, description):
            raise StateDoesNotFit(f"{description['name']}: the state's is {description['dtype']}"
                                  f"{description['shape']}, this worker's {tensor.dtype}{list(tensor.shape)}")
    # Everything fits: apply.
    parts.optimizer.state.clear()
    for parameter, slot in new_state.items():
        parts.optimizer.state[parameter] = slot
    for group, loaded in zip(parts.optimizer.param_groups, groups, strict=True):
        group.update(loaded)
    if parts.scheduler is not None and "scheduler" in manifest:
        parts.scheduler.load_state_dict(manifest["scheduler"])
    apply_counters(counters, manifest["counters"])
    apply_rng(manifest.get("rng", {}))
    return destinations


def apply_counters(counters: Counters, loaded: Mapping[str, Any]) -> None:
    counters.step = int(loaded["step"])
    counters.position = int(loaded["position"])
    counters.global_batch = int(loaded["global_batch"])
    # (Absent from checkpoints written before the count existed.)
    counters.samples = int(loaded.get("samples", counters.step * counters.global_batch))


def apply_rng(rng: Mapping[str, Any]) -> None:
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _first_difference(got: list[str], expected: list[str]) -> str:
    for index, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"tensor {index} is {a} in the state, {b} here"
    return f"the state has {len(got)} tensors, this worker {len(expected)}"


@torch.no_grad()
def restore(parts: TrainingParts, counters: Counters, state: Mapping[str, Any]) -> None:
    """Load a captured (or checkpointed) state into this worker, tensor by tensor in place."""
    if _is_legacy(state):
        _restore_legacy(parts, counters, state)
        return
    destinations = apply_manifest(parts, counters, state["manifest"])
    sources = state["tensors"]
    if len(sources) != len(destinations):
        raise StateDoesNotFit(f"the state holds {len(sources)} tensors, its manifest names {len(destinations)}")
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source)


def detached_copy(value: Any, copy: bool = True) -> Any:
    """A deep copy of a captured state whose tensors no longer share memory with the live
    ones (a checkpoint written in the background must not see later steps). `copy=False`:
    the same structure with its tensors on the CPU, a CPU tensor itself (for a state
    written at once, that no step changes meanwhile)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, Mapping):
        return {key: detached_copy(item, copy) for key, item in value.items()}
    if isinstance(value, list):
        return [detached_copy(item, copy) for item in value]
    if isinstance(value, tuple):
        return tuple(detached_copy(item, copy) for item in value)
    return value


def serialize(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def _is_legacy(state: Mapping[str, Any]) -> bool:
    """A whole-replica state as versions before tidal.train wrote it (fallback checkpoints of
    jobs that ran then): {"model": state_dict, "optimizer": state_dict, "counters", "rng"}."""
    return "manifest" not in state and all(key in state for key in ("model", "optimizer", "counters"))


def _restore_legacy(parts: TrainingParts, counters: Counters, state: Mapping[str, Any]) -> None:
    parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    if parts.scheduler is not None and "scheduler" in state:
        parts.scheduler.load_state_dict(state["scheduler"])
    apply_counters(counters, state["counters"])
    apply_rng(state.get("rng", {}))


def validate(loaded: Any) -> dict[str, Any]:
    if isinstance(loaded, dict) and _is_legacy(loaded):
        return loaded
    if (not isinstance(loaded, dict) or not isinstance(loaded.get("manifest"), dict)
            or loaded["manifest"].get("format") != FORMAT or not isinstance(loaded.get("tensors"), list)):
        raise ValueError("not a Tidal training state")
    return loaded


def deserialize(data: bytes) -> dict[str, Any]:
    return validate(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def tensor_buffers(tensor: torch.Tensor, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> Iterator[Any]:
    """The bytes of `tensor` in order, as buffer objects over its own memory (host tensors:
    no copy) or over bounded host copies of its chunks (device tensors)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    total = flat.numel() * flat.element_size()
    if total == 0:
        return
    if flat.device.type == "cpu":
        yield (ctypes.c_char * total).from_address(flat.data_ptr())
        return
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    for start in range(0, total, chunk_bytes):
        piece = raw[start:start + chunk_bytes].cpu()
        yield (ctypes.c_char * piece.numel()).from_address(piece.data_ptr())


def _canonical(value: Any) -> str:
    """A stable text form of a manifest value (dict keys sorted; tensors by dtype and bytes)."""
    if isinstance(value, torch.Tensor):
        hasher = hashlib.sha256()
        for buffer in tensor_buffers(value):
            hasher.update(buffer)
        return f"tensor({value.dtype},{list(value.shape)},{hasher.hexdigest()})"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key!r}:{_canonical(value[key])}" for key in sorted(value, key=str)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canonical(item) for item in value) + "]"
    return repr(value)


def digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over a captured state: its manifest without the RNG states, then every
    tensor's exact bytes, read in place once every stream of their devices is done with
    them (`tidal.train.backend.synchronize`)."""
    if _is_legacy(state):
        return _legacy_digest(state)
    synchronize_tensors(state["tensors"])
    hasher = hashlib.sha256()
    manifest = {key: value for key, value in state["manifest"].items() if key != "rng"}
    hasher.update(_canonical(manifest).encode())
    for tensor in state["tensors"]:
        hasher.update(f"|{tensor.dtype}:{list(tensor.shape)}|".encode())
        for buffer in tensor_buffers(tensor):
            hasher.update(buffer)
    return hasher.hexdigest()


def _legacy_digest(state: Mapping[str, Any]) -> str:
    """The digest earlier versions wrote beside a whole-replica checkpoint."""
    hasher = hashlib.sha256()

    def feed(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            hasher.update(f"{name}:tensor:{value.dtype}:{tuple(value.shape)}:".encode())
            for buffer in tensor_buffers(value):
                hasher.update(buffer)
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                feed(f"{name}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                feed(f"{name}[{index}]", item)
        else:
            hasher.update(f"{name}={value!r};".encode())

    for part in ("model", "optimizer", "scheduler", "counters"):
        if part in state:
            feed(part, state[part])
    return hasher.hexdigest()


def state_bytes(state: Mapping[str, Any]) -> int:
    """The bytes of a captured state's tensors."""
    return sum(t.numel() * t.element_size() for t in state["tensors"])
