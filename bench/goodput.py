"""Goodput under churn on the mini cluster (4 nodes), on simulated accelerators: the same
fixed trace of other work is played against Tidal (live mode, min 2, max 4, the example LM,
a fallback checkpoint every 20 steps), against the static baseline (a Slurm job of min = 2
nodes: srun + torchrun --max-restarts 3 running the plain DDP script, checkpoint every 20
steps, `--requeue` so that a preemption restarts it from its checkpoint) and, when torchft
is installed, against torchft (4 replica groups, each a 1-node Slurm job with `--requeue`
whose script restarts its process up to 3 times, torchft's Manager and pure DDP wrapper
on gloo, its lighthouse on loopback; a group that comes back heals from a live peer).

Every worker of the three trains the real (small) LM on a simulated H100
(`tidal.train.simulated`: each micro-batch's device time and each step's ring all-reduce
time slept, a 1B-parameter model of 4096 tokens a sample; --quick: 0.1B), so a node's
throughput does not depend on how many others share this machine's 2 cores.

The trace, as fractions of the duration D (600 s, --duration; --quick: 20 s):
  [0, 0.40)    background work holds 1 node (partition urgent: never preempted)
  [0.20, 0.35) an urgent job needs 1 node     (preempts when nothing is idle)
  [0.55, 0.70) an urgent job needs 2 nodes
  0.80         one worker of the training job is killed (kill -9)
  [0.85, 0.95) an urgent job needs 3 nodes

Goodput = node-seconds that became training progress / node-seconds the job held. Held:
squeue sampled every second (nodes of the job's running Slurm jobs). Progress: what the
system committed, every step counted once (a step redone after a restart counts once;
torchft: a step its quorum committed, with its groups' shares of samples), each at the
node-seconds an ideal run on the simulated devices spends on that step at its world size
(`ideal_step_node_seconds`), so a slow step, a stall or a redone step costs its real time
and earns only its ideal one. Each system plays the trace 3 times (--repeat). Where the held
node-seconds went (`breakdown`: training, steps slower than ideal, joining, stopped, below
min) is in the result's text. Goal: Tidal ≥ 95% and ahead of both.

Held node-seconds leave out what a job never asked for, so a second row divides the same
progress by the node-seconds the trace's other work left free (the cluster's nodes minus
those the trace's jobs held, from the same squeue samples): the capacity an elastic job
could have turned into training. Those samples show what the trace's jobs got, not what they
asked for: a system that holds a node an urgent job waits for gains it as free and trains
on it. So two more rows, reported without a goal: the same measure against the trace's
schedule (`SCHEDULE`: the node-seconds it leaves free, the same for every system, and the
progress made on them, a step's share capped at the nodes the schedule left free then),
and how long the urgent jobs waited for their nodes (Slurm's submit and start times).

Not modelled: the time a 1B model's checkpoint write, load or state transfer would take
(each is the small model's real time here), which flatters the static baseline most;
torchft keeps its per-group batch, so its global batch shrinks with its groups (Tidal's
stays fixed): its node-seconds of progress are counted the same way."""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    DDP_BASELINE,
    LM_EXAMPLE,
    TORCHRUN_ENV,
    Row,
    code_version,
    median,
    parser,
    read_jsonl,
    stop_on_sigterm,
    workspace,
    write_result,
)
from bench.scaling import simulation_flags
from bench.torchft_job import lighthouse_command, replica_command, torchft_lighthouse, torchft_name
from tests.integration.conftest import ControllerProcess, free_port
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient, Job, JobState, UnitSubmission
from tidal.train.simulated import ACCELERATORS, Simulation

MODEL = ["--global-batch", "32", "--micro-batch", "16", "--context", "64", "--width", "64", "--layers", "2"]
GLOBAL_BATCH = int(MODEL[MODEL.index("--global-batch") + 1])
MIN, MAX = 2, 4
SIMULATION = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)
QUICK_SIMULATION = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e8, tokens_per_sample=4096)
GOAL = 0.95
# How long the static job's script waits after a failed srun (preempted: Slurm requeues it
# at the end of the partition's GraceTime, 5 s on the mini cluster, and kills the wait).
STATIC_REQUEUE_WAIT_S = 30
# The controller's settings for the trace (the rest are the defaults): a 1 s poll, a short
# settle, a 30 s cool-down of a node whose unit failed (the trace's 4 nodes would otherwise
# lose one for 5 minutes; the trace's one kill -9 of a worker spares its node, as a first
# kill does: `node_suspect`), and up to max - min units kept queued in Slurm below
# max_replicas, so that Slurm starts one the moment a node frees, as it starts torchft's
# requeued replica groups (all MAX of them wait in its queue).
TIDAL_SETTINGS = {"slurm_poll_interval_s": "1", "join_settle_s": "1", "node_cooldown_s": "30",
                  "queued_units": str(MAX - MIN)}
