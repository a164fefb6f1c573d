"""`tidal plot JOB`: a job's world size, samples/s and loss over time, with its grows,
leaves (preemptions, drains), failures, recoveries and checkpoint resumes marked.

`series` turns the controller's history (GetJobHistory) into what is drawn, a pure
function; `render` draws it with matplotlib (the `plot` extra), imported only here."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp

from tidal.proto import admin_pb2

FORMATS = (".png", ".svg", ".pdf")
# Mark kind -> (colour, line style, legend label).
MARK_STYLES = {
    "grow": ("tab:blue", "-", "grow"),
    "preemption": ("tab:orange", "--", "preemption / given back"),
    "leave": ("tab:gray", ":", "drain / resize"),
    "failure": ("tab:red", "-", "failure"),
    "recovery": ("tab:green", "--", "recovered (first step)"),
    "resume": ("tab:purple", "-.", "resumed from checkpoint"),
    "end": ("black", "-", "job ended"),
}
# A unit leaving for one of these causes was taken by Slurm or given back by the job.
_TAKEN = {"preempted", "requeued", "yielded", "released", "saving_shards"}


@dataclasses.dataclass(frozen=True)
class Mark:
    at: float  # seconds since the plot's start
    kind: str  # a key of MARK_STYLES
    label: str


@dataclasses.dataclass(frozen=True)
class Series:
    start: float  # wall clock of the plot's zero
    world: tuple[tuple[float, int], ...]  # (seconds, world size)
    rate: tuple[tuple[float, float, float], ...]  # (from, to seconds, samples/s over that interval)
    loss: tuple[tuple[float, float], ...]  # (seconds, loss)
    marks: tuple[Mark, ...]
    # "samples/s", or "steps/s" where neither the workers' counts nor a global batch is
    # known (a restart-mode job submitted without --global-batch).
    rate_unit: str = "samples/s"


def _seconds(timestamp: Timestamp) -> float:
    return timestamp.ToNanoseconds() / 1e9


def mark_of(event: admin_pb2.Event) -> tuple[str, str] | None:
    """The mark an event makes (kind, label), or None."""
    cause = event.fields.get("cause", "")
    if event.kind in ("world_formed", "world_reconfigured") and cause == "grow":
        return "grow", f"grow to {event.fields.get('world_size', '?')}"
    if event.kind == "unit_leaving" and cause != "finished":
        return ("preemption" if cause in _TAKEN else "leave"), f"{event.unit_id} {cause}"
    if event.kind == "below_min_released":
        return "preemption", "nodes given back below min"
    if event.kind == "failure_detected":
        return "failure", f"{event.unit_id} {cause}".strip()
    if event.kind == "recovered":
        return "recovery", f"recovered at {event.fields.get('world_size', '?')}"
    if event.kind == "resumed_from_checkpoint":
        return "resume", "resumed from checkpoint"
    if event.kind in ("job_completed", "job_cancelled", "state_lost"):
        return "end", event.kind.removeprefix("job_")
    return None


def series(history: admin_pb2.JobHistory) -> Series:
    samples = list(history.samples)
    events = list(history.events)
    times = [_seconds(s.time) for s in samples] + [_seconds(e.time) for e in events]
    start = min(times) if times else 0.0
    world = tuple((_seconds(s.time) - start, s.world_size) for s in samples)
    rate: list[tuple[float, float, float]] = []
    counted = history.global_batch > 0 or any(s.samples for s in samples)
    for before, after in itertools.pairwise(samples):
        elapsed = _seconds(after.time) - _seconds(before.time)
        if elapsed <= 0:
            continue
        if after.samples and before.samples:
            trained = after.samples - before.samples
        else:
            trained = (after.step - before.step) * (history.global_batch if counted else 1)
        rate.append((_seconds(before.time) - start, _seconds(after.time) - start, max(0, trained) / elapsed))
    loss = tuple((_seconds(s.time) - start, s.loss) for s in samples if s.HasField("loss"))
    marks = []
    for event in events:
        made = mark_of(event)
        if made is not None:
            marks.append(Mark(at=_seconds(event.time) - start, kind=made[0], label=made[1]))
    return Series(start=start, world=world, rate=tuple(rate), loss=loss, marks=tuple(marks),
                  rate_unit="samples/s" if counted else "steps/s")


def time_unit(span_s: float) -> tuple[float, str]:
    """(seconds per unit, its name) for an axis spanning `span_s` seconds."""
    if span_s <= 300:
        return 1.0, "seconds"
    if span_s <= 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed, or the output's format is not one it writes here."""


def render(drawn: Series, output: Path, *, title: str) -> None:
    """Draw `drawn` into `output` (.png, .svg or .pdf)."""
    if output.suffix.lower() not in FORMATS:
        raise PlotUnavailable(f"{output}: the format is given by the name's ending, one of {', '.join(FORMATS)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise PlotUnavailable("matplotlib is not installed: pip install 'tidal-elastic[plot]'") from error
    ends = [t for t, _ in drawn.world] + [t for _, t, _ in drawn.rate] + [m.at for m in drawn.marks]
    scale, unit = time_unit(max(ends, default=0.0))
    rows = 3 if drawn.loss else 2
    figure, axes = pyplot.subplots(rows, 1, sharex=True, figsize=(11, 2.6 * rows + 0.8), squeeze=False)
    column = [row[0] for row in axes]
    world, rate = column[0], column[1]
    world.step([t / scale for t, _ in drawn.world], [n for _, n in drawn.world], where="post", color="tab:blue")
    world.set_ylabel("world size (ranks)")
    world.set_ylim(bottom=0)
    world.yaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn.rate:
        # Each interval's rate drawn over the interval.
        rate.step([t / scale for t, _, _ in drawn.rate] + [drawn.rate[-1][1] / scale],
                  [r for _, _, r in drawn.rate] + [drawn.rate[-1][2]], where="post", color="tab:green")
    rate.set_ylabel(drawn.rate_unit)
    rate.set_ylim(bottom=0)
    if drawn.loss:
        column[2].plot([t / scale for t, _ in drawn.loss], [v for _, v in drawn.loss], color="tab:red", linewidth=1)
        column[2].set_ylabel("loss")
    seen: set[str] = set()
    for mark in drawn.marks:
        colour, style, label = MARK_STYLES[mark.kind]
        for axis in column:
            axis.axvline(mark.at / scale, color=colour, linestyle=style, linewidth=1, alpha=0.8,
                         label=label if axis is world and mark.kind not in seen else None)
        seen.add(mark.kind)
    if seen:
        world.legend(loc="upper left", fontsize="small", ncol=4, framealpha=0.8)
    column[-1].set_xlabel(f"{unit} since the job's first sample")
    figure.suptitle(title)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    pyplot.close(figure)
