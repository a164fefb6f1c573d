"""When a finishing job is over.

A job is FINISHING from the moment a rank committed its last step (live mode: the worker
said "finished"; restart mode: a rank exited 0). From then on exits and silences are not
failures and no generation forms; the job ends COMPLETED once every unit still part of it
is done: all its workers exited (with any status), or its launcher is gone."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class FinishingMember:
    """One unit of a finishing job: how many workers it runs, which local ranks exited and
    how (a description per non-zero exit), and whether it is gone (left, failed, or its
    launcher out of touch past the reconnect deadline)."""

    unit_id: str
    workers: int
    exited_ok: frozenset[int] = frozenset()
    exited_failed: Mapping[int, str] = dataclasses.field(default_factory=dict)
    gone: bool = False

    @property
    def done(self) -> bool:
        return self.gone or len(self.exited_ok | set(self.exited_failed)) >= self.workers


@dataclasses.dataclass(frozen=True)
class Completed:
    """The job is over; `reason` goes into the `job_completed` event."""

    reason: str


def completion_verdict(step: int, members: Sequence[FinishingMember]) -> Completed | None:
    """Completed once every member is done, else None. A worker that failed after the last
    step is named in the reason; it does not make the training fail."""
    if not all(member.done for member in members):
        return None
    failed = [f"{member.unit_id} local rank {local_rank} {how}"
              for member in members for local_rank, how in sorted(member.exited_failed.items())]
    reason = f"training completed at step {step}"
    if failed:
        reason += "; after the last step " + ", ".join(failed)
    return Completed(reason)