# The trace's other work: (name, from, to, nodes), as fractions of the duration D from the
# training job's start (the background job is submitted before it: 2 s, and for Tidal
# also the job's submission; no sample is taken before the start); one worker is killed
# at HURT_AT.
SCHEDULE = (("background", 0.0, 0.40, 1), ("urgent-1", 0.20, 0.35, 1), ("urgent-2", 0.55, 0.70, 2),
            ("urgent-3", 0.85, 0.95, 3))
HURT_AT = 0.80


class Trace:
    """Plays the other work of the trace (`SCHEDULE`); `hurt` kills one training worker at
    HURT_AT × D."""

    def __init__(self, slurm: CliJsonSlurmClient, folder: Path, duration: float, hurt: Callable[[], None]) -> None:
        self.slurm = slurm
        self.folder = folder
        self.duration = duration
        self.hurt = hurt
        self.jobs: dict[str, int] = {}
        self.started = 0.0
        # Each urgent job's wait for its nodes: Slurm's start time - its submit time (1 s
        # resolution), as an squeue shows them; one that never started waited at least its
        # whole window (from its submission to its end here), and is named in `unstarted`.
        self.waits: dict[str, float] = {}
        self.unstarted: set[str] = set()
        self.submitted: dict[str, float] = {}

    def submit(self, name: str, nodes: int) -> None:
        self.submitted[name] = time.time()
        self.jobs[name] = self.slurm.submit(UnitSubmission(
            name=f"trace-{name}", script="#!/bin/sh\nsleep 3600\n", partition="urgent", nodes=nodes,
            exclusive=True, requeue=False, output=str(self.folder / f"trace-{name}-%j.out")))

    def end(self, name: str) -> None:
        key = f"trace-{name}"
        if name.startswith("urgent") and name in self.submitted and key not in self.waits:
            # Started since the last sample?
            with contextlib.suppress(Exception):
                self._note_waits([j for j in self.slurm.list_jobs() if j.job_id == self.jobs.get(name)])
            if key not in self.waits:
                self.waits[key] = time.time() - self.submitted[name]
                self.unstarted.add(key)
        with contextlib.suppress(Exception):
            self.slurm.cancel(self.jobs.pop(name))

    def _note_waits(self, jobs: list[Job]) -> None:
        for job in jobs:
            if (job.state == JobState.RUNNING and job.name.startswith("trace-urgent") and job.start_time
                    and job.submit_time):
                self.waits.setdefault(job.name, (job.start_time - job.submit_time).total_seconds())

    def scheduled_nodes(self, at: float) -> int:
        """The nodes the trace's other work asks for at time `at` (from its schedule, not
        from what Slurm gave it: an urgent job waiting for a node wants it all the same)."""
        since = (at - self.started) / self.duration
        return sum(nodes for _, begin, end, nodes in SCHEDULE if begin <= since < end)

    def play(self, started: float, is_training: Callable[[Job], bool]) -> list[tuple[float, int, int]]:
        """Plays the trace; returns one sample a second: (time, nodes the training job holds,
        nodes the trace's other work holds), from one squeue each."""
        self.started = started
        samples: list[tuple[float, int, int]] = []
        steps: list[tuple[float, Callable[[], None]]] = [(HURT_AT, self.hurt)]
        for name, begin, end, nodes in SCHEDULE:
            if name != "background":  # submitted before the training job
                steps.append((begin, functools.partial(self.submit, name, nodes)))
            steps.append((end, functools.partial(self.end, name)))
        steps.sort(key=lambda step: step[0])
        while True:
            now = time.time() - started
            if now >= self.duration:
                break
            while steps and now >= steps[0][0] * self.duration:
                steps.pop(0)[1]()
            with contextlib.suppress(Exception):
                running = [j for j in self.slurm.list_jobs() if j.state == JobState.RUNNING]
                samples.append((time.time(), sum(len(j.nodes) for j in running if is_training(j)),
                                sum(len(j.nodes) for j in running if j.name.startswith("trace-"))))
                self._note_waits(running)
            time.sleep(1.0)
        for name in list(self.jobs):
            self.end(name)
        return samples


@dataclass(frozen=True)
class Commit:
    """A step as first committed: when, by how many replicas (nodes), with how many samples."""

    step: int
    time: float
    world: int
    samples: int


# Where a system's held node-seconds went (`breakdown`), in RESULTS.md's order.
PARTS = ("training (ideal)", "steps slower than ideal", "joining (held, not in the world yet: Slurm start, Python, "
         "torch, model, state)", "stopped (at or above min: re-forming, recovering, restarting)",
         "below min (waiting for nodes)")


