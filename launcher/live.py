"""The leader's live mode (scripts using `tidal.train`): its workers outlive generations. A
world change or a failure elsewhere reaches them over the control channel (`control`) and
they re-form in-process; only a worker of a failed unit, or one that does not stop in
time, is killed. Here: what the workers said (`LiveWorkers`), the worlds and stops sent to
them, and the look at their beats that the tick's liveness verdict judges."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from typing import TYPE_CHECKING

from tidal.launcher import decisions
from tidal.launcher.control import LauncherChannel
from tidal.launcher.events import WorkersStopped
from tidal.launcher.lifecycle import LauncherState
from tidal.launcher.liveness import (
    Now,
    ProcessSample,
    WorkerWatch,
    group_members,
    read_group_sample,
    silent_past,
)
from tidal.launcher.workers import Worker
from tidal.proto import common_pb2, launcher_pb2
from tidal.proto.control import (
    Beat,
    Coming,
    Finished,
    FirstStep,
    Formed,
    Hello,
    Left,
    Resumed,
    StateLost,
    Stop,
    Stopped,
    WorkerToLauncher,
    World,
)

if TYPE_CHECKING:
    from tidal.launcher.leader import Agent

# A stop SIGTERMs the workers twice, this far apart (the library takes a first SIGTERM
# alone for Slurm's notice, see tidal.train.elastic's TERM_WAIT_S).
LIVE_TERM_REPEAT_S = 0.3


@dataclasses.dataclass
class LastBeat:
    """A live worker's newest beat, as its launcher relays it in heartbeats."""

    at: float  # the launcher's wall clock when it arrived
    waiting: bool
    samples: int
    loss: float | None
    compute_generation: int = 0
    compute_seconds: float = 0.0
    compute_samples: int = 0
    compute_steps: int = 0


@dataclasses.dataclass
class LiveWorkers:
    """What live-mode workers told the launcher, by local rank."""

    hello: set[int] = dataclasses.field(default_factory=set)
    idle: set[int] = dataclasses.field(default_factory=set)
    left: set[int] = dataclasses.field(default_factory=set)
    # Where each worker that left as the state's last holder wrote it, and at which step.
    saved: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    formed: dict[int, int] = dataclasses.field(default_factory=dict)
    # The workers one replica of the model spans, as the workers said when they formed (0: not said).
    replica_workers: int = 0
    # (generation, GenerationPhase) reports already sent: STARTED (a joiner's workers ready),
    # RECONFIGURED, FIRST_STEP; each goes once.
    reported: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # A joiner reports its workers ready (GENERATION_PHASE_STARTED) once all said hello.
    ready_generation: int = 0
    # The newest generation whose world was named to the workers, set-aside ones included
    # (a unit set aside stays in its old generation, `Agent.generation`, while its workers
    # wait for a world after this one).
    named_generation: int = 0
    stop_deadline: float | None = None
    # Each worker's last beat: (when, waiting in a collective, samples trained so far,
    # the last committed step's loss or None).
    beats: dict[int, LastBeat] = dataclasses.field(default_factory=dict)
    # Each worker's process (state, CPU time) when its last beat arrived, or at the first
    # look once it fell silent: a silent worker that used CPU since is slow, not frozen.
    beat_samples: dict[int, ProcessSample] = dataclasses.field(default_factory=dict)
    # Workers found silent but busy in their current silent spell (logged once a spell).
    slow: set[int] = dataclasses.field(default_factory=set)
    # Other processes in each worker's process group, found at its first silent look.
    group_members: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Workers the launcher killed for falling silent: local rank -> why.
    silenced: dict[int, str] = dataclasses.field(default_factory=dict)
    # Workers that committed the job's last step (said "finished"): training is over for
    # them, and their exit or silence is no failure.
    finished: set[int] = dataclasses.field(default_factory=set)


