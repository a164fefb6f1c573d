"""The elastic training API: a data-parallel PyTorch loop that survives world changes in-process.

A plain script hands its model, optimizer, map-style dataset and a loss function to
`Elastic` and iterates `train(steps)`:

    job = Elastic(model, optimizer, dataset, global_batch=64, micro_batch=16,
                  loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="sum"),
                  lr_scheduler=scheduler, seed=0, checkpoint_dir="ckpt", checkpoint_every=100)
    for result in job.train(steps=1000):
        if result.rank == 0 and result.step % 10 == 0:
            print(result.step, result.loss)

What it does for every step k (see `data` for the numbers):

- the step's samples are positions [kB, (k+1)B) of one seeded global order; this rank
  takes its share and runs `loss_fn` over it in micro-batches, summing losses (loss_fn
  returns the SUM over the batch's samples) and accumulating gradients;
- one small float64 all-reduce carries the sample count and index checksums (every sample
  of the step counted once, or the step fails loudly), the summed loss and whether any
  rank has been told of a world change; then one all-reduce sums the gradients, which are
  divided by B. The update is the same whatever the world size;
- the step commits only once the gradient all-reduce has completed; if a peer dies before
  that, the step is abandoned here (no optimizer step, gradients dropped), the survivors
  re-form and redo the step's samples. A rank whose all-reduce did complete has applied
  the step correctly; on re-forming, every rank adopts the state of the most advanced
  survivor, so the optimizer step counts as applied everywhere or nowhere.

Under a Tidal launcher in live mode (`TIDAL_CONTROL_SOCKET` set) world changes happen in
this process: a planned one (grow, graceful leave) after the step the ranks agree on, a
failure as soon as the launcher says stop. Forming a world syncs the training state from
a live peer (a joiner receives it) and checks a SHA-256 digest of it on every rank. Run
without a launcher (or under torchrun) the same script trains in a fixed world; that is
the reference an elastic run must reproduce."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from tidal.proto.control import (
    EXIT_STATE_LOST,
    Beat,
    Finished,
    FirstStep,
    Formed,
    Left,
    Resumed,
    Stopped,
    World,
)
from tidal.proto.control import StateLost as StateLostMessage
from tidal.train.channel import ChannelClosed, WorkerChannel
from tidal.train.checkpoint import AsyncCheckpointer
from tidal.train.data import GlobalOrder, StepSamples, micro_batches, step_samples
from tidal.train.groups import Groups, fixed_world_store, form_groups
from tidal.train.progress import report_progress
from tidal.train.simulated import SimulatedDevice, Simulation
from tidal.train.state import Counters, StateDoesNotFit, TrainingParts, capture, digest, restore
from tidal.train.strategy import DataParallel, Strategy
from tidal.train.transfer import DEFAULT_BUCKET_BYTES, receive_state, send_state

log = structlog.get_logger("tidal.train.elastic")

# Index checksums are taken modulo this prime so that float64 sums stay exact.
CHECKSUM_MODULUS = 2_147_483_647
PROGRESS_INTERVAL_S = 0.2
# The generation's store answers at once while its launcher lives; past this, its host is gone.
STORE_TIMEOUT_S = 10.0
# Once every rank of a generation arrived, its process group connects within this (plus a
# little per rank). A member lost in that window (a node failing while a world forms) must
# not hold the others in gloo's connect for the whole process-group timeout, nor past
# their launcher's stop grace (10 s), which would kill them and their state with them.
FORM_TIMEOUT_S = 5.0
FORM_TIMEOUT_PER_RANK_S = 0.01
# A worker started ahead (standby) waits this long for a world; its launcher ends it
# sooner if the unit leaves.
STANDBY_TIMEOUT_S = 7 * 24 * 3600.0


# A live worker's first SIGTERM is held this long ($TIDAL_TERM_WAIT_S): Slurm ending an
# allocation signals every process in it, and the launcher must first learn from the
# controller whether this unit holds the job's last copy of the state and saves it before
# leaving. A second SIGTERM (the launcher's own stop sends two) ends the worker at once.
TERM_WAIT_S = 3.0


def leave_state_folder(env: dict[str, str] | os._Environ[str]) -> Path | None:
    """Live mode under a launcher: where the last replica to leave writes the job's state
    when the script keeps no checkpoints of its own. `$TIDAL_STATE_DIR`, else
    `tidal-state/<job id>` in the working directory; like any checkpoint it must be on
    storage that every node sees. None outside live mode."""
    if not env.get("TIDAL_CONTROL_SOCKET"):
        return None
    if env.get("TIDAL_STATE_DIR"):
        return Path(env["TIDAL_STATE_DIR"]).absolute()
    return Path.cwd() / "tidal-state" / (env.get("TIDAL_JOB_ID") or "job")


class WorldBroken(Exception):
    """The step cannot complete in this world: a peer is gone or the launcher said stop."""


class StateMismatch(RuntimeError):
    """Replicas disagree on the training state after a world formed (a bug, never ignored)."""


class AccountingError(RuntimeError):
    """A step did not consume exactly its B samples (a bug, never ignored)."""


class StateLost(RuntimeError):
    """No rank of a world holds the training state at the job's committed step, and there
    is no checkpoint to resume from: training refuses to start again from scratch."""



@dataclasses.dataclass(frozen=True)
class FixedBatch:
    """The default: the global batch B is the job's, whatever the world size."""

    global_batch: int

    def batch_for(self, world_size: int) -> int:
        return self.global_batch

    def lr_factor(self, world_size: int) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class ScaledBatch:
    """For users who want it: B follows the world size (`per_rank` samples a rank), and the
    learning rate follows B by a rule relative to `reference_world_size`: "linear" (Goyal
    et al.), "sqrt", or "none". An elastic run then no longer computes what a fixed-size
    run computes."""

    per_rank: int
    lr_rule: Literal["linear", "sqrt", "none"] = "linear"
    reference_world_size: int = 1

    def batch_for(self, world_size: int) -> int:
        return self.per_rank * world_size

    def lr_factor(self, world_size: int) -> float:
        ratio = world_size / self.reference_world_size
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_rule]


