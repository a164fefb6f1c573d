"""Stragglers: a worker persistently slower than its peers at its own work. Pure: functions
of what the heartbeats said and the previous windows.

A live-mode worker reports, with its beats, its own compute in the current generation (the
seconds of its forward and backward passes, before it waits for its peers, over the samples
and steps they took; the generation's first step left out). The controller takes the
difference between two heartbeats as one interval (seconds per sample, seconds per step,
samples per step). Each worker keeps its last `window` intervals; its score is the median
of them against the median of its peers' (the other workers of the world with a full
window): per step against the peers with the same share of the batch, else per sample
(`_Peers.ratio`). A worker whose ratio stays at or above `ratio` for `confirm` new intervals
in a row is a straggler; it is cleared once its ratio falls below `clear_ratio`, or when it
leaves the world. A world change keeps the scores (a new window fills from the new
generation's totals).

Why these make no false alarms where a world is slowed evenly: every rank's time rises
together (a CPU hog on the node, a bigger model), so the ratio stays near 1; ranks with
different shares of the batch (the first `batch % world` ranks take one sample more) are
compared per step with the ranks of their own share, so neither a per-step cost that does
not grow with the samples nor a bigger share makes a rank look slow; the step a joiner
arrives (cold caches, new groups) is each generation's first, which is not counted.

Also kept, for the event and the operator: the worker's own history, its ratio against the
best window median it had in this job (`self_ratio`). It does not decide: a worker that
was slow from its first step has no faster past to compare with."""

from __future__ import annotations

import bisect
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
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class Interval:
    """One heartbeat interval of a worker's compute."""

    per_sample: float  # seconds per sample
    per_step: float  # seconds per step (0: steps not reported)
    share: float  # samples per step (0: steps not reported)


@dataclasses.dataclass(frozen=True)
class WorkerCompute:
    """One worker's recent compute, as the controller scores it."""

    totals: Totals
    # Its last `window` intervals, oldest first.
    recent: tuple[Interval, ...] = ()
    # Whether `observe` added an interval this time (a score counts only those).
    fresh: bool = False
    # The lowest window median (per sample) it had in this job (its own history).
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
            policy: StragglerPolicy, members: Iterable[WorkerKey]) -> dict[WorkerKey, WorkerCompute]:
    """The windows of the world's workers (`members`) after a heartbeat's `totals`: an
    interval is added where a worker's totals of `generation` grew since the last ones of
    the same generation. A worker whose totals are missing or still of an older generation
    (its first step in this one not counted yet, its launcher out of touch) keeps what it
    had; one whose totals are of this generation for the first time starts a new window,
    keeping its score and its best until scored again. Workers out of the world are dropped."""
    windows: dict[WorkerKey, WorkerCompute] = {}
    for key in members:
        before = previous.get(key)
        now = totals.get(key)
        if now is None or now.generation != generation:
            if before is not None:
                windows[key] = dataclasses.replace(before, fresh=False)
            continue
        if before is None or before.totals.generation != generation or now.samples < before.totals.samples:
            windows[key] = (WorkerCompute(totals=now) if before is None else
                            WorkerCompute(totals=now, best=before.best, suspected=before.suspected,
                                          ratio=before.ratio, self_ratio=before.self_ratio))
            continue
        added = now.samples - before.totals.samples
        if added <= 0:
            windows[key] = dataclasses.replace(before, totals=now, fresh=False)
            continue
        seconds = max(0.0, now.seconds - before.totals.seconds)
        steps = now.steps - before.totals.steps
        interval = Interval(per_sample=seconds / added, per_step=seconds / steps if steps > 0 else 0.0,
                            share=added / steps if steps > 0 else 0.0)
        recent = (*before.recent, interval)[-policy.window:]
        windows[key] = dataclasses.replace(before, totals=now, recent=recent, fresh=True)
    return windows


@dataclasses.dataclass(frozen=True)
class _Medians:
    per_sample: float
    per_step: float
    share: float


def _medians(worker: WorkerCompute) -> _Medians:
    return _Medians(per_sample=statistics.median(i.per_sample for i in worker.recent),
                    per_step=statistics.median(i.per_step for i in worker.recent),
                    share=statistics.median(i.share for i in worker.recent))


def median_without(ordered: list[float], value: float) -> float:
    """The median of `ordered` (sorted, holding `value`) with one copy of `value` taken out:
    a worker's peers' median, from one sort of everyone's (O(log n), not a list per worker)."""
    index = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def at(position: int) -> float:
        return ordered[position if position < index else position + 1]

    if count % 2:
        return at(count // 2)
    return (at(count // 2 - 1) + at(count // 2)) / 2


@dataclasses.dataclass(frozen=True)
class _Peers:
    """Every scored worker's medians, sorted once: per sample, and per step by share."""

    per_sample: list[float]
    per_step_by_share: dict[float, list[float]]

    @classmethod
    def of(cls, medians: Iterable[_Medians]) -> _Peers:
        per_sample: list[float] = []
        by_share: dict[float, list[float]] = {}
        for m in medians:
            per_sample.append(m.per_sample)
            if m.share > 0:
                by_share.setdefault(m.share, []).append(m.per_step)
        return cls(sorted(per_sample), {share: sorted(times) for share, times in by_share.items()})

    def ratio(self, mine: _Medians) -> float:
        """A worker's time against its peers': per step against the peers with the same
        share of the batch (samples a step) where there are any, so that a per-step cost that
        does not grow with the samples (launches, hooks, a collective's set-up) cannot make a
        rank with fewer samples look slow per sample; per sample against all of them
        otherwise."""
        same_share = self.per_step_by_share.get(mine.share, []) if mine.share > 0 else []
        if len(same_share) > 1:
            reference = median_without(same_share, mine.per_step)
            return mine.per_step / reference if reference > 0 else 0.0
        reference = median_without(self.per_sample, mine.per_sample)
        return mine.per_sample / reference if reference > 0 else 0.0


def score(windows: Mapping[WorkerKey, WorkerCompute], policy: StragglerPolicy
          ) -> tuple[dict[WorkerKey, WorkerCompute], list[Change]]:
    """Each worker with a full window scored against its peers' (see the module); the
    workers newly suspected or cleared. Nothing is scored again until an interval is added
    (a tick between two heartbeats costs no medians)."""
    if not any(worker.fresh for worker in windows.values()):
        return dict(windows), []
    medians = {key: _medians(w) for key, w in windows.items() if len(w.recent) >= policy.window}
    peers = _Peers.of(medians.values())
    scored: dict[WorkerKey, WorkerCompute] = {}
    changes: list[Change] = []
    for key, worker in windows.items():
        mine = medians.get(key)
        if mine is None or len(medians) < 2:
            # Not scored yet (a window filling, or no peer with one): as it was.
            scored[key] = dataclasses.replace(worker, slow_intervals=0)
            continue
        ratio = peers.ratio(mine)
        best = mine.per_sample if worker.best is None else min(worker.best, mine.per_sample)
        self_ratio = mine.per_sample / best if best > 0 else 0.0
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


def cleared_by_leaving(previous: Mapping[WorkerKey, WorkerCompute], members: Iterable[WorkerKey]) -> list[WorkerKey]:
    """Suspected workers that are no longer in the world (their unit left or failed)."""
    present = set(members)
    return [key for key, worker in previous.items() if worker.suspected and key not in present]
