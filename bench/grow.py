"""Grow latency on the mini cluster: a live job with max 4 runs on 3 nodes while a plain
Slurm job holds the 4th; the plain job is cancelled, and the time is measured from the
scancel until the first committed step at world size 4 (the new replica contributes).
The controller polls Slurm every second. Goal: ≤ poll interval + 3 s.

Two series. In the first the training ranks keep the host's cores busy (the example MLP
stepping every few milliseconds: 3 ranks and their launchers on this machine's 2 cores),
so the joiner's start (Python, torch) competes with them for CPU, which a real cluster's
separate node never does. In the second each micro-batch is 0.1 s of device time spent
sleeping, as on an accelerator, so the host's cores are mostly free, as a GPU node's are.

Where the seconds go, from the controller's events and the workers' ledger, each stage
from the end of the one before: the poll that sees the node idle and submits the unit
(`unit_submitting`); Slurm starting the unit's batch job and the launcher starting and
registering (`unit_registered`); the joiner's workers starting (Python, torch, the
script up to `Elastic`: `joiners_ready`, every worker said hello); the members finishing
their step and the grown world forming, state sent to the joiner (`world_reconfigured`);
the first step at 4."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, median, parser, workspace, write_result
from bench.live import event_time
from bench.slurm_job import SlurmJob

POLL_S = 1.0
# (stage name, the event that ends it; None: the first commit at world size 4)
STAGES = (("poll and sbatch", "unit_submitting"), ("Slurm start, launcher start and register", "unit_registered"),
          ("joiner's workers start (Python, torch, the script)", "joiners_ready"),
          ("members finish their step, grown world forms", "world_reconfigured"), ("first step at 4", None))


@dataclass(frozen=True)
class Series:
    name: str
    metric: str
    step_time: float


SERIES = (Series("busy", "node freed (scancel of its job) → first step with its replica, training ranks busy on the "
                         "host's cores", 0.01),
          Series("idle_host", "node freed (scancel of its job) → first step with its replica, training ranks on "
                              "simulated devices (host cores mostly free)", 0.1))


def measure(folder: Path, series: Series, repeat: int) -> tuple[list[float], dict[str, list[float]]]:
    totals: list[float] = []
    stages: dict[str, list[float]] = {name: [] for name, _ in STAGES}
    with SlurmJob(folder, 4, POLL_S, blocked_nodes=1, step_time=series.step_time) as job:
        job.wait_world(3)
        for index in range(repeat):
            at = time.time()
            job.slurm.cancel(job.blockers.pop())
            ends = [event_time(job.event_after(kind, at)) if kind else 0.0 for _, kind in STAGES]
            job.wait_world(4)
            ends[-1] = job.commits_after(at, 4)[0]["time"]
            totals.append(ends[-1] - at)
            previous = at
            for (name, _), end in zip(STAGES, ends, strict=True):
                stages[name].append(end - previous)
                previous = end
            print(f"grow: {series.name} {index + 1}: first step at 4 {totals[-1]:.2f} s after the node was freed: "
                  + "; ".join(f"{name} {values[-1]:.2f} s" for name, values in stages.items()), flush=True)
            if index + 1 < repeat:
                job.resize(3)
                job.wait_world(3)
                time.sleep(2 * POLL_S)
                job.block_a_node()
                job.resize(4)
                time.sleep(2 * POLL_S)
    return totals, stages


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    rows, stages_by_series = [], {}
    # --quick: the second series only (the first is the same code with busier ranks).
    with workspace(args.keep, "grow") as folder:
        for series in SERIES[1:] if args.quick else SERIES:
            totals, stages = measure(folder / series.name, series, repeat)
            stages_by_series[series.name] = stages
            rows.append(Row(
                benchmark="grow", metric=series.metric, unit="s", tidal=median(totals),
                goal=f"≤ poll interval + 3 s = {POLL_S + 3:g} s", met=median(totals) <= POLL_S + 3,
                tidal_samples=totals,
                note=f"poll interval {POLL_S:g} s; example MLP, --step-time {series.step_time:g} s a micro-batch; "
                     "where the seconds go (medians [min–max], each stage from the end of the one before): "
                     + "; ".join(f"{name} {median(values):.2f} s [{min(values):.2f}–{max(values):.2f}]"
                                 for name, values in stages.items())))
    write_result("grow", rows, quick=args.quick, settings={"repeat": repeat, "poll_interval_s": POLL_S,
                                                          "step_time_s": {s.name: s.step_time for s in SERIES}},
                 extra={"stages": stages_by_series})


if __name__ == "__main__":
    main()
