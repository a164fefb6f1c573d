"""A launcher's worker processes: a torchrun-compatible environment, start, watch, stop.

Each worker runs in a session (process group) of its own, so a stop reaches whatever it
started; each is started through `deathsig`, which sets PR_SET_PDEATHSIG, so that a
launcher killed with SIGKILL leaves no orphan behind. Exits are seen at once through a
pidfd on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

from tidal.launcher.liveness import read_process_sample

log = structlog.get_logger("tidal.launcher.workers")

# Variables a worker must not inherit from its launcher.
PRIVATE_VARIABLES = frozenset({"TIDAL_JOB_SECRET", "TIDAL_SECRET_FILE"})
# torchrun's TORCHELASTIC_MAX_RESTARTS is never negative; Tidal restarts a job's workers
# without a limit, so it says the largest count a 32-bit reader takes.
UNLIMITED_RESTARTS = 2**31 - 1
# What of a failed worker's error file travels to the controller: the exception line, and
# the last lines of its traceback, within a few KiB.
MAX_ERROR_MESSAGE_CHARS = 500
MAX_TRACEBACK_LINES = 20
MAX_TRACEBACK_CHARS = 3000
# After its SIGKILL, how long a stop waits for a worker's exit before giving up on it. One
# in uninterruptible sleep (D state: a hung file system, a wedged GPU driver) dies only when
# its kernel call returns, which may be never. A GPU process's teardown takes seconds; this
# is short of Slurm's default KillWait (30 s), so the launcher says so before Slurm kills it.
KILL_WAIT_S = 20.0

@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this launcher's workers sit in a generation's world."""

    generation: int
    first_rank: int
    group_rank: int
    group_world_size: int
    procs_per_node: int
    world_size: int
    master_addr: str
    master_port: int
    # The generation's target step (the job's committed step when it was decided).
    target_step: int = 0


def worker_environment(base: Mapping[str, str], extra: Mapping[str, str], *, placement: Placement, local_rank: int,
                       job_id: str, unit_id: str, progress_file: Path, error_file: Path) -> dict[str, str]:
    """The environment of one worker: the launcher's (minus its secrets), the job's own
    variables, then what torchrun 2.13's agent sets, then Tidal's. A script written for
    torchrun (env:// rendezvous) runs unmodified; TORCHELASTIC_USE_AGENT_STORE makes every
    rank a client of the store the generation's host launcher serves, as under torchrun.
    One role ("default"): ROLE_RANK and ROLE_WORLD_SIZE are the global rank and world
    size. TORCHELASTIC_RESTART_COUNT counts every restart (generation - 1), where torchrun
    counts those after a failure only. TORCHELASTIC_ERROR_FILE is where torch's `@record`
    writes a failing worker's exception (`read_worker_error`)."""
    env = {k: v for k, v in base.items() if k not in PRIVATE_VARIABLES}
    env.update(extra)
    rank = placement.first_rank + local_rank
    # torchrun keeps a value its own environment sets, else "1": in restart mode. In live mode
    # (a control channel) the worker library sets what its generations' NCCL groups need in
    # the worker itself (tidal.train.backend.nccl_environment) and says so when it replaces a
    # value the job set; the launcher does not import tidal.train.
    if not env.get("TIDAL_CONTROL_SOCKET"):
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_WORLD_SIZE": str(placement.procs_per_node),
        "GROUP_RANK": str(placement.group_rank),
        "GROUP_WORLD_SIZE": str(placement.group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(placement.world_size),
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(placement.generation - 1),
        "TORCHELASTIC_MAX_RESTARTS": str(UNLIMITED_RESTARTS),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "TIDAL_JOB_ID": job_id,
        "TIDAL_UNIT_ID": unit_id,
        "TIDAL_GENERATION": str(placement.generation),
        "TIDAL_TARGET_STEP": str(placement.target_step),
        "TIDAL_PROGRESS_FILE": str(progress_file),
    })
    if placement.procs_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclasses.dataclass(frozen=True)
class WorkerProgress:
    step: int
    at: float


def read_progress(path: Path) -> WorkerProgress | None:
    """What a worker last wrote with `tidal.train.progress.report_progress`."""
    try:
        step_text, time_text = path.read_text().split()[:2]
        return WorkerProgress(step=int(step_text), at=float(time_text))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """A failed worker's own account, from the error file torch's `@record` wrote."""

    # The exception line ("ValueError: boom 42"), at most MAX_ERROR_MESSAGE_CHARS.
    message: str
    # The end of its traceback: at most MAX_TRACEBACK_LINES lines, MAX_TRACEBACK_CHARS.
    traceback: str


def error_files(run_dir: Path, generation: int, procs: int) -> list[Path]:
    """Each worker's TORCHELASTIC_ERROR_FILE, in a folder per generation, as torchrun's
    `<log_dir>/attempt_<n>/<local rank>/error.json`. Only the new generation's folder is
    kept: every earlier worker has exited and its exit was read."""
    root = run_dir / "errors"
    shutil.rmtree(root, ignore_errors=True)
    return [root / f"generation-{generation}" / f"local-rank-{local}.json" for local in range(procs)]


