"""A job's progress over time, as `tidal plot` draws it: the step, the samples trained,
the world size and the loss, sampled by the controller from its launchers' heartbeats.

Pure decisions (when to keep a sample, which samples to thin) live here; the job actor
(controller/jobs.py) applies them to SQLite (controller/store.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tidal.proto import admin_pb2

# A sample every this many seconds while the job steps; at once when the world changes.
HISTORY_INTERVAL_S = 2.0
# While nothing changes (no step, same world), a sample this often still, so that a plot
# shows the time the job stood still.
HISTORY_IDLE_INTERVAL_S = 30.0
# Samples kept per job: past this, the older half is thinned to every other sample (a
# long job keeps its whole span at a coarser grain).
HISTORY_MAX_SAMPLES = 20_000
# The events a plot marks: grows, leaves (preemptions, drains, resizes), failures,
# recoveries, checkpoint resumes and the job's end.
HISTORY_EVENT_KINDS = ("world_formed", "world_reconfigured", "failure_detected", "recovered", "unit_leaving",
                       "resumed_from_checkpoint", "below_min_released", "job_completed", "job_cancelled",
                       "state_lost")
# What one GetJobHistory reply carries at most (it must fit the controller's gRPC message
# limit, max_message_bytes, 1 MiB by default): the samples spread over the whole span, and
# the newest events, without their reasons (ListEvents has them).
HISTORY_REPLY_POINTS = 4_000
HISTORY_MAX_EVENTS = 1_000


@dataclasses.dataclass(frozen=True)
class ProgressSample:
    time: float  # wall clock (seconds since the epoch)
    step: int
    samples: int  # trained since the job began (live mode); 0 where unknown
    world_size: int  # ranks in the running world; 0 when none runs
    loss: float | None = None  # the last committed step's loss, where workers report it

    def __post_init__(self) -> None:
        if self.loss is not None and not math.isfinite(self.loss):
            object.__setattr__(self, "loss", None)


def sample_due(last: ProgressSample | None, current: ProgressSample, *, interval_s: float = HISTORY_INTERVAL_S,
               idle_interval_s: float = HISTORY_IDLE_INTERVAL_S) -> bool:
    """Whether `current` goes into the history after `last`."""
    if last is None or current.world_size != last.world_size:
        return True
    elapsed = current.time - last.time
    if current.step != last.step or current.samples != last.samples:
        return elapsed >= interval_s
    return elapsed >= idle_interval_s


def thinned(times: Sequence[float], limit: int = HISTORY_MAX_SAMPLES) -> list[float]:
    """The times of the samples to delete when a job holds more than `limit`: every
    other one of the older half (the first sample is always kept)."""
    if len(times) <= limit:
        return []
    ordered = sorted(times)
    older = ordered[: len(ordered) // 2]
    return older[1::2]


def downsampled(samples: Sequence[ProgressSample], limit: int) -> list[ProgressSample]:
    """At most about `limit` of `samples` spread over their whole span: every k-th, every
    one where the world size changes (a plot keeps its steps), and the last."""
    if len(samples) <= limit:
        return list(samples)
    stride = math.ceil(len(samples) / max(1, limit))
    kept = [sample for index, sample in enumerate(samples)
            if index % stride == 0 or index == len(samples) - 1
            or samples[index - 1].world_size != sample.world_size]
    return kept


def history_reply(job_id: str, global_batch: int, samples: Sequence[ProgressSample],
                  events: Sequence[admin_pb2.Event], budget_bytes: int) -> admin_pb2.JobHistory:
    """GetJobHistory's reply within `budget_bytes`: fewer points and events until it fits."""
    points, kept_events = HISTORY_REPLY_POINTS, HISTORY_MAX_EVENTS
    while True:
        reply = admin_pb2.JobHistory(job_id=job_id, global_batch=global_batch)
        for sample in downsampled(samples, points):
            point = reply.samples.add(step=sample.step, samples=sample.samples, world_size=sample.world_size)
            point.time.FromNanoseconds(int(sample.time * 1e9))
            if sample.loss is not None:
                point.loss = sample.loss
        for event in events[len(events) - kept_events:] if kept_events < len(events) else events:
            reply.events.add().CopyFrom(event)
            reply.events[-1].reason = ""
        if reply.ByteSize() <= budget_bytes or (points <= 16 and kept_events <= 16):
            return reply
        points, kept_events = max(16, points // 2), max(16, kept_events // 2)