class LiveMode:
    """The leader's end of its live-mode workers: the control channel and what they said."""

    def __init__(self, agent: Agent, channel: LauncherChannel) -> None:
        self.agent = agent
        self.channel = channel
        self.workers = LiveWorkers()
        # When the workers' silence was last looked at (monotonic; 0: never), and the
        # samples taken then (None: not silent past the limit, or gone).
        self.last_look_at = 0.0
        self.samples_now: dict[int, ProcessSample | None] = {}

    def reset(self, ready_generation: int) -> None:
        """A new set of workers is about to start."""
        self.channel.reset()
        self.workers = LiveWorkers(ready_generation=ready_generation)

    def report_once(self, generation: int, phase: launcher_pb2.GenerationPhase, step: int = 0,
                    detail: str = "", replica_workers: int = 0) -> None:
        if (generation, phase) not in self.workers.reported:
            self.workers.reported.add((generation, phase))
            self.agent.report(generation, phase, step=step, detail=detail, replica_workers=replica_workers)

    def send_worlds(self, generation: int, table: common_pb2.RankTable, rendezvous: common_pb2.Rendezvous,
                    joining: bool = False, target_step: int = 0, at_step_boundary: bool = True,
                    set_aside: bool = False) -> None:
        """Name generation `generation`'s world to each worker (rank -1: leave after the agreed
        step; not `at_step_boundary`: the generation it replaces broke; with `set_aside`, wait
        for a later world instead: this unit stays in the job, out of that generation, and
        keeps the one it was in)."""
        agent = self.agent
        assert agent.workers is not None
        mine = next((a for a in table.assignments if a.unit_id == agent.options.unit_id), None)
        if not set_aside:
            agent.generation = generation
        self.workers.named_generation = max(self.workers.named_generation, generation)
        for worker in agent.workers.workers:
            rank = mine.first_rank + worker.local_rank if mine is not None else -1
            if rank >= 0:
                worker.rank = rank
            self.workers.idle.discard(worker.local_rank)
            self.channel.send(worker.local_rank, World(
                generation=generation, rank=rank, world_size=table.world_size, master_addr=rendezvous.host,
                master_port=rendezvous.port, joining=joining, target_step=target_step,
                at_step_boundary=at_step_boundary, set_aside=set_aside))
        if set_aside:
            agent.log.info("set_aside", generation=generation, stays_in=agent.generation)
            return
        if mine is None:
            agent.state = LauncherState.LEAVING
            self.workers.stop_deadline = time.monotonic() + agent.options.leave_timeout_s
        agent.log.info("world_sent", generation=generation, in_world=mine is not None, world_size=table.world_size)

    def tell_coming(self, generation: int) -> None:
        """A change to `generation` is decided and its world follows (`ChangeComing`): the
        workers also vote at each step's end until it arrives. Workers not started, or not
        said hello yet, hear nothing or get it on hello: either is harmless."""
        group = self.agent.workers
        if group is None or generation <= self.agent.generation:
            return
        for worker in group.workers:
            self.channel.send(worker.local_rank, Coming(generation=generation))

    def leave_saving_state(self) -> None:
        """This unit holds the job's last copy of the training state: its workers write it
        to disk after the step they agree on, then leave (a world they are not in, marked
        `save`). Past the leave timeout they are stopped like any leaving worker."""
        agent = self.agent
        assert agent.workers is not None
        # A generation after any they know, never formed: it only says "leave". (After the
        # set-aside world too: workers set aside wait for a world after that one, and one
        # numbered below it was never read: a replica's node set aside hung there, unsaved.)
        after = max(agent.generation, self.workers.named_generation) + 1
        for worker in agent.workers.workers:
            self.workers.idle.discard(worker.local_rank)
            self.channel.send(worker.local_rank, World(generation=after, rank=-1, world_size=0,
                                                       master_addr="", master_port=0, save=True))
        agent.state = LauncherState.LEAVING
        self.workers.stop_deadline = time.monotonic() + agent.options.leave_timeout_s
        agent.log.info("leaving_with_state", generation=agent.generation)

    def stop(self, generation: int) -> None:
        """The workers abandon the step in flight and wait, in-process."""
        agent = self.agent
        assert agent.workers is not None
        agent.state = LauncherState.STOPPING
        agent.generation = max(agent.generation, generation)
        self.workers.stop_deadline = time.monotonic() + agent.options.stop_grace_s
        for worker in agent.workers.workers:
            self.channel.send(worker.local_rank, Stop(generation=generation))
        self.check_stopped()

    def check_stopped(self) -> None:
        agent = self.agent
        group = agent.workers
        if group is None or agent.state is not LauncherState.STOPPING or self.workers.stop_deadline is None:
            return
        alive = {w.local_rank for w in group.workers if not w.exited.done()}
        # A worker that never formed a world (a joiner still starting, or waiting on
        # standby) is in no process group and holds no state: nothing to stop. It reads the
        # next world when it gets to it; killing it would only cost another start.
        never_formed = alive - set(self.workers.formed)
        if alive <= self.workers.idle | never_formed | self.workers.finished:
            self.workers.stop_deadline = None
            agent.events.put_nowait(WorkersStopped(agent.generation))

    def on_worker_said(self, local_rank: int, said: WorkerToLauncher) -> None:
        live = self.workers
        group = self.agent.workers
        if group is None:
            return
        everyone = {w.local_rank for w in group.workers}
        match said:
            case Hello():
                live.hello.add(local_rank)
                if live.ready_generation and live.hello >= everyone:
                    self.report_once(live.ready_generation, launcher_pb2.GENERATION_PHASE_STARTED,
                                     detail="workers ready to join")
            case Formed(generation=generation, step=step, replica_workers=replica_workers):
                live.formed[local_rank] = generation
                live.idle.discard(local_rank)
                live.replica_workers = max(live.replica_workers, replica_workers)
                if all(live.formed.get(r) == generation for r in everyone):
                    self.report_once(generation, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=step,
                                     replica_workers=live.replica_workers)
            case FirstStep(generation=generation, step=step):
                self.report_once(generation, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=step)
            case Stopped():
                live.idle.add(local_rank)
                self.check_stopped()
            case Left(step=step, saved_to=saved_to):
                live.left.add(local_rank)
                if saved_to:
                    live.saved[local_rank] = (saved_to, step)
            case Finished(generation=generation, step=step):
                live.finished.add(local_rank)
                # The end of training: what follows (this, the exits, "left") is held until
                # the controller confirms it read it, and sent again after a break.
                self.agent.link.hold_written()
                self.report_once(generation, launcher_pb2.GENERATION_PHASE_FINISHED, step=step,
                                 detail="committed the last step")
                self.check_stopped()
            case Resumed(generation=generation, step=step, detail=detail):
                self.report_once(generation, launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT, step=step,
                                 detail=detail)
            case StateLost(generation=generation, target_step=target_step, detail=detail):
                self.report_once(generation, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=target_step, detail=detail)
            case Beat(samples=samples, waiting=waiting, loss=loss, compute_generation=compute_generation,
                      compute_seconds=compute_seconds, compute_samples=compute_samples, compute_steps=compute_steps):
                live.beats[local_rank] = LastBeat(time.time(), waiting, max(0, samples), loss, compute_generation,
                                                  max(0.0, compute_seconds), max(0, compute_samples),
                                                  max(0, compute_steps))
                live.slow.discard(local_rank)
                beating = next((w for w in group.workers if w.local_rank == local_rank), None)
                # The CPU reference only (one /proc read per process, no thread scan): this
                # runs twice a second per worker.
                sample = (read_group_sample(beating.pid, live.group_members.get(local_rank, ()), threads=False)
                          if beating is not None else None)
                if sample is not None:
                    live.beat_samples[local_rank] = sample
                else:
                    live.beat_samples.pop(local_rank, None)

    # Silence: what the tick's liveness verdict looks at, and what it leads to.

    def watch(self, now: Now, limit_s: float) -> tuple[tuple[WorkerWatch, ...], float]:
        """The workers to judge (beating once, neither exited, finished nor killed
        already), each with a fresh sample if it is silent past `limit_s`, and when the
        previous look was (monotonic; 0: none). Reads /proc only for the silent ones."""
        group = self.agent.workers
        live = self.workers
        previous, self.last_look_at = self.last_look_at, now.monotonic
        watches: list[WorkerWatch] = []
        if group is None:
            return (), previous
        held_up = bool(previous) and now.monotonic - previous > limit_s
        for worker in group.workers:
            local_rank = worker.local_rank
            last = live.beats.get(local_rank)
            if worker.exited.done() or last is None or local_rank in live.silenced or local_rank in live.finished:
                continue
            sample: ProcessSample | None = None
            reference = live.beat_samples.get(local_rank)
            if not held_up and silent_past(last.at, now.wall, limit_s):
                if local_rank not in live.group_members:
                    # At its first silent look: what else runs in its process group (a wrapper's child).
                    live.group_members[local_rank] = group_members(worker.pid)
                sample = read_group_sample(worker.pid, live.group_members[local_rank])
                if reference is None and sample is not None:
                    # No sample from its last beat: this first silent look is the reference.
                    live.beat_samples[local_rank] = sample
            watches.append(WorkerWatch(local_rank, last.at, reference, sample))
        self.samples_now = {watch.local_rank: watch.sample_now for watch in watches}
        return tuple(watches), previous

    def kill(self, kill: decisions.KillWorker) -> None:
        """SIGKILL a frozen worker; its exit is reported with the reason."""
        worker = self._worker(kill.local_rank)
        if worker is None:
            return
        self.workers.silenced[kill.local_rank] = kill.detail
        self.agent.log.warning("worker_frozen", rank=worker.rank, pid=worker.pid, silent_s=round(kill.silent_s, 3),
                               reason=kill.reason)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)

    def note_slow(self, slow: decisions.NoteSlowWorker) -> None:
        """A silent, busy worker: left alone, logged once a silent spell. The reference
        slides with the CPU time: a worker that was busy and then stops using any is
        judged frozen one limit later, not never."""
        live = self.workers
        local_rank = slow.local_rank
        reference = live.beat_samples.get(local_rank)
        sample_now = self.samples_now.get(local_rank)
        if sample_now is not None and reference is not None and sample_now.cpu_s > reference.cpu_s:
            live.beat_samples[local_rank] = sample_now
        if local_rank not in live.slow:
            live.slow.add(local_rank)
            worker = self._worker(local_rank)
            if worker is not None:
                self.agent.log.warning("worker_slow", rank=worker.rank, pid=worker.pid,
                                       silent_s=round(slow.silent_s, 3), reason=slow.reason)

    def _worker(self, local_rank: int) -> Worker | None:
        group = self.agent.workers
        return next((w for w in group.workers if w.local_rank == local_rank), None) if group is not None else None
