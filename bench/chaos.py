"""Chaos on the mini cluster: for each seed, a seeded random sequence of faults against a
live-mode float64 job while a CPU hog runs, each run to the job's end, then checks.

    python -m bench.chaos --seeds N [--first-seed S] [--steps K] [--keep DIR]

The job is examples/live_mode/train_mlp.py (K steps, global batch 24, micro-batch 4,
float64, 0.01 s per micro-batch), min 1 and max 4 replicas on `train`, live mode, under a
controller that runs units as Slurm jobs and polls every second (as `make demo`). Two
`while True: pass` processes hog the machine's 2 cores throughout.

With `--nodes-per-replica 2` the job's replicas span two nodes each (two one-node units,
min 1 and max 2 replicas, DataParallel: every worker holds the whole model, so a node left
of a replica trains on while its lost node's place is taken): the same faults, sized in
replicas (a shrink is --max 1, a grow comes back to 2), none aimed at the last holder or a
save (a one-node unit is not a replica there); results in `chaos_multinode.json`. With
`--sharded` as well, the job is the language model of tests/integration/test_hsdp.py under
HybridSharded (400 steps; its fixed run one DataParallel process): a unit holds only its
node's shards, so an ungraceful fault (a kill, a stop, a node failure) lands only while
another replica trains whole, and the controller is not restarted while an urgent job
preempts units (out of touch, a preempted unit cannot hear that its shards are the last
copy); a unit set aside because its replica lost a node is no unexplained standby;
results in `chaos_hsdp.json`.

Faults (seeded `random.Random(seed)`: 4-6 of them, a few seconds apart, each only while
the job trains with enough replicas for it to make sense; a replica that holds the
training state always survives a fault, or, the last one, leaves gracefully and saves it):

- `grow`: resize --max back up after a shrink, or let it grow; at 4 replicas, --max 3 and
  back to 4 a few seconds later;
- `drain`: admin drain of a unit; `shrink`: resize --max 2, back to 4 later;
- `kill_worker`: kill -9 of a worker; `kill_launcher`: kill -9 of a worker's parent;
- `stop_worker`: SIGSTOP a worker, SIGCONT a few seconds later if it is still alive (its
  launcher is expected to kill it);
- `urgent`: an `urgent`-partition job on 2-3 nodes preempts units (on all 4: every unit,
  the last saving the state as it leaves); cancelled later;
- `node_fail`: a node's slurmd and every process of its unit killed; the node started
  again later;
- `controller_restart`: the controller SIGKILLed and started again on the same SQLite.

About half the faults (drawn per fault from a second generator of the seed) are aimed at a
hard moment: `recovery` (while a world change is in flight: it lands right after the fault
before it), `grow` (while units join; with every node in the world, --max 3 then 4 makes
one), `last_steps` (the last 5 % of the steps, before the last 10; the seed's last fault),
`last_holder` (--max 1, then a drain or an urgent job on every node hits the one replica
left, which saves the state as it leaves) and `save` (--max 1, the one replica drained,
then a controller restart, an urgent job or a grow while it saves). Each landed fault is
recorded with its aim and what the harness saw when it landed. A fault that cannot land
(no candidate, the moment never came) is replaced at once by another drawn from the seed,
the slot and the attempt, up to 3 times; one that finds the job in its last steps is aimed
at them instead; a slot that lands none fails the seed. Faults left when the job reaches
its end (the faults before them waited that long for their moments) are noted, and fail
the seed only if none landed.

Checks per seed (a failing seed prints the problems and the timeline: the controller's
events and the harness's actions; exit 1 if any seed fails):

- the job ends COMPLETED, with exactly one `job_completed` event, within the deadline;
- every step 0..K-1 is committed, and for each (step, generation) that committed, the
  union of the ranks' attempted samples is the fixed run's set for that step. A step
  committed by every rank of one generation and tried again later (committed or abandoned)
  went back (an abandon counts where the rank had attempted the step): a problem unless
  a resumed_from_checkpoint covers it. A step broken in one
  generation (some ranks committed it, or every rank abandoned it) and redone in the next
  is noted; a generation abandoned with no newer one formed is a problem;
- the final parameters (--out) equal a fixed single-process run's to 1e-9 and step == K;
- no survivor restarted: each (unit, local rank) ran one worker PID (launchers' logs); no
  healthy unit told to leave: every unit_leaving has a cause a fault or a policy explains
  (drained: a unit the harness drained; preempted, requeued: an urgent job or a node
  down; resized: a lowered --max; released: below_min_released named it; finished: after
  job_finishing; nothing else), and every member dropped from a generation failed or left;
- no healthy unit failed: failure_detected, unit_lost, unit_submit_failed,
  unit_leave_overdue, worker_failed_after_training, state_not_held and a
  resumed_from_checkpoint that redoes steps each fail the seed unless the harness's acts
  explain them (see `unhealthy_events`); drains, resizes, preemptions and controller
  restarts are graceful and must fail no unit;
- nothing is left: the units' Slurm jobs end (a Slurm that does not answer fails this
  too), no launcher or worker outlives the job.

The fixed run is train_mlp.py alone with the same arguments and --step-time 0 (the step
time is a sleep; the numbers are the same), OMP_NUM_THREADS=1."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import (
    MLP_EXAMPLE,
    REFERENCE_MICRO_BATCH,
    REPO,
    Row,
    parser,
    small_lm_command,
    stop_on_sigterm,
    workspace,
    write_result,
)
from tests.integration.conftest import ControllerProcess, alive
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient, JobState, SlurmError, UnitSubmission

GLOBAL_BATCH = 24
MICRO_BATCH = 4
STEP_TIME_S = 0.01
NODES = 4
DEFAULT_STEPS = 1600
# The sharded job (`--sharded`): the language model under HybridSharded, a few steps a
# second on 2 cores.
SHARDED_STEPS = 400
DEFAULT_DEADLINE_S = 360.0
PARAMETER_TOLERANCE = 1e-9
# As `make demo`: units are Slurm jobs, polled every second; a failed node is avoided for
# 10 s only, so that a job can grow back onto it within one seed.
CONTROLLER_SETTINGS = {"slurm_units": "true", "slurm_poll_interval_s": "1", "join_settle_s": "1",
                       "reconnect_grace_s": "10", "node_cooldown_s": "10"}
FAULTS = ("grow", "drain", "shrink", "kill_worker", "kill_launcher", "stop_worker", "urgent", "node_fail",
          "controller_restart")
# How long a fault waits for the job to train with enough replicas before it is skipped.
PRECONDITION_WAIT_S = 30.0
# How long a fault aimed at a hard moment waits for it (a grow or a single replica is made
# for it first where needed), and how long a grow made for a fault waits after the shrink.
HARD_MOMENT_WAIT_S = 25.0
GROW_PREPARATION_S = 2.0
# An injector's answer that skips the fault at once instead of waiting for it to make sense.
SKIP = "skip: "
# A unit trains if its workers committed a step this recently.
TRAINING_WINDOW_S = 3.0
# A stopped worker's unit may fail until this long after its SIGCONT.
STOP_EXCUSE_S = 15.0
# An event may carry a time up to this much before the harness's record of the act that
# caused it (the harness notes the time after the call).
EVENT_EARLY_S = 0.5
# What a job-wide fault explains goes on this long after it ends (a preemption Slurm
# decided before an urgent job was cancelled, a lowered --max acted on late).
WINDOW_SLACK_S = 10.0
# A fault aimed at the last steps lands at least this many steps before the last (a rank 0
# killed after the last step takes the --out file with it: the script's, not Tidal's, loss).
LAST_STEPS_CLEARANCE = 10
HOG_PROCESSES = 2


class SetupError(RuntimeError):
    """The harness could not run a seed (the cluster was not idle, ...): not Tidal's fault."""


class Aborted(RuntimeError):
    """Tidal broke so that the seed cannot go on (the controller died, or did not start again)."""


# The fixed run.

@dataclasses.dataclass
class Reference:
    steps: int
    # The global sample indices of each step, sorted.
    indices: list[list[int]]
    params: dict[str, torch.Tensor]


def train_command(steps: int, ledger: Path, out: Path, step_time: float = STEP_TIME_S,
                  sharded: bool = False, fixed: bool = False) -> list[str]:
    """The job: train_mlp.py (float64), or with `sharded` the language model of
    tests/integration/test_hsdp.py under HybridSharded (float64; its `fixed` run, the same
    model as one DataParallel process, as those tests check)."""
    if sharded:
        if fixed:
            return small_lm_command(out, ledger, "dp", steps=steps, micro_batch=REFERENCE_MICRO_BATCH)
        return small_lm_command(out, ledger, "hsdp", steps=steps)
    return [sys.executable, str(MLP_EXAMPLE), "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH),
            "--micro-batch", str(MICRO_BATCH), "--dtype", "float64", "--step-time", f"{step_time:g}",
            "--ledger-dir", str(ledger), "--out", str(out)]


