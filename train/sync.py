"""The training state across worlds: when a world forms, which replicas hold it, who sends
it to whom, and that every copy agrees; the job's committed step (the generation's target)
against what the ranks hold; and the disk the state falls back on (the periodic
checkpoint, the state the last holder writes on leaving).

The decisions are pure functions (`plan_sync`, `judge_target`, `disagreeing_shards`);
`StateSync` carries them out with the generation's groups. How the bytes travel is
`tidal.train.transfer`; what the state is, `tidal.train.state`.

Forming a world, every rank gathers every rank's committed step (-1: no state). For each
shard index the replicas at the most advanced step are the sources (replica 0 when nobody
holds state yet: a fresh job) and the others receive; then every rank's digest of its
shard is gathered, and those of each shard index must agree."""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from tidal.proto.control import Resumed, World
from tidal.proto.control import StateLost as StateLostMessage
from tidal.train.backend import synchronize
from tidal.train.channel import WorkerChannel
from tidal.train.checkpoint import AsyncCheckpointer
from tidal.train.errors import StateLost, StateMismatch
from tidal.train.groups import Collectives, Groups, gather_world
from tidal.train.ledger import Ledger
from tidal.train.state import Counters, StateDoesNotFit, TrainingParts, capture, digest, restore
from tidal.train.strategy import Strategy
from tidal.train.transfer import receive_state, send_state

log = structlog.get_logger("tidal.train.sync")


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


def checkpointer_for(folder: Path, strategy: Strategy) -> AsyncCheckpointer:
    """The checkpointer of this worker's shard. Under a sharded strategy each shard index
    keeps its own checkpoints (written by replica 0's worker, or by the leaving unit's),
    and a step loads only when every shard has it."""
    shard_size = strategy.shard_size
    if shard_size == 1:
        return AsyncCheckpointer(folder)
    folders = [folder / f"shard-{k}-of-{shard_size}" for k in range(shard_size)]
    mine = folders.pop(strategy.shard_rank)
    return AsyncCheckpointer(mine, siblings=tuple(folders))


# Decisions.


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """Who holds one shard index's state when a world forms, by replica index."""

    # The most advanced step any rank holds (-1: none holds any state).
    target: int
    # The replicas that hold this shard at `target` (replica 0 when none holds state).
    sources: list[int]
    # The others: they receive it.
    receivers: list[int]


