"""What depends on the collective backend: gloo on CPUs, NCCL on GPUs. Every rule Tidal
follows because of how torch 2.13's ProcessGroupNCCL (or ProcessGroupGloo) behaves lives
here, each with the behaviour it relies on; the rest of `tidal.train` calls these and
stays backend-blind.

Sources read (torch 2.13.0, git cf30153c): `torch/include/torch/csrc/distributed/c10d/
ProcessGroupNCCL.hpp` in the wheel (the environment variables and their meaning),
`torch/distributed/distributed_c10d.py` and `torch/cuda/__init__.py`; torch's
`ProcessGroupNCCL.cpp` and `NCCLUtils.cpp` (not in the wheel: the most recent copies in
pytorch/pytorch with the same header layout) for what the constructor reads, what
`WorkNCCL::wait`, `abort()`, `shutdown()`, the watchdog and the heartbeat monitor do; and
torchft 0.2.0's `process_group.py` for how it keeps NCCL survivors alive (it sets its
error flag before aborting, and aborts from a thread other than the one blocked).

The rules:

- **device per rank** (`worker_device`, `select_device`): a worker's GPU is `cuda:LOCAL_RANK`
  among the GPUs CUDA lets it see (Slurm's CUDA_VISIBLE_DEVICES, renumbered from 0), made
  the current device before the worker's first CUDA call, for every strategy.
- **environment per mode** (`nccl_environment`, `apply_environment`): in live mode the
  generation's NCCL groups are made with blocking waits, so that a failed or timed-out
  collective raises in the worker instead of NCCL's watchdog ending the process; restart
  mode (and any fixed world) keeps torchrun's settings.
- **aborting a generation** (`abort_from_outside`, `abort_groups`, `close_groups`): a
  broken generation's NCCL communicators are aborted, from the control channel's thread
  when the launcher says the generation broke (the training thread may be blocked in a
  collective with a frozen peer), and their memory is given back; gloo groups are closed
  as they always were.
- **streams** (`synchronize`): the device is synchronized before the state is digested,
  copied or sent, so that no kernel on any stream still writes what is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger("tidal.train.backend")

GLOO = "gloo"
NCCL = "nccl"


class DeviceError(RuntimeError):
    """This worker has no device of its own to run on (a LOCAL_RANK past the GPUs it sees)."""


# Device per rank.


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names (indices or UUIDs, as Slurm's GRES plugin sets
    it for the job step), or None when it is not set (CUDA then shows every GPU). CUDA
    numbers the visible ones from 0, in this order, and stops at the first empty entry."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    names: list[str] = []
    for name in value.split(","):
        if not name.strip():
            break
        names.append(name.strip())
    return names


def worker_device(env: Mapping[str, str], backend: str, *, device_count: int | None = None) -> torch.device:
    """The device this worker computes and communicates on: the CPU under gloo; under NCCL
    `cuda:LOCAL_RANK` (0 when LOCAL_RANK is not set: a process alone), where CUDA's index
    is the LOCAL_RANK-th of the GPUs it sees (with CUDA_VISIBLE_DEVICES=2,3, LOCAL_RANK 1
    is `cuda:1`, physical GPU 3). `device_count`: how many GPUs CUDA sees (default: ask
    torch; the fewer of that and CUDA_VISIBLE_DEVICES' count counts). Raises DeviceError,
    naming LOCAL_RANK and the GPUs seen, when there is no GPU for this rank.

    Relies on: one NCCL communicator holds one rank per GPU (two ranks of one communicator
    on the same GPU is unsupported and may hang), and `ProcessGroupNCCL` puts a collective
    on its tensors' device; so each worker of a node needs its own GPU, and the tensors
    Tidal makes for collectives must be on it."""
    if backend != NCCL:
        return torch.device("cpu")
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    visible = visible_devices(env)
    count = torch.cuda.device_count() if device_count is None else device_count
    usable = count if visible is None else min(count, len(visible))
    if not 0 <= local_rank < usable:
        seen = (f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r} ({len(visible)} named, "
                f"{count} seen by CUDA)" if visible is not None else f"{count} GPUs seen by CUDA")
        raise DeviceError(f"LOCAL_RANK {local_rank} has no GPU of its own: {seen}. NCCL needs one GPU per worker; "
                          "run at most as many workers per node (procs_per_node) as GPUs the unit is given "
                          "(--gres=gpu:N)")
    return torch.device("cuda", local_rank)


def select_device(device: torch.device) -> torch.device:
    """Make `device` this thread's current CUDA device (nothing for the CPU); returns it.

    Relies on: without it CUDA's current device is 0, and every tensor made with
    device="cuda", `torch.cuda.current_device()`, NCCL's lazy communicator init and
    FSDP2's device mesh (`init_device_mesh("cuda")`) land on GPU 0 whatever the rank
    (torch/cuda/__init__.py: `set_device`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def device_mismatch(model_devices: Iterable[torch.device], device: torch.device) -> str | None:
    """Why a model on `model_devices` cannot train on this worker's `device` (None: it can):
    a parameter on another GPU than this worker's. (A worker on the CPU, gloo, takes any.)"""
    if device.type != "cuda":
        return None
    others = sorted({str(d) for d in model_devices if d.type == "cuda" and d != device})
    if not others:
        return None
    return (f"the model is on {', '.join(others)} but this worker's GPU is {device} (LOCAL_RANK among "
            "CUDA_VISIBLE_DEVICES): move it there first, e.g. model.to(tidal.train.backend.worker_device(os.environ, "
            "'nccl'))")


# Environment per mode.


class Mode(enum.Enum):
    """How the job's workers live: changing worlds in-process (live), or restarted by their
    launcher on every change, as torchrun would (restart; also any fixed world)."""

    LIVE = "live"
    RESTART = "restart"


def mode_of(env: Mapping[str, str]) -> Mode:
    """Live under a launcher's control channel (TIDAL_CONTROL_SOCKET), restart otherwise."""
    return Mode.LIVE if env.get("TIDAL_CONTROL_SOCKET") else Mode.RESTART


# Read by each ProcessGroupNCCL's constructor (ProcessGroupNCCL.cpp, torch 2.13):
# - TORCH_NCCL_BLOCKING_WAIT=1: `WorkNCCL::wait` blocks the calling thread until the
#   collective completes, and on an NCCL error or on its timeout aborts the communicator
#   and raises (DistBackendError, a RuntimeError) in that thread; and the group starts no
#   watchdog thread ("TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is
#   created"), hence no heartbeat monitor either (the watchdog starts it). Without it
#   `wait()` only makes the current stream wait on the collective and returns: the worker
#   would read a collective's output, or commit a step, before knowing it failed, and the
#   watchdog would handle the failure instead (below).
# - TORCH_NCCL_ASYNC_ERROR_HANDLING: what the watchdog does on a failure or timeout. torch's
#   default is 3 (tear the process down without aborting), torchrun's and the launcher's 1
#   (abort, then tear down): either ends every survivor of a lost peer. 0 leaves errors to
#   the caller, as `torch.distributed._abort_process_group` asks of a process that aborts
#   its groups itself. Under blocking waits there is no watchdog; 0 says the same should one
#   ever run.
# Not set: TORCH_NCCL_DUMP_ON_TIMEOUT and TORCH_NCCL_ENABLE_MONITORING act through the
# watchdog's heartbeat monitor, which these groups do not have.
LIVE_NCCL_ENVIRONMENT: Mapping[str, str] = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
}


def nccl_environment(mode: Mode) -> dict[str, str]:
    """The NCCL settings the worker library imposes for `mode`: in live mode, those that make
    a failed collective of a generation's group raise in the worker (LIVE_NCCL_ENVIRONMENT);
    in restart mode none: torchrun's (the launcher sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
    unless the job sets it, as torchrun's agent does), so that a failure ends the workers
    and the launcher restarts them."""
    return dict(LIVE_NCCL_ENVIRONMENT) if mode is Mode.LIVE else {}


@dataclasses.dataclass(frozen=True)
class Override:
    """A variable the job's environment set otherwise, replaced by the mode's value."""

    name: str
    was: str
    now: str


def environment_overrides(env: Mapping[str, str], mode: Mode) -> list[Override]:
    """The variables `apply_environment` changes from a value already set (in the job's
    environment or the launcher's torchrun defaults)."""
    return [Override(name, env[name], value) for name, value in nccl_environment(mode).items()
            if name in env and env[name] != value]


def apply_environment(environ: MutableMapping[str, str], mode: Mode) -> list[Override]:
    """Set `mode`'s NCCL variables in `environ` (the process's own: `os.environ`), replacing
    what was set; returns what was replaced (logged: a job that set them otherwise for live
    mode would lose its in-process recovery).

    Called by `Elastic` before the generation's first group is made: each ProcessGroupNCCL
    reads them in its constructor, so they apply to the groups made after this. In live mode
    under `HybridSharded` the replica's shard group (FSDP2's) is made per generation too,
    with its own blocking setting (`new_group(..., host_waits=False)`); a fixed world's unit
    group (restart mode, `HybridSharded.shard` under torchrun's settings) keeps torch's
    watchdog: a failure within it ends the unit's workers, and their launcher restarts them."""
    overrides = environment_overrides(environ, mode)
    for name, value in nccl_environment(mode).items():
        environ[name] = value
    for override in overrides:
        log.warning("nccl_environment_overridden", variable=override.name, job_value=override.was,
                    value=override.now, mode=mode.value)
    return overrides


# The groups of a generation.


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """`values` in os.environ for the block (a group's constructor reads them), then as before.
    In a live worker the variables are already set (`apply_environment`), so only their
    values change: glibc's setenv then replaces one entry of the environment's array, which
    a getenv in another thread (NCCL's, torch's) reads whole, old or new."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def new_group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta, *,
              host_waits: bool = True) -> Any:
    """A process group of `size` ranks meeting at `store`: a raw `ProcessGroupNCCL` or
    `ProcessGroupGloo` object, never registered as torch.distributed's default group.
    Gloo connects here, within `timeout`. NCCL connects its communicator lazily, at the
    group's first collective, on that collective's device (this worker's GPU: `select_device`).

    `host_waits=False` (NCCL only; the replica's shard group, FSDP2's): the group is made
    with TORCH_NCCL_BLOCKING_WAIT=0 whatever the process's setting, so that a `wait()` on
    one of its works only orders the current stream after the collective and the host runs
    on. Relies on: ProcessGroupNCCL reads TORCH_NCCL_BLOCKING_WAIT once, in its constructor
    (getCvarBool), so the setting is the group's for its life. Measured on an H100 (torch
    2.11, NCCL 2.28.9, a group of one rank, 1 s of earlier work queued on the GPU): a
    blocking group's waited all-gather held the host 0.995 s; its collectives issued through
    torch.distributed's API with async_op=False, as FSDP2 issues its all-gathers and
    reduce-scatters by default, returned in 0.0003 s blocking or not; a non-blocking group's
    waited all-gather returned at once. So FSDP2's default calls overlap compute either way,
    and this setting keeps a waited shard collective (FSDP2's `unshard(async_op=True)`,
    whose work it waits on before the layer runs) from stopping the host. Such a group's
    failures are not raised by its waits: a collective stuck on a lost peer holds the
    streams until the step's next wait that stops the host (the commit vote's: on the world
    group, or under `HybridSharded` on the replica group and then the stream's
    synchronization that ends the vote, `tidal.train.groups.start_world_allreduce`), and
    the launcher's word aborts every group of the generation together (`abort_groups`),
    which ends the stuck kernels."""
    if backend == NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if host_waits:
            return dist.ProcessGroupNCCL(store, rank, size, options)
        with _environment(TORCH_NCCL_BLOCKING_WAIT="0"):
            return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend != GLOO:
        raise ValueError(f"backend {backend!r}: Tidal's elastic groups are gloo or nccl")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def backend_of(group: Any) -> str:
    """"nccl" or "gloo" (what the group says its backend is; "" when it says nothing)."""
    name = getattr(group, "name", None)
    return str(name()) if callable(name) else ""


def aborts_from_outside(backend: str) -> bool:
    """Whether the launcher's word that a generation broke (a stop, or the next world sent
    at once after a failure) aborts that generation's groups from the control channel's
    thread, while the training thread may still be blocked in one of its collectives.

    NCCL: yes. A peer that is frozen (SIGSTOP, a hung GPU) never fails the collective: the
    survivors' kernels wait for it until the group's timeout. `ProcessGroupNCCL.abort()`
    from another thread aborts the communicators (ncclCommAbort makes the running kernels
    exit), and the blocked wait returns. Not freed so: a rank whose own GPU hangs, its
    collective queued behind the hung kernel (measured on an H100, torch 2.11: a wait behind a
    20 s kernel returned after 20.0 s, the abort sent at 1 s, tests/gpu/test_one_gpu.py): its
    wait ends at the groups' timeout, or when the kernel does (docs/limits.md). Gloo: no.
    `ProcessGroupGloo.abort()` does not unblock a peer waiting on a stopped one (measured:
    DESIGN.md); the frozen worker's launcher kills it instead, and the survivors' gloo
    collectives then fail at once with "Connection closed by peer"."""
    return backend == NCCL


def abort_from_outside(backend: str, *, groups_generation: int | None, broken_through: int) -> bool:
    """Whether this rank's groups (of `groups_generation`; None: it holds none) are aborted
    now, from outside the training thread, on the launcher's word that every generation up
    to `broken_through` is broken."""
    return (aborts_from_outside(backend) and groups_generation is not None
            and groups_generation <= broken_through)


def abort_groups(groups: Sequence[Any]) -> None:
    """Abort each group (callable from any thread; errors are logged, not raised): later
    collectives on them fail, and a thread blocked in one of their waits returns.

    Relies on (torch 2.13): `ProcessGroupNCCL::abort()` aborts every communicator of the
    group (including one still being connected), without waiting for its kernels, bounded
    by the group's timeout, and stops its watchdog; NCCL wants the communicators of one
    device aborted together, inside one ncclGroupStart/End, or one abort may wait on the
    other's kernels (distributed_c10d._abort_process_group, pytorch issue 119797). A
    `WorkNCCL::wait` unblocked this way returns without raising: the caller must have
    recorded that the generation broke before calling this (torchft sets its error before
    aborting for the same reason). `ProcessGroupGloo.abort()` closes nothing and wakes no
    waiter: gloo's connections close when the group's last reference goes."""
    nccl = [group for group in groups if backend_of(group) == NCCL]
    grouped = bool(nccl) and len(nccl) > 1 and hasattr(nccl[0], "_group_start")
    if grouped:
        nccl[0]._group_start()
    try:
        for group in groups:
            try:
                group.abort()
            except RuntimeError as error:
                log.warning("group_abort_failed", backend=backend_of(group), error=str(error))
    finally:
        if grouped:
            nccl[0]._group_end()


def close_groups(groups: list[Any], *, broken: bool, aborted: bool = False) -> None:
    """Leave a generation's groups, then drop `groups`' references (the list is emptied; the
    caller must hold no other). NCCL groups are aborted whether or not the world broke
    (unless `aborted`: `abort_groups` already did), and their cached memory given back;
    gloo groups are shut down after a planned change, and after a failure aborted and
    dropped on a thread of their own (`_abort_and_drop`: that may block).

    Relies on: NCCL's `shutdown()` flushes and destroys the communicators
    (ncclCommFinalize, ncclCommDestroy), which may wait on peers; once every collective
    of the generation completed, `abort()` has nothing left to cancel and waits for nobody
    (torchft aborts on every reconfiguration too). ncclCommAbort frees the communicator's
    own device memory; the tensors its works held return to the caching allocator when
    the group goes, and `torch.cuda.empty_cache()` then hands them back to the driver, so
    that the next generation's communicators, which NCCL allocates outside the caching
    allocator, find the memory. A gloo group's sockets close only when its last reference
    goes (`abort` and `shutdown` leave them open), which is how its peers learn that this
    rank left."""
    nccl = any(backend_of(group) == NCCL for group in groups)
    if aborted:
        pass
    elif nccl:
        abort_groups(groups)
    elif broken:
        # On a thread of its own, which then drops the last references: see below. They
        # move to the thread's own list first: had this thread kept one (the caller's
        # list), it could be the last to let go, once the other had aborted and dropped
        # its copy, and block here in the groups' destruction (seen on the mini cluster:
        # a survivor held 120 s in `groups.clear()` below).
        handed = list(groups)
        groups.clear()
        threading.Thread(target=_abort_and_drop, args=(handed,), name="tidal-gloo-close", daemon=True).start()
        del handed
    else:
        for group in groups:
            with contextlib.suppress(RuntimeError):
                group.shutdown()
    groups.clear()
    if nccl:
        release_memory()


def _abort_and_drop(groups: list[Any]) -> None:
    """Abort a broken generation's gloo groups, then drop them (their connections close).

    Off the training thread because it can block: `ProcessGroupGloo.abort()` (and the
    group's destruction) waits for the group's work threads, and one of them may still be
    in a collective of the broken step (an all-reduce of another gradient bucket) waiting
    on a peer that is alive but has left that step, until the collective's timeout (seen on
    the mini cluster: a survivor held 120 s in the close, its peers waiting in the next
    generation's rendezvous for it). The training thread goes on to the next generation's
    groups meanwhile; these connections close when this returns."""
    for group in groups:
        with contextlib.suppress(RuntimeError):
            group.abort()
    groups.clear()


def release_memory() -> None:
    """Give the CUDA caching allocator's free blocks back to the driver (nothing without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# Streams.


def synchronize(device: torch.device | None) -> None:
    """Wait until every kernel queued on `device`, on every stream, has finished (nothing
    for the CPU). Before the training state is digested, copied to the host or sent.

    Relies on: NCCL collectives run on streams of their own and FSDP2 all-gathers and
    reduce-scatters on others; a `wait()` orders only the current stream after a
    collective, and a host copy (`.cpu()`) waits only for the current stream.
    `torch.cuda.synchronize(device)` waits for all of them."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_tensors(tensors: Iterable[torch.Tensor]) -> None:
    """`synchronize` each CUDA device among `tensors`' devices, once."""
    for device in sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str):
        synchronize(device)


def prepare_worker(environ: MutableMapping[str, str], backend: str) -> torch.device:
    """Before a worker's first collective: its device chosen and made current, and its
    mode's NCCL environment set (NCCL only). Returns the device."""
    device = select_device(worker_device(environ, backend))
    if backend == NCCL:
        apply_environment(environ, mode_of(environ))
    return device


__all__ = ["GLOO", "LIVE_NCCL_ENVIRONMENT", "NCCL", "DeviceError", "Mode", "Override", "abort_from_outside",
           "abort_groups", "aborts_from_outside", "apply_environment", "backend_of", "close_groups",
           "device_mismatch", "environment_overrides", "mode_of", "nccl_environment", "new_group",
           "prepare_worker", "release_memory", "select_device", "synchronize", "synchronize_tensors",
           "visible_devices", "worker_device"]