@dataclass(frozen=True)
class Outcome:
    """One play of the trace: node-seconds of training progress, node-seconds the job held,
    node-seconds the trace's other work left free (the capacity an elastic job could use),
    the distinct steps and samples committed, and where the held node-seconds went."""

    progress: float
    held: float
    free: float
    steps: int
    samples: int
    parts: dict[str, float]
    # The squeue samples (time, nodes the job held, nodes the trace's other work held) and
    # the first commits (step, time, world size, samples): what the figures come from.
    samples_taken: tuple[tuple[float, int, int], ...] = ()
    commits: tuple[tuple[int, float, int, int], ...] = ()
    # The same against the trace's schedule (`Trace.scheduled_nodes`): the node-seconds it
    # leaves free, a node an urgent job waits for not counted; the progress made on them
    # (each step's share at most the nodes the schedule left free then, over its world);
    # and the urgent jobs' waits for their nodes, in seconds (of them, `urgent_unstarted`
    # never started: their whole window counted).
    scheduled_free: float = 0.0
    scheduled_progress: float = 0.0
    urgent_waits: tuple[float, ...] = ()
    urgent_unstarted: int = 0
    # When the play started (the trace's time 0), and where it lost by trace event
    # (`losses_by_segment`; with the trace played).
    started: float = 0.0
    segments: tuple[tuple[str, float, float], ...] = ()
    # The cluster's nodes (free = these less the trace's other work's).
    nodes: int = 0


