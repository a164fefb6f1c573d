"""Stragglers: a worker persistently slower than its peers at its own work. Pure: functions
of what the heartbeats said and the previous windows.

A live-mode worker reports, with its beats, its own compute in the current generation (the
seconds of its forward and backward passes, before it waits for its peers, over the samples
they took; the generation's first step left out). The controller takes the difference
between two heartbeats as one interval: seconds per sample over the steps in it. Each
worker keeps its last `window` intervals; its score is the median of them against the
median of its peers' (the other workers of the world with a full window): the ratio vs
peers. A worker whose ratio stays at or above `ratio` for `confirm` new intervals in a row
is a straggler; it is cleared once its ratio falls below `clear_ratio`.

Why these make no false alarms where a world is slowed evenly: every rank's time rises
together (a CPU hog on the node, a bigger model), so the ratio stays near 1; a rank with a
bigger batch share after a shrink does more samples, not slower ones (per sample); the step
a joiner arrives (cold caches, new groups) is each generation's first, which is not counted.

Also kept, for the event and the operator: the worker's own history, its ratio against the
best window median it had in this job (`self_ratio`). It does not decide: a worker that
was slow from its first step has no faster past to compare with."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping

# A worker: its unit and its local rank there.
WorkerKey = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    ratio: float = 1.5
    clear_ratio: float = 1.2
    window: int = 8
    confirm: int = 3


@dataclasses.dataclass(frozen=True)
class Totals:
    """What a worker's newest beat said of its own compute."""

    generation: int
    seconds: float
    samples: int


@dataclasses.dataclass(frozen=True)
class WorkerCompute:
    """One worker's recent compute, as the controller scores it."""

    totals: Totals
    # Seconds per sample of its last `window` intervals, oldest first.
    recent: tuple[float, ...] = ()
    # Whether `observe` added an interval this time (a score counts only those).
    fresh: bool = False
    # The lowest window median it had in this job (its own history).
    best: float | None = None
    ratio: float = 0.0
    self_ratio: float = 0.0
    slow_intervals: int = 0
    suspected: bool = False


@dataclasses.dataclass(frozen=True)
class Change:
    """A worker newly suspected, or cleared."""

    key: WorkerKey
    suspected: bool
    worker: WorkerCompute


def observe(previous: Mapping[WorkerKey, WorkerCompute], totals: Mapping[WorkerKey, Totals], generation: int,
            policy: StragglerPolicy) -> dict[WorkerKey, WorkerCompute]:
    """The windows after a heartbeat's `totals` (the workers of the world now): an interval
    is added where a worker's totals of `generation` grew since the last ones of the same
    generation. A worker of another generation, or gone, starts again (its `best` kept)."""
    windows: dict[WorkerKey, WorkerCompute] = {}
    for key, now in totals.items():
        if now.generation != generation:
            continue
        before = previous.get(key)
        if before is None or before.totals.generation != generation or now.samples < before.totals.samples:
            # A new generation (or a restarted count): a new window; what it was suspected
            # of and its best stay until scored again.
            windows[key] = (WorkerCompute(totals=now) if before is None else
                            WorkerCompute(totals=now, best=before.best, suspected=before.suspected,
                                          ratio=before.ratio, self_ratio=before.self_ratio))
            continue
        added = now.samples - before.totals.samples
        if added <= 0:
            windows[key] = dataclasses.replace(before, totals=now, fresh=False)
            continue
        per_sample = max(0.0, now.seconds - before.totals.seconds) / added
        recent = (*before.recent, per_sample)[-policy.window:]
        windows[key] = dataclasses.replace(before, totals=now, recent=recent, fresh=True)
    return windows


def score(windows: Mapping[WorkerKey, WorkerCompute], policy: StragglerPolicy
          ) -> tuple[dict[WorkerKey, WorkerCompute], list[Change]]:
    """Each worker with a full window scored against its peers' (see the module); the
    workers newly suspected or cleared."""
    medians = {key: statistics.median(w.recent) for key, w in windows.items() if len(w.recent) >= policy.window}
    scored: dict[WorkerKey, WorkerCompute] = {}
    changes: list[Change] = []
    for key, worker in windows.items():
        mine = medians.get(key)
        peers = [m for other, m in medians.items() if other != key]
        if mine is None or not peers:
            # Not scored yet (a window filling): as it was.
            scored[key] = dataclasses.replace(worker, slow_intervals=0)
            continue
        reference = statistics.median(peers)
        ratio = mine / reference if reference > 0 else 0.0
        best = mine if worker.best is None else min(worker.best, mine)
        self_ratio = mine / best if best > 0 else 0.0
        slow = worker.slow_intervals
        if worker.fresh:
            slow = slow + 1 if ratio >= policy.ratio else 0
        suspected = worker.suspected
        if not suspected and slow >= policy.confirm:
            suspected = True
        elif suspected and ratio < policy.clear_ratio:
            suspected = False
        updated = dataclasses.replace(worker, best=best, ratio=ratio, self_ratio=self_ratio, slow_intervals=slow,
                                      suspected=suspected)
        scored[key] = updated
        if suspected != worker.suspected:
            changes.append(Change(key, suspected, updated))
    return scored, changes


def cleared_by_leaving(previous: Mapping[WorkerKey, WorkerCompute], now: Iterable[WorkerKey]) -> list[WorkerKey]:
    """Suspected workers that are no longer in the world (their unit left or failed)."""
    present = set(now)
    return [key for key, worker in previous.items() if worker.suspected and key not in present]
