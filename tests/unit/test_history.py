"""A job's progress history: when a sample is kept, how a long history is thinned, and
the SQLite table it lives in."""

from __future__ import annotations

import math
from pathlib import Path

from tidal.controller.history import ProgressSample, downsampled, history_reply, sample_due, thinned
from tidal.controller.model import JobRecord, JobState
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2


def at(time: float, step: int, world: int = 2, samples: int = 0, loss: float | None = None) -> ProgressSample:
    return ProgressSample(time=time, step=step, samples=samples, world_size=world, loss=loss)


def test_a_sample_is_kept_first_on_a_world_change_every_interval_while_stepping_and_rarely_when_idle() -> None:
    assert sample_due(None, at(0, 0))
    assert sample_due(at(0, 5), at(0.1, 5, world=3))  # a world change: at once
    assert not sample_due(at(0, 5), at(1.9, 9))
    assert sample_due(at(0, 5), at(2.0, 9))
    assert not sample_due(at(0, 5), at(29, 5))  # nothing moved
    assert sample_due(at(0, 5), at(30, 5))


def test_a_loss_that_is_not_a_number_is_no_loss() -> None:
    assert at(0, 1, loss=math.nan).loss is None
    assert at(0, 1, loss=math.inf).loss is None
    assert at(0, 1, loss=0.5).loss == 0.5


def test_past_the_limit_every_other_sample_of_the_older_half_goes_and_the_first_stays() -> None:
    assert thinned([1.0, 2.0, 3.0], limit=3) == []
    times = [float(t) for t in range(10)]
    gone = thinned(times, limit=8)
    assert gone == [1.0, 3.0]
    assert 0.0 not in gone and all(t < 5 for t in gone)


def test_the_store_keeps_a_jobs_history_in_order_and_thins_it(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "tidal.db")
    spec = admin_pb2.JobSpec(name="h", min_replicas=1, max_replicas=2, command=["x"])
    for job_id in ("j1", "j2"):
        store.insert_job(JobRecord(job_id=job_id, spec=spec, state=JobState.RUNNING, owner_uid=0, secret_sha256="0",
                                   generation=0, step=0, created_at=0.0))
    for index in range(12):
        store.add_progress("j1", at(float(index), index, loss=1.0 / (index + 1)), limit=10)
    store.add_progress("j2", at(5.0, 1))
    kept = store.progress("j1")
    assert [s.time for s in kept] == sorted(s.time for s in kept)
    assert kept[0].time == 0.0 and kept[-1].time == 11.0
    assert 8 <= len(kept) <= 10
    assert kept[-1].loss == 1.0 / 12 and kept[-1].world_size == 2
    assert [s.time for s in store.progress("j2")] == [5.0]
    store.close()
    # On disk: a controller started again reads it back.
    again = StateStore(tmp_path / "tidal.db")
    assert [s.step for s in again.progress("j1")] == [s.step for s in kept]
    again.close()


def test_a_long_history_is_downsampled_over_its_whole_span_keeping_every_world_change() -> None:
    samples = [at(float(t), t, world=2 if t < 5000 else 3) for t in range(20_000)]
    kept = downsampled(samples, 1000)
    assert 1000 <= len(kept) <= 1002
    assert kept[0].time == 0.0 and kept[-1].time == 19_999.0
    assert any(s.time == 5000.0 for s in kept), "the first sample of the new world size"
    assert downsampled(samples[:10], 1000) == samples[:10]


def test_the_reply_fits_the_message_limit_at_the_cap() -> None:
    """20,000 samples (the most a job keeps) and 1,000 events with long reasons: within
    the default 1 MiB limit, and within a much smaller one by taking fewer."""
    samples = [at(1.8e9 + t, t, world=4, samples=32 * t, loss=1.0 / (t + 1)) for t in range(20_000)]
    events = []
    for index in range(1_000):
        event = admin_pb2.Event(sequence=index, job_id="j1", unit_id="u12", kind="unit_leaving", reason="x" * 300,
                                fields={"cause": "preempted"})
        event.time.FromNanoseconds(int((1.8e9 + index) * 1e9))
        events.append(event)
    full = history_reply("j1", 32, samples, events, budget_bytes=int((1 << 20) * 0.9))
    assert full.ByteSize() <= (1 << 20) * 0.9
    assert len(full.samples) >= 4_000 and len(full.events) == 1_000
    assert all(not e.reason for e in full.events), "reasons are ListEvents' to give"
    small = history_reply("j1", 32, samples, events, budget_bytes=20_000)
    assert small.ByteSize() <= 20_000 and small.samples[-1].step == 19_999
    assert small.events[-1].sequence == 999, "the newest events are kept"