BatchPolicy = FixedBatch | ScaledBatch


@dataclasses.dataclass(frozen=True)
class StepResult:
    # Steps completed, this one included.
    step: int
    # Sum of the step's per-sample losses over all ranks, divided by the global batch.
    loss: float
    global_batch: int
    world_size: int
    rank: int
    # The world's version (generation) this step was committed in.
    generation: int
    # This rank's sample indices in the step.
    indices: list[int]
    seconds: float
    # The gradient's global 2-norm before clipping (None: Elastic's max_grad_norm not set).
    grad_norm: float | None = None


class Ledger:
    """Optional JSONL record of every step attempt and commit (for audits and tests)."""

    def __init__(self, directory: Path | None) -> None:
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._file = open(directory / f"ledger-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "pid": os.getpid(), "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _index_checksums(indices: Sequence[int]) -> tuple[float, float]:
    return (float(sum(indices) % CHECKSUM_MODULUS), float(sum(i * i for i in indices) % CHECKSUM_MODULUS))


class Elastic:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, *,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], global_batch: int | None = None,
                 micro_batch: int | None = None, lr_scheduler: Any = None, seed: int = 0,
                 collate_fn: Callable[[list[Any]], Any] = default_collate, batch_policy: BatchPolicy | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int = 0,
                 ledger_dir: str | os.PathLike[str] | None = None, timeout_s: float = 120.0,
                 backend: str | None = None, strategy: Strategy | None = None,
                 transfer_bucket_bytes: int = DEFAULT_BUCKET_BYTES, simulation: Simulation | None = None,
                 max_grad_norm: float | None = None) -> None:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Tidal reduces gradients itself (SUM / B over a process group that changes);
            # DDP's averaging over a fixed group does not fit, so its module is used.
            model = model.module
        if batch_policy is None:
            if global_batch is None:
                raise ValueError("give global_batch (or a batch_policy)")
            batch_policy = FixedBatch(global_batch)
        if isinstance(batch_policy, FixedBatch) and batch_policy.global_batch <= 0:
            raise ValueError(f"global_batch must be positive, not {batch_policy.global_batch}")
        self.parts = TrainingParts(model=model, optimizer=optimizer, scheduler=lr_scheduler)
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.micro_batch = micro_batch
        self.collate_fn = collate_fn
        self.policy = batch_policy
        self.order = GlobalOrder(len(dataset), seed)
        self.counters = Counters()
        self.timeout_s = timeout_s
        self.strategy = strategy or DataParallel()
        self.transfer_bucket_bytes = transfer_bucket_bytes
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or None: no clipping), not {max_grad_norm}")
        # Each step's gradient is clipped to this global 2-norm before the optimizer step.
        self.max_grad_norm = max_grad_norm
        # A simulated accelerator (`tidal.train.simulated`): each micro-batch also takes its
        # device time, each step's reduction its all-reduce time, in sleeps. None: off.
        self.simulated = SimulatedDevice(simulation) if simulation is not None else None
        if simulation is not None:
            log.info("simulated_accelerator", simulation=simulation.describe())
        checkpoint_path = Path(checkpoint_dir) if checkpoint_dir and checkpoint_every else None
        self.checkpoint_every = checkpoint_every if checkpoint_path is not None else 0
        # Live mode without checkpoints of the script's own: the folder where the last
        # replica to leave writes the state (and the next world reads it), removed when
        # the job's training completes.
        self.state_folder = None if checkpoint_path is not None else leave_state_folder(os.environ)
        folder = checkpoint_path or self.state_folder
        self.checkpointer: AsyncCheckpointer | None = self._checkpointer(folder) if folder is not None else None
        self.ledger = Ledger(Path(ledger_dir) if ledger_dir else None)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.strategy.attach(model, self.params)
        on_gpu = any(p.is_cuda for p in self.params)
        self.backend = backend or ("nccl" if on_gpu and dist.is_nccl_available() else "gloo")
        # Collectives' tensors live where the backend wants them (NCCL: the current GPU).
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        if self.backend == "nccl":
            # A failed collective is Tidal's to handle (abort, re-form): NCCL's watchdog
            # must not tear the process down first.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        self.has_state = False
        # Set once this worker leaves the job on its launcher's word (after a SIGTERM, the
        # wait for that word ends there).
        self._leaving = False
        self.world: World | None = None
        self.channel: WorkerChannel | None = None
        self._store: Any = None
        self.groups: Groups | None = None
        self._first_step_pending = False
        self._progress_at = 0.0
        # True while this rank is blocked in a collective (read by the beat thread).
        self._waiting = False
        # The last committed step's loss (None before the first): sent with the beats, so
        # the controller keeps a loss history (`tidal plot`).
        self.last_loss: float | None = None
        self.log = log

    # What a script may read.

    @property
    def rank(self) -> int:
        return self.world.rank if self.world else 0

    @property
    def world_size(self) -> int:
        return self.world.world_size if self.world else 1

    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def live(self) -> bool:
        return self.channel is not None

    # The loop.

    def train(self, steps: int) -> Iterator[StepResult]:
        """Train until `steps` steps are complete, yielding after each committed step. A
        replica told to leave returns from here by raising SystemExit(0) after its last
        step; one that can no longer take part raises. When the job's state is lost (no
        live rank holds it and there is no checkpoint) it exits with EXIT_STATE_LOST rather
        than train from step 0."""
        try:
            self._open()
            while self.counters.step < steps:
                # Recovery runs outside the except clause: the exception's traceback holds
                # the failed collective, and with it the old process group, whose
                # connections must close for the peers to see this rank leave.
                broken = self._guarded(self._attempt_step)
                if isinstance(broken, str):
                    if not self.live:
                        raise RuntimeError(f"training failed in a fixed world: {broken}")
                    self._recover(broken)
                    continue
                result, change_pending = broken
                if self.counters.step >= steps and self.channel is not None:
                    # Training is over: say so before the script's own code after train()
                    # runs and before anything is torn down, so that from here on an exit or
                    # a silence is not a failure and no new world forms.
                    self.channel.send(Finished(generation=result.generation, step=self.counters.step))
                    self.ledger.write("finished", epoch=result.generation, step=self.counters.step)
                    self._remove_state_folder()
                yield result
                if change_pending and self.counters.step < steps:
                    self._move_to_next_world()
        except StateLost as lost:
            self.log.error("state_lost", reason=str(lost))
            raise SystemExit(EXIT_STATE_LOST) from lost
        finally:
            self._close()

    def _open(self) -> None:
        env = os.environ
        if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            # `kill -USR1 <pid>` prints every thread's stack to stderr: where a stuck rank
            # is. A handler the script installed itself (say, for Slurm's --signal) stays.
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        socket_path = env.get("TIDAL_CONTROL_SOCKET")
        if socket_path and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if socket_path:
            self.channel = WorkerChannel(socket_path, int(env.get("LOCAL_RANK", "0")), os.getpid())
            self.channel.start_beats(lambda: Beat(step=self.counters.step, samples=self.counters.samples,
                                                  waiting=self._waiting, loss=self.last_loss))
        self.world = World(generation=int(env.get("TIDAL_EPOCH", "0")), rank=int(env.get("RANK", "0")),
                           world_size=int(env.get("WORLD_SIZE", "1")), master_addr=env.get("MASTER_ADDR", ""),
                           master_port=int(env.get("MASTER_PORT", "0") or 0),
                           target_step=int(env.get("TIDAL_TARGET_STEP", "0") or 0))
        self.log = log.bind(pid=os.getpid())
        joining = env.get("TIDAL_JOINING") == "1"
        if self.channel is not None and env.get("TIDAL_STANDBY") == "1":
            # Started ahead of any world: wait until the launcher names one, and whether it
            # joins a running world.
            self.world = self.channel.wait_world(after_generation=0, timeout_s=STANDBY_TIMEOUT_S)
            joining = self.world.joining
            if self.world.leaves:
                # Told to leave before it ever joined a world (the unit leaves, or gives its
                # node back): it holds no training state, so there is nothing to save.
                self._leave(dataclasses.replace(self.world, save=False))
        if self.checkpointer is not None and not joining:
            self._load_checkpoint()
        if not self.live:
            if self.world.world_size > 1:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                self.groups = self._form_groups(dist.PrefixStore("tidal/fixed", fixed_world_store()), self.world,
                                                timeout, timeout)
            self._sync_state()
            self._apply_batch_policy()
            return
        broken = self._guarded(self._form, self.world)
        if isinstance(broken, str):
            self._recover(broken)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """A first SIGTERM: wait (in a thread) for the launcher to say this unit leaves,
        saving the state if it holds the last copy; if it does not within TERM_WAIT_S, end
        as SIGTERM would have. Any later SIGTERM ends the process at once."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        wait_s = float(os.environ.get("TIDAL_TERM_WAIT_S", TERM_WAIT_S))
        self.log.info("sigterm_held", wait_s=wait_s, step=self.counters.step)

        def end_unless_leaving() -> None:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self._leaving or self._leave_announced():
                    return
                time.sleep(0.05)
            if not (self._leaving or self._leave_announced()):
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=end_unless_leaving, name="tidal-sigterm", daemon=True).start()

    def _leave_announced(self) -> bool:
        """The launcher named a world this worker leaves for (it goes at the next step's end)."""
        world, channel = self.world, self.channel
        if channel is None:
            return False
        announced = channel.next_world(world.generation if world is not None else 0)
        return announced is not None and announced.leaves

    def _remove_state_folder(self) -> None:
        """Training is complete: a state written by a leaving replica is of no more use."""
        if self.state_folder is not None and self.rank == 0 and self.state_folder.is_dir():
            shutil.rmtree(self.state_folder, ignore_errors=True)

    def _close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self._destroy_group()
        self.ledger.close()
        if self.channel is not None:
            self.channel.close()

    def _checkpointer(self, folder: Path) -> AsyncCheckpointer:
        shard_size = self.strategy.shard_size
        if shard_size == 1:
            return AsyncCheckpointer(folder)
        # Each shard index keeps its own checkpoints (written by replica 0's worker, or by
        # the leaving unit's), and a step loads only when every shard has it.
        folders = [folder / f"shard-{k}-of-{shard_size}" for k in range(shard_size)]
        mine = folders.pop(self.strategy.shard_rank)
        return AsyncCheckpointer(mine, siblings=tuple(folders))

    def _load_checkpoint(self) -> None:
        assert self.checkpointer is not None
        state = self.checkpointer.latest()
        if state is None:
            return
        restore(self.parts, self.counters, state)
        self.has_state = True
        self.log.info("checkpoint_loaded", step=self.counters.step, position=self.counters.position)

    # Worlds.

    def _destroy_group(self, broken: bool = False) -> None:
        """Leave the generation's groups (aborted after a failure: a destroy would wait on
        collectives that will never finish). The unit's shard group stays."""
        if self.groups is not None:
            self.groups.close(broken)
        self.groups = None

    def _form_groups(self, store: Any, world: World, connect: datetime.timedelta,
                     timeout: datetime.timedelta) -> Groups | None:
        if world.world_size == 1:
            return None
        try:
            return form_groups(self.backend, store, rank=world.rank, world_size=world.world_size,
                               shard_size=self.strategy.shard_size, shard_rank=self.strategy.shard_rank,
                               connect_timeout=connect, timeout=timeout)
        except ValueError as error:
            # A world that does not fit the strategy's replicas is a planning bug, never retried.
            raise StateMismatch(f"generation {world.generation}: {error}") from error

    def _form(self, world: World) -> None:
        """Join `world`'s process group (every member arrives first, so waiting stays
        interruptible by a stop) and agree on the training state."""
        assert self.channel is not None
        started = time.monotonic()
        self._destroy_group()
        self.world = world
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            store = self._connect_store(world)
            store.set_timeout(timeout)
            self._store = store
            # One store serves the launcher's life; each generation meets under its own prefix.
            prefix = dist.PrefixStore(f"gen/{world.generation}", store)
            prefix.add("arrived", 1)
            deadline = started + self.timeout_s
            while prefix.add("arrived", 0) < world.world_size:
                if self.channel.stop_requested(world.generation):
                    raise WorldBroken(f"stopped while waiting for the peers of generation {world.generation}")
                self._check_superseded(world)
                if time.monotonic() > deadline:
                    raise WorldBroken(f"peers of generation {world.generation} did not arrive within "
                                      f"{self.timeout_s:g} s")
                time.sleep(0.002)
            form_s = min(self.timeout_s, FORM_TIMEOUT_S + FORM_TIMEOUT_PER_RANK_S * world.world_size)
            # Formed, the groups' collectives (the state's transfer first) get the full
            # timeout, the backstop.
            self.groups = self._form_groups(dist.PrefixStore("group", prefix), world,
                                            datetime.timedelta(seconds=form_s), timeout)
            source, state_digest = self._sync_state()
        except (RuntimeError, ValueError) as error:
            if isinstance(error, (StateMismatch, AccountingError, StateLost)):
                raise
            raise WorldBroken(f"forming generation {world.generation} failed: {error}") from error
        self._apply_batch_policy()
        self._first_step_pending = True
        seconds = time.monotonic() - started
        self.channel.send(Formed(generation=world.generation, step=self.counters.step, digest=state_digest))
        self.ledger.write("formed", epoch=world.generation, rank=world.rank, world_size=world.world_size,
                          shard=self.strategy.shard_rank, step=self.counters.step, digest=state_digest, source=source,
                          seconds=seconds)
        self.log.info("world_formed", generation=world.generation, rank=world.rank, world_size=world.world_size,
                      step=self.counters.step, state_source=source, seconds=round(seconds, 4))

    def _check_superseded(self, world: World) -> None:
        """A newer generation was announced while this one formed: its peers may never come
        (they went straight to the newer one, or it replaced this one after a failure), so
        nothing is gained by waiting; the rank takes the newer one instead."""
        assert self.channel is not None
        newer = self.channel.next_world(world.generation)
        if newer is not None:
            raise WorldBroken(f"generation {newer.generation} was announced while generation {world.generation} "
                              "formed")

    def _connect_store(self, world: World) -> dist.TCPStore:
        """The generation's rendezvous store, on its host launcher. That host may be gone (it
        failed during the change): attempts of one second each, a stop between any two,
        and past STORE_TIMEOUT_S the world counts as broken."""
        assert self.channel is not None
        deadline = time.monotonic() + min(self.timeout_s, STORE_TIMEOUT_S)
        while True:
            if self.channel.stop_requested(world.generation):
                raise WorldBroken(f"stopped while reaching the store of generation {world.generation}")
            self._check_superseded(world)
            try:
                return dist.TCPStore(world.master_addr, world.master_port, is_master=False,
                                     timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
            except RuntimeError as error:
                if time.monotonic() > deadline:
                    raise WorldBroken(f"the store of generation {world.generation} at {world.master_addr}:"
                                      f"{world.master_port} does not answer: {error}") from error
                time.sleep(0.05)

    def _sync_state(self) -> tuple[int, str]:
        """Every shard of every replica adopts the state of the most advanced replica (a
        fresh one when none has state yet): joiners receive it shard by shard, streamed from
        the replicas that hold it (striped across them), then all check that the digests of
        each shard agree. Returns the first source replica and this shard's digest."""
        steps = self._gather_steps()
        target_step = self.world.target_step if self.world is not None else 0
        if max(steps) < target_step and self.checkpointer is not None:
            # Nobody holds the target. A joiner skipped its checkpoint (the members were to
            # bring the state): every rank without state loads its own now, and all gather
            # again (each rank sees the same steps, so all of them do).
            if not self.has_state:
                self._load_checkpoint()
            steps = self._gather_steps()
        target = max(steps)
        self._check_target_step(target)
        groups = self.groups
        source = 0
        if groups is not None:
            shard_size, shard_rank = groups.shard_size, groups.shard_rank
            # This shard index's replicas, by replica index.
            replica_steps = steps[shard_rank::shard_size]
            # Nobody has state yet (a fresh job): replica 0's fresh one is everyone's.
            sources = [0] if target < 0 else [index for index, step in enumerate(replica_steps) if step == target]
            if not sources:
                raise StateMismatch(f"the shards of the replicas hold different steps ({steps} by rank): no replica "
                                    f"holds shard {shard_rank} at step {target}")
            receivers = [index for index in range(groups.replicas) if index not in sources]
            source = sources[0]
            if receivers:
                self._transfer_state(groups, sources, receivers)
        self.has_state = True
        state_digest = digest(capture(self.parts, self.counters))
        if groups is not None:
            self._check_digests(groups, state_digest)
        return source, state_digest

    def _transfer_state(self, groups: Groups, sources: list[int], receivers: list[int]) -> None:
        me = groups.replica_index
        started = time.monotonic()
        try:
            if me in sources:
                stats = send_state(groups.replica, self.parts, self.counters, me=me, sources=sources,
                                   receivers=receivers, bucket_bytes=self.transfer_bucket_bytes)
            else:
                stats = receive_state(groups.replica, self.parts, self.counters, me=me, sources=sources,
                                      bucket_bytes=self.transfer_bucket_bytes)
        except StateDoesNotFit as error:
            raise StateMismatch(f"the state a live replica sent does not fit this worker: {error}") from error
        seconds = time.monotonic() - started
        self.log.info("state_transferred", role="source" if me in sources else "receiver", sources=sources,
                      receivers=receivers, shard=groups.shard_rank, bytes=stats.bytes, items=stats.items,
                      seconds=round(seconds, 4))
        self.ledger.write("transfer", epoch=self.world.generation if self.world else 0, shard=groups.shard_rank,
                          role="source" if me in sources else "receiver", sources=sources, receivers=receivers,
                          bytes=stats.bytes, items=stats.items, staging_bytes=stats.staging_bytes, seconds=seconds)

    def _check_digests(self, groups: Groups, state_digest: str) -> None:
        """Every replica's copy of each shard must be bit-identical."""
        encoded = torch.tensor(list(bytes.fromhex(state_digest)), dtype=torch.uint8, device=self.device)
        gathered = [torch.zeros(32, dtype=torch.uint8, device=self.device) for _ in range(groups.world_size)]
        self._collective(groups.world.allgather([gathered], [encoded]))
        digests = [bytes(t.tolist()).hex() for t in gathered]
        for shard in range(groups.shard_size):
            found = set(digests[shard::groups.shard_size])
            if len(found) != 1:
                raise StateMismatch(f"replicas disagree on shard {shard} of the training state after forming: "
                                    f"{sorted(found)}")

    def _gather_steps(self) -> list[int]:
        """Every rank's committed steps (-1 for a rank without state), by rank."""
        mine = self.counters.step if self.has_state else -1
        if self.groups is None:
            return [mine]
        gathered = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.groups.world_size)]
        self._collective(self.groups.world.allgather([gathered],
                                                     [torch.tensor([mine], dtype=torch.int64, device=self.device)]))
        return [int(t.item()) for t in gathered]

    @contextlib.contextmanager
    def _in_collective(self) -> Iterator[None]:
        """Around a wait for this generation's collectives: the beat thread says this rank is
        blocked in one, and a failure breaks the world."""
        self._waiting = True
        try:
            yield
        except RuntimeError as error:
            raise WorldBroken(f"a collective failed: {error}") from error
        finally:
            self._waiting = False

    def _collective(self, work: Any) -> None:
        with self._in_collective():
            work.wait()

    def _check_target_step(self, held: int) -> None:
        """The world's state must be at the job's committed step (the generation's target)
        or later. `held` is the most advanced step any rank holds (-1: none holds any
        state, not even a checkpoint). Below the target, a checkpoint the ranks loaded is
        resumed from, loudly; with no state at all, training refuses to start over."""
        assert self.world is not None
        target_step = self.world.target_step
        if held >= target_step or (held < 0 and target_step == 0):
            return
        if not self.live:
            # Restart mode (or a fixed world): the script's own checkpoint is the state, as
            # under torchrun; say that it is behind, and go on.
            self.log.warning("state_behind_target", step=max(held, 0), target_step=target_step)
            return
        if held < 0:
            detail = (f"no rank of generation {self.world.generation} holds the training state at step {target_step} "
                      "(every replica that held it is gone) and "
                      + (f"no replica saved it on leaving (nothing in {self.state_folder}) and the script keeps "
                         "no checkpoint (checkpoint_dir/checkpoint_every)" if self.state_folder is not None
                         else "no checkpoint was found in the checkpoint folder" if self.checkpointer is not None
                         else "the script keeps no checkpoint (checkpoint_dir/checkpoint_every)")
                      + ": refusing to train from step 0")
            if self.channel is not None:
                # Every rank says it, so that every launcher reports it before the exit.
                self.channel.send(StateLostMessage(generation=self.world.generation, target_step=target_step,
                                                   detail=detail))
            self.ledger.write("state_lost", epoch=self.world.generation, target_step=target_step)
            raise StateLost(detail)
        detail = (f"no rank of generation {self.world.generation} holds step {target_step}; resumed from the "
                  f"checkpoint at step {held}: steps {held}..{target_step - 1} are redone")
        self.log.warning("resumed_from_checkpoint", step=held, target_step=target_step)
        self.ledger.write("resumed", epoch=self.world.generation, step=held, target_step=target_step)
        if self.channel is not None and self.rank == 0:
            self.channel.send(Resumed(generation=self.world.generation, step=held, target_step=target_step,
                                      detail=detail))

    def _apply_batch_policy(self) -> None:
        self.counters.global_batch = self.policy.batch_for(self.world_size)
        if isinstance(self.policy, ScaledBatch):
            factor = self.policy.lr_factor(self.world_size)
            for group, base in zip(self.parts.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * factor

    def _recover(self, reason: str) -> None:
        """Out of the broken world; wait for the launcher to name the next one and join it."""
        assert self.channel is not None and self.world is not None
        while True:
            self._destroy_group(broken=True)
            generation = self.world.generation
            self.log.warning("world_broken", generation=generation, step=self.counters.step, reason=reason)
            self.ledger.write("abandoned", epoch=generation, step=self.counters.step, reason=reason)
            try:
                self.channel.send(Stopped(generation=generation, step=self.counters.step))
                # As long as the launcher lives: a job below min_replicas waits for nodes, for
                # minutes or hours, and this rank's memory is the training state meanwhile (a
                # launcher that dies closes the channel, and this wait ends).
                world = self.channel.wait_world(after_generation=max(generation, self.channel.stopped_generation),
                                                timeout_s=STANDBY_TIMEOUT_S)
                if world.leaves:
                    self._leave(world)
            except (ChannelClosed, TimeoutError) as error:
                raise RuntimeError(f"no world to join after generation {generation}: {error}") from error
            failed = self._guarded(self._form, world)
            if not isinstance(failed, str):
                return
            reason = failed

    def _move_to_next_world(self) -> None:
        """The ranks agreed to change worlds after this step: wait for this rank's copy of
        the new world (it is on its way) and join it, or leave."""
        assert self.channel is not None and self.world is not None
        try:
            world = self.channel.wait_world(after_generation=self.world.generation, timeout_s=self.timeout_s)
        except (ChannelClosed, TimeoutError) as error:
            raise RuntimeError(f"peers agreed on a world change this rank never heard of: {error}") from error
        if world.leaves:
            self._leave(world)
        broken = self._guarded(self._form, world)
        if isinstance(broken, str):
            self._recover(broken)

    @staticmethod
    def _guarded(action: Callable[..., Any], *args: Any) -> Any:
        """`action(*args)`'s result, or the reason it broke the world (as a str), with the
        exception and everything its traceback holds already released."""
        try:
            return action(*args)
        except WorldBroken as broken:
            return str(broken) or "the world broke"

    def _leave(self, world: World) -> None:
        assert self.channel is not None
        self._leaving = True
        self._destroy_group()
        saved_to = ""
        if self.checkpointer is not None:
            self.checkpointer.wait()
            if world.save:
                saved_to = self._save_before_leaving()
        self.log.info("leaving", generation=world.generation, step=self.counters.step, saved_to=saved_to or None)
        self.ledger.write("left", epoch=world.generation, step=self.counters.step, saved_to=saved_to)
        self.channel.send(Left(generation=world.generation, step=self.counters.step, saved_to=saved_to))
        raise SystemExit(0)

    def _save_before_leaving(self) -> str:
        """The last holder of the job's state writes it (this worker's shard of it) before
        leaving, so that the next world resumes where it stopped. Returns the folder, or ""
        when there was nothing to save or writing failed (said loudly: the next world then
        finds no state at the job's step and refuses to train)."""
        assert self.checkpointer is not None
        # Each shard of a sharded replica is written by its worker; a unit of whole replicas
        # (DataParallel) writes one copy, from its first worker.
        writes = self.strategy.shard_size > 1 or int(os.environ.get("LOCAL_RANK", "0")) == 0
        if not self.has_state or not writes:
            return ""
        started = time.monotonic()
        try:
            self.checkpointer.write_now(capture(self.parts, self.counters), self.counters.step)
        except (RuntimeError, OSError) as error:
            self.log.error("state_save_failed", step=self.counters.step, folder=str(self.checkpointer.directory),
                           error=str(error))
            return ""
        self.log.info("state_saved", step=self.counters.step, folder=str(self.checkpointer.directory),
                      seconds=round(time.monotonic() - started, 3))
        return str(self.checkpointer.directory)

    # One step.

    def _check_stop(self) -> None:
        if self.channel is not None and self.world is not None and self.channel.stop_requested(self.world.generation):
            raise WorldBroken(f"the launcher stopped generation {self.world.generation}")

    def _micro_batches(self, samples: StepSamples) -> list[list[int]]:
        """This rank's share in micro-batches. Under a strategy whose ranks must run the
        same number of them (FSDP's collectives within a unit), that number is the largest
        share's, and a rank runs empty ones as a zero-weight sample."""
        micro = self.micro_batch or max(1, math.ceil(samples.global_batch / self.world_size))
        chunks = [chunk for chunk in micro_batches(samples.indices, micro) if chunk]
        if self.strategy.uniform_micro_batches:
            count = math.ceil(math.ceil(samples.global_batch / self.world_size) / micro)
            chunks += [[] for _ in range(count - len(chunks))]
        return chunks

    def _attempt_step(self) -> tuple[StepResult, bool]:
        assert self.world is not None
        started = time.monotonic()
        step = self.counters.step
        batch_size = self.counters.global_batch
        world = self.world
        strategy = self.strategy
        groups = self.groups
        samples = step_samples(self.order, step=step, start=self.counters.position, global_batch=batch_size,
                               rank=world.rank, world_size=world.world_size)
        self.ledger.write("attempt", epoch=world.generation, step=step, rank=world.rank, world_size=world.world_size,
                          indices=samples.indices)
        model = self.parts.model
        model.train()
        strategy.begin_step(groups.replica if groups is not None else None, batch_size)
        try:
            control, control_work = self._compute_gradients(samples, world)
            with self._in_collective():
                if self.simulated is not None:
                    # Once per step, on top of the real reduction (none in a world of one replica).
                    self.simulated.reduce(groups.replicas if groups is not None else 1, strategy.shard_size)
                strategy.finish()
                if control_work is not None:
                    control_work.wait()
        except WorldBroken:
            strategy.abandon()
            raise
        # Committed: every rank's contribution is in the sum.
        self._check_accounting(step, control, samples.step_indices)
        grad_norm = (strategy.clip_grad_norm(self.params, self.max_grad_norm) if self.max_grad_norm is not None
                     else None)
        self.parts.optimizer.step()
        if self.parts.scheduler is not None:
            self.parts.scheduler.step()
        self.counters.step += 1
        self.counters.position += batch_size
        self.counters.samples += batch_size
        step_loss = control[4].item() / batch_size
        self._after_commit(world, samples.indices, step_loss)
        result = StepResult(step=self.counters.step, loss=step_loss, global_batch=batch_size,
                            world_size=world.world_size, rank=world.rank, generation=world.generation,
                            indices=samples.indices, seconds=time.monotonic() - started, grad_norm=grad_norm)
        return result, control[3].item() > 0

    def _compute_gradients(self, samples: StepSamples, world: World) -> tuple[torch.Tensor, Any]:
        """Forward and backward over this rank's micro-batches; the strategy starts reducing
        gradients during the last backward pass. Returns the step's control tensor and its
        all-reduce in flight (None in a world of one)."""
        strategy = self.strategy
        loss_sum = torch.zeros((), dtype=torch.float64)
        control: tuple[torch.Tensor, Any] | None = None
        chunks = self._micro_batches(samples)
        for number, chunk in enumerate(chunks):
            started = time.monotonic()
            last = number == len(chunks) - 1
            if strategy.stops_within_step:
                self._check_stop()
            if chunk:
                loss = self.loss_fn(self.parts.model, self.collate_fn([self.dataset[i] for i in chunk]))
            else:
                # A rank short of samples keeps its unit's collectives in step: one sample, weight 0.
                loss = self.loss_fn(self.parts.model, self.collate_fn([self.dataset[samples.step_indices[0]]])) * 0.0
            loss_sum += loss.detach().to(torch.float64).cpu()
            strategy.before_backward(last)
            if last and strategy.stops_within_step:
                # The control all-reduce goes first on every rank, then the gradient buckets,
                # in the same order everywhere (they share the world's group).
                control = self._start_control(samples, world, loss_sum)
            loss.backward()
            if self.simulated is not None:
                # The rest of the micro-batch's simulated device time (an empty one runs one sample).
                self.simulated.finish_micro_batch(max(1, len(chunk)), started)
        # Under HybridSharded a stop is only taken here, after the backward pass: every
        # worker of a unit has then run the same FSDP collectives.
        return control or self._start_control(samples, world, loss_sum)

    def _start_control(self, samples: StepSamples, world: World, loss_sum: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The step's control vector (sample count, index checksums, whether a world change
        is wanted, summed loss), its all-reduce started (None in a world of one)."""
        self._check_stop()
        change_wanted = self.channel is not None and self.channel.next_world(world.generation) is not None
        index_sum, index_square_sum = _index_checksums(samples.indices)
        control = torch.tensor([len(samples.indices), index_sum, index_square_sum, float(change_wanted),
                                loss_sum.item()], dtype=torch.float64, device=self.device)
        if self.groups is None:
            return control, None
        with self._in_collective():
            return control, self.groups.world.allreduce([control])

    def _check_accounting(self, step: int, control: torch.Tensor, expected: list[int]) -> None:
        index_sum, index_square_sum = _index_checksums(expected)
        got = (int(control[0].item()), control[1].item() % CHECKSUM_MODULUS, control[2].item() % CHECKSUM_MODULUS)
        if got != (len(expected), index_sum, index_square_sum):
            raise AccountingError(f"step {step}: the ranks consumed {got[0]} samples with checksums {got[1:]}, "
                                  f"expected {len(expected)} with {(index_sum, index_square_sum)}")

    def _after_commit(self, world: World, indices: list[int], loss: float) -> None:
        step = self.counters.step
        self.last_loss = loss
        # cpu_s: this process's CPU seconds so far (benchmarks read CPU time per step from it).
        self.ledger.write("commit", epoch=world.generation, step=step - 1, rank=world.rank, world_size=world.world_size,
                          loss=loss, cpu_s=time.process_time())
        now = time.monotonic()
        if self._first_step_pending:
            self._first_step_pending = False
            if self.channel is not None:
                self.channel.send(FirstStep(generation=world.generation, step=step))
        if now - self._progress_at >= PROGRESS_INTERVAL_S:
            self._progress_at = now
            report_progress(step)
        if (self.checkpointer is not None and self.checkpoint_every > 0
                and world.rank // self.strategy.shard_size == 0 and step % self.checkpoint_every == 0):
            self.checkpointer.save(capture(self.parts, self.counters), step)

