"""Grow latency on the mini cluster: a live job with max 4 runs on 3 nodes while a plain
Slurm job holds the 4th; the plain job is cancelled, and the time is measured from the
scancel until the first committed step at world size 4 (the new replica contributes).
The controller polls Slurm every second. Goal: ≤ poll interval + 3 s."""

from __future__ import annotations

import time

from bench.common import Row, median, parser, workspace, write_result
from bench.live import event_time
from bench.slurm_job import SlurmJob

POLL_S = 1.0


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    totals, decided, registered = [], [], []
    with workspace(args.keep, "grow") as folder, SlurmJob(folder, 4, POLL_S, blocked_nodes=1) as job:
        job.wait_world(3)
        for index in range(repeat):
            at = time.time()
            job.slurm.cancel(job.blockers.pop())
            first = job.event_after("unit_submitting", at)
            joined = job.event_after("unit_registered", at)
            job.wait_world(4)
            commits = job.commits_after(at, 4)
            totals.append(commits[0]["time"] - at)
            decided.append(event_time(first) - at)
            registered.append(event_time(joined) - at)
            print(f"grow: {index + 1}: unit submitted {decided[-1]:.2f} s, launcher registered {registered[-1]:.2f} s, "
                  f"first step at 4 {totals[-1]:.2f} s after the node was freed", flush=True)
            if index + 1 < repeat:
                job.resize(3)
                job.wait_world(3)
                time.sleep(2 * POLL_S)
                job.block_a_node()
                job.resize(4)
                time.sleep(2 * POLL_S)
    row = Row(benchmark="grow", metric="node freed (scancel of its job) → first step with its replica",
              unit="s", tidal=median(totals), goal=f"≤ poll interval + 3 s = {POLL_S + 3:g} s",
              met=median(totals) <= POLL_S + 3, tidal_samples=totals,
              note=f"poll interval {POLL_S:g} s; medians: unit submitted {median(decided):.2f} s, its launcher "
                   f"registered {median(registered):.2f} s after the scancel")
    write_result("grow", [row], quick=args.quick, settings={"repeat": repeat, "poll_interval_s": POLL_S})


if __name__ == "__main__":
    main()