def plan_sync(steps: Sequence[int], *, shard_size: int, shard_rank: int) -> SyncPlan:
    """The plan for shard index `shard_rank`, given every rank's committed step (`steps`,
    by rank; -1 for a rank without state; replicas of `shard_size` consecutive ranks).
    Raises StateMismatch when no replica holds this shard at the most advanced step (the
    shards of a replica are always at one step, unless something is badly wrong)."""
    target = max(steps)
    # This shard index's replicas, by replica index.
    replica_steps = list(steps[shard_rank::shard_size])
    # Nobody has state yet (a fresh job): replica 0's fresh one is everyone's.
    sources = [0] if target < 0 else [index for index, step in enumerate(replica_steps) if step == target]
    if not sources:
        raise StateMismatch(f"the shards of the replicas hold different steps ({list(steps)} by rank): no replica "
                            f"holds shard {shard_rank} at step {target}")
    receivers = [index for index in range(len(steps) // shard_size) if index not in sources]
    return SyncPlan(target=target, sources=sources, receivers=receivers)


def every_shard_held(steps: Sequence[int], shard_size: int) -> bool:
    """Whether each shard index has a replica at the most advanced step any rank holds
    (`steps` by rank, -1 without state). Not so when a replica of several nodes lost a node
    and no peer replica holds that node's shards: the newest state is then not whole."""
    target = max(steps)
    return target < 0 or all(max(steps[k::shard_size]) == target for k in range(shard_size))


class Verdict(enum.Enum):
    """The world's state against the job's committed step (the generation's target)."""

    # Some rank holds the target step or later (or the job is fresh: no state, target 0).
    HELD = "held"
    # A fixed world (restart mode, torchrun, alone) behind the target: the script's own
    # checkpoint is the state, as under torchrun; said, and training goes on.
    BEHIND = "behind"
    # Live, behind the target: resumed from the checkpoint the ranks loaded, loudly.
    RESUMED = "resumed"
    # Live, no state at all and no checkpoint: refuse to train from step 0.
    LOST = "lost"


def judge_target(held: int, target_step: int, *, live: bool) -> Verdict:
    """`held`: the most advanced step any rank holds (-1: none holds any state, not even
    a checkpoint)."""
    if held >= target_step or (held < 0 and target_step == 0):
        return Verdict.HELD
    if not live:
        return Verdict.BEHIND
    if held < 0:
        return Verdict.LOST
    return Verdict.RESUMED


def lost_detail(generation: int, target_step: int, *, state_folder: Path | None, has_checkpointer: bool) -> str:
    """Why the job's state is lost, in words a user acts on."""
    return (f"no rank of generation {generation} holds the training state at step {target_step} "
            "(every replica that held it is gone) and "
            + (f"no replica saved it on leaving (nothing in {state_folder}) and the script keeps "
               "no checkpoint (checkpoint_dir/checkpoint_every)" if state_folder is not None
               else "no checkpoint was found in the checkpoint folder" if has_checkpointer
               else "the script keeps no checkpoint (checkpoint_dir/checkpoint_every)")
            + ": refusing to train from step 0")


def disagreeing_shards(digests: Sequence[str], shard_size: int) -> dict[int, list[str]]:
    """The shard indices whose replicas' digests (by rank) differ, with the digests seen."""
    found = {shard: set(digests[shard::shard_size]) for shard in range(shard_size)}
    return {shard: sorted(seen) for shard, seen in found.items() if len(seen) != 1}


def writes_on_leaving(*, has_state: bool, shard_size: int, local_rank: int) -> bool:
    """Whether this worker writes the state as its unit leaves holding the last copy: each
    shard of a sharded replica by its worker, a unit of whole replicas (DataParallel) one
    copy, from its first worker; nothing without state."""
    return has_state and (shard_size > 1 or local_rank == 0)


# Carrying them out.


class StateSync:
    """This worker's training state across worlds: whether it holds one, agreeing on it
    when a world forms, and its checkpoints."""

    def __init__(self, parts: TrainingParts, counters: Counters, *, strategy: Strategy,
                 checkpointer: AsyncCheckpointer | None, checkpoint_every: int, state_folder: Path | None,
                 bucket_bytes: int, device: torch.device, collectives: Collectives, ledger: Ledger) -> None:
        self.parts = parts
        self.counters = counters
        self.strategy = strategy
        self.checkpointer = checkpointer
        # Every checkpoint_every-th step replica 0 writes a checkpoint (0: never).
        self.checkpoint_every = checkpoint_every
        # Live mode without checkpoints of the script's own: the folder where the last
        # replica to leave writes the state (and the next world reads it), removed when
        # the job's training completes.
        self.state_folder = state_folder
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.collectives = collectives
        self.ledger = ledger
        self.has_state = False
        self.log = log.bind(pid=os.getpid())

    def load_checkpoint(self) -> None:
        """Adopt the newest checkpoint whose digest verifies, if there is one."""
        assert self.checkpointer is not None
        self._adopt(self.checkpointer.latest())

    def _adopt(self, state: dict[str, Any] | None, exact: bool = False) -> None:
        """Take a checkpoint's state read from disk, if there is one."""
        if state is None:
            return
        restore(self.parts, self.counters, state)
        self.has_state = True
        self.log.info("checkpoint_loaded", step=self.counters.step, position=self.counters.position,
                      **({"exact": True} if exact else {}))

    def load_newer_checkpoint(self, groups: Groups | None) -> None:
        """Every rank (all of them call this) adopts the newest checkpoint that verifies of a
        step after the one it holds, if there is one. The shards of a replica (each reads
        its own folder) load one step together or none of them loads: each offers the
        newest step it can read, and while a replica's offers differ, a shard above the
        lowest offers the newest it can read at or below it, or nothing (it holds that step
        or a newer one itself), until they agree; a damaged or unreadable file in one
        shard's folder never leaves a replica's shards at different steps from the disk."""
        assert self.checkpointer is not None
        own = self.counters.step if self.has_state else -1
        found = self.checkpointer.newest(after=own)
        offer, state = found if found is not None else (-1, None)
        if groups is not None and groups.shard_size > 1:
            size = groups.shard_size
            while True:
                # (Every rank sees the same offers, so every rank goes round as often.)
                gathered = self._gather(groups, offer)
                replicas = [gathered[first:first + size] for first in range(0, len(gathered), size)]
                if all(min(offers) == max(offers) for offers in replicas):
                    break
                lowest = min(replicas[groups.replica_index])
                if offer > lowest:
                    found = self.checkpointer.newest(after=own, below=lowest + 1) if lowest > own else None
                    offer, state = found if found is not None else (-1, None)
        self._adopt(state)

    def load_step(self, step: int) -> None:
        """Adopt this shard's own checkpoint of exactly `step`, if it is there and verifies."""
        assert self.checkpointer is not None
        self._adopt(self.checkpointer.at(step), exact=True)

    def agree(self, groups: Groups | None, world: World, channel: WorkerChannel | None) -> tuple[int, str]:
        """Every shard of every replica adopts the state of the most advanced replica (a
        fresh one when none has state yet): joiners receive it shard by shard, streamed from
        the replicas that hold it (striped across them), then all check that the digests of
        each shard agree. Returns the first source replica and this shard's digest."""
        steps = self._gather_steps(groups)
        if (groups is not None and not every_shard_held(steps, groups.shard_size) and self.checkpointer is not None
                and max(steps) > 0):
            # A shard index without a live holder of the newest step may have it on disk at
            # exactly that step: the last unit of that node index saved it as it left, while
            # the other shards stayed live (a replica's node drained or released, the
            # other node kept). Every rank behind loads its own shard of that step if its
            # folder has it (not `latest`: a step every shard's folder has, which the live
            # shards never wrote), and all gather again (each rank sees the same steps).
            if self.counters.step < max(steps) or not self.has_state:
                self.load_step(max(steps))
            steps = self._gather_steps(groups)
        if groups is not None and not every_shard_held(steps, groups.shard_size):
            # Some shards of the newest state are gone with a node and no live replica holds
            # them (a job of one replica of several nodes): what the survivors hold cannot
            # be completed, and mixing it with older shards would train on a state that
            # never was. Going back in-process to the checkpoint is not done: it diverged from
            # the fixed run when tried, before FSDP2's accumulated gradients of a broken step
            # were found and dropped (`HybridSharded.abandon`), and was not tried since. The
            # job stops, loudly; submitted again, it resumes from its newest checkpoint in
            # fresh processes.
            detail = (f"the training state at step {max(steps)} is incomplete in generation {world.generation}: "
                      "shards of it were held only by a lost node and no live replica holds them (steps by rank: "
                      f"{steps}); refusing to mix shards of different steps or to start over. Submit the job again "
                      "to resume from its newest checkpoint")
            self.log.error("state_incomplete", steps=steps)
            if channel is not None:
                channel.send(StateLostMessage(generation=world.generation, target_step=world.target_step,
                                              detail=detail))
            self.ledger.write("state_lost", generation=world.generation, target_step=world.target_step)
            raise StateLost(detail)
        if max(steps) < world.target_step and self.checkpointer is not None:
            # Nobody holds the target. A joiner skipped its checkpoint (the members were to
            # bring the state), and a rank that kept an older state (left out of the worlds
            # since) would take the world back past what the last holder saved as it left:
            # every rank without state, or behind a newer checkpoint, loads its own now (a
            # sharded replica's shards one step together, `load_newer_checkpoint`), and all
            # gather again (each rank sees the same steps, so all of them do).
            self.load_newer_checkpoint(groups)
            steps = self._gather_steps(groups)
        target = max(steps)
        self._check_target_step(target, world, channel)
        source = 0
        if groups is not None:
            plan = plan_sync(steps, shard_size=groups.shard_size, shard_rank=groups.shard_rank)
            source = plan.sources[0]
            if plan.receivers:
                self._transfer(groups, world, plan.sources, plan.receivers)
        self.has_state = True
        state_digest = digest(capture(self.parts, self.counters))
        if groups is not None:
            self._check_digests(groups, state_digest)
        return source, state_digest

    def _gather_steps(self, groups: Groups | None) -> list[int]:
        """Every rank's committed steps (-1 for a rank without state), by rank."""
        mine = self.counters.step if self.has_state else -1
        return [mine] if groups is None else self._gather(groups, mine)

    def _gather(self, groups: Groups, value: int) -> list[int]:
        """Every rank's `value`, by world rank."""
        gathered = gather_world(groups, self.collectives, torch.tensor([value], dtype=torch.int64, device=self.device))
        return [int(t.item()) for t in gathered]

    def _transfer(self, groups: Groups, world: World, sources: list[int], receivers: list[int]) -> None:
        """Stream the state from `sources` to `receivers` (replica indices). A transfer cut
        short (a peer lost, the groups aborted) breaks the world; a receiver then holds a
        mix of two states, and no longer counts as holding one."""
        me = groups.replica_index
        started = time.monotonic()
        try:
            # A wait on an aborted NCCL group returns without raising: `waiting_in` says
            # the world broke once the transfer returns, as for any collective.
            with self.collectives.waiting_in():
                if me in sources:
                    stats = send_state(groups.replica, self.parts, self.counters, me=me, sources=sources,
                                       receivers=receivers, bucket_bytes=self.bucket_bytes)
                else:
                    stats = receive_state(groups.replica, self.parts, self.counters, me=me, sources=sources,
                                          bucket_bytes=self.bucket_bytes)
        except StateDoesNotFit as error:
            # Refused before anything was applied.
            raise StateMismatch(f"the state a live replica sent does not fit this worker: {error}") from error
        except BaseException:
            if me not in sources:
                self.has_state = False
            raise
        seconds = time.monotonic() - started
        self.log.info("state_transferred", role="source" if me in sources else "receiver", sources=sources,
                      receivers=receivers, shard=groups.shard_rank, bytes=stats.bytes, items=stats.items,
                      seconds=round(seconds, 4))
        self.ledger.write("transfer", generation=world.generation, shard=groups.shard_rank,
                          role="source" if me in sources else "receiver", sources=sources, receivers=receivers,
                          bytes=stats.bytes, items=stats.items, staging_bytes=stats.staging_bytes, seconds=seconds)

    def _check_digests(self, groups: Groups, state_digest: str) -> None:
        """Every replica's copy of each shard must be bit-identical."""
        encoded = torch.tensor(list(bytes.fromhex(state_digest)), dtype=torch.uint8, device=self.device)
        gathered = gather_world(groups, self.collectives, encoded)
        digests = [bytes(t.tolist()).hex() for t in gathered]
        disagreeing = disagreeing_shards(digests, groups.shard_size)
        if disagreeing:
            shard, found = min(disagreeing.items())
            raise StateMismatch(f"replicas disagree on shard {shard} of the training state after forming: {found}")

    def _check_target_step(self, held: int, world: World, channel: WorkerChannel | None) -> None:
        """The world's state must be at the job's committed step (the generation's target)
        or later: below it, a checkpoint the ranks loaded is resumed from, loudly; with no
        state at all, training refuses to start over (StateLost)."""
        target_step = world.target_step
        verdict = judge_target(held, target_step, live=channel is not None)
        if verdict is Verdict.HELD:
            return
        if verdict is Verdict.BEHIND:
            self.log.warning("state_behind_target", step=max(held, 0), target_step=target_step)
            return
        if verdict is Verdict.LOST:
            detail = lost_detail(world.generation, target_step, state_folder=self.state_folder,
                                 has_checkpointer=self.checkpointer is not None)
            if channel is not None:
                # Every rank says it, so that every launcher reports it before the exit.
                channel.send(StateLostMessage(generation=world.generation, target_step=target_step, detail=detail))
            self.ledger.write("state_lost", generation=world.generation, target_step=target_step)
            raise StateLost(detail)
        detail = (f"no rank of generation {world.generation} holds step {target_step}; resumed from the "
                  f"checkpoint at step {held}: steps {held}..{target_step - 1} are redone")
        self.log.warning("resumed_from_checkpoint", step=held, target_step=target_step)
        self.ledger.write("resumed", generation=world.generation, step=held, target_step=target_step)
        if channel is not None and world.rank == 0:
            channel.send(Resumed(generation=world.generation, step=held, target_step=target_step, detail=detail))

    def after_commit(self, step: int, rank: int) -> None:
        """Replica 0 starts a checkpoint every `checkpoint_every` steps (skipped while the
        previous one is still being written)."""
        if (self.checkpointer is not None and self.checkpoint_every > 0
                and rank // self.strategy.shard_size == 0 and step % self.checkpoint_every == 0):
            # Copied to the host: every stream of the device done with the state first.
            synchronize(self.device)
            self.checkpointer.save(capture(self.parts, self.counters), step)

    def before_leaving(self, save: bool) -> str:
        """Waits for a checkpoint being written; with `save` (this unit holds the job's last
        copy), writes the state (this worker's shard of it) so that the next world resumes
        where this one stopped. Returns the folder, or "" when there was nothing to save or
        writing failed (said loudly: the next world then finds no state at the job's step and
        refuses to train)."""
        if self.checkpointer is None:
            return ""
        try:
            self.checkpointer.wait()
        except RuntimeError as error:
            # A periodic checkpoint failed (logged as it did): the leave goes on, and the
            # state is written below when asked (the disk may take it now).
            self.log.warning("checkpoint_failed_before_leaving", error=str(error))
        if not save or not writes_on_leaving(has_state=self.has_state, shard_size=self.strategy.shard_size,
                                             local_rank=int(os.environ.get("LOCAL_RANK", "0"))):
            return ""
        started = time.monotonic()
        try:
            synchronize(self.device)
            self.checkpointer.write_now(capture(self.parts, self.counters), self.counters.step)
        except (RuntimeError, OSError) as error:
            self.log.error("state_save_failed", step=self.counters.step, folder=str(self.checkpointer.directory),
                           error=str(error))
            return ""
        self.log.info("state_saved", step=self.counters.step, folder=str(self.checkpointer.directory),
                      seconds=round(time.monotonic() - started, 3))
        return str(self.checkpointer.directory)

    def remove_state_folder(self, rank: int) -> None:
        """Training is complete: a state written by a leaving replica is of no more use."""
        if self.state_folder is not None and rank == 0 and self.state_folder.is_dir():
            shutil.rmtree(self.state_folder, ignore_errors=True)

    def wait(self) -> None:
        """Until a checkpoint being written is on disk (raises if writing it failed)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
