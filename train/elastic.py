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
  re-form and redo the step's samples. Under HybridSharded the control all-reduce starts
  only after this rank's reduction completed: each shard reduces with its own peers, and a
  rank commits only if every rank's reduction did (else one shard of a replica could be a
  step ahead of another). A rank whose all-reduce did complete has applied
  the step correctly; on re-forming, every rank adopts the state of the most advanced
  survivor, so the optimizer step counts as applied everywhere or nowhere.

Under a Tidal launcher in live mode (`TIDAL_CONTROL_SOCKET` set) world changes happen in
this process: a planned one (grow, graceful leave) after the step the ranks agree on, a
failure as soon as the launcher says stop. Forming a world syncs the training state from
a live peer (a joiner receives it) and checks a SHA-256 digest of it on every rank. Run
without a launcher (or under torchrun) the same script trains in a fixed world; that is
the reference an elastic run must reproduce.

This file is the facade and the step loop. Joining, leaving and changing worlds is
`tidal.train.world` (`Membership`, a state machine over the launcher's messages); agreeing
on the training state when a world forms, and its checkpoints, `tidal.train.sync`, which
streams it with `tidal.train.transfer`."""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from tidal.proto.control import EXIT_STATE_LOST, Beat, World
from tidal.train.backend import device_mismatch, prepare_worker
from tidal.train.batch import BatchPolicy, FixedBatch, ScaledBatch, scale_learning_rates
from tidal.train.data import GlobalOrder, StepSamples, micro_batches, step_samples
from tidal.train.errors import AccountingError, StateLost, StateMismatch, WorldBroken, raised_by_a_collective
from tidal.train.groups import Collectives, Groups, start_world_allreduce
from tidal.train.ledger import Ledger
from tidal.train.progress import report_progress
from tidal.train.simulated import SimulatedDevice, Simulation
from tidal.train.state import Counters, TrainingParts
from tidal.train.strategy import DataParallel, Strategy
from tidal.train.sync import StateSync, checkpointer_for, leave_state_folder
from tidal.train.transfer import DEFAULT_BUCKET_BYTES
from tidal.train.world import TERM_WAIT_S, Membership, Phase, guarded

__all__ = ["CHECKSUM_MODULUS", "TERM_WAIT_S", "AccountingError", "BatchPolicy", "Elastic", "FixedBatch", "Ledger",
           "ScaledBatch", "StateLost", "StateMismatch", "StepResult", "WorldBroken", "check_accounting",
           "leave_state_folder", "micro_batch_plan"]

log = structlog.get_logger("tidal.train.elastic")

# Index checksums are taken modulo this prime so that float64 sums stay exact.
CHECKSUM_MODULUS = 2_147_483_647
PROGRESS_INTERVAL_S = 0.2


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


def _index_checksums(indices: Sequence[int]) -> tuple[float, float]:
    return (float(sum(indices) % CHECKSUM_MODULUS), float(sum(i * i for i in indices) % CHECKSUM_MODULUS))


def check_accounting(step: int, control: torch.Tensor | Sequence[float], expected: list[int]) -> None:
    """Raises AccountingError unless the step's reduced control vector counts exactly the
    step's `expected` samples (their number and both index checksums)."""
    values = control.tolist() if isinstance(control, torch.Tensor) else control
    index_sum, index_square_sum = _index_checksums(expected)
    got = (int(values[0]), values[1] % CHECKSUM_MODULUS, values[2] % CHECKSUM_MODULUS)
    if got != (len(expected), index_sum, index_square_sum):
        raise AccountingError(f"step {step}: the ranks consumed {got[0]} samples with checksums {got[1:]}, "
                              f"expected {len(expected)} with {(index_sum, index_square_sum)}")


def micro_batch_plan(indices: list[int], *, global_batch: int, world_size: int, micro_batch: int | None,
                     uniform: bool) -> list[list[int]]:
    """A rank's share (`indices`) in micro-batches of `micro_batch` samples (default: the
    whole share). With `uniform` (a strategy whose ranks must run the same number of them:
    FSDP's collectives within a unit) that number is the largest share's, and a rank short
    of samples gets empty ones, which it runs as a zero-weight sample."""
    micro = micro_batch or max(1, math.ceil(global_batch / world_size))
    chunks = [chunk for chunk in micro_batches(indices, micro) if chunk]
    if uniform:
        count = math.ceil(math.ceil(global_batch / world_size) / micro)
        chunks += [[] for _ in range(count - len(chunks))]
    return chunks


class Elastic:
    """The training loop: `train(steps)` takes the steps; world changes are `Membership`'s
    (`tidal.train.world`), the training state across them `StateSync`'s (`tidal.train.sync`)."""

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
        self.strategy = strategy or DataParallel()
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
        state_folder = None if checkpoint_path is not None else leave_state_folder(os.environ)
        folder = checkpoint_path or state_folder
        checkpointer = checkpointer_for(folder, self.strategy) if folder is not None else None
        self.ledger = Ledger(Path(ledger_dir) if ledger_dir else None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The model's modules, each step's training mode checked on them (`_train_mode`).
        self._modules = list(model.modules())
        self.strategy.attach(model, self.params)
        on_gpu = any(p.is_cuda for p in self.params)
        backend = backend or ("nccl" if on_gpu and dist.is_nccl_available() else "gloo")
        # Collectives' tensors live where the backend wants them (NCCL: this worker's GPU,
        # LOCAL_RANK's, made the current device), and in live mode the generations' NCCL
        # groups raise a failed collective here rather than end the process
        # (`tidal.train.backend`).
        self.device = prepare_worker(os.environ, backend)
        mismatch = device_mismatch((p.device for p in self.params), self.device)
        if mismatch is not None:
            raise ValueError(mismatch)
        self.collectives = Collectives()
        self.strategy.wait_work = self.collectives.wait_work
        self.state = StateSync(self.parts, self.counters, strategy=self.strategy, checkpointer=checkpointer,
                               checkpoint_every=checkpoint_every if checkpoint_path is not None else 0,
                               state_folder=state_folder, bucket_bytes=transfer_bucket_bytes, device=self.device,
                               collectives=self.collectives, ledger=self.ledger)
        self.membership = Membership(backend=backend, shard_size=self.strategy.shard_size,
                                     shard_rank=self.strategy.shard_rank, timeout_s=timeout_s,
                                     counters=self.counters, ledger=self.ledger, agree=self._agree,
                                     before_leaving=self.state.before_leaving, collectives=self.collectives,
                                     shard_group=self.strategy.shard_group)
        self._progress_at = 0.0
        # The last committed step's loss (None before the first): sent with the beats, so
        # the controller keeps a loss history (`tidal plot`).
        self.last_loss: float | None = None
        # This generation's own compute so far: (generation, seconds, samples, steps)
        # (`_count_compute`; -1: no step yet).
        self.compute: tuple[int, float, int, int] = (-1, 0.0, 0, 0)

    # What a script may read.

    @property
    def rank(self) -> int:
        world = self.membership.world
        return world.rank if world else 0

    @property
    def world_size(self) -> int:
        world = self.membership.world
        return world.world_size if world else 1

    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def live(self) -> bool:
        return self.membership.live

    # The loop.

    def train(self, steps: int) -> Iterator[StepResult]:
        """Train until `steps` steps are complete, yielding after each committed step. A
        replica told to leave returns from here by raising SystemExit(0) after its last
        step; one that can no longer take part raises. When the job's state is lost (no
        live rank holds it and there is no checkpoint) it exits with EXIT_STATE_LOST rather
        than train from step 0."""
        membership = self.membership
        if membership.phase is Phase.FINISHED:
            # Live mode: the launcher was told the job finished (and the job is finishing);
            # another world cannot form. Steps in chunks: one train(total), with the
            # evaluation inside the loop.
            raise RuntimeError(f"train() already ran this job to its end (step {self.counters.step}, its launcher "
                               "told): in live mode call train(steps) once, with the job's last step, and "
                               "evaluate inside its loop")
        try:
            self._open()
            if self.counters.step >= steps and membership.live:
                # The state already holds the last step (a job resumed at its end): training
                # is over, said as when the last step commits; no step is taken.
                self._finish()
            while self.counters.step < steps:
                # Recovery runs outside the except clause (see `guarded`).
                broken = guarded(self._attempt_step)
                if isinstance(broken, str):
                    membership.recover(broken)
                    continue
                result, change_pending, change_coming = broken
                # A change on its way (a rank said so in the step's vote): the ranks vote again
                # now that the step is committed, so that a world announced during the step
                # is taken after it. Every rank read the same sum: all vote, or none.
                broke_after: str | None = None
                if change_coming and not change_pending and self.counters.step < steps:
                    voted = guarded(self._vote_at_step_end)
                    if isinstance(voted, str):
                        broke_after = voted
                    else:
                        change_pending = voted
                if self.counters.step >= steps and membership.live:
                    self._finish()
                yield result
                if broke_after is not None:
                    # The step stands (every rank's vote on it returned); the world broke after it.
                    membership.recover(broke_after)
                elif change_pending and self.counters.step < steps:
                    membership.move_on()
        except StateLost as lost:
            log.bind(pid=os.getpid()).error("state_lost", reason=str(lost))
            raise SystemExit(EXIT_STATE_LOST) from lost
        finally:
            self._close()

    def _finish(self) -> None:
        """The job's last step is committed: tell the launcher (`Membership.finish`), and drop
        the state a leaving replica wrote, of no more use."""
        world = self.membership.world
        assert world is not None
        self.membership.finish(world.generation)
        self.state.remove_state_folder(self.rank)

    def _open(self) -> None:
        if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            # `kill -USR1 <pid>` prints every thread's stack to stderr: where a stuck rank
            # is. A handler the script installed itself (say, for Slurm's --signal) stays.
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        joining = self.membership.open(os.environ, self._beat)
        if self.state.checkpointer is not None and not joining and not self.state.has_state:
            # (A second train() call goes on from the state the first left, not from the disk.)
            self.state.load_checkpoint()
        self.membership.enter()

    def _beat(self) -> Beat:
        generation, seconds, samples, steps = self.compute
        return Beat(step=self.counters.step, samples=self.counters.samples, waiting=self.collectives.waiting,
                    loss=self.last_loss, compute_generation=generation, compute_seconds=seconds,
                    compute_samples=samples, compute_steps=steps)

    def _count_compute(self, generation: int, seconds: float, samples: int) -> None:
        """Add a committed step's own compute to this generation's totals (the beats carry
        them). A generation's first step only starts the count: it pays for the world
        change (a joiner's cold start, new groups), which is not the rank's speed."""
        counted, total_seconds, total_samples, total_steps = self.compute
        if counted != generation:
            self.compute = (generation, 0.0, 0, 0)
        elif samples > 0:
            # One tuple, replaced whole: the beat thread reads it without a lock.
            self.compute = (generation, total_seconds + seconds, total_samples + samples, total_steps + 1)

    def _agree(self, groups: Groups | None, world: World) -> tuple[int, str]:
        """A world just met: agree on the training state, then size the batch for it."""
        agreed = self.state.agree(groups, world, self.membership.channel)
        self._apply_batch_policy(world.world_size)
        return agreed

    def _apply_batch_policy(self, world_size: int) -> None:
        self.counters.global_batch = self.policy.batch_for(world_size)
        if isinstance(self.policy, ScaledBatch):
            # From the factor the state's lr holds (the scheduler's decay kept), not from the
            # lr the optimizer was made with: that undid the decay at each world change.
            scale_learning_rates(self.parts.optimizer, self.parts.scheduler, self.policy.lr_factor(world_size))

    def _close(self) -> None:
        try:
            self.state.wait()
        finally:
            try:
                self.membership.close()
            finally:
                self.ledger.close()

    # One step.

    def _train_mode(self) -> None:
        """The model in training mode for the step (the script may have evaluated it since
        the last one). `model.train()` walks every module in Python, a cost each step would
        pay; so it is called only when a module is not in training mode."""
        if not all(module.training for module in self._modules):
            self.parts.model.train()

    def _attempt_step(self) -> tuple[StepResult, bool, bool]:
        world = self.membership.world
        assert world is not None
        started = time.monotonic()
        step = self.counters.step
        batch_size = self.counters.global_batch
        strategy = self.strategy
        groups = self.membership.groups
        samples = step_samples(self.order, step=step, start=self.counters.position, global_batch=batch_size,
                               rank=world.rank, world_size=world.world_size)
        self.ledger.write("attempt", generation=world.generation, step=step, rank=world.rank,
                          world_size=world.world_size,
                          indices=samples.indices)
        self._train_mode()
        strategy.begin_step(groups.replica if groups is not None else None, batch_size)
        try:
            try:
                computing_since = time.monotonic()
                started_control, loss_sum = self._compute_gradients(samples, world)
                computed_s = time.monotonic() - computing_since
            except RuntimeError as error:
                if strategy.shard_group is None or not raised_by_a_collective(error):
                    raise
                # A peer of this replica is gone (FSDP2's collectives run in the passes).
                raise WorldBroken(f"a collective of the replica's shard group failed: {error}") from None
            with self.collectives.waiting_in():
                if self.simulated is not None:
                    # Once per step, on top of the real reduction (none in a world of one replica).
                    self.simulated.reduce(groups.replicas if groups is not None else 1, strategy.shard_size)
                strategy.finish()
                # The norm's collective (sharded gradients) before the vote: nothing after it.
                norm = strategy.gradient_norm(self.params) if self.max_grad_norm is not None else None
                # Under HybridSharded the vote comes only now (`Strategy.vote_after_reduction`).
                control, control_work = started_control or self._start_control(samples, loss_sum)
                if control_work is not None:
                    self.collectives.wait_work(control_work)
        except WorldBroken:
            strategy.abandon()
            raise
        # Committed: every rank's contribution is in the sum.
        reduced = control.tolist()
        check_accounting(step, reduced, samples.step_indices)
        grad_norm = (strategy.clip_to_norm(self.params, self.max_grad_norm, norm) if self.max_grad_norm is not None
                     else None)
        self.parts.optimizer.step()
        if self.parts.scheduler is not None:
            self.parts.scheduler.step()
        self.counters.step += 1
        self.counters.position += batch_size
        self.counters.samples += batch_size
        step_loss = reduced[4] / batch_size
        self._count_compute(world.generation, computed_s, len(samples.indices))
        self._after_commit(world, step_loss)
        result = StepResult(step=self.counters.step, loss=step_loss, global_batch=batch_size,
                            world_size=world.world_size, rank=world.rank, generation=world.generation,
                            indices=samples.indices, seconds=time.monotonic() - started, grad_norm=grad_norm)
        return result, reduced[3] > 0, reduced[5] > 0

    def _compute_gradients(self, samples: StepSamples, world: World) -> tuple[tuple[torch.Tensor, Any] | None, float]:
        """Forward and backward over this rank's micro-batches; the strategy starts reducing
        gradients during the last backward pass. Returns the step's control tensor and its
        all-reduce in flight (None in a world of one), or None where the strategy votes
        after its reduction (`Strategy.vote_after_reduction`); and the rank's summed loss."""
        strategy = self.strategy
        # The rank's summed loss, in float64 (each micro-batch's loss read once: on a GPU,
        # one wait for the device, as a copy to the host would be).
        loss_sum = 0.0
        control: tuple[torch.Tensor, Any] | None = None
        chunks = micro_batch_plan(samples.indices, global_batch=samples.global_batch, world_size=world.world_size,
                                  micro_batch=self.micro_batch, uniform=strategy.uniform_micro_batches)
        for number, chunk in enumerate(chunks):
            started = time.monotonic()
            last = number == len(chunks) - 1
            if strategy.stops_within_step:
                self.membership.check_stop()
            if chunk:
                loss = self.loss_fn(self.parts.model, self.collate_fn([self.dataset[i] for i in chunk]))
            else:
                # A rank short of samples keeps its unit's collectives in step: one sample, weight 0.
                loss = self.loss_fn(self.parts.model, self.collate_fn([self.dataset[samples.step_indices[0]]])) * 0.0
            loss_sum += loss.item()
            strategy.before_backward(last)
            if last and strategy.stops_within_step:
                # The control all-reduce goes first on every rank, then the gradient buckets,
                # in the same order everywhere (they share the world's group).
                control = self._start_control(samples, loss_sum)
            loss.backward()
            strategy.after_backward(last)
            if self.simulated is not None:
                # The rest of the micro-batch's simulated device time (an empty one runs one sample).
                self.simulated.finish_micro_batch(max(1, len(chunk)), started)
        # Under HybridSharded a stop is only taken after the backward pass (every worker of a
        # unit has then run the same FSDP collectives), when the vote starts: after the
        # reduction (`_attempt_step`).
        if control is None and not strategy.vote_after_reduction:
            control = self._start_control(samples, loss_sum)
        return control, loss_sum

    def _start_control(self, samples: StepSamples, loss_sum: float) -> tuple[torch.Tensor, Any]:
        """The step's control vector (sample count, index checksums, whether a world change
        is wanted, summed loss, whether one is on its way), its all-reduce started (None in
        a world of one). A change on its way makes the ranks vote again at the step's end
        (`_vote_at_step_end`), unless the strategy's vote already comes after its reduction."""
        self.membership.check_stop()
        change_wanted = self.membership.change_announced()
        change_coming = (not change_wanted and not self.strategy.vote_after_reduction
                         and self.membership.change_coming())
        index_sum, index_square_sum = _index_checksums(samples.indices)
        control = torch.tensor([len(samples.indices), index_sum, index_square_sum, float(change_wanted), loss_sum,
                                float(change_coming)], dtype=torch.float64, device=self.device)
        groups = self.membership.groups
        if groups is None:
            return control, None
        with self.collectives.waiting_in():
            return control, start_world_allreduce(groups, self.collectives, control)

    def _vote_at_step_end(self) -> bool:
        """After a committed step, while a change is on its way: whether a rank has heard of
        the next world by now (the step's own vote came before its last backward pass, and
        a world announced since would wait a whole step more). One more all-reduce, taken
        only while a change is coming: each step's vote overlaps its backward pass, and
        this one does not."""
        self.membership.check_stop()
        groups = self.membership.groups
        if groups is None:
            return self.membership.change_announced()
        vote = torch.tensor([float(self.membership.change_announced())], dtype=torch.float64, device=self.device)
        with self.collectives.waiting_in():
            self.collectives.wait_work(start_world_allreduce(groups, self.collectives, vote))
        changes = vote.item() > 0
        world = self.membership.world
        assert world is not None
        self.ledger.write("end_vote", generation=world.generation, step=self.counters.step - 1, rank=world.rank,
                          changes=changes)
        return changes

    def _after_commit(self, world: World, loss: float) -> None:
        step = self.counters.step
        self.last_loss = loss
        # cpu_s: this process's CPU seconds so far (benchmarks read CPU time per step from it).
        self.ledger.write("commit", generation=world.generation, step=step - 1, rank=world.rank,
                          world_size=world.world_size,
                          loss=loss, cpu_s=time.process_time())
        now = time.monotonic()
        self.membership.committed(step)
        if now - self._progress_at >= PROGRESS_INTERVAL_S:
            self._progress_at = now
            report_progress(step)
        self.state.after_commit(step, world.rank)
