"""What ends a step, a world or the training: the library's exceptions.

`WorldBroken` is the one that is handled: the step in flight is abandoned and the rank
waits for its next world (`tidal.train.world`). The others are never retried."""

from __future__ import annotations

import traceback

# Where a collective of torch.distributed (FSDP2's all-gathers and reduce-scatters, c10d's
# calls) or the replica's shard group raises from.
_COLLECTIVE_CODE = ("/torch/distributed/", "/tidal/train/shard_group.py", "/train/shard_group.py")


class WorldBroken(Exception):
    """The step cannot complete in this world: a peer is gone or the launcher said stop."""


class StateMismatch(RuntimeError):
    """Replicas disagree on the training state after a world formed (a bug, never ignored)."""


class AccountingError(RuntimeError):
    """A step did not consume exactly its B samples (a bug, never ignored)."""


class StateLost(RuntimeError):
    """No rank of a world holds the training state at the job's committed step, and there
    is no checkpoint to resume from: training refuses to start again from scratch."""


def raised_by_a_collective(error: BaseException) -> bool:
    """Whether `error` came out of a collective (a frame of torch.distributed or of the
    shard group on its traceback): under HybridSharded a replica's FSDP2 collectives run
    inside the forward and backward passes, and one that fails because a peer of the
    replica died raises there, not in Tidal's own waits. An error of the script's own
    code (its model's forward, its loss) has no such frame and is not taken for one."""
    frames = traceback.extract_tb(error.__traceback__)
    return any(any(part in frame.filename for part in _COLLECTIVE_CODE) for frame in frames)