def clean_environment() -> dict[str, str]:
    """This process's environment without TIDAL_* (a fixed run must not find a launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def fixed_run(steps: int, folder: Path, sharded: bool = False) -> Reference:
    """The job's script alone, in a world of one: the samples of every step and the final
    parameters an elastic run must reproduce."""
    folder.mkdir(parents=True, exist_ok=True)
    ledger, out = folder / "ledger", folder / "out.pt"
    for path in ledger.glob("ledger-*.jsonl"):
        path.unlink()
    out.unlink(missing_ok=True)
    result = subprocess.run(train_command(steps, ledger, out, step_time=0.0, sharded=sharded, fixed=True),
                            cwd=folder, env=clean_environment(), capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SetupError(f"the fixed run failed ({result.returncode}): {result.stderr[-3000:]}")
    records = read_ledger(ledger)
    attempts = {r["step"]: sorted(r["indices"]) for r in records if r["kind"] == "attempt"}
    commits = {r["step"] for r in records if r["kind"] == "commit"}
    saved = torch.load(out)
    if sorted(attempts) != list(range(steps)) or sorted(commits) != list(range(steps)) or saved["step"] != steps:
        raise SetupError(f"the fixed run did not take steps 0..{steps - 1} once each")
    return Reference(steps=steps, indices=[attempts[s] for s in range(steps)], params=saved["model"])


# Reading what the workers and launchers wrote.

def read_ledger(folder: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(folder.glob("ledger-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return sorted(records, key=lambda r: r["time"])


class LedgerTail:
    """The ledger's commits as they come (whole lines only), for the fault loop."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offsets: dict[Path, int] = {}
        self.last_commit_at = 0.0
        self.last_step = -1
        # pid -> when it last committed a step.
        self.committed_at: dict[int, float] = {}

    def poll(self) -> None:
        for path in sorted(self.folder.glob("ledger-*.jsonl")):
            offset = self.offsets.get(path, 0)
            with contextlib.suppress(OSError), open(path, "rb") as file:
                file.seek(offset)
                data = file.read()
                end = data.rfind(b"\n") + 1
                self.offsets[path] = offset + end
                for line in data[:end].splitlines():
                    with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                        record = json.loads(line)
                        if record.get("kind") == "commit":
                            self.last_commit_at = max(self.last_commit_at, record["time"])
                            self.last_step = max(self.last_step, record["step"])
                            self.committed_at[record["pid"]] = max(self.committed_at.get(record["pid"], 0.0),
                                                                   record["time"])


@dataclasses.dataclass
class UnitProcesses:
    """What a unit's launcher logged of its processes (its Slurm output file)."""

    unit_id: str
    launchers: list[int] = dataclasses.field(default_factory=list)
    # local rank -> every PID started for it, in order.
    workers: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # pid -> when its launcher started it (wall clock).
    started_at: dict[int, float] = dataclasses.field(default_factory=dict)
    outputs: list[Path] = dataclasses.field(default_factory=list)


def unit_processes(state_dir: Path, job_id: str) -> dict[str, UnitProcesses]:
    found: dict[str, UnitProcesses] = {}
    for path in sorted((state_dir / "units").glob(f"{job_id}-u*-*.out")):
        unit_id = path.name[len(job_id) + 1:].rsplit("-", 1)[0]
        unit = found.setdefault(unit_id, UnitProcesses(unit_id))
        unit.outputs.append(path)
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "launcher_started" and "pid" in record:
                if record["pid"] not in unit.launchers:
                    unit.launchers.append(record["pid"])
            elif record.get("event") in ("workers_started", "workers_on_standby") and record.get("pids"):
                for local_rank, pid in enumerate(record["pids"]):
                    pids = unit.workers.setdefault(local_rank, [])
                    if pid not in pids:
                        pids.append(pid)
                        with contextlib.suppress(KeyError, ValueError):
                            unit.started_at[pid] = datetime.datetime.fromisoformat(record["timestamp"]).timestamp()
    return found


# Processes, by PID only.

def process_environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if parent_of(int(entry.name)) == pid:
                    found.append(int(entry.name))
    return found


