"""What ends a step, a world or the training: the library's exceptions.

`WorldBroken` is the one that is handled: the step in flight is abandoned and the rank
waits for its next world (`tidal.train.world`). The others are never retried."""

from __future__ import annotations


class WorldBroken(Exception):
    """The step cannot complete in this world: a peer is gone or the launcher said stop."""


class StateMismatch(RuntimeError):
    """Replicas disagree on the training state after a world formed (a bug, never ignored)."""


class AccountingError(RuntimeError):
    """A step did not consume exactly its B samples (a bug, never ignored)."""


class StateLost(RuntimeError):
    """No rank of a world holds the training state at the job's committed step, and there
    is no checkpoint to resume from: training refuses to start again from scratch."""