def ideal_step_node_seconds(simulation: Simulation, samples: int, world: int, micro_batch: int) -> float:
    """The node-seconds an ideal run spends on a step of `samples` samples over `world`
    replicas on the simulated devices: each replica's share (the largest, when they differ)
    in micro-batches of at most `micro_batch`, plus the gradient all-reduce, times `world`."""
    share = -(-samples // world)
    chunks = [micro_batch] * (share // micro_batch) + ([share % micro_batch] if share % micro_batch else [])
    reduction = simulation.reduction_seconds(world) if world > 1 else 0.0
    return world * (sum(simulation.micro_batch_seconds(c) for c in chunks) + reduction)


def held_node_seconds(samples: list[tuple[float, int, int]]) -> float:
    """The node-seconds the job held: each squeue sample's nodes until the next sample."""
    return sum(held * (t1 - t0) for (t0, held, _), (t1, _, _) in itertools.pairwise(samples))


def trace_segments(duration: float) -> list[tuple[str, float, float]]:
    """The trace cut at its events (`SCHEDULE`'s starts and ends, the kill at HURT_AT):
    (the event that opens the segment, from, to) in seconds from the training job's start;
    together they cover [0, duration)."""
    events = {0.0: "start", HURT_AT: "kill -9 of a worker"}
    for name, begin, end, _ in SCHEDULE:
        if begin > 0:
            events[begin] = f"{name} submitted"
        events.setdefault(end, f"{name} ended")
    edges = sorted(events)
    # (Rounded to the microsecond: 0.55 × 100 is 55.00000000000001 in floating point.)
    return [(events[at], round(at * duration, 6), round((edges[i + 1] if i + 1 < len(edges) else 1.0) * duration, 6))
            for i, at in enumerate(edges)]


def losses_by_segment(commits: list[Commit], samples: list[tuple[float, int, int]], nodes: int, started: float,
                      duration: float, simulation: Simulation, micro_batch: int) -> list[tuple[str, float, float]]:
    """Where a play lost, by trace event: for each of `trace_segments`, (its event, the
    node-seconds the trace's other work left free in it, those free node-seconds that did
    not become progress). A commit's progress counts in the segment where it was committed;
    samples and commits after the last segment's end count in it."""
    segments = trace_segments(duration)
    found: list[tuple[str, float, float]] = []
    for index, (event, begin, end) in enumerate(segments):
        last = index == len(segments) - 1

        def inside(at: float, begin: float = begin, end: float = end, last: bool = last) -> bool:
            return begin <= at - started and (last or at - started < end)

        free = sum((nodes - other) * (t1 - t0) for (t0, _, other), (t1, _, _) in itertools.pairwise(samples)
                   if inside(t0))
        progress = sum(ideal_step_node_seconds(simulation, c.samples, c.world, micro_batch) for c in commits
                       if inside(c.time))
        found.append((event, free, free - progress))
    return found


def segments_table(plays: dict[str, list[list[tuple[str, float, float]]]]) -> str:
    """RESULTS.md's table of `losses_by_segment` for every system: medians over the plays."""
    names = list(plays)
    events = [event for event, _, _ in next(iter(plays.values()))[0]]
    header = ("| from the event | " + " | ".join(f"{name}: free | {name}: not progress" for name in names)
              + " |\n|---|" + "---|---|" * len(names) + "\n")
    lines = []
    for index, event in enumerate([*events, "the whole trace"]):
        cells = []
        for name in names:
            if index < len(events):
                free = [play[index][1] for play in plays[name]]
                lost = [play[index][2] for play in plays[name]]
            else:
                free = [sum(part[1] for part in play) for play in plays[name]]
                lost = [sum(part[2] for part in play) for play in plays[name]]
            cells += [f"{statistics.median(free):.0f}",
                      f"{statistics.median(lost):.0f} ({', '.join(f'{value:.0f}' for value in lost)})"]
        lines.append(f"| {event} | " + " | ".join(cells) + " |")
    return header + "\n".join(lines)


def first_commits(records: list[Commit]) -> list[Commit]:
    """Each step once, as first committed (a step redone after a restart counts once)."""
    first: dict[int, Commit] = {}
    for commit in sorted(records, key=lambda c: c.time):
        first.setdefault(commit.step, commit)
    return sorted(first.values(), key=lambda c: c.time)


def outcome(records: list[Commit], samples: list[tuple[float, int, int]], nodes: int, simulation: Simulation,
            minimum: int, trace: Trace | None = None) -> Outcome:
    """One play's figures, from the steps first committed while the samples were taken;
    with the `trace` played, also against its schedule, and its urgent jobs' waits."""
    commits = [c for c in first_commits(records) if samples and samples[0][0] <= c.time <= samples[-1][0]]
    micro = int(MODEL[MODEL.index("--micro-batch") + 1])
    costs = [ideal_step_node_seconds(simulation, c.samples, c.world, micro) for c in commits]
    progress = sum(costs)
    pairs = list(itertools.pairwise(samples))
    free = sum((nodes - other) * (t1 - t0) for (t0, _, other), (t1, _, _) in pairs)
    if trace is None:
        scheduled_free, scheduled_progress = free, progress
    else:
        scheduled = trace.scheduled_nodes
        scheduled_free = sum((nodes - scheduled(t0)) * (t1 - t0) for (t0, _, _), (t1, _, _) in pairs)
        scheduled_progress = sum(cost * min(c.world, max(0, nodes - scheduled(c.time))) / c.world
                                 for c, cost in zip(commits, costs, strict=True))
    return Outcome(progress=progress, held=held_node_seconds(samples),
                   free=free, steps=len(commits),
                   samples=sum(c.samples for c in commits),
                   parts=breakdown(commits, samples, progress, minimum, simulation, micro),
                   samples_taken=tuple(samples),
                   commits=tuple((c.step, c.time, c.world, c.samples) for c in commits),
                   scheduled_free=scheduled_free, scheduled_progress=scheduled_progress,
                   urgent_waits=tuple(trace.waits.values()) if trace else (),
                   urgent_unstarted=len(trace.unstarted) if trace else 0,
                   started=trace.started if trace else 0.0, nodes=nodes,
                   segments=tuple(losses_by_segment(commits, samples, nodes, trace.started, trace.duration,
                                                    simulation, micro)) if trace else ())


def breakdown(commits: list[Commit], samples: list[tuple[float, int, int]], progress: float, minimum: int,
              simulation: Simulation, micro_batch: int) -> dict[str, float]:
    """Where the held node-seconds went, from the squeue samples and the first commits
    alone (the same for every system). Between two commits less than 3 ideal steps (+ 1 s)
    apart the world trains with the later one's nodes: those node-seconds are training
    (the ideal share, `progress`) or steps slower than ideal (the rest); nodes held beyond
    it are joining. Elsewhere nothing trains: held nodes are stopped (at or above
    `minimum`) or below min."""
    spans: list[tuple[float, float, int]] = []
    for before, after in itertools.pairwise(commits):
        ideal_s = ideal_step_node_seconds(simulation, after.samples, after.world, micro_batch) / after.world
        if after.time - before.time <= 3 * ideal_s + 1.0:
            spans.append((before.time, after.time, after.world))
    parts = dict.fromkeys(PARTS, 0.0)
    contributing = 0.0
    index = 0
    for (t0, held, _), (t1, _, _) in itertools.pairwise(samples):
        covered = 0.0
        while index < len(spans) and spans[index][1] <= t0:
            index += 1
        for start, end, world in spans[index:]:
            if start >= t1:
                break
            overlap = min(t1, end) - max(t0, start)
            if overlap > 0:
                covered += overlap
                contributing += min(world, held) * overlap
                parts[PARTS[2]] += max(0, held - world) * overlap
        idle = (t1 - t0) - covered
        parts[PARTS[4] if held < minimum else PARTS[3]] += held * idle
    parts[PARTS[0]] = min(progress, contributing)
    parts[PARTS[1]] = max(0.0, contributing - progress)
    return parts


def progress_node_seconds(steps: list[tuple[int, float, int]]) -> tuple[float, int]:
    """(node-seconds, distinct steps) from (step, time, world size) of rank 0's steps,
    each step at its world size × the median step time there (the measure before the
    committed samples: kept for comparison in the note)."""
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


def kill_one_worker(log_dir: Path, pattern: str, is_first: Callable[[dict[str, object]], bool]) -> None:
    """SIGKILL a live worker other than the first (rank 0; torchft: replica group 0), found
    by its log file's name (<kind>-…-<pid>.jsonl)."""
    for path in sorted(log_dir.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
        pid = int(path.stem.rsplit("-", 1)[1])
        records = read_jsonl([path])
        if records and not is_first(records[-1]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                print(f"goodput: killed worker pid {pid}", flush=True)
                return


def is_rank_zero(record: dict[str, object]) -> bool:
    return record.get("rank", 0) == 0


def run_tidal(folder: Path, slurm: CliJsonSlurmClient, duration: float, simulation: Simulation) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    ledger = folder / "ledger"
    controller = ControllerProcess(folder, {**TIDAL_SETTINGS, "slurm_units": "true"})
    trace = Trace(slurm, folder, duration, lambda: kill_one_worker(ledger, "ledger-*.jsonl", is_rank_zero))
    samples: list[tuple[float, int, int]] = []
    try:
        # The controller is a long-running service: it is up before the trace, as torchft's
        # lighthouse is (started before its background job and the 2 s wait). Started after
        # them, its first poll came just before the submission, which then waited for the
        # next poll (1 s). (In the try: a controller that does not come up in time is
        # stopped too.)
        controller.start()
        trace.submit("background", 1)
        time.sleep(2.0)
        spec = admin_pb2.JobSpec(
            name="goodput", min_replicas=MIN, max_replicas=MAX, partition="train", mode=common_pb2.JOB_MODE_LIVE,
            working_dir=str(folder), environment={"OMP_NUM_THREADS": "1"},
            command=[sys.executable, str(LM_EXAMPLE), "--steps", "1000000", "--log-every", "100000",
                     "--ledger-dir", str(ledger), "--checkpoint-dir", str(folder / "checkpoints"),
                     "--checkpoint-every", "20", *MODEL, *simulation_flags(simulation)])
        with controller.admin() as admin:
            job_id = admin.submit(spec).job.job_id
        started = time.time()

        samples = trace.play(started, lambda j: j.name.startswith(f"tidal-{job_id}-"))
        with controller.admin() as admin:
            admin.cancel(job_id)
    finally:
        for name in list(trace.jobs):
            trace.end(name)
        controller.stop()
    commits = [Commit(r["step"], r["time"], r["world_size"], GLOBAL_BATCH)
               for r in read_jsonl(sorted(ledger.glob("ledger-*.jsonl"))) if r["kind"] == "commit" and r["rank"] == 0]
    return outcome(commits, samples, len(slurm.list_nodes()), simulation, MIN, trace)


def static_script(port: int, folder: Path, logs: Path, simulation: Simulation,
                  requeue_wait_s: float = STATIC_REQUEUE_WAIT_S) -> str:
    """The static job's batch script: srun + torchrun --max-restarts 3 running the plain DDP
    script, which resumes from its checkpoint. Slurm preempts a job of partition train with
    SIGTERM and requeues it at the end of its GraceTime, but only if it is still running
    then: one that has ended is done for good. torchrun exits on SIGTERM at once, so the
    script outlives it (SIGTERM caught, a failed srun followed by a wait that Slurm's requeue
    ends) and the preempted job comes back from its checkpoint, as `--requeue` promises."""
    return "\n".join([
        "#!/bin/bash",
        "export " + " ".join(f"{name}={value}" for name, value in TORCHRUN_ENV.items()),
        "trap 'echo \"static: SIGTERM: waiting for Slurm to requeue the job\"' TERM",
        f"srun --nodes {MIN} --ntasks-per-node 1 {sys.executable} -m torch.distributed.run --nnodes {MIN} "
        f"--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id goodput "
        f"--max-restarts 3 {DDP_BASELINE} --steps 1000000 --checkpoint {folder / 'checkpoint.pt'} "
        f"--checkpoint-every 20 --log-dir {logs} {' '.join([*MODEL, *simulation_flags(simulation)])}",
        "status=$?",
        f"[ $status -eq 0 ] || sleep {requeue_wait_s:g}",
        "exit $status", ""])


def run_baseline(folder: Path, slurm: CliJsonSlurmClient, duration: float, simulation: Simulation) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "ddp-log"
    port = free_port()
    script = static_script(port, folder, logs, simulation)
    trace = Trace(slurm, folder, duration, lambda: kill_one_worker(logs, "ddp-*.jsonl", is_rank_zero))
    trace.submit("background", 1)
    time.sleep(2.0)
    job = slurm.submit(UnitSubmission(name="goodput-static", script=script, partition="train", nodes=MIN,
                                      exclusive=True, requeue=True, working_dir=str(folder),
                                      output=str(folder / "static-%j.out")))
    samples: list[tuple[float, int, int]] = []
    try:
        samples = trace.play(time.time(), lambda j: j.job_id == job)
    finally:
        slurm.cancel(job)
        for name in list(trace.jobs):
            trace.end(name)
    commits = [Commit(r["step"], r["time"], r["world_size"], GLOBAL_BATCH)
               for r in read_jsonl(sorted(logs.glob("*.jsonl"))) if r["rank"] == 0]
    return outcome(commits, samples, len(slurm.list_nodes()), simulation, MIN, trace)


def run_torchft(folder: Path, slurm: CliJsonSlurmClient, duration: float, simulation: Simulation,
                lighthouse: Path) -> Outcome:
    """torchft on the trace: its lighthouse here (loopback), MAX replica groups, each a 1-node
    Slurm job (partition train, --requeue) whose script restarts its process up to 3 times,
    as torchrun --max-restarts 3 does for the static job."""
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "torchft-log"
    port = free_port()
    with open(folder / "lighthouse.log", "wb") as lighthouse_log:
        beacon = subprocess.Popen(lighthouse_command(lighthouse, port, min_replicas=MIN),
                                  stdout=lighthouse_log, stderr=subprocess.STDOUT, start_new_session=True)
    trace = Trace(slurm, folder, duration,
                  lambda: kill_one_worker(logs, "torchft-*.jsonl", lambda r: r.get("replica") == 0))
    trace.submit("background", 1)
    time.sleep(2.0)
    groups: list[int] = []
    samples: list[tuple[float, int, int]] = []
    try:
        for replica in range(MAX):
            command = shlex.join(replica_command(replica, MAX, port, logs, [*MODEL, *simulation_flags(simulation)],
                                                 wrapper="pure"))
            script = "\n".join(["#!/bin/bash", "export OMP_NUM_THREADS=1",
                                 f"for attempt in 0 1 2 3; do {command} && break; done", ""])
            groups.append(slurm.submit(UnitSubmission(
                name=f"goodput-torchft-{replica}", script=script, partition="train", nodes=1, exclusive=True,
                requeue=True, working_dir=str(folder), output=str(folder / f"torchft-{replica}-%j.out"))))
        samples = trace.play(time.time(), lambda j: j.job_id in groups)
    finally:
        for job in groups:
            with contextlib.suppress(Exception):
                slurm.cancel(job)
        for name in list(trace.jobs):
            trace.end(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(beacon.pid, signal.SIGKILL)
        beacon.wait(10)
    # Each group trains its own share a step (torchft keeps the per-group batch).
    commits = [Commit(r["step"], r["time"], r["world_size"], GLOBAL_BATCH // MAX * r["world_size"])
               for r in read_jsonl(sorted(logs.glob("torchft-*.jsonl"))) if r["committed"]]
    return outcome(commits, samples, len(slurm.list_nodes()), simulation, MIN, trace)


def wait_for_idle_cluster(slurm: CliJsonSlurmClient) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(n.is_idle_and_usable for n in slurm.list_nodes()) and not any(j.is_active for j in slurm.list_jobs()):
            return
        time.sleep(1.0)
    raise SystemExit("goodput: the mini cluster is not idle (scripts/minicluster up, nothing else running)")


def main() -> None:
    arguments = parser(__doc__.split("\n\n")[0])
    arguments.add_argument("--duration", type=float, default=None,
                           help="the trace's length D in seconds (default 600; --quick: 20)")
    arguments.add_argument("--systems", default="tidal,static,torchft",
                           help="which systems play the trace (comma-separated); with fewer than all three the "
                                "plays are printed and no result is written")
    arguments.add_argument("--retell", type=Path, default=None, metavar="RESULT",
                           help="rewrite a stored result's text (where the node-seconds went, by part and by trace "
                                "event) from its plays, then stop: no trace is played")
    args = arguments.parse_args()
    if args.retell is not None:
        retell(args.retell)
        return
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    systems = {name.strip() for name in args.systems.split(",") if name.strip()}
    if not systems or systems - {"tidal", "static", "torchft"}:
        raise SystemExit(f"goodput: --systems takes tidal, static and torchft, got {args.systems!r}")
    duration = args.duration or (20.0 if args.quick else 600.0)
    simulation = QUICK_SIMULATION if args.quick else SIMULATION
    # Three plays of each by default (--quick: one): each plays the whole trace.
    repeat = args.repeat or (1 if args.quick else 3)
    slurm = CliJsonSlurmClient(timeout_s=10)
    lighthouse = torchft_lighthouse()
    if lighthouse is None:
        print("goodput: torchft is not installed here (pip install torchft==0.2.0): its rows are left out",
              flush=True)
    runs: dict[str, list[Outcome]] = {name: [] for name in ("tidal", "static", "torchft") if name in systems
                                      and (name != "torchft" or lighthouse is not None)}
    with workspace(args.keep, "goodput") as folder:
        for index in range(repeat):
            for name, run in (("tidal", run_tidal), ("static", run_baseline)):
                if name not in runs:
                    continue
                wait_for_idle_cluster(slurm)
                runs[name].append(run(folder / f"{name}-{index}", slurm, duration, simulation))
            if "torchft" in runs and lighthouse is not None:
                wait_for_idle_cluster(slurm)
                runs["torchft"].append(run_torchft(folder / f"torchft-{index}", slurm, duration, simulation,
                                                   lighthouse))
            wait_for_idle_cluster(slurm)
            for name, result in ((n, r[-1]) for n, r in runs.items()):
                print(f"goodput: {name} run {index + 1}: {result.steps} steps, {result.samples} samples, progress "
                      f"{result.progress:.0f} node-s of {result.held:.0f} held, {result.free:.0f} left free by the "
                      "trace; " + ", ".join(f"{part} {seconds:.0f}" for part, seconds in result.parts.items())
                      + f"; by the trace's schedule: {result.scheduled_progress:.0f} node-s of progress on "
                      f"{result.scheduled_free:.0f} left free; the urgent jobs waited "
                      + ", ".join(f"{wait:.0f}" for wait in result.urgent_waits) + " s for their nodes"
                      + (f" ({result.urgent_unstarted} of them never started: each counted with its whole window)"
                         if result.urgent_unstarted else ""), flush=True)
    if systems != {"tidal", "static", "torchft"}:
        print(f"goodput: {', '.join(sorted(systems))} only (--systems): no result written", flush=True)
        return
    names = {"static": f"static {MIN}-node job, torchrun --max-restarts, checkpoint-restart on preemption",
             "torchft": f"{torchft_name('pure', min_replicas=MIN)}; {MAX} replica groups as 1-node Slurm jobs "
                        "with --requeue"}
    runs_note = "; ".join(
        f"run {i + 1}: " + ", ".join(f"{name} {results[i].steps} steps ({results[i].samples} samples), "
                                     f"{results[i].held:.0f} node-s held of {results[i].free:.0f} left free"
                                     for name, results in runs.items())
        for i in range(repeat))
    ratios = {denominator: {name: [r.progress / (getattr(r, denominator) or float("inf")) for r in results]
                            for name, results in runs.items()} for denominator in ("held", "free")}
    ahead = {denominator: all(median(values["tidal"]) > median(v) for name, v in values.items() if name != "tidal")
             for denominator, values in ratios.items()}
    rows = []
    for metric, denominator, goal in (
            ("goodput under churn: progress / node-seconds held", "held", f"Tidal ≥ {GOAL:.0%} and ahead of both"),
            ("progress / node-seconds the trace left free", "free", "Tidal ahead of both")):
        samples = ratios[denominator]
        tidal = median(samples["tidal"])
        for peer in (name for name in runs if name != "tidal"):
            baseline = median(samples[peer])
            met = (tidal >= GOAL and ahead["held"]) if denominator == "held" else ahead["free"]
            rows.append(Row(
                benchmark="goodput", metric=f"{metric}, {duration:.0f} s trace, simulated H100s, vs {peer}",
                unit="fraction", tidal=tidal, baseline=baseline, tidal_samples=samples["tidal"],
                baseline_samples=samples[peer], baseline_name=names[peer], goal=goal, met=met,
                ratio=tidal / baseline if baseline else None, ratio_meaning=f"Tidal / {peer}", note=runs_note))
    scheduled = {name: [r.scheduled_progress / (r.scheduled_free or float("inf")) for r in results]
                 for name, results in runs.items()}
    waits = {name: [wait for r in results for wait in r.urgent_waits] for name, results in runs.items()}
    unstarted = {name: sum(r.urgent_unstarted for r in results) for name, results in runs.items()}
    waits_note = "; ".join(f"{name}: {len(values)} urgent jobs, {unstarted[name]} never started (their whole "
                           "window counted, a lower bound)" for name, values in waits.items())
    for peer in (name for name in runs if name != "tidal"):
        rows.append(Row(
            benchmark="goodput", metric=f"progress on the node-seconds the trace's schedule left free (a node an "
                                        f"urgent job waits for is not free), {duration:.0f} s trace, simulated H100s, "
                                        f"vs {peer}",
            unit="fraction", tidal=median(scheduled["tidal"]), baseline=median(scheduled[peer]),
            tidal_samples=scheduled["tidal"], baseline_samples=scheduled[peer], baseline_name=names[peer],
            goal="reported (no goal: the free measure against the trace's schedule, the same for every system)",
            met=True,
            ratio=median(scheduled["tidal"]) / median(scheduled[peer]) if median(scheduled[peer]) else None,
            ratio_meaning=f"Tidal / {peer}", note=runs_note))
    for peer in (name for name in runs if name != "tidal"):
        rows.append(Row(
            benchmark="goodput", metric=f"the trace's urgent jobs: submission to start (Slurm's times, 1 s "
                                        f"resolution), {duration:.0f} s trace, vs {peer}",
            unit="s", tidal=median(waits["tidal"]), baseline=median(waits[peer]), tidal_samples=waits["tidal"],
            baseline_samples=waits[peer], baseline_name=names[peer],
            goal="reported (no goal: how long the other work waits for the training job's nodes)", met=True,
            ratio=median(waits[peer]) / median(waits["tidal"]) if median(waits["tidal"]) else None,
            ratio_meaning=f"{peer} / Tidal: urgent work waits N× longer beside {peer}", note=waits_note))
    text = result_text({name: [(r.parts, r.held) for r in results] for name, results in runs.items()},
                       {name: [list(r.segments) for r in results] for name, results in runs.items()})
    write_result("goodput", rows, quick=args.quick, text=text, settings={
        "duration_s": duration, "min": MIN, "max": MAX, "repeat": repeat, "model": " ".join(MODEL),
        "simulation": " ".join(simulation_flags(simulation)), "simulated": simulation.describe(),
        "tidal_settings": TIDAL_SETTINGS},
        extra={"parts": {name: [r.parts for r in results] for name, results in runs.items()},
               "plays": {name: [{"started": r.started, "nodes": r.nodes, "squeue": r.samples_taken,
                                 "first_commits": r.commits} for r in results] for name, results in runs.items()}})


def result_text(plays: dict[str, list[tuple[dict[str, float], float]]],
                segments: dict[str, list[list[tuple[str, float, float]]]]) -> str:
    """The paragraph RESULTS.md prints under the goodput rows: how progress is counted, where
    each system's held node-seconds went (from each play's parts and held node-seconds:
    medians of the fractions) and, where the plays were timed against the trace
    (`segments`), where each lost by trace event."""
    parts = {name: {part: median([values[part] / held if held else 0.0 for values, held in played])
                    for part in PARTS} for name, played in plays.items()}
    text = ("Progress is what each system committed: every step counted once (a step redone after a restart "
            "once; torchft: a step its quorum committed, with its groups' shares), each at the node-seconds an "
            "ideal run on the simulated devices spends on it at that step's world size (its largest share's "
            "micro-batches plus the gradient all-reduce, times the world size), so a slow step, a stall or a "
            "step redone costs its real time and earns its ideal one. Where the held node-seconds went "
            "(medians over the plays, fractions of held; from squeue samples and the first commits alone, the "
            "same for every system):\n\n| system | " + " | ".join(PARTS) + " |\n|---|"
            + "---|" * len(PARTS) + "\n" + "\n".join(
                f"| {name} | " + " | ".join(f"{parts[name][part]:.1%}" for part in PARTS) + " |" for name in parts))
    if segments and all(timed and all(timed) for timed in segments.values()):
        text += ("\n\nWhere each system lost, by trace event: from each event of the trace to the next, the "
                 "node-seconds the trace's other work left free, and those of them that did not become progress "
                 "(free minus progress; medians over the plays, each play's in brackets; a step's progress counts "
                 "where it was committed). A node an urgent job waits for is free, so the system holding it gains "
                 "it; a lone node while the others are taken (urgent-3 takes 3 of 4) is free and no system with "
                 f"min {MIN} can use it:\n\n" + segments_table(segments))
    return text


def retell(path: Path) -> None:
    """Rewrite a stored full result's `text` (`result_text`) from what it holds: the parts
    of every play and its plays' squeue samples and first commits, the trace's time 0 being
    a play's `started` (or, in results written before it was kept, its first squeue sample,
    taken within a second of it) and the cluster's nodes a play's `nodes` (before: the mini
    cluster's 4). The rows, code and date stay those of the run. Refused (SystemExit, the
    file left as it is) for what is not such a result, and for a run of another model or
    simulation than this code's, whose ideal step costs differ."""
    try:
        document = json.loads(path.read_text())
        settings = document["settings"]
        simulation = QUICK_SIMULATION if document.get("quick") else SIMULATION
        # The ideal step costs are this code's: only for a run of the same model and simulation.
        if (settings.get("model") != " ".join(MODEL)
                or settings.get("simulation") != " ".join(simulation_flags(simulation))):
            raise SystemExit(f"goodput: {path} was played with another model or simulation than this code's "
                             f"({settings.get('model')!r}, {settings.get('simulation')!r}): its text is left as "
                             "it is")
        parts, segments = _retold(document, simulation)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise SystemExit(f"goodput: cannot retell {path}: not a goodput result with its plays "
                         f"({type(error).__name__}: {error})") from None
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    document["text"] = (result_text(parts, segments) + f"\n\n(This paragraph was rewritten from the run's stored "
                        f"plays by `python -m bench.goodput --retell {path}`, code {code_version()}, {when}; the rows "
                        "and their figures are the run's.)")
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"goodput: rewrote the text of {path} from its plays")


def _retold(document: dict[str, Any], simulation: Simulation) -> tuple[
        dict[str, list[tuple[dict[str, float], float]]], dict[str, list[list[tuple[str, float, float]]]]]:
    """`retell`'s inputs to `result_text`: each play's parts with its held node-seconds, and
    its losses by segment, from a stored result's plays."""
    micro = int(MODEL[MODEL.index("--micro-batch") + 1])
    parts: dict[str, list[tuple[dict[str, float], float]]] = {}
    segments: dict[str, list[list[tuple[str, float, float]]]] = {}
    for name, plays in document["plays"].items():
        parts[name], segments[name] = [], []
        for play, play_parts in zip(plays, document["parts"][name], strict=True):
            samples = [(float(t), int(held), int(other)) for t, held, other in play["squeue"]]
            if len(samples) < 2:
                raise ValueError(f"a {name} play has fewer than 2 squeue samples")
            parts[name].append((play_parts, held_node_seconds(samples)))
            commits = [Commit(*commit) for commit in play["first_commits"]]
            segments[name].append(losses_by_segment(
                commits, samples, int(play.get("nodes") or 4), play.get("started") or samples[0][0],
                float(document["settings"]["duration_s"]), simulation, micro))
    return parts, segments


if __name__ == "__main__":
    main()