def signal_pid(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def cpu_hog(processes: int = HOG_PROCESSES) -> Iterator[list[int]]:
    """`processes` busy loops for as long as the block runs, stopped by PID."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                         env=clean_environment()))
        yield [h.pid for h in hogs]
    finally:
        for hog in hogs:
            with contextlib.suppress(ProcessLookupError):
                hog.kill()
            hog.wait(10)


def minicluster(*args: str) -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "minicluster"), *args], capture_output=True,
                            text=True, timeout=180)
    if result.returncode != 0:
        raise RuntimeError(f"minicluster {' '.join(args)}: {result.stderr.strip()[-500:]}")


def wait_cluster_idle(slurm: CliJsonSlurmClient, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    idle: list[str] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(SlurmError):
            idle = [n.name for n in slurm.list_nodes() if "train" in n.partitions and n.is_idle_and_usable]
            if len(idle) >= NODES:
                return
        time.sleep(1.0)
    raise SetupError(f"the mini cluster has {len(idle)} idle nodes of {NODES} after {timeout_s:g} s "
                     "(scripts/minicluster up, nothing else running)")


# One seed.

# Where a fault is aimed. `any`: while the job trains, away from its last steps (as
# before). The hard moments: `recovery` (while a world change is in flight: a generation
# being formed or reconfigured, a unit leaving or joining; it lands at once after the fault
# before it, which starts one), `grow` (while units join), `last_steps` (in the last 5 % of
# the steps, before the last), `last_holder` (on the only replica that holds the training
# state: --max 1 first, then the fault on the one left), `save` (while that last holder,
# drained, saves the state as it leaves).
AIM_ANY = "any"
HARD_AIMS = ("recovery", "grow", "last_steps", "last_holder", "save")
# The share of faults aimed at a hard moment (drawn per fault).
HARD_AIM_SHARE = 0.5
# The faults that make sense at a moment where not every kind does: the last holder may
# only be taken gracefully (it saves the state as it leaves); a saving holder must not be
# killed (the state would be lost: the fallback checkpoint's case, not this harness's).
AIM_KINDS = {"last_holder": ("drain", "urgent"), "save": ("controller_restart", "urgent", "grow")}
# A fault that cannot land is replaced at once by another drawn for its slot, this many
# times; one still skipped after that fails the seed.
MAX_REDRAWS = 3


@dataclasses.dataclass
class PlannedFault:
    kind: str
    # Seconds of training before it.
    gap_s: float
    # Which candidate it hits (a fraction of the sorted candidates), how long it lasts,
    # how many nodes an urgent job takes: all drawn up front, so a seed is one sequence.
    pick: float
    duration_s: float
    nodes: int
    # The moment it is aimed at (AIM_ANY or one of HARD_AIMS).
    aim: str = AIM_ANY


def plan_faults(seed: int, nodes_per_replica: int = 1) -> list[PlannedFault]:
    """The faults of a seed, in order: the kinds and timings as drawn by random.Random(seed)
    (the same sequence as before aims existed), then each fault's aim drawn from a second
    generator of the seed. At most one fault is aimed at the last steps (it goes last: no
    fault follows the end) and at most one at the last holder or a save (each shrinks the
    job to one replica first); a fault at the last holder or a save takes a kind that makes
    sense there, and an urgent job there takes every node. With replicas of several nodes
    (`nodes_per_replica` > 1) no fault is aimed at the last holder or a save: a one-node
    unit is not a replica there, and the drawn aim is taken as `any` (the kinds and timings
    stay the seed's)."""
    rng = random.Random(seed)
    faults = [PlannedFault(kind=rng.choice(FAULTS), gap_s=rng.uniform(1.0, 3.5), pick=rng.random(),
                           duration_s=rng.uniform(3.0, 8.0), nodes=rng.choice((2, 3)))
              for _ in range(rng.randint(4, 6))]
    aims = random.Random(f"chaos-aims-{seed}")
    last_steps = one_replica = False
    for fault in faults:
        aim = aims.choice(HARD_AIMS) if aims.random() < HARD_AIM_SHARE else AIM_ANY
        if nodes_per_replica > 1 and aim in AIM_KINDS:
            aim = AIM_ANY
        if (aim == "last_steps" and last_steps) or (aim in AIM_KINDS and one_replica):
            aim = AIM_ANY
        last_steps |= aim == "last_steps"
        one_replica |= aim in AIM_KINDS
        fault.aim = aim
        if aim in AIM_KINDS and fault.kind not in AIM_KINDS[aim]:
            fault.kind = aims.choice(AIM_KINDS[aim])
        if aim in AIM_KINDS and fault.kind == "urgent":
            fault.nodes = NODES
    return [f for f in faults if f.aim != "last_steps"] + [f for f in faults if f.aim == "last_steps"]


def redraw(seed: int, slot: int, attempt: int) -> PlannedFault:
    """The fault that replaces slot `slot`'s after `attempt` skips: drawn from the seed, the
    slot and the attempt only (a seed stays one sequence), aimed anywhere, soon."""
    rng = random.Random(f"chaos-redraw-{seed}-{slot}-{attempt}")
    return PlannedFault(kind=rng.choice(FAULTS), gap_s=rng.uniform(0.5, 1.5), pick=rng.random(),
                        duration_s=rng.uniform(3.0, 8.0), nodes=rng.choice((2, 3)))


@dataclasses.dataclass
class Landed:
    """A fault the harness did, for the run record: its kind, the moment it was aimed at,
    what the harness saw when it landed (the job's step, state, the world change in flight)
    and, for a replacement, the slot and attempt."""

    kind: str
    aim: str
    at_s: float
    moment: str
    slot: int
    attempt: int = 0

    def label(self) -> str:
        return self.kind if self.aim == AIM_ANY else f"{self.kind}@{self.aim}"


@dataclasses.dataclass
class Action:
    """What the harness did, for the timeline."""

    at: float
    kind: str
    unit_id: str = ""
    detail: str = ""


@dataclasses.dataclass
class Hurt:
    """A unit the harness hurt: a failure_detected of it between `since` and `until` is expected."""

    unit_id: str
    since: float
    until: float = float("inf")


@dataclasses.dataclass
class Heal:
    due: float
    what: str
    action: Callable[[], None]


@dataclasses.dataclass
class SeedResult:
    seed: int
    faults: list[str]
    skipped: list[str]
    seconds: float
    problems: list[str]
    notes: list[str]
    timeline: list[str]
    folder: Path
    job_id: str = ""
    # Every fault that landed, with its aim and the moment seen (faults holds their labels).
    landed: list[Landed] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        outcome = "PASS" if self.passed else f"FAIL ({len(self.problems)} problem(s))"
        return (f"chaos: seed {self.seed}: {outcome} in {self.seconds:.0f} s; faults: "
                f"{', '.join(self.faults) or 'none'}" + (f"; skipped: {', '.join(self.skipped)}" if self.skipped
                                                         else ""))

    def report(self, timeline: bool = False) -> str:
        lines = [self.summary()]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        if timeline or not self.passed:
            lines += [f"  timeline of seed {self.seed} (job {self.job_id}, logs in {self.folder}):"]
            lines += [f"    {t}" for t in self.timeline]
        return "\n".join(lines)


def ranges(numbers: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# The checks over what was recorded: pure functions of the controller's events (as `Seen`),
# the workers' ledger and what the harness did (`Harm`), so that unit tests feed them
# recorded lists (tests/unit/test_chaos_checks.py).

@dataclasses.dataclass(frozen=True)
class Seen:
    """One controller event, as the checks read it (`at`: wall-clock seconds)."""

    kind: str
    at: float
    unit_id: str = ""
    generation: int = 0
    reason: str = ""
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def ids(self, key: str) -> set[str]:
        """A field that lists unit ids ("u1,u3"; "-" or absent: none)."""
        value = self.fields.get(key, "")
        return {u for u in value.split(",") if u and u != "-"}


def seen(events: Sequence[admin_pb2.Event]) -> list[Seen]:
    return [Seen(kind=e.kind, at=e.time.ToNanoseconds() / 1e9, unit_id=e.unit_id, generation=e.generation,
                 reason=e.reason,
                 fields=dict(e.fields)) for e in events]


@dataclasses.dataclass
class Window:
    """A job-wide fault in force from `since` to `until`: an urgent job (`urgent`), a
    lowered --max (`shrink`), the controller down (`controller_down`), a node down
    (`node_down`)."""

    kind: str
    since: float
    until: float = float("inf")


@dataclasses.dataclass
class Harm:
    """What the harness did that may explain an event: units hurt (killed, stopped,
    node-failed), units drained, and job-wide windows."""

    hurt: list[Hurt] = dataclasses.field(default_factory=list)
    # unit -> when the harness drained it.
    drained: dict[str, float] = dataclasses.field(default_factory=dict)
    windows: list[Window] = dataclasses.field(default_factory=list)

    def hurt_at(self, unit_id: str, at: float) -> Hurt | None:
        return next((h for h in self.hurt if h.unit_id == unit_id and h.since - EVENT_EARLY_S <= at <= h.until), None)

    def window_at(self, kinds: Sequence[str], at: float) -> Window | None:
        return next((w for w in self.windows
                     if w.kind in kinds and w.since - EVENT_EARLY_S <= at <= w.until + WINDOW_SLACK_S), None)

    def drained_before(self, unit_id: str, at: float) -> bool:
        return unit_id in self.drained and self.drained[unit_id] - EVENT_EARLY_S <= at


def describe(event: Seen, t0: float) -> str:
    return (f"{event.kind} of {event.unit_id or 'the job'} at +{event.at - t0:.1f} s (generation {event.generation}): "
            f"{event.reason}")


def unhealthy_events(events: Sequence[Seen], harm: Harm, t0: float) -> list[str]:
    """Every event a user would call a fault that what the harness did does not explain:

    - failure_detected: a unit failed (its workers or launcher died or fell silent): only
      of a unit the harness hurt;
    - unit_lost: a unit's Slurm job ended before its launcher registered: only of a unit
      the harness hurt, or while an urgent job preempted units or a node was down;
    - unit_submit_failed: sbatch refused a unit: never (the mini cluster takes every
      submission; a refusal means Tidal asked for something Slurm cannot give);
    - unit_leave_overdue: a unit asked to leave was still there past the grace (its
      launcher or workers hung): only of a unit the harness hurt (a killed launcher or a
      stopped worker cannot answer);
    - worker_failed_after_training: a worker exited badly after the last step: only of a
      unit the harness hurt;
    - state_not_held: no member of a new generation holds the training state: only right
      after the last holder left saving it (state_saving, below_min_released), or when the
      harness hurt every holder of the previous generation;
    - resumed_from_checkpoint that redoes steps (steps_redone > 0): training went back;
      only where the state_not_held before it was explained by the harness hurting every
      holder (a saved state is at the target step: nothing is redone)."""
    problems: list[str] = []
    holders: set[str] = set()
    # A generation with no holder may follow: the last holder saved the state, or every
    # holder was hurt (None: neither).
    why_not_held: str | None = None
    lost_all_holders = False
    for event in events:
        at = event.at
        if event.kind in ("world_formed", "world_reconfiguring"):
            if event.ids("state_holders"):
                why_not_held = None
            if holders and all(harm.hurt_at(u, at) for u in holders):
                why_not_held, lost_all_holders = "the harness hurt every holder", True
            holders = event.ids("state_holders") or holders
        elif event.kind in ("state_saving", "below_min_released"):
            why_not_held = "the last holder saved the state as it left"
        if event.kind == "failure_detected":
            if not harm.hurt_at(event.unit_id, at):
                problems.append(f"{describe(event, t0)}: a unit the harness did not hurt failed")
        elif event.kind == "unit_lost":
            if not (harm.hurt_at(event.unit_id, at) or harm.window_at(("urgent", "node_down"), at)):
                problems.append(f"{describe(event, t0)}: a unit was lost with no urgent job, node failure or "
                                "harm to explain it")
        elif event.kind == "unit_submit_failed":
            problems.append(f"{describe(event, t0)}: sbatch refused a unit")
        elif event.kind in ("unit_leave_overdue", "worker_failed_after_training"):
            if not harm.hurt_at(event.unit_id, at):
                problems.append(f"{describe(event, t0)}: of a unit the harness did not hurt")
        elif event.kind == "state_not_held":
            # (It comes just before the world_formed of the generation it is about.)
            if holders and all(harm.hurt_at(u, at) for u in holders):
                why_not_held, lost_all_holders = "the harness hurt every holder", True
            if why_not_held is None:
                problems.append(f"{describe(event, t0)}: no holder left the state saved and the harness hurt "
                                "no generation's every holder")
        elif event.kind == "resumed_from_checkpoint":
            redone = int(event.fields.get("steps_redone", "0") or 0)
            if redone > 0 and not lost_all_holders:
                problems.append(f"{describe(event, t0)}: {redone} step(s) redone (training went back) with no "
                                "fault that took every holder of the state")
    return problems


def unexplained_leaves(events: Sequence[Seen], harm: Harm, t0: float) -> list[str]:
    """Every unit told to leave, or dropped from the world, that no fault targeted and no
    policy explains:

    - unit_leaving with cause `drained`: only a unit the harness drained; `preempted` and
      `requeued`: only while an urgent job ran (or, requeued, a node was down or the unit
      was hurt); `resized`: only while the harness had lowered --max; `released`: only a
      unit a below_min_released before it named; `saving_shards` (it saves its node's
      shards of a state split between disk and a replica set aside): only of a replica that
      lost a unit before; `finished`: only after job_finishing;
      any other cause (`yielded`: another job's share, with no other job here): never;
    - unit_standby (left out of a world by the sizes the job allows): only while the
      harness had lowered --max; with cause `replica_incomplete` (replicas of several
      nodes under HybridSharded): only of a replica one of whose units failed, left or was
      lost before it (the harness's fault or a policy, judged on that unit's own events; a
      unit's replica is the one it registered in, or the one a replicas_merged put it in);
    - a member of one generation missing from the next (world_formed,
      world_reconfiguring) with no failure_detected, unit_leaving, unit_standby or
      unit_left of it since it became a member."""
    problems: list[str] = []
    released: set[str] = set()
    # Replicas of several nodes: each unit's replica (unit_registered), and the replicas
    # that lost a unit (it failed, left or was lost).
    replica_of: dict[str, str] = {}
    broken_replicas: set[str] = set()
    finishing = False
    members: set[str] = set()
    # unit -> the events that let it drop out of the world, since it last became a member.
    excused: set[str] = set()

    def out_of_the_world(unit: str) -> None:
        """`unit` may drop out of the world from now on, and its replica lacks it."""
        excused.add(unit)
        if unit in replica_of:
            broken_replicas.add(replica_of[unit])

    for event in events:
        at, unit = event.at, event.unit_id
        if event.kind == "below_min_released":
            released |= event.ids("units")
        elif event.kind == "job_finishing":
            finishing = True
        elif event.kind == "unit_registered" and event.fields.get("replica"):
            replica_of[unit] = event.fields["replica"]
        elif event.kind == "replicas_merged" and event.fields.get("replica"):
            # Units of incomplete replicas made a new one together: theirs from now on.
            for merged in event.ids("units"):
                replica_of[merged] = event.fields["replica"]
        elif event.kind in ("failure_detected", "unit_left", "unit_lost"):
            out_of_the_world(unit)
        elif event.kind == "unit_standby":
            # Left out of a world by the sizes the job allows: only while the harness had
            # lowered --max; or its replica lost a node.
            excused.add(unit)
            incomplete = (event.fields.get("cause") == "replica_incomplete"
                          and event.fields.get("replica", "") in broken_replicas)
            if harm.window_at(("shrink",), at) is None and not incomplete:
                problems.append(f"{describe(event, t0)}: a healthy unit was left out of the world with no fault "
                                "or policy to explain it")
        elif event.kind == "unit_leaving":
            replica_broken = replica_of.get(unit, "") in broken_replicas
            out_of_the_world(unit)
            cause = event.fields.get("cause", "")
            if cause == "drained":
                ok = harm.drained_before(unit, at)
            elif cause == "preempted":
                ok = harm.window_at(("urgent",), at) is not None
            elif cause == "requeued":
                ok = bool(harm.window_at(("urgent", "node_down"), at) or harm.hurt_at(unit, at))
            elif cause == "resized":
                ok = harm.window_at(("shrink",), at) is not None
            elif cause == "released":
                ok = unit in released
            elif cause == "saving_shards":
                ok = replica_broken
            elif cause == "finished":
                ok = finishing
            else:
                ok = False
            if not ok:
                problems.append(f"{describe(event, t0)}: a healthy unit was told to leave ({cause or 'no cause'}) "
                                "with no fault or policy to explain it")
        elif event.kind in ("world_formed", "world_reconfiguring"):
            new = event.ids("members")
            for dropped in sorted(members - new - excused):
                problems.append(f"{describe(event, t0)}: member {dropped} of the previous generation was dropped "
                                "with no failure or leave of it")
            for joined in new - members:
                excused.discard(joined)
            members = new
    return problems


@dataclasses.dataclass
class StepVerdict:
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def step_verdict(records: Sequence[Mapping[str, Any]], reference: Sequence[Sequence[int]],
                 events: Sequence[Seen] = ()) -> StepVerdict:
    """The ledger's steps against the fixed run's (`reference`: each step's sorted sample
    indices): every step committed, with the fixed run's samples; and no committed step
    tried again. A step committed by every rank of one generation is done: one attempted
    again (committed or abandoned in a later generation) means training went back, which
    only a resumed_from_checkpoint covering it (checkpoint_step <= step < target_step)
    explains, and that event is judged by `unhealthy_events`. An abandon by a rank that had
    not attempted the step in that generation (a joiner still waiting for the state)
    redoes nothing. A step broken in one generation (some ranks committed it, or every rank
    abandoned it) is redone in the next: noted. A generation every rank of which abandoned
    a step must be followed by a newer generation (the world was changed, not left
    broken), unless it is newer than the generation that committed the job's last step
    (a change in flight that the job's end dropped)."""
    verdict = StepVerdict()
    steps = len(reference)
    commits: dict[tuple[int, int], list[Mapping[str, Any]]] = defaultdict(list)
    attempts: dict[tuple[int, int], list[Mapping[str, Any]]] = defaultdict(list)
    abandoned: dict[tuple[int, int], list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        if record["kind"] == "commit":
            commits[(record["step"], record["generation"])].append(record)
        elif record["kind"] == "attempt":
            attempts[(record["step"], record["generation"])].append(record)
        elif record["kind"] == "abandoned":
            abandoned[(record["step"], record["generation"])].append(record)
    generations_of: dict[int, list[int]] = defaultdict(list)
    for step, generation in sorted(commits):
        generations_of[step].append(generation)
    missing = [s for s in range(steps) if s not in generations_of]
    if missing:
        verdict.problems.append(f"steps never committed: {ranges(missing)}")
    beyond = sorted(s for s in generations_of if s >= steps)
    if beyond:
        verdict.problems.append(f"steps past the last one committed: {ranges(beyond)}")
    # step -> the first generation every rank of which committed it.
    done_in: dict[int, int] = {}
    for (step, generation), done in sorted(commits.items()):
        if step not in done_in and len({r["rank"] for r in done}) >= done[0]["world_size"]:
            done_in[step] = generation
    rewinds = [(int(e.fields.get("checkpoint_step", "0") or 0), int(e.fields.get("target_step", "0") or 0))
               for e in events if e.kind == "resumed_from_checkpoint"]

    def rewound(step: int) -> bool:
        return any(low <= step < high for low, high in rewinds)

    wrong_samples: dict[str, list[int]] = defaultdict(list)
    went_back: dict[str, list[int]] = defaultdict(list)
    explained: dict[str, list[int]] = defaultdict(list)
    broke: dict[str, list[int]] = defaultdict(list)
    for step in range(min(steps, max(generations_of, default=-1) + 1)):
        for generation in generations_of.get(step, []):
            done = commits[(step, generation)]
            world_size = done[0]["world_size"]
            tried = attempts[(step, generation)]
            union = sorted(i for a in tried for i in a["indices"])
            ranks = sorted(a["rank"] for a in tried)
            if union != list(reference[step]) or ranks != list(range(world_size)):
                expected = set(reference[step])
                wrong_samples[f"generation {generation} (world size {world_size}, attempts by ranks {ranks}, "
                              f"{len(set(union) - expected)} extra, {len(expected - set(union))} missing, "
                              f"{len(union) - len(set(union))} twice)"].append(step)
            if step in done_in and generation > done_in[step]:
                what = f"committed by every rank of generation {done_in[step]} and again in generation {generation}"
                (explained if rewound(step) else went_back)[what].append(step)
            elif step not in done_in or generation < done_in[step]:
                committed = sorted({r["rank"] for r in done})
                broke[f"generation {generation} broke at it (ranks {committed} of {world_size} committed, "
                      f"pids {sorted({r['pid'] for r in done})})"].append(step)
    # pid -> the (step, generation) it attempted: an abandon by a rank that never began the step
    # (a joiner whose world broke while it waited for the state, still at step 0) redoes
    # nothing.
    tried_by: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for (step, generation), tried in attempts.items():
        for record in tried:
            tried_by[record["pid"]].add((step, generation))
    for (step, generation), records_of in sorted(abandoned.items()):
        if not any((step, generation) in tried_by[r["pid"]] for r in records_of):
            continue
        if step in done_in and generation > done_in[step]:
            what = (f"committed by every rank of generation {done_in[step]} and attempted again (abandoned) in "
                    f"generation {generation}")
            (explained if rewound(step) else went_back)[what].append(step)
    generations = {e.generation for e in events if e.kind in ("world_formed", "world_reconfiguring")}
    # The generation every rank of which committed the job's last step: a newer one, a world
    # change in flight when training ended, is dropped by the end (its joiners told to leave,
    # their forming broken), and needs no newer generation after it.
    finished_in = done_in.get(steps - 1)
    for generation in sorted({generation for (_, generation) in abandoned}):
        if events and not any(g > generation for g in generations):
            steps_of = sorted(step for (step, e) in abandoned if e == generation)
            if finished_in is not None and generation > finished_in:
                verdict.notes.append(f"step(s) {ranges(steps_of)} abandoned in generation {generation}: a world "
                                     f"change the job's end dropped (its last step was committed by every rank of "
                                     f"generation {finished_in})")
                continue
            verdict.problems.append(f"step(s) {ranges(steps_of)} abandoned in generation {generation}, and no newer "
                                    "generation formed: the world broke and was not changed")
    for what, found in wrong_samples.items():
        verdict.problems.append(f"step(s) {ranges(found)}: the samples are not the fixed run's: {what}")
    for what, found in went_back.items():
        verdict.problems.append(f"step(s) {ranges(found)} {what} (training went back)")
    for what, found in explained.items():
        verdict.notes.append(f"step(s) {ranges(found)} {what}, after a resumed_from_checkpoint")
    for what, found in broke.items():
        verdict.notes.append(f"step(s) {ranges(found)}: {what}; redone in a later generation")
    if abandoned:
        count = sum(len(r) for r in abandoned.values())
        verdict.notes.append(f"{count} abandoned step attempt(s) in the ledger (steps "
                             f"{ranges([s for (s, _) in abandoned])}), none of a step done before")
    return verdict


def slurm_leftover_problems(answer: list[int] | SlurmError, waited_s: float) -> list[str]:
    """The units' Slurm jobs still active after the wait, as `squeue` answered it; an
    error is a problem too (nothing proves the units ended)."""
    if isinstance(answer, SlurmError):
        return [f"Slurm did not answer whether the units' jobs ended ({waited_s:g} s after the job ended): {answer}"]
    if answer:
        return [f"units' Slurm jobs still active {waited_s:g} s after the job ended: {answer} (cancelled here)"]
    return []


class ChaosRun:
    """One live job on the mini cluster, the faults of one seed against it, and the checks."""

    def __init__(self, seed: int, reference: Reference, folder: Path, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 faults: list[PlannedFault] | None = None, min_replicas: int = 1, max_replicas: int | None = None,
                 nodes_per_replica: int = 1, sharded: bool = False,
                 controller_settings: dict[str, str] | None = None, log: Callable[[str], None] = print) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.reference = reference
        self.steps = reference.steps
        self.folder = folder
        self.deadline_s = deadline_s
        # Replicas of `nodes_per_replica` one-node units (DataParallel: every worker holds
        # the whole model, so a node left of a replica trains on); the full size, in
        # replicas, takes every node.
        self.nodes_per_replica = nodes_per_replica
        # HybridSharded: a unit holds only its node index's shards; a replica holds the
        # state only whole (`whole_trainers`).
        self.sharded = sharded and nodes_per_replica > 1
        self.full = NODES // nodes_per_replica
        self.plan = plan_faults(seed, nodes_per_replica) if faults is None else faults
        self.min_replicas = min_replicas
        self.max_replicas = self.full if max_replicas is None else max_replicas
        self.log = log
        self.ledger_dir = folder / "ledger"
        self.out = folder / "out.pt"
        self.slurm = CliJsonSlurmClient(timeout_s=10)
        self.controller = ControllerProcess(folder, {**CONTROLLER_SETTINGS, **(controller_settings or {})})
        self.tail = LedgerTail(self.ledger_dir)
        self.job_id = ""
        self.submitted_at = 0.0
        self.actions: list[Action] = []
        self.harm = Harm()
        self.hurt = self.harm.hurt
        self.landed: list[Landed] = []
        # The controller's events as the fault loop saw them (for the moments).
        self.seen: list[Seen] = []
        self.last_sequence = 0
        # For a fault at the last holder or a save: whether the harness set --max 1 for it,
        # and the holder it drained to make it save.
        self.one_replica = False
        self.saver = ""
        # Units the harness killed, drained or stopped: never counted on to hold the state.
        self.taken: set[str] = set()
        self.heals: list[Heal] = []
        self.urgent_jobs: dict[int, list[str]] = {}
        self.down_nodes: set[str] = set()
        self.stopped: set[int] = set()
        self.shrunk = False
        self.done: list[str] = []
        self.skipped: list[str] = []
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.last_job: admin_pb2.Job | None = None
        self.events_at_end: list[admin_pb2.Event] = []
        # No fault once the job is this close to its end: the last steps and the saving of
        # the parameters are the job's own (a rank 0 killed after its last step takes the
        # --out file with it).
        self.margin = max(20, self.steps // 20)

    # Talking to the controller (which may be down: a controller_restart fault).

    def job(self) -> admin_pb2.Job | None:
        try:
            with self.controller.admin() as admin:
                self.last_job = admin.job(self.job_id)
                return self.last_job
        except grpc.RpcError:
            return None

    def events(self) -> list[admin_pb2.Event]:
        found: list[admin_pb2.Event] = []
        with self.controller.admin() as admin:
            while True:
                page = admin.events(self.job_id, after_sequence=found[-1].sequence if found else 0, limit=1000)
                found += page
                if len(page) < 1000:
                    return found

    def ended(self, job: admin_pb2.Job | None) -> bool:
        return job is not None and job.state in (admin_pb2.JOB_STATE_COMPLETED, admin_pb2.JOB_STATE_FAILED,
                                                 admin_pb2.JOB_STATE_CANCELLED)

    def act(self, kind: str, unit_id: str = "", detail: str = "") -> None:
        action = Action(time.time(), kind, unit_id, detail)
        self.actions.append(action)
        self.log(f"chaos: seed {self.seed}: +{action.at - self.submitted_at:6.1f} s {kind} {unit_id} {detail}".rstrip())

    # The run.

    def run(self) -> SeedResult:
        started = time.monotonic()
        try:
            wait_cluster_idle(self.slurm)
            self.controller.start()
            spec = admin_pb2.JobSpec(
                name="chaos", min_replicas=self.min_replicas, max_replicas=self.max_replicas, partition="train",
                nodes_per_replica=self.nodes_per_replica, mode=common_pb2.JOB_MODE_LIVE,
                working_dir=str(self.folder), environment={"OMP_NUM_THREADS": "1"},
                command=train_command(self.steps, self.ledger_dir, self.out, sharded=self.sharded))
            with self.controller.admin() as admin:
                self.job_id = admin.submit(spec).job.job_id
            self.submitted_at = time.time()
            self.act("submitted", detail=f"job {self.job_id}: {self.steps} steps, replicas "
                                         f"{self.min_replicas}..{self.max_replicas}"
                                         + (f" of {self.nodes_per_replica} nodes" if self.nodes_per_replica > 1
                                            else ""))
            self.inject_faults()
            self.wait_for_end()
        except SetupError as error:
            self.problems.append(f"setup: {error}")
        except Aborted as error:
            self.problems.append(str(error))
        except Exception as error:  # a harness error is reported, and everything still stopped
            self.problems.append(f"harness error: {type(error).__name__}: {error}")
        finally:
            self.clean_up()
        if self.job_id:
            self.check()
        return SeedResult(seed=self.seed, faults=self.done, skipped=self.skipped,
                          seconds=time.monotonic() - started, problems=self.problems, notes=self.notes,
                          timeline=self.timeline(), folder=self.folder, job_id=self.job_id, landed=self.landed)

    def past_deadline(self) -> bool:
        self.check_controller()
        return time.time() > self.submitted_at + self.deadline_s

    def check_controller(self) -> None:
        process = self.controller.process
        if process is not None and process.poll() is not None:
            log = self.folder / f"controller-{self.controller.starts}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise Aborted(f"the controller exited by itself with code {process.returncode}: {tail}")

    def run_due_heals(self, everything: bool = False) -> None:
        now = time.time()
        for heal in sorted(self.heals, key=lambda h: h.due):
            if everything or heal.due <= now:
                self.heals.remove(heal)
                try:
                    heal.action()
                except Exception as error:
                    self.problems.append(f"harness: healing {heal.what} failed: {error}")

    def pause(self, seconds: float) -> bool:
        """Wait, healing what is due and watching the job; False once the job ended."""
        until = time.time() + seconds
        while True:
            self.run_due_heals()
            self.poll_urgent()
            if self.ended(self.job()) or self.past_deadline():
                return False
            if time.time() >= until:
                return True
            time.sleep(0.5)

    def training(self, job: admin_pb2.Job | None) -> bool:
        """The job trains (RUNNING, a step committed within TRAINING_WINDOW_S) and is not in
        its last steps."""
        return self.committing(job) and job is not None and job.state == admin_pb2.JOB_STATE_RUNNING \
            and self.tail.last_step < self.steps - self.margin

    def committing(self, job: admin_pb2.Job | None) -> bool:
        """The job has not ended or begun to finish, and a step was committed within
        TRAINING_WINDOW_S (whatever the job's state: a world change may be in flight)."""
        self.tail.poll()
        return (job is not None and not self.ended(job) and job.state != admin_pb2.JOB_STATE_FINISHING
                and self.tail.last_commit_at > time.time() - TRAINING_WINDOW_S
                and self.tail.last_step < self.steps - 1)

    def poll_events(self) -> None:
        """The controller's new events into self.seen (nothing while it is down)."""
        with contextlib.suppress(grpc.RpcError), self.controller.admin() as admin:
            while True:
                page = admin.events(self.job_id, after_sequence=self.last_sequence, limit=1000)
                if page:
                    self.last_sequence = page[-1].sequence
                    self.seen += seen(page)
                if len(page) < 1000:
                    return

    def generation_in_flight(self) -> tuple[str, str]:
        """(what, cause) of the world change the events show in flight: a generation being
        reconfigured that has not moved yet, or one being stopped that no new one
        followed; ("", "") if none."""
        what, cause = "", ""
        for event in self.seen:
            if event.kind == "world_reconfiguring":
                what, cause = f"generation {event.generation} reconfiguring", event.fields.get("cause", "")
            elif event.kind == "generation_stopping":
                what, cause = f"generation {event.generation} stopping", event.fields.get("cause", "")
            elif event.kind in ("world_reconfigured", "world_formed", "job_finishing"):
                what, cause = "", ""
        return what, cause

    def in_flight(self, job: admin_pb2.Job) -> list[str]:
        """The world changes in flight now, in words (empty: none)."""
        self.poll_events()
        found = []
        if job.state in (admin_pb2.JOB_STATE_RECONFIGURING, admin_pb2.JOB_STATE_DEGRADED):
            found.append(f"job {admin_pb2.JobState.Name(job.state).removeprefix('JOB_STATE_')}")
        what, cause = self.generation_in_flight()
        if what:
            found.append(f"{what} ({cause or 'no cause'})")
        for state, name in ((admin_pb2.UNIT_STATE_JOINING, "joining"), (admin_pb2.UNIT_STATE_LEAVING, "leaving"),
                            (admin_pb2.UNIT_STATE_SUBMITTED, "submitted")):
            units = sorted(u.unit_id for u in job.units if u.state == state)
            if units:
                found.append(f"{','.join(units)} {name}")
        return found

    def moment(self, fault: PlannedFault, job: admin_pb2.Job | None) -> str:
        """What the job is doing now, in words, if it is at the moment `fault` aims at;
        "" if it is not (yet)."""
        if job is None:
            return ""
        where = f"step {self.tail.last_step}/{self.steps}, world size {job.world_size}"
        if fault.aim == AIM_ANY:
            return f"training at {where}" if self.training(job) else ""
        if not self.committing(job):
            return ""
        if fault.aim == "recovery":
            flight = [f for f in self.in_flight(job) if not f.endswith(" submitted")]
            return f"mid-recovery at {where}: {'; '.join(flight)}" if flight else ""
        if fault.aim == "grow":
            flight = self.in_flight(job)
            growing = [f for f in flight if "(grow)" in f or f.endswith((" joining", " submitted"))]
            return f"mid-grow at {where}: {'; '.join(flight)}" if growing else ""
        if fault.aim == "last_steps":
            first, last = self.steps - self.margin, self.steps - LAST_STEPS_CLEARANCE
            return f"in the last steps, at {where}" if first <= self.tail.last_step < last else ""
        units = self.active_units(job)
        trainers = self.trainers(job)
        if fault.aim == "last_holder":
            # (A unit on standby holds nothing: with --max 1 a registered joiner waits
            # there for good, and the one trainer is still the last holder. Seed 6 waited
            # 25 s for a moment that had come.)
            others = [u.unit_id for u in job.units if u.state == admin_pb2.UNIT_STATE_LEAVING]
            if len(units) == 1 and trainers == {units[0].unit_id} and not others and not self.in_flight_generation():
                return f"{units[0].unit_id} the only replica, holding the state at {where}"
            return ""
        if fault.aim == "save":
            self.poll_events()
            saver = self.saver
            if saver and any(e.kind == "state_saving" and e.unit_id == saver for e in self.seen) and any(
                    u.unit_id == saver and u.state == admin_pb2.UNIT_STATE_LEAVING for u in job.units):
                return f"mid-save: {saver} (the last holder, drained) saving the state as it leaves, at {where}"
            return ""
        raise ValueError(f"unknown aim {fault.aim}")

    def in_flight_generation(self) -> bool:
        self.poll_events()
        return bool(self.generation_in_flight()[0])

    def inject_faults(self) -> None:
        """Each slot of the plan lands a fault: the planned one, or, when it cannot land (no
        candidate, the moment never came), up to MAX_REDRAWS others drawn for the slot at
        once. A slot that lands none is a problem; slots left when the job reaches its end are
        a note (a problem if no fault landed at all)."""
        if not self.plan:
            return
        # Faults hurt a world that trains: a failure while workers still start is another case.
        deadline = time.time() + 180
        while not self.committing(self.job()):
            if self.ended(self.last_job) or self.past_deadline() or time.time() > deadline:
                self.skipped += [f"{f.kind}@{f.aim} (the job never trained)" for f in self.plan]
                self.problems.append(f"no fault landed: the job never trained ({len(self.plan)} planned)")
                return
            self.run_due_heals()
            time.sleep(0.25)
        for slot, planned in enumerate(self.plan):
            fault, reasons = planned, []
            for attempt in range(MAX_REDRAWS + 1):
                # A fault aimed at a recovery lands right after the one before (which starts
                # one); one aimed at the last steps once they have come, at once.
                self.tail.poll()
                at_once = fault.aim == "recovery" or (fault.aim == "last_steps"
                                                      and self.tail.last_step >= self.steps - self.margin)
                if not self.pause(0.0 if at_once else fault.gap_s):
                    why_not = "job ended"
                else:
                    why_not = self.inject(fault, slot, attempt)
                if not why_not:
                    break
                reasons.append(f"{fault.kind}@{fault.aim}: {why_not}")
                self.skipped.append(f"{fault.kind}@{fault.aim} ({why_not})")
                self.act(f"skip {fault.kind}@{fault.aim}", detail=why_not)
                if why_not == "job ending" and fault.aim != "last_steps":
                    # The last steps have come first: the fault lands there instead.
                    fault = dataclasses.replace(fault, aim="last_steps")
                    continue
                if why_not in ("job ended", "job ending"):
                    # The job trained to its end before these could land (the faults before
                    # them waited for their moments): not Tidal's failure, unless no fault
                    # landed at all.
                    left = [f"{f.kind}@{f.aim}" for f in self.plan[slot:]]
                    said = (f"fault(s) {', '.join(left)} never landed: the job reached its last steps before them "
                            f"({'; '.join(reasons)})")
                    completed = self.last_job is not None and self.last_job.state == admin_pb2.JOB_STATE_COMPLETED
                    reached_end = why_not == "job ending" or completed
                    (self.notes if self.landed and reached_end else self.problems).append(said)
                    return
                fault = redraw(self.seed, slot, attempt + 1)
            else:
                self.problems.append(f"fault slot {slot} ({planned.kind}@{planned.aim}) landed no fault in "
                                     f"{MAX_REDRAWS + 1} draws: {'; '.join(reasons)}")

    def wait_for_end(self) -> None:
        while True:
            self.run_due_heals()
            self.poll_urgent()
            job = self.job()
            if self.ended(job):
                return
            if self.past_deadline():
                self.run_due_heals(everything=True)
                job = self.job() or self.last_job
                state = admin_pb2.JobState.Name(job.state) if job else "unknown"
                self.tail.poll()
                self.problems.append(f"the job did not end within {self.deadline_s:g} s: {state}, last committed "
                                     f"step {self.tail.last_step}")
                return
            time.sleep(0.5)

    # Faults.

    def prepare(self, fault: PlannedFault, job: admin_pb2.Job) -> None:
        """For a fault mid-grow with every node in the world: --max one replica less, back to
        the full size a moment later (a grow to come). For a fault at the last holder or a save: --max 1
        (once; back to NODES after the fault lands), so that one replica is left; for a
        save, once one is, drain it."""
        if fault.aim == "grow":
            if (not self.shrunk and job.world_size >= NODES and job.spec.max_replicas >= self.full
                    and not self.in_flight(job) and self.committing(job)):
                self.open_window("shrink")
                with self.controller.admin() as admin:
                    admin.resize(self.job_id, max_replicas=self.full - 1)
                self.shrunk = True
                self.act("resize", detail=f"--max {self.full - 1}, back to {self.full} in {GROW_PREPARATION_S:g} s: "
                                          "a grow for a fault aimed at it")
                self.heals.append(Heal(time.time() + GROW_PREPARATION_S, "shrink", self.unshrink))
            return
        if fault.aim not in AIM_KINDS:
            return
        if not self.one_replica:
            self.heals = [h for h in self.heals if h.what != "shrink"]
            with self.controller.admin() as admin:
                admin.resize(self.job_id, max_replicas=1)
            self.shrunk = True
            self.one_replica = True
            self.open_window("shrink")
            self.act("resize", detail=f"--max 1 (world size {job.world_size}): one replica left to hold the state, "
                                      f"for a fault aimed at {'it' if fault.aim == 'last_holder' else 'its save'}")
            return
        if fault.aim == "save" and not self.saver:
            holder = self.moment(dataclasses.replace(fault, aim="last_holder"), job)
            if holder:
                (unit,) = self.active_units(job)
                self.saver = unit.unit_id
                self.taken.add(unit.unit_id)
                self.harm.drained[unit.unit_id] = time.time()
                with self.controller.admin() as admin:
                    drained = admin.drain(unit.unit_id)
                self.act("drain", unit.unit_id, f"on {','.join(unit.nodes)} ({','.join(drained) or 'nothing drained'})"
                                                f": {holder}; it saves the state as it leaves")

    def inject(self, fault: PlannedFault, slot: int, attempt: int) -> str:
        """Do the fault once the job is at the moment it aims at, with enough replicas for
        it; the reason if not."""
        injector = getattr(self, f"fault_{fault.kind}")
        waited_s = PRECONDITION_WAIT_S if fault.aim == AIM_ANY else HARD_MOMENT_WAIT_S
        deadline = time.time() + waited_s
        why_not = f"the moment ({fault.aim}) did not come within {waited_s:g} s"
        self.one_replica, self.saver = False, ""
        try:
            while time.time() < deadline or fault.aim == "last_steps":
                job = self.job()
                if self.ended(job):
                    return "job ended"
                if job is not None:
                    self.prepare(fault, job)
                    gone = (admin_pb2.UNIT_STATE_LEFT, admin_pb2.UNIT_STATE_FAILED)
                    if fault.aim == "save" and self.saver and any(
                            u.unit_id == self.saver and u.state in gone for u in job.units):
                        return f"{self.saver} had saved the state and left before the fault could land"
                moment = self.moment(fault, job)
                if moment:
                    assert job is not None
                    why_not = injector(fault, job, dry_run=True)
                    if not why_not:
                        at = time.time()
                        why_not = injector(fault, job, dry_run=False)
                        if not why_not:
                            self.landed.append(Landed(fault.kind, fault.aim, round(at - self.submitted_at, 2),
                                                      moment, slot, attempt))
                            self.done.append(self.landed[-1].label())
                            self.act(f"landed {self.landed[-1].label()}", detail=moment)
                            return ""
                    if why_not.startswith(SKIP):
                        return why_not.removeprefix(SKIP)
                self.tail.poll()
                if fault.aim == "last_steps" and self.tail.last_step >= self.steps - LAST_STEPS_CLEARANCE:
                    return "job ending"
                if fault.aim not in ("last_steps", "save") and self.tail.last_step >= self.steps - self.margin:
                    return "job ending"
                self.run_due_heals()
                self.poll_urgent()
                # A save lasts a moment: look often.
                time.sleep(0.05 if fault.aim == "save" else 0.25)
            return why_not
        finally:
            if self.one_replica and self.shrunk:
                delay = fault.duration_s if any(f.slot == slot and f.attempt == attempt for f in self.landed) else 0.0
                self.heals.append(Heal(time.time() + delay, "shrink", self.unshrink))

    def active_units(self, job: admin_pb2.Job) -> list[admin_pb2.Unit]:
        return sorted((u for u in job.units if u.state == admin_pb2.UNIT_STATE_ACTIVE), key=lambda u: u.unit_id)

    def worker_of(self, unit_id: str) -> int | None:
        """The unit's live worker of local rank 0 (checked by its environment)."""
        procs = unit_processes(self.controller.state_dir, self.job_id).get(unit_id)
        if procs is None:
            return None
        for pid in reversed(procs.workers.get(0, [])):
            env = process_environment(pid)
            if (alive(pid) and env.get("TIDAL_UNIT_ID") == unit_id and env.get("TIDAL_JOB_ID") == self.job_id
                    and pid not in self.stopped):
                return pid
        return None

    def trainers(self, job: admin_pb2.Job) -> set[str]:
        """The replicas that hold the training state now: active units whose workers
        committed a step within TRAINING_WINDOW_S, less those the harness took away."""
        self.tail.poll()
        recent = {pid for pid, at in self.tail.committed_at.items() if at > time.time() - TRAINING_WINDOW_S}
        active = {u.unit_id for u in self.active_units(job)}
        return {unit.unit_id for unit in unit_processes(self.controller.state_dir, self.job_id).values()
                if unit.unit_id in active and unit.unit_id not in self.taken
                and any(pid in recent for pids in unit.workers.values() for pid in pids)}

    def whole_trainers(self, job: admin_pb2.Job, unit: admin_pb2.Unit) -> bool:
        """Sharded: whether a replica other than `unit`'s trains whole (every node of it a
        trainer), so that the state survives `unit`'s failure."""
        trainers = self.trainers(job)
        by_replica: dict[int, set[str]] = {}
        for other in self.active_units(job):
            by_replica.setdefault(other.replica, set()).add(other.unit_id)
        return any(replica != unit.replica and len(ids) == self.nodes_per_replica and ids <= trainers
                   for replica, ids in by_replica.items())

    def pick_victim(self, fault: PlannedFault, job: admin_pb2.Job) -> tuple[admin_pb2.Unit, int] | str:
        """An active unit (a member of the world, or joining it) and its worker, such that a
        replica that holds the training state survives it: losing every replica is the
        fallback checkpoint's case, not this harness's. (Sharded: a whole other replica.)"""
        units = [u for u in self.active_units(job) if u.nodes and u.nodes[0] not in self.down_nodes]
        if not units:
            return "no active replica"
        unit = units[min(len(units) - 1, int(fault.pick * len(units)))]
        if not self.trainers(job) - {unit.unit_id}:
            return f"no replica but {unit.unit_id} trains"
        if self.sharded and not self.whole_trainers(job, unit):
            return f"no whole replica but {unit.unit_id}'s (replica {unit.replica}) trains"
        pid = self.worker_of(unit.unit_id)
        if pid is None:
            return f"no live worker of {unit.unit_id}"
        return unit, pid

    def fault_grow(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        """Resize --max back up after a shrink; below the full size, let it grow; at the
        full size, take one replica away (--max one less) and give it back later: a grow to
        come."""
        if self.shrunk:
            if not dry_run:
                self.heals = [h for h in self.heals if h.what != "shrink"]
                self.unshrink()
            return ""
        if job.world_size < NODES:
            if not dry_run:
                self.act("grow", detail=f"let it grow from {job.world_size} (max {job.spec.max_replicas})")
            return ""
        if not dry_run:
            self.open_window("shrink")
            with self.controller.admin() as admin:
                admin.resize(self.job_id, max_replicas=self.full - 1)
            self.shrunk = True
            self.act("resize", detail=f"--max {self.full - 1}, to grow back to {self.full} in "
                                      f"{fault.duration_s:.1f} s")
            self.heals.append(Heal(time.time() + fault.duration_s, "shrink", self.unshrink))
        return ""

    def unshrink(self) -> None:
        with self.controller.admin() as admin:
            admin.resize(self.job_id, max_replicas=self.full)
        self.shrunk = False
        self.close_window("shrink")
        self.act("resize", detail=f"--max {self.full}")

    def open_window(self, kind: str) -> Window:
        window = Window(kind, time.time())
        self.harm.windows.append(window)
        return window

    def close_window(self, kind: str) -> None:
        for window in self.harm.windows:
            if window.kind == kind and window.until == float("inf"):
                window.until = time.time()

    def fault_shrink(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        """--max half the full size (2 of 4 one-node replicas, 1 of 2 of two nodes) for a
        while, once the world is larger than that."""
        smaller = max(1, self.full // 2)
        if self.shrunk or job.world_size <= smaller * self.nodes_per_replica:
            return f"world size {job.world_size}" if not self.shrunk else "already shrunk"
        if not dry_run:
            self.open_window("shrink")
            with self.controller.admin() as admin:
                admin.resize(self.job_id, max_replicas=smaller)
            self.shrunk = True
            self.act("resize", detail=f"--max {smaller} (world size {job.world_size}) for {fault.duration_s:.1f} s")
            self.heals.append(Heal(time.time() + fault.duration_s, "shrink", self.unshrink))
        return ""

    def fault_drain(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        """Drain an active unit such that another holds the state, or, aimed at the last
        holder, the only one (it saves the state as it leaves)."""
        units = self.active_units(job)
        if len(units) < (1 if fault.aim == "last_holder" else 2):
            return f"{len(units)} active replica(s)"
        unit = units[min(len(units) - 1, int(fault.pick * len(units)))]
        if fault.aim != "last_holder" and not self.trainers(job) - {unit.unit_id}:
            return f"no replica but {unit.unit_id} trains"
        if not dry_run:
            self.taken.add(unit.unit_id)
            self.harm.drained[unit.unit_id] = time.time()
            with self.controller.admin() as admin:
                drained = admin.drain(unit.unit_id)
            self.act("drain", unit.unit_id, f"on {','.join(unit.nodes)}: {','.join(drained) or 'nothing drained'}")
        return ""

    def fault_kill_worker(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        victim = self.pick_victim(fault, job)
        if isinstance(victim, str):
            return victim
        if not dry_run:
            unit, pid = victim
            self.hurt.append(Hurt(unit.unit_id, time.time()))
            self.taken.add(unit.unit_id)
            signal_pid(pid, signal.SIGKILL)
            self.act("kill -9 worker", unit.unit_id, f"pid {pid} on {','.join(unit.nodes)}")
        return ""

    def launcher_of(self, worker: int) -> int | None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            launcher = parent_of(worker)
            if "tidal.launcher.agent" in command_line(launcher):
                return launcher
        return None

    def fault_kill_launcher(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        victim = self.pick_victim(fault, job)
        if isinstance(victim, str):
            return victim
        unit, pid = victim
        launcher = self.launcher_of(pid)
        if launcher is None:
            return f"no launcher above worker {pid}"
        if not dry_run:
            self.hurt.append(Hurt(unit.unit_id, time.time()))
            self.taken.add(unit.unit_id)
            signal_pid(launcher, signal.SIGKILL)
            self.act("kill -9 launcher", unit.unit_id, f"pid {launcher} (worker {pid}) on {','.join(unit.nodes)}")
        return ""

    def fault_stop_worker(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        victim = self.pick_victim(fault, job)
        if isinstance(victim, str):
            return victim
        if not dry_run:
            unit, pid = victim
            hurt = Hurt(unit.unit_id, time.time())
            self.hurt.append(hurt)
            self.taken.add(unit.unit_id)
            signal_pid(pid, signal.SIGSTOP)
            self.stopped.add(pid)
            self.act("SIGSTOP worker", unit.unit_id, f"pid {pid} for {fault.duration_s:.1f} s")

            def resume() -> None:
                self.stopped.discard(pid)
                if alive(pid) and signal_pid(pid, signal.SIGCONT):
                    self.act("SIGCONT worker", unit.unit_id, f"pid {pid} (still alive)")
                else:
                    self.act("SIGCONT worker", unit.unit_id, f"pid {pid} is gone (killed while stopped)")
                hurt.until = time.time() + STOP_EXCUSE_S

            self.heals.append(Heal(time.time() + fault.duration_s, f"SIGCONT {pid}", resume))
        return ""

    def fault_urgent(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        if self.urgent_jobs and any(h.what.startswith("urgent") for h in self.heals):
            return "an urgent job is already there"
        trainers = self.trainers(job)
        # An urgent job on every node preempts every unit: the last to hold the state
        # saves it on its way out. On fewer nodes, one replica is left to keep it.
        if fault.nodes < NODES and len(trainers) < fault.nodes + 1:
            return f"{len(trainers)} training replica(s) for an urgent job of {fault.nodes} nodes"
        if not dry_run:
            urgent = self.slurm.submit(UnitSubmission(
                name="chaos-urgent", script="#!/bin/sh\nsleep 600\n", partition="urgent", nodes=fault.nodes,
                exclusive=True, requeue=False, output=str(self.folder / "urgent-%j.out")))
            self.urgent_jobs[urgent] = []
            window = self.open_window("urgent")
            duration = fault.duration_s + 4.0
            self.act("urgent job", detail=f"Slurm job {urgent} on {fault.nodes} nodes for {duration:.1f} s")

            def cancel() -> None:
                self.poll_urgent()
                self.slurm.cancel(urgent)
                window.until = time.time()
                ran_on = ",".join(self.urgent_jobs[urgent]) or "no node yet"
                self.act("scancel urgent", detail=f"Slurm job {urgent} (ran on {ran_on})")

            self.heals.append(Heal(time.time() + duration, f"urgent {urgent}", cancel))
        return ""

    def poll_urgent(self) -> None:
        for urgent, nodes in self.urgent_jobs.items():
            if nodes or not any(h.what == f"urgent {urgent}" for h in self.heals):
                continue
            with contextlib.suppress(SlurmError):
                record = self.slurm.get_job(urgent)
                if record.state is JobState.RUNNING and record.nodes:
                    nodes.extend(record.nodes)
                    self.act("urgent job runs", detail=f"Slurm job {urgent} on {','.join(record.nodes)}")

    def fault_node_fail(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        if self.down_nodes:
            return f"{','.join(sorted(self.down_nodes))} is down already"
        victim = self.pick_victim(fault, job)
        if isinstance(victim, str):
            return victim
        unit, worker = victim
        launcher = self.launcher_of(worker)
        if launcher is None:
            return f"no launcher above worker {worker}"
        if dry_run:
            return ""
        (node,) = unit.nodes
        self.hurt.append(Hurt(unit.unit_id, time.time()))
        self.taken.add(unit.unit_id)
        # The node dies: its slurmd, then everything its unit ran there (the launcher, its
        # workers, the slurmstepd above it).
        window = self.open_window("node_down")
        minicluster("kill-node", node)
        self.down_nodes.add(node)
        victims = [launcher, *children_of(launcher)]
        with contextlib.suppress(OSError, IndexError, ValueError):
            stepd = parent_of(launcher)
            if Path(f"/proc/{stepd}/comm").read_text().startswith("slurmstepd"):
                victims.append(stepd)
        for pid in victims:
            signal_pid(pid, signal.SIGKILL)
        self.act("node failure", unit.unit_id, f"{node}: slurmd and pids {victims} killed; back in "
                                               f"{fault.duration_s + 5:.1f} s")

        def restart() -> None:
            minicluster("start-node", node)
            self.down_nodes.discard(node)
            window.until = time.time()
            self.act("node back", detail=node)

        self.heals.append(Heal(time.time() + fault.duration_s + 5.0, f"start-node {node}", restart))
        return ""

    def fault_controller_restart(self, fault: PlannedFault, job: admin_pb2.Job, dry_run: bool) -> str:
        # Sharded: not while an urgent job preempts units. Out of touch, a preempted unit's
        # launcher cannot hear that it holds the last copy of its shards, and does not save
        # them (with one-node replicas any survivor holds the whole state).
        if self.sharded and self.urgent_jobs and any(h.what.startswith("urgent") for h in self.heals):
            return "an urgent job is there (sharded: its preempted units could not save their shards)"
        if not dry_run:
            down_s = fault.duration_s / 2
            window = self.open_window("controller_down")
            self.controller.kill()
            self.act("kill -9 controller", detail=f"down for {down_s:.1f} s")
            time.sleep(down_s)
            try:
                self.controller.start()
            except Exception as error:
                raise Aborted(f"the controller did not start again on its SQLite: {error}") from error
            window.until = time.time()
            self.act("controller started", detail=f"log controller-{self.controller.starts}.log")
        return ""

    # The end.

    def clean_up(self) -> None:
        """Stop everything this seed started, whatever happened; what had to be stopped
        here (and should have stopped by itself) is a problem."""
        try:
            self.run_due_heals(everything=True)
            for pid in list(self.stopped):
                signal_pid(pid, signal.SIGCONT)
            for node in list(self.down_nodes):
                with contextlib.suppress(Exception):
                    minicluster("start-node", node)
                    self.down_nodes.discard(node)
            for urgent in self.urgent_jobs:
                with contextlib.suppress(SlurmError):
                    self.slurm.cancel(urgent)
            if not self.job_id:
                return
            job = self.job()
            if job is not None and not self.ended(job):
                with contextlib.suppress(grpc.RpcError), self.controller.admin() as admin:
                    admin.cancel(self.job_id)
                self.act("cancelled", detail="by the harness, at the end")
            self.check_nothing_left()
        finally:
            with contextlib.suppress(Exception):
                self.events_at_end = self.events()
            self.job()
            self.controller.stop()

    def units_in_slurm(self) -> list[int] | SlurmError:
        """The units' Slurm jobs still active, or Slurm's error."""
        try:
            return [j.job_id for j in self.slurm.list_jobs() if j.name.startswith(f"tidal-{self.job_id}-")
                    and j.is_active]
        except SlurmError as error:
            return error

    def check_nothing_left(self) -> None:
        waited_s = 60.0
        deadline = time.time() + waited_s
        answer = self.units_in_slurm()
        while answer != [] and time.time() < deadline:
            time.sleep(1.0)
            answer = self.units_in_slurm()
        self.problems += slurm_leftover_problems(answer, waited_s)
        for slurm_job in answer if isinstance(answer, list) else []:
            with contextlib.suppress(SlurmError):
                self.slurm.cancel(slurm_job)
        pids = {pid for unit in unit_processes(self.controller.state_dir, self.job_id).values()
                for pid in unit.launchers + [p for ps in unit.workers.values() for p in ps]}
        pids |= {int(p.stem.split("-")[1]) for p in self.ledger_dir.glob("ledger-*.jsonl")}
        deadline = time.time() + 30

        def ours(pid: int) -> bool:
            return alive(pid) and process_environment(pid).get("TIDAL_JOB_ID", "") in ("", self.job_id) and (
                "tidal.launcher.agent" in command_line(pid) or str(MLP_EXAMPLE) in command_line(pid))

        while any(ours(p) for p in pids) and time.time() < deadline:
            time.sleep(0.5)
        leftovers = sorted(p for p in pids if ours(p))
        if leftovers:
            self.problems.append(f"processes outlived the job by 30 s: {leftovers} (killed here)")
            for pid in leftovers:
                signal_pid(pid, signal.SIGCONT)
                signal_pid(pid, signal.SIGKILL)

    def check(self) -> None:
        events = self.events_at_end
        kinds = [e.kind for e in events]
        job = self.last_job
        state = admin_pb2.JobState.Name(job.state) if job else "unknown"
        if not events:
            self.problems.append("no events could be read from the controller")
        elif kinds.count("job_completed") != 1 or job is None or job.state != admin_pb2.JOB_STATE_COMPLETED:
            ends = [k for k in kinds if k in ("job_completed", "job_failed", "job_cancelled")]
            self.problems.append(f"the job did not end COMPLETED exactly once: state {state}, end events {ends}, "
                                 f"last event {events[-1].kind}: {events[-1].reason}")
        records = read_ledger(self.ledger_dir)
        recorded = seen(events)
        steps = step_verdict(records, self.reference.indices, recorded)
        self.problems += steps.problems
        self.notes += steps.notes
        self.check_parameters()
        self.check_workers(records)
        self.problems += unhealthy_events(recorded, self.harm, self.submitted_at)
        self.problems += unexplained_leaves(recorded, self.harm, self.submitted_at)
        for event in events:
            if event.kind == "state_not_held":
                self.notes.append(f"state_not_held at generation {event.generation}: {event.reason}")
            elif event.kind == "generation_stopped" and float(event.fields.get("detection_to_all_stopped_s", 0)) > 5:
                took = event.fields["detection_to_all_stopped_s"]
                self.notes.append(f"generation {event.generation} took {took} s to stop")
        hard = [f"{f.label()} ({f.moment})" for f in self.landed if f.aim != AIM_ANY]
        if hard:
            self.notes.append(f"faults at hard moments: {'; '.join(hard)}")
        redrawn = [f.label() for f in self.landed if f.attempt]
        if redrawn:
            self.notes.append(f"drawn again after a skip, and landed: {', '.join(redrawn)} (skipped: "
                              f"{'; '.join(self.skipped)})")

    def check_parameters(self) -> None:
        if not self.out.exists():
            self.problems.append(f"no final parameters: {self.out} was not written")
            return
        try:
            saved = torch.load(self.out)
        except Exception as error:
            self.problems.append(f"the final parameters cannot be read: {error}")
            return
        if saved.get("step") != self.steps:
            self.problems.append(f"the --out file says step {saved.get('step')}, not {self.steps}")
        model = saved.get("model", {})
        if set(model) != set(self.reference.params):
            self.problems.append(f"the final parameters have keys {sorted(model)}")
            return
        worst = max(float((model[k].double() - self.reference.params[k].double()).abs().max()) for k in model)
        if not worst <= PARAMETER_TOLERANCE:
            self.problems.append(f"the final parameters differ from the fixed run's by {worst:.3g} "
                                 f"(tolerance {PARAMETER_TOLERANCE:g})")
        else:
            self.notes.append(f"final parameters within {worst:.2g} of the fixed run's")

    def check_workers(self, records: list[dict[str, Any]]) -> None:
        units = unit_processes(self.controller.state_dir, self.job_id)
        owner = {}
        for unit in units.values():
            for local_rank, pids in unit.workers.items():
                for pid in pids:
                    owner[pid] = unit.unit_id
                for pid in pids[1:]:
                    at = unit.started_at.get(pid, 0.0)
                    hurt = [h for h in self.hurt if h.unit_id == unit.unit_id and h.since <= at]
                    who = (f"the harness hurt the unit at +{hurt[0].since - self.submitted_at:.1f} s and its launcher "
                           "started another worker instead of the unit failing" if hurt
                           else "a survivor was restarted")
                    self.problems.append(f"unit {unit.unit_id} local rank {local_rank}: worker {pid} started at "
                                         f"+{at - self.submitted_at:.1f} s after {pids[:pids.index(pid)]}: {who}")
        strangers = sorted({r["pid"] for r in records} - set(owner))
        if strangers:
            self.problems.append(f"ledger PIDs {strangers} belong to no unit's launcher log")

    def timeline(self) -> list[str]:
        lines: list[tuple[float, str]] = []
        for event in self.events_at_end:
            at = event.time.ToNanoseconds() / 1e9
            fields = " ".join(f"{k}={v}" for k, v in sorted(event.fields.items()))
            lines.append((at, f"{event.kind:<20} {event.unit_id or '-':<4} e{event.generation:<3} {event.reason}"
                              + (f" [{fields}]" if fields else "")))
        for action in self.actions:
            lines.append((action.at, f">> {action.kind} {action.unit_id} {action.detail}".rstrip()))
        return [f"+{at - self.submitted_at:7.2f} s  {text}" for at, text in sorted(lines, key=lambda x: x[0])]


def run_seed(seed: int, reference: Reference, folder: Path, **options: Any) -> SeedResult:
    return ChaosRun(seed, reference, folder, **options).run()


def main() -> None:
    arguments = parser(__doc__.split("\n\n")[0])
    arguments.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    arguments.add_argument("--first-seed", type=int, default=1, help="the first seed (default 1)")
    arguments.add_argument("--steps", type=int, default=None,
                           help=f"K (default {DEFAULT_STEPS}; --sharded: {SHARDED_STEPS})")
    arguments.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                           help=f"seconds from submit for the job to end (default {DEFAULT_DEADLINE_S:g})")
    arguments.add_argument("--timeline", action="store_true",
                           help="print every seed's timeline, not only a failing one's")
    arguments.add_argument("--nodes-per-replica", type=int, default=1, choices=(1, 2),
                           help="replicas of this many one-node units (default 1; 2: min 1, max 2 replicas, "
                                "results in chaos_multinode.json)")
    arguments.add_argument("--sharded", action="store_true",
                           help="with --nodes-per-replica 2: the language model under HybridSharded, each unit "
                                "holding its node's shards (results in chaos_hsdp.json)")
    args = arguments.parse_args()
    spans = args.nodes_per_replica > 1
    if args.sharded and not spans:
        raise SystemExit("chaos: --sharded needs --nodes-per-replica 2")
    if args.steps is None:
        args.steps = SHARDED_STEPS if args.sharded else DEFAULT_STEPS
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))
    steps = min(args.steps, 100 if args.sharded else 200) if args.quick else args.steps
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("chaos: SLURM_CONF is not set (scripts/minicluster up; export SLURM_CONF=...)")
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    results: list[SeedResult] = []
    with workspace(args.keep, "chaos") as folder:
        print(f"chaos: the fixed run of {steps} steps", flush=True)
        reference = fixed_run(steps, folder / "reference", sharded=args.sharded)
        with cpu_hog() as hogs:
            print(f"chaos: CPU hog pids {hogs}; seeds {seeds}", flush=True)
            for seed in seeds:
                result = run_seed(seed, reference, folder / f"seed-{seed}", deadline_s=args.deadline,
                                  nodes_per_replica=args.nodes_per_replica, sharded=args.sharded,
                                  log=lambda line: print(line, flush=True))
                results.append(result)
                print(result.report(args.timeline), flush=True)
    print()
    for result in results:
        print(result.summary())
    name = "chaos_hsdp" if args.sharded else "chaos_multinode" if spans else "chaos"
    shape = (f" (replicas of {args.nodes_per_replica} nodes{', HybridSharded' if args.sharded else ''})" if spans
             else "")
    rows = [Row(benchmark=name, metric=f"seed {r.seed}{shape}: {', '.join(r.faults) or 'no fault'}", unit="s",
                tidal=r.seconds, goal="COMPLETED once; every step with the fixed run's samples; parameters within "
                f"{PARAMETER_TOLERANCE:g}; no survivor restarted; no healthy unit failed; nothing left",
                met=r.passed, tidal_samples=[r.seconds], note="; ".join(r.problems)[:2000])
            for r in results]
    passed = sum(r.passed for r in results)
    rows.append(Row(benchmark=name, metric=f"seeds passed{shape}", unit="fraction",
                    tidal=passed / max(1, len(results)),
                    goal="all", met=passed == len(results), tidal_samples=[float(r.passed) for r in results]))
    write_result(name, rows, quick=args.quick, module="chaos",
                 settings={"seeds": seeds, "steps": steps, "deadline_s": args.deadline,
                           "nodes_per_replica": args.nodes_per_replica, "sharded": args.sharded,
                           "hog_processes": HOG_PROCESSES,
                           "controller": CONTROLLER_SETTINGS,
                           "hard_aim_share": HARD_AIM_SHARE, "max_redraws": MAX_REDRAWS,
                           "runs": [{"seed": r.seed, "passed": r.passed, "faults": r.faults, "skipped": r.skipped,
                                     "landed": [dataclasses.asdict(f) for f in r.landed],
                                     "seconds": round(r.seconds, 1), "problems": r.problems, "notes": r.notes}
                                    for r in results]})
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
