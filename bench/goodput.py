"""Goodput under churn on the mini cluster (4 nodes): the same fixed trace of other work
is played twice, once against Tidal (live mode, min 2, max 4, the example LM, a fallback
checkpoint every 20 steps) and once against the baseline, a static Slurm job of min = 2
nodes (srun + torchrun --max-restarts 3 running the plain DDP script, checkpoint every 20
steps, `--requeue` so that a preemption restarts it from its checkpoint).

The trace, as fractions of the duration D (600 s; --quick: 60 s):
  [0, 0.40)    background work holds 1 node (partition urgent: never preempted)
  [0.20, 0.35) an urgent job needs 1 node     (preempts when nothing is idle)
  [0.55, 0.70) an urgent job needs 2 nodes
  0.80         one worker of the training job is killed (kill -9)
  [0.85, 0.95) an urgent job needs 3 nodes

Goodput = node-seconds that became training progress / node-seconds the job held. Held:
squeue sampled every second (nodes of the job's running Slurm jobs). Progress: every step
counted once (a step redone after a restart counts once), each costing its world size ×
the median step time at that world size, so stalls count as held but not as progress.
Goal: Tidal ≥ 90% and ahead of the baseline."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import DDP_BASELINE, LM_EXAMPLE, TORCHRUN_ENV, Row, parser, read_jsonl, workspace, write_result
from tests.integration.conftest import ControllerProcess, free_port
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient, UnitSubmission

MODEL = ["--global-batch", "32", "--micro-batch", "16", "--context", "64", "--width", "64", "--layers", "2"]
MIN, MAX = 2, 4


class Trace:
    """Plays the other work of the trace; `hurt` kills one training worker at 0.8 D."""

    def __init__(self, slurm: CliJsonSlurmClient, folder: Path, duration: float, hurt: Callable[[], None]) -> None:
        self.slurm = slurm
        self.folder = folder
        self.duration = duration
        self.hurt = hurt
        self.jobs: dict[str, int] = {}

    def submit(self, name: str, nodes: int) -> None:
        self.jobs[name] = self.slurm.submit(UnitSubmission(
            name=f"trace-{name}", script="#!/bin/sh\nsleep 3600\n", partition="urgent", nodes=nodes,
            exclusive=True, requeue=False, output=str(self.folder / f"trace-{name}-%j.out")))

    def end(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.slurm.cancel(self.jobs.pop(name))

    def play(self, started: float, held: list[tuple[float, int]], count_held: Callable[[], int]) -> None:
        steps = [(0.20, lambda: self.submit("urgent-1", 1)), (0.35, lambda: self.end("urgent-1")),
                 (0.40, lambda: self.end("background")), (0.55, lambda: self.submit("urgent-2", 2)),
                 (0.70, lambda: self.end("urgent-2")), (0.80, self.hurt),
                 (0.85, lambda: self.submit("urgent-3", 3)), (0.95, lambda: self.end("urgent-3"))]
        while True:
            now = time.time() - started
            if now >= self.duration:
                break
            while steps and now >= steps[0][0] * self.duration:
                steps.pop(0)[1]()
            with contextlib.suppress(Exception):
                held.append((time.time(), count_held()))
            time.sleep(1.0)
        for name in list(self.jobs):
            self.end(name)


def held_node_seconds(samples: list[tuple[float, int]]) -> float:
    return sum(nodes * (t1 - t0) for (t0, nodes), (t1, _) in itertools.pairwise(samples))


def progress_node_seconds(steps: list[tuple[int, float, int]]) -> tuple[float, int]:
    """(node-seconds, distinct steps) from (step, time, world size) of rank 0's steps."""
    first: dict[int, tuple[float, int]] = {}
    for step, at, world in sorted(steps, key=lambda s: s[1]):
        first.setdefault(step, (at, world))
    ordered = sorted(first.items())
    durations: dict[int, list[float]] = {}
    for (step, (at, world)), (next_step, (next_at, next_world)) in itertools.pairwise(ordered):
        if next_step == step + 1 and next_world == world and next_at > at:
            durations.setdefault(world, []).append(next_at - at)
    typical = {world: statistics.median(values) for world, values in durations.items()}
    fallback = statistics.median([v for values in durations.values() for v in values]) if durations else 0.0
    return sum(world * typical.get(world, fallback) for _, (_, world) in ordered), len(ordered)


