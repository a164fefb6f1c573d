"""`tidal plot`: what is drawn from a job's history (pure), and the files it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.controller import plot
from tidal.proto import admin_pb2

T0 = 1_800_000_000.0


def history() -> admin_pb2.JobHistory:
    reply = admin_pb2.JobHistory(job_id="j1", global_batch=32)
    # (seconds, step, samples, world size, loss)
    for seconds, step, samples, world, loss in [(0, 0, 0, 0, None), (2, 10, 320, 2, 1.0), (4, 30, 960, 3, 0.5),
                                                (6, 30, 960, 0, None), (8, 40, 1280, 2, 0.25)]:
        point = reply.samples.add(step=step, samples=samples, world_size=world)
        point.time.FromNanoseconds(int((T0 + seconds) * 1e9))
        if loss is not None:
            point.loss = loss
    for seconds, kind, unit, fields in [
            (1, "world_formed", "", {"world_size": "2"}),
            (3, "world_reconfigured", "", {"cause": "grow", "world_size": "3"}),
            (5, "failure_detected", "u1", {"cause": "worker_exit"}),
            (7, "recovered", "u2", {"world_size": "2"}),
            (7.5, "unit_leaving", "u3", {"cause": "preempted"}),
            (7.6, "unit_leaving", "u4", {"cause": "drained"}),
            (7.7, "unit_leaving", "u2", {"cause": "finished"}),
            (7.8, "resumed_from_checkpoint", "", {}),
            (9, "job_completed", "", {})]:
        event = reply.events.add(kind=kind, unit_id=unit, fields=fields)
        event.time.FromNanoseconds(int((T0 + seconds) * 1e9))
    return reply


def test_the_series_are_the_world_the_rate_and_the_loss_with_a_mark_per_event_that_matters() -> None:
    drawn = plot.series(history())
    assert drawn.start == T0
    assert drawn.world == ((0.0, 0), (2.0, 2), (4.0, 3), (6.0, 0), (8.0, 2))
    # samples/s from the workers' counts: 320 in 2 s, then 640 in 2 s, then none, then 320.
    assert drawn.rate == ((0.0, 2.0, 160.0), (2.0, 4.0, 320.0), (4.0, 6.0, 0.0), (6.0, 8.0, 160.0))
    assert drawn.loss == ((2.0, 1.0), (4.0, 0.5), (8.0, 0.25))
    assert [(round(m.at, 3), m.kind) for m in drawn.marks] == [
        (3.0, "grow"), (5.0, "failure"), (7.0, "recovery"), (7.5, "preemption"), (7.6, "leave"), (7.8, "resume"),
        (9.0, "end")]
    assert drawn.marks[0].label == "grow to 3" and drawn.marks[1].label == "u1 worker_exit"


def test_without_the_workers_sample_counts_the_rate_is_steps_times_the_global_batch() -> None:
    reply = admin_pb2.JobHistory(job_id="j1", global_batch=32)
    for seconds, step in [(0, 0), (4, 8)]:
        reply.samples.add(step=step, world_size=2).time.FromNanoseconds(int((T0 + seconds) * 1e9))
    assert plot.series(reply).rate == ((0.0, 4.0, 64.0),)
    assert plot.series(reply).rate_unit == "samples/s"
    # Neither counts nor a global batch (restart mode without --global-batch): steps/s.
    reply.global_batch = 0
    assert plot.series(reply).rate == ((0.0, 4.0, 2.0),)
    assert plot.series(reply).rate_unit == "steps/s"


def test_the_time_axis_is_in_seconds_minutes_or_hours_by_the_span() -> None:
    assert plot.time_unit(90) == (1.0, "seconds")
    assert plot.time_unit(1800) == (60.0, "minutes")
    assert plot.time_unit(86400) == (3600.0, "hours")


def test_render_writes_a_png_and_an_svg_with_the_three_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    drawn = plot.series(history())
    png, svg = tmp_path / "job.png", tmp_path / "out" / "job.svg"
    plot.render(drawn, png, title="j1: completed")
    plot.render(drawn, svg, title="j1: completed")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    for label in ("world size (ranks)", "samples/s", "loss", "grow", "failure", "recovered (first step)",
                  "preemption / given back", "resumed from checkpoint", "j1: completed"):
        assert label in text, label


def test_a_format_it_does_not_write_is_refused_before_drawing(tmp_path: Path) -> None:
    with pytest.raises(plot.PlotUnavailable, match="ending"):
        plot.render(plot.series(history()), tmp_path / "job.gif", title="x")
    assert not (tmp_path / "job.gif").exists()
