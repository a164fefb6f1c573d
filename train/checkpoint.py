"""The fallback checkpoint: used only when every replica of a job is lost.

While one replica lives, a joiner gets its state from a peer and no disk is read. A
checkpoint is a copy of the training state taken at a step boundary (one tensor copy on
the step path) and written by a background thread: serialized, written to a temporary
file, fsync'ed, renamed into place and the folder fsync'ed, so a crash never leaves a torn
file under a checkpoint's name. A worker that starts with no live peer holding state loads
the newest checkpoint whose digest verifies and goes on at its exact step and sample."""

from __future__ import annotations

import io
import os
import re
import threading
from pathlib import Path
from typing import Any

import structlog
import torch

from tidal.train.state import detached_copy, digest, serialize, validate

log = structlog.get_logger("tidal.train.checkpoint")

NAME = re.compile(r"^step-(\d{12})\.tidal$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:012d}.tidal"


def write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class AsyncCheckpointer:
    """Writes checkpoints off the step path, one at a time, keeping the newest `keep`."""

    def __init__(self, directory: Path, keep: int = 2, siblings: tuple[Path, ...] = ()) -> None:
        self.directory = directory
        # The folders of the other shards of a sharded replica: a step is loaded only when
        # every shard has it, so that all shards resume from the same step.
        self.siblings = siblings
        self.keep = max(1, keep)
        self._thread: threading.Thread | None = None
        self.written: list[int] = []
        self.skipped = 0
        self.error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, state: dict[str, Any], step: int) -> bool:
        """Start writing `state` (taken after `step` steps). Returns False, and writes
        nothing, while the previous write is still going: the step path never waits."""
        if self.busy:
            self.skipped += 1
            return False
        snapshot = detached_copy(state)
        self._thread = threading.Thread(target=self._write, args=(snapshot, step), name="tidal-checkpoint",
                                        daemon=True)
        self._thread.start()
        return True

    def write_now(self, state: dict[str, Any], step: int) -> None:
        """Write `state` in this thread, from the live tensors (no copy: nothing trains
        meanwhile, as when a replica saves the state on its way out). Raises on failure."""
        self.wait()
        self._write_checkpoint(detached_copy(state, copy=False), step)

    def _write(self, snapshot: dict[str, Any], step: int) -> None:
        try:
            self._write_checkpoint(snapshot, step)
        except BaseException as error:  # reported by the next wait(), never lost
            self.error = error
            log.error("checkpoint_failed", step=step, error=repr(error))

    def _write_checkpoint(self, snapshot: dict[str, Any], step: int) -> None:
        payload = {"state_digest": digest(snapshot), "state": snapshot}
        # Made at the first write: a folder that only a leaving replica ever writes to is
        # not created for nothing.
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(checkpoint_path(self.directory, step), serialize(payload))
        self.written.append(step)
        for old in self.steps()[:-self.keep]:
            checkpoint_path(self.directory, old).unlink(missing_ok=True)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"writing a checkpoint failed: {error!r}") from error

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = [int(match.group(1)) for entry in os.listdir(self.directory) if (match := NAME.match(entry))]
        return sorted(found)

    def complete_steps(self) -> list[int]:
        """Steps written here and by every sibling shard."""
        steps = set(self.steps())
        for sibling in self.siblings:
            steps &= {int(match.group(1)) for entry in (os.listdir(sibling) if sibling.is_dir() else [])
                      if (match := NAME.match(entry))}
        return sorted(steps)

    def latest(self) -> dict[str, Any] | None:
        """The newest checkpoint (that every sibling shard also wrote) whose digest
        verifies, or None; a damaged one is skipped with a warning."""
        found = self.newest()
        return found[1] if found is not None else None

    def newest(self, after: int = -1, below: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The step and state of the newest checkpoint (that every sibling shard also
        wrote) of a step after `after` (and below `below`) whose digest verifies, or None;
        a damaged one is skipped with a warning."""
        for step in reversed(self.complete_steps()):
            if below is not None and step >= below:
                continue
            if step <= after:
                break
            state = self.at(step)
            if state is not None:
                return step, state
        return None

    def at(self, step: int) -> dict[str, Any] | None:
        """This folder's own checkpoint of exactly `step` if it is there and its digest
        verifies, whatever the siblings hold (a sharded world whose other shards of that
        step are live, in their replicas' memory), else None."""
        path = checkpoint_path(self.directory, step)
        if not path.is_file():
            return None
        try:
            payload = deserialize_payload(path.read_bytes())
        except Exception as error:  # torch.load raises many kinds on garbage (zeros, an empty file)
            log.warning("checkpoint_unreadable", path=str(path), error=f"{type(error).__name__}: {error}")
            return None
        if digest(payload["state"]) != payload["state_digest"]:
            log.warning("checkpoint_digest_mismatch", path=str(path))
            return None
        return payload["state"]


def deserialize_payload(data: bytes) -> dict[str, Any]:
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or "state_digest" not in loaded:
        raise ValueError("not a Tidal checkpoint")
    validate(loaded.get("state"))
    return loaded