def kill_one_worker(log_dir: Path, pattern: str) -> None:
    """SIGKILL a live worker other than rank 0, found by its log file's name (<kind>-<pid>.jsonl)."""
    for path in sorted(log_dir.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
        pid = int(path.stem.rsplit("-", 1)[1])
        records = read_jsonl([path])
        if records and records[-1].get("rank", 0) != 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                print(f"goodput: killed worker pid {pid}", flush=True)
                return


def run_tidal(folder: Path, slurm: CliJsonSlurmClient, duration: float) -> tuple[float, float, int]:
    folder.mkdir(parents=True, exist_ok=True)
    ledger = folder / "ledger"
    controller = ControllerProcess(folder, {"slurm_units": "true", "slurm_poll_interval_s": "1",
                                            "join_settle_s": "1", "node_cooldown_s": "30"})
    trace = Trace(slurm, folder, duration, lambda: kill_one_worker(ledger, "ledger-*.jsonl"))
    trace.submit("background", 1)
    time.sleep(2.0)
    controller.start()
    held: list[tuple[float, int]] = []
    try:
        spec = admin_pb2.JobSpec(
            name="goodput", min_replicas=MIN, max_replicas=MAX, partition="train", mode=common_pb2.JOB_MODE_LIVE,
            working_dir=str(folder), environment={"OMP_NUM_THREADS": "1"},
            command=[sys.executable, str(LM_EXAMPLE), "--steps", "1000000", "--log-every", "100000",
                     "--ledger-dir", str(ledger), "--checkpoint-dir", str(folder / "checkpoints"),
                     "--checkpoint-every", "20", *MODEL])
        with controller.admin() as admin:
            job_id = admin.submit(spec).job.job_id
        started = time.time()

        def count_held() -> int:
            return sum(len(j.nodes) for j in slurm.list_jobs()
                       if j.name.startswith(f"tidal-{job_id}-") and j.state.value == "RUNNING")

        trace.play(started, held, count_held)
        with controller.admin() as admin:
            admin.cancel(job_id)
    finally:
        for name in list(trace.jobs):
            trace.end(name)
        controller.stop()
    steps = [(r["step"], r["time"], r["world_size"]) for r in read_jsonl(sorted(ledger.glob("ledger-*.jsonl")))
             if r["kind"] == "commit" and r["rank"] == 0]
    progress, distinct = progress_node_seconds(steps)
    return progress, held_node_seconds(held), distinct


def run_baseline(folder: Path, slurm: CliJsonSlurmClient, duration: float) -> tuple[float, float, int]:
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "ddp-log"
    port = free_port()
    script = "\n".join([
        "#!/bin/bash",
        "export " + " ".join(f"{name}={value}" for name, value in TORCHRUN_ENV.items()),
        f"exec srun --nodes {MIN} --ntasks-per-node 1 {sys.executable} -m torch.distributed.run --nnodes {MIN} "
        f"--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id goodput "
        f"--max-restarts 3 {DDP_BASELINE} --steps 1000000 --checkpoint {folder / 'checkpoint.pt'} "
        f"--checkpoint-every 20 --log-dir {logs} {' '.join(MODEL)}", ""])
    trace = Trace(slurm, folder, duration, lambda: kill_one_worker(logs, "ddp-*.jsonl"))
    trace.submit("background", 1)
    time.sleep(2.0)
    job = slurm.submit(UnitSubmission(name="goodput-static", script=script, partition="train", nodes=MIN,
                                      exclusive=True, requeue=True, working_dir=str(folder),
                                      output=str(folder / "static-%j.out")))
    held: list[tuple[float, int]] = []
    try:
        started = time.time()

        def count_held() -> int:
            found = slurm.get_job(job)
            return len(found.nodes) if found.state.value == "RUNNING" else 0

        trace.play(started, held, count_held)
    finally:
        slurm.cancel(job)
        for name in list(trace.jobs):
            trace.end(name)
    steps = [(r["step"], r["time"], r["world_size"]) for r in read_jsonl(sorted(logs.glob("*.jsonl")))
             if r["rank"] == 0]
    progress, distinct = progress_node_seconds(steps)
    return progress, held_node_seconds(held), distinct


def wait_for_idle_cluster(slurm: CliJsonSlurmClient) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(n.is_idle_and_usable for n in slurm.list_nodes()) and not any(j.is_active for j in slurm.list_jobs()):
            return
        time.sleep(1.0)
    raise SystemExit("goodput: the mini cluster is not idle (scripts/minicluster up, nothing else running)")


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    duration = 60.0 if args.quick else 600.0
    slurm = CliJsonSlurmClient(timeout_s=10)
    with workspace(args.keep, "goodput") as folder:
        wait_for_idle_cluster(slurm)
        tidal = run_tidal(folder / "tidal", slurm, duration)
        wait_for_idle_cluster(slurm)
        baseline = run_baseline(folder / "baseline", slurm, duration)
        wait_for_idle_cluster(slurm)
    fraction = {name: progress / held if held else 0.0 for name, (progress, held, _) in
                (("tidal", tidal), ("baseline", baseline))}
    for name, (progress, held, steps) in (("Tidal", tidal), ("baseline", baseline)):
        print(f"goodput: {name}: {steps} steps, progress {progress:.0f} node-s of {held:.0f} held", flush=True)
    row = Row(benchmark="goodput", metric=f"goodput under churn, {duration:.0f} s trace", unit="fraction",
              tidal=fraction["tidal"], baseline=fraction["baseline"],
              baseline_name=f"static {MIN}-node job, torchrun --max-restarts, checkpoint-restart on preemption",
              goal="Tidal ≥ 90% and ahead", met=fraction["tidal"] >= 0.9 and fraction["tidal"] > fraction["baseline"],
              ratio=fraction["tidal"] / fraction["baseline"] if fraction["baseline"] else None,
              ratio_meaning="Tidal / baseline goodput",
              note=f"steps done: Tidal {tidal[2]}, baseline {baseline[2]}; node-seconds held: Tidal {tidal[1]:.0f}, "
                   f"baseline {baseline[1]:.0f}")
    write_result("goodput", [row], quick=args.quick, settings={"duration_s": duration, "min": MIN, "max": MAX,
                                                                "model": " ".join(MODEL)})


if __name__ == "__main__":
    main()