def read_worker_error(path: Path) -> WorkerError | None:
    """What torch's ErrorHandler wrote into `path` (TORCHELASTIC_ERROR_FILE), read as
    torchrun's ProcessFailure reads it: {"message": {"message": ..., "extraInfo":
    {"py_callstack": ...}}}, or {"message": "..."}. None when there is no file (the worker
    did not use `@record`, or died by a signal) or it holds no such JSON (logged)."""
    try:
        data = json.loads(path.read_text(errors="replace"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("error_file_unreadable", path=str(path), error=str(error))
        return None
    found = data.get("message") if isinstance(data, dict) else None
    if isinstance(found, str):
        return WorkerError(message=_bounded_message(found), traceback="")
    if not isinstance(found, dict) or not isinstance(found.get("message"), str):
        log.warning("error_file_unreadable", path=str(path), error="no message in it")
        return None
    extra = found.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return WorkerError(message=_bounded_message(found["message"]),
                       traceback=_traceback_tail(callstack) if isinstance(callstack, str) else "")


def _bounded_message(message: str) -> str:
    return message.strip()[:MAX_ERROR_MESSAGE_CHARS]


def _traceback_tail(callstack: str) -> str:
    """The last MAX_TRACEBACK_LINES lines, within MAX_TRACEBACK_CHARS (the end kept)."""
    tail = "\n".join(callstack.rstrip().splitlines()[-MAX_TRACEBACK_LINES:])
    return tail[-MAX_TRACEBACK_CHARS:]


@dataclasses.dataclass
class Worker:
    local_rank: int
    rank: int
    process: subprocess.Popen[bytes]
    progress_file: Path
    exited: asyncio.Future[int]
    # Where torch's `@record` writes its exception (TORCHELASTIC_ERROR_FILE).
    error_file: Path

    @property
    def pid(self) -> int:
        return self.process.pid


class WorkerGroup:
    """The workers of one generation on this node."""

    def __init__(self, generation: int, workers: list[Worker]) -> None:
        self.generation = generation
        self.workers = workers
        # Set once the launcher stops them, so their exits are not reported as failures.
        self.stopping = False
        # The pids of workers still there KILL_WAIT_S after a stop's SIGKILL.
        self.unkillable: tuple[int, ...] = ()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if not w.exited.done()]

    @property
    def all_exited(self) -> bool:
        return all(w.exited.done() for w in self.workers)

    async def stop(self, grace_s: float, repeat_term_after_s: float | None = None) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after `grace_s`, and
        wait at most KILL_WAIT_S more: a worker still there then is given up on (logged,
        and named in `unkillable`).

        `repeat_term_after_s`: SIGTERM once more after that long. A live-mode worker takes a
        first SIGTERM for Slurm's notice that its allocation ends (it waits briefly for the
        launcher to say whether it must save the job's state) and a second one as the
        launcher's own stop."""
        self.stopping = True
        alive = [w for w in self.workers if not w.exited.done()]
        for worker in alive:
            _signal_group(worker.pid, signal.SIGTERM)
        if alive and repeat_term_after_s is not None and repeat_term_after_s < grace_s:
            await asyncio.wait([w.exited for w in alive], timeout=repeat_term_after_s)
            grace_s -= repeat_term_after_s
            for worker in alive:
                if not worker.exited.done():
                    _signal_group(worker.pid, signal.SIGTERM)
        if alive:
            await asyncio.wait([w.exited for w in alive], timeout=grace_s)
        for worker in alive:
            # The group may outlive its leader (a child the worker started).
            _signal_group(worker.pid, signal.SIGKILL)
        if alive:
            await asyncio.wait([w.exited for w in alive], timeout=KILL_WAIT_S)
        self.unkillable = tuple(w.pid for w in alive if not w.exited.done())
        for pid in self.unkillable:
            sample = read_process_sample(pid, threads=False)
            log.error("worker_unkillable", pid=pid, state=sample.state if sample is not None else None,
                      waited_s=KILL_WAIT_S)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def start_workers(command: Sequence[str], environments: Sequence[dict[str, str]], *, generation: int, first_rank: int,
                  working_dir: str, progress_files: Sequence[Path], error_files: Sequence[Path],
                  on_exit: Callable[[Worker, int], None]) -> WorkerGroup:
    """Start one process per environment; `on_exit(worker, returncode)` runs on the event
    loop when one exits (negative: killed by that signal). Each worker's error file
    (`error_files`, named in its environment) is absent, and its folder there, when it
    starts. Raises OSError if the command cannot be started (after stopping the ones
    already started)."""
    loop = asyncio.get_running_loop()
    workers: list[Worker] = []
    try:
        for local_rank, env in enumerate(environments):
            with contextlib.suppress(FileNotFoundError):
                progress_files[local_rank].unlink()
            error_file = error_files[local_rank]
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.unlink(missing_ok=True)
            wrapped = [sys.executable, "-m", "tidal.launcher.deathsig", str(os.getpid()), *command]
            process = subprocess.Popen(wrapped, env=env, cwd=working_dir or None, start_new_session=True,
                                       stdin=subprocess.DEVNULL)
            worker = Worker(local_rank=local_rank, rank=first_rank + local_rank, process=process,
                            progress_file=progress_files[local_rank], exited=loop.create_future(),
                            error_file=error_file)
            workers.append(worker)
            _watch_exit(loop, worker, on_exit)
    except OSError:
        for worker in workers:
            _signal_group(worker.pid, signal.SIGKILL)
            worker.process.wait()
        raise
    log.info("workers_started", generation=generation, pids=[w.pid for w in workers], first_rank=first_rank)
    return WorkerGroup(generation, workers)


def _watch_exit(loop: asyncio.AbstractEventLoop, worker: Worker, on_exit: Callable[[Worker, int], None]) -> None:
    descriptor = os.pidfd_open(worker.pid)

    def exited() -> None:
        loop.remove_reader(descriptor)
        os.close(descriptor)
        returncode = worker.process.wait()
        # What it started in its process group (a data loader's workers, a helper) serves
        # nothing without it and may hold its devices' memory: killed now, while the
        # group's members keep its id from going to another process (later, the group
        # emptied by itself, the id could be another's).
        _signal_group(worker.pid, signal.SIGKILL)
        if not worker.exited.done():
            worker.exited.set_result(returncode)
        on_exit(worker, returncode)

    loop.add_reader(descriptor, exited)

