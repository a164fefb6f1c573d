"""Preemption on the mini cluster: a live job runs on 4 units (Slurm jobs); one unit's
Slurm job gets SIGTERM in all its processes (`scancel --signal=TERM --full`, what Slurm
sends when a preemption's GraceTime ends), and the time is measured until the job runs at
3 (the controller's `world_reconfigured` event), with the steps lost (abandoned in the
workers' ledger). Goals: 0 steps lost, ≤ 2 s (well inside a 30 s GraceTime)."""

from __future__ import annotations

import subprocess
import time

from bench.common import Row, median, parser, workspace, write_result
from bench.live import event_time
from bench.slurm_job import SlurmJob
from tidal.proto import admin_pb2

POLL_S = 1.0


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    times, lost = [], []
    with workspace(args.keep, "preemption") as folder, SlurmJob(folder, 4, POLL_S) as job:
        for index in range(repeat):
            running = job.wait_world(4)
            time.sleep(1.0)
            active = [u for u in running.units if u.state == admin_pb2.UNIT_STATE_ACTIVE]
            victim = max(active, key=lambda u: u.group_rank)
            at = time.time()
            subprocess.run(["scancel", "--signal=TERM", "--full", str(victim.slurm_job_id)], check=True, timeout=30)
            reconfigured = job.event_after("world_reconfigured", at)
            times.append(event_time(reconfigured) - at)
            job.wait_world(3)
            lost.append(len(job.abandoned_after(at)))
            print(f"preemption: {index + 1}: running at 3 after {times[-1]:.3f} s, {lost[-1]} steps lost",
                  flush=True)
            # The freed node is idle again once the unit's Slurm job ended: the job grows back.
    rows = [Row(benchmark="preemption", metric="SIGTERM at a unit → job running at N−1 (4 → 3)", unit="s",
                tidal=median(times), goal="≤ 2 s", met=max(times) <= 2.0, tidal_samples=times,
                note=f"poll interval {POLL_S:g} s (not involved: the launcher asks to leave at once)"),
            Row(benchmark="preemption", metric="steps lost to the SIGTERM", unit="steps", tidal=float(sum(lost)),
                goal="0", met=sum(lost) == 0, tidal_samples=[float(n) for n in lost],
                note="abandoned steps in the workers' ledger, all repetitions")]
    write_result("preemption", rows, quick=args.quick, settings={"repeat": repeat, "poll_interval_s": POLL_S})


if __name__ == "__main__":
    main()
