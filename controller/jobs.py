"""One actor per elastic job: the runtime around the job's pure state machine.

Inputs (launcher sessions opening and closing, what launchers say, admin requests, Slurm
views and a clock tick) wait in one queue. The loop hands each to `core.job.transition`,
which decides everything, and applies the effects it returns (`_persist`, then `_act`):
whatever must be persisted, in one SQLite transaction, and only then the messages, session
closes, Slurm cancels and submissions. A controller killed at any point reloads what it
decided. Heartbeats skip the queue: they only update the session they came on, and reach
the core with the next tick."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from tidal.controller import owners, units
from tidal.controller.config import ControllerConfig
from tidal.controller.core import forming, replicas, sharing
from tidal.controller.core import job as core
from tidal.controller.core.job import (
    CancelFailed,
    CancelRequested,
    DrainRequested,
    ResizeRequested,
    SlurmObserved,
    UnitSubmitted,
    describe_exit,
    duration,
)
from tidal.controller.core.stragglers import Totals
from tidal.controller.events import EventLog
from tidal.controller.history import ProgressSample, sample_due
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import EventRecord, GenerationRecord, JobRecord, JobState, UnitRecord
from tidal.controller.security import secret_matches
from tidal.controller.sessions import LauncherSession
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2, launcher_pb2
from tidal.slurm.client import SlurmClient
from tidal.slurm.errors import SlurmError, SlurmJobNotFound, answer_lost, slurmctld_unanswered
from tidal.slurm.models import UnitOwner
from tidal.slurm.snapshot import ClusterView

log = structlog.get_logger("tidal.controller.jobs")

__all__ = ["Barrier", "CancelRequested", "Connected", "Disconnected", "DrainRequested", "JobActor", "JobInput",
           "Refusal", "ResizeRequested", "Said", "SlurmObserved", "SlurmUnits", "Throughput", "Tick",
           "UnitSubmitted", "describe_exit", "event_to_proto"]


class Refusal(Exception):
    """A launcher call the controller refuses, with the gRPC status it gets."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# Inputs of the actor's loop that carry sessions (the core sees unit ids); the others are
# the core's own (`CancelRequested`, `DrainRequested`, `ResizeRequested`, `SlurmObserved`,
# `UnitSubmitted`, `CancelFailed`).


@dataclasses.dataclass(frozen=True)
class Connected:
    session: LauncherSession
    register: launcher_pb2.Register


@dataclasses.dataclass(frozen=True)
class Said:
    session: LauncherSession
    message: launcher_pb2.LauncherMessage


@dataclasses.dataclass(frozen=True)
class Disconnected:
    session: LauncherSession
    reason: str


@dataclasses.dataclass(frozen=True)
class Tick:
    pass


@dataclasses.dataclass(frozen=True)
class Barrier:
    """Resolves `done` once every input queued before it has been handled."""

    done: asyncio.Future[None]


@dataclasses.dataclass(frozen=True)
class SlurmUnits:
    """How this controller runs units as Slurm jobs."""

    client: SlurmClient
    launcher: tuple[str, ...]
    controller_address: str
    # Where a job's units write (a template for each owner: config.unit_output_dir).
    output_template: str
    secrets_dir: Path

    def files(self, owner: UnitOwner, job_id: str) -> owners.JobFiles:
        return owners.job_files(owner, job_id, output_template=self.output_template, secrets_dir=self.secrets_dir,
                                controller_uid=os.geteuid())


JobInput = (Connected | Said | Disconnected | Tick | CancelRequested | DrainRequested | ResizeRequested | Barrier
            | SlurmObserved | UnitSubmitted | CancelFailed)


class Throughput:
    """Steps and samples per second over the last `window_s`, and goodput: the share of
    node-seconds held by the job's launchers that went to a running world's members."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, int, int]] = collections.deque()
        self.last_at: float | None = None
        self.held_node_seconds = 0.0
        self.training_node_seconds = 0.0

    def observe(self, now: float, step: int, samples: int, held_nodes: int, training_nodes: int) -> None:
        if self.last_at is not None:
            elapsed = now - self.last_at
            self.held_node_seconds += held_nodes * elapsed
            self.training_node_seconds += min(training_nodes, held_nodes) * elapsed
        self.last_at = now
        if not self.points or self.points[-1][1:] != (step, samples):
            self.points.append((now, step, samples))
        while len(self.points) > 2 and self.points[1][0] < now - self.window_s:
            self.points.popleft()

    def rates(self, now: float, global_batch: int) -> tuple[float, float]:
        """(steps/s, samples/s) over the window; samples/s from the workers' own count
        where they report it (live mode), else steps/s x the spec's global batch."""
        if len(self.points) < 2 or now - self.points[-1][0] > self.window_s:
            return 0.0, 0.0
        (t0, step0, samples0), (t1, step1, samples1) = self.points[0], self.points[-1]
        elapsed = now - t0 if now > t1 else t1 - t0
        if elapsed <= 0:
            return 0.0, 0.0
        steps = max(0, step1 - step0) / elapsed
        samples = max(0, samples1 - samples0) / elapsed if samples1 else steps * global_batch
        return steps, samples

    @property
    def goodput(self) -> float:
        return self.training_node_seconds / self.held_node_seconds if self.held_node_seconds > 0 else 0.0


def clock() -> core.Now:
    return core.Now(monotonic=time.monotonic(), wall=time.time())


class JobActor:
    def __init__(self, job: JobRecord, units: list[UnitRecord], generation: GenerationRecord | None, *,
                 generation_stopped: bool, config: ControllerConfig, store: StateStore, events: EventLog,
                 metrics: ControllerMetrics, started_at: float, slurm: SlurmUnits | None = None) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.metrics = metrics
        self.inputs: asyncio.Queue[JobInput] = asyncio.Queue()
        self.sessions: dict[str, LauncherSession] = {}
        # Replicas of several nodes: the slot each registering launcher was told, until its
        # session is taken in (`replicas.slot_for`).
        self.reserved_slots: dict[str, replicas.Slot] = {}
        now = core.Now(monotonic=started_at, wall=time.time() - (time.monotonic() - started_at))
        before = (store.generation(job.job_id, generation.number - 1)
                  if generation is not None and generation.number > 1 and not job.state.is_final else None)
        self.state = core.restore(job, units, generation, generation_stopped=generation_stopped,
                                  pending=store.pending(job.job_id), config=config, now=now,
                                  slurm_units=slurm is not None, previous=before[0] if before else None)
        self._slurm = slurm
        # Asks the controller for a Slurm poll soon (`Controller.poll_soon`; set by it).
        self.ask_for_poll: Callable[[], None] = lambda: None
        # In memory: a controller restart starts the rates and goodput afresh.
        self.throughput = Throughput()
        # The newest sample of the job's progress history kept in SQLite (`tidal plot`).
        self.last_progress: ProgressSample | None = None
        self.log = log.bind(job=job.job_id)

    # The state, as the gRPC layer and the gauges read it.

    @property
    def job(self) -> JobRecord:
        return self.state.job

    @property
    def units(self) -> dict[str, UnitRecord]:
        return self.state.units

    @property
    def generation(self) -> GenerationRecord | None:
        return self.state.generation

    @property
    def slurm(self) -> SlurmUnits | None:
        return self._slurm

    @slurm.setter
    def slurm(self, slurm: SlurmUnits | None) -> None:
        self._slurm = slurm
        self.state = dataclasses.replace(self.state, slurm_units=slurm is not None)

    # Entry points used by the gRPC layer (synchronous, on the event loop).

    def admit(self, register: launcher_pb2.Register) -> launcher_pb2.Registered:
        """Check a launcher's Register; raise Refusal with the status it gets."""
        job = self.job
        if not secret_matches(register.secret, job.secret_sha256):
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"wrong secret for job {job.job_id}")
        refused = core.refusal(self.state, register)
        if refused is not None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, refused)
        spec = job.spec
        # (The replicas holding the newest state only where units are grouped: a scan of
        # every unit at each registration costs a large one-node job for nothing.)
        current = forming.current_replicas(self.state) if replicas.nodes_per_replica(spec) > 1 else frozenset()
        slot = replicas.slot_for(self.state.units, spec, register.unit_id, self.reserved_slots, current=current)
        if slot is not None:
            # Kept until the actor takes the session in (two launchers registering at once
            # must not be given one slot).
            self.reserved_slots[register.unit_id] = slot
        return launcher_pb2.Registered(
            replica=slot.replica if slot is not None else 0, node_index=slot.node_index if slot is not None else 0,
            nodes_per_replica=replicas.nodes_per_replica(spec),
            current_generation=job.generation, heartbeat_interval=duration(self.config.heartbeat_interval_s),
            heartbeat_timeout=duration(self.config.heartbeat_timeout_s), mode=spec.mode,
            progress_timeout=duration(self.config.progress_timeout_s), command=list(spec.command),
            environment=dict(spec.environment), working_dir=spec.working_dir,
            procs_per_node=spec.procs_per_node or 1, job_name=spec.name,
            worker_silence_timeout=duration(self.config.worker_silence_timeout_s))

    def heartbeat(self, session: LauncherSession, beat: launcher_pb2.Heartbeat) -> None:
        """Record a heartbeat; it needs no decision, so it skips the queue, and no reply
        (the stream and gRPC keepalive tell the launcher the controller is there)."""
        now = time.monotonic()
        session.last_heartbeat_at = now
        if beat.sequence and beat.sequence <= session.heartbeat_sequence:
            # Older than one already taken (the stream keeps order; a resent copy does not).
            return
        session.heartbeat_sequence = beat.sequence
        if beat.HasField("sent_at"):
            sent_at = beat.sent_at.ToNanoseconds() / 1e9
            self.metrics.heartbeat_latency.observe(max(0.0, time.time() - sent_at))
            # Only the workers this heartbeat names: in live mode a worker's rank changes
            # with the world, and an old rank must not linger as a silent one.
            progress_at, steps, beat_at, waiting = {}, {}, {}, {}
            for worker in beat.workers:
                if worker.HasField("progress_time"):
                    age = max(0.0, sent_at - worker.progress_time.ToNanoseconds() / 1e9)
                    progress_at[worker.rank] = now - age
                    steps[worker.rank] = worker.step
                if worker.HasField("beat_time"):
                    beat_at[worker.rank] = now - max(0.0, sent_at - worker.beat_time.ToNanoseconds() / 1e9)
                    waiting[worker.rank] = worker.waiting
            session.progress_at, session.steps, session.beat_at, session.waiting = progress_at, steps, beat_at, waiting
            session.compute = {w.local_rank: Totals(w.compute_generation, w.compute_seconds, w.compute_samples,
                                                    w.compute_steps)
                               for w in beat.workers if w.compute_generation > 0}
            session.samples = max((w.samples for w in beat.workers), default=0)
            # The loss is the global batch's, the same on every rank: the newest one said.
            reported = [(w.samples, w.loss) for w in beat.workers if w.HasField("loss")]
            session.loss = max(reported)[1] if reported else None

    def put(self, item: JobInput) -> None:
        self.inputs.put_nowait(item)

    async def put_and_wait(self, item: JobInput) -> None:
        """Queue `item` and return once the actor has handled it, so that an admin call
        answers with the state it asked for."""
        self.inputs.put_nowait(item)
        await self.settled()

    async def settled(self) -> None:
        """Return once the actor has handled every input queued before this call (and so
        written what they decided to SQLite)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.inputs.put_nowait(Barrier(done))
        await done

    async def run(self) -> None:
        while True:
            item = await self.inputs.get()
            try:
                self.handle(item)
            except Exception:
                # One bad input must not take the job (or the daemon) down.
                self.log.exception("job_input_failed", input=type(item).__name__)
                if isinstance(item, Connected | Said):
                    # What a launcher said was not taken (say, SQLite refused the write): its
                    # session breaks instead of ending cleanly, so that the launcher says it
                    # again in its next one rather than count it delivered.
                    item.session.close(grpc.StatusCode.UNAVAILABLE,
                                       "the controller could not take a message of this session: send it again")

    # The one place transitions happen, and effects are applied.

    def handle(self, item: JobInput) -> None:
        event: core.Input
        match item:
            case Barrier(done):
                if not done.done():
                    done.set_result(None)
                return
            case Connected(session, register):
                previous = self.sessions.get(session.unit_id)
                if previous is not None and previous is not session:
                    previous.close(grpc.StatusCode.ABORTED, "replaced by a newer session of the same unit")
                self.sessions[session.unit_id] = session
                event = core.LauncherConnected(session.unit_id, register,
                                               self.reserved_slots.pop(session.unit_id, None))
            case Said(session, message):
                if self.sessions.get(session.unit_id) is not session:
                    return
                event = core.LauncherSaid(session.unit_id, message)
            case Disconnected(session, reason):
                if self.sessions.get(session.unit_id) is not session:
                    return
                del self.sessions[session.unit_id]
                event = core.LauncherClosed(session.unit_id, reason)
            case Tick():
                event = core.ClockTick(self._links())
            case _:
                event = item
        now = clock()
        state, effects = core.transition(self.state, event, now)
        # What the transition decided is on disk before the actor moves on or anything is
        # sent; if SQLite refuses, the actor keeps the state it had.
        self._persist(effects)
        self.state = state
        self._act(effects)
        if isinstance(item, Tick) and not self.job.state.is_final:
            self._observe_throughput(now.monotonic)
        elif self.job.state.is_final and self.last_progress is not None and self.last_progress.world_size:
            # The job ended: its last step, with no world running.
            last = self.last_progress
            samples = max((s.samples for s in self.sessions.values()), default=0)
            self._keep_progress(self.job.step, max(samples, last.samples), 0, last.loss)

    def _links(self) -> dict[str, core.Link]:
        # (No copies: `heartbeat` replaces a session's maps with new ones, never changes them.)
        return {unit_id: core.Link(last_heartbeat_at=s.last_heartbeat_at, progress_at=s.progress_at,
                                   steps=s.steps, beat_at=s.beat_at, waiting=s.waiting, compute=s.compute,
                                   heard=s.heartbeat_sequence > 0)
                for unit_id, s in self.sessions.items()}

    def _persist(self, effects: list[core.Effect]) -> None:
        """What the transition decided that must survive a restart, in one transaction."""
        persistent = [e for e in effects if isinstance(e, core.PERSISTENT)]
        if persistent:
            job_id = self.job.job_id
            with self.store.transaction():
                for saved in persistent:
                    match saved:
                        case core.SaveJob(job):
                            self.store.update_job(job)
                        case core.SaveUnit(unit):
                            self.store.upsert_unit(unit)
                        case core.SaveGeneration(generation):
                            self.store.insert_generation(generation)
                        case core.GenerationStopped(_, number, at):
                            self.store.mark_generation_stopped(job_id, number, at)
                        case core.Record(kind, reason, unit_id, generation, fields):
                            self.events.record(job_id, kind, reason, unit_id=unit_id, generation=generation,
                                               fields=fields)
                        case core.SavePending(key, value):
                            self.store.save_pending(job_id, key, value)

    def _act(self, effects: list[core.Effect]) -> None:
        """The rest of the effects, in order: messages, session closes, Slurm, metrics."""
        for effect in effects:
            match effect:
                case core.Send(unit_id, message):
                    session = self.sessions.get(unit_id)
                    if session is not None:
                        session.send(message)
                case core.Close(unit_id, details):
                    session = self.sessions.get(unit_id)
                    if session is not None:
                        session.close(grpc.StatusCode.ABORTED, details)
                case core.CancelInSlurm(unit_id, slurm_job_id):
                    self._cancel_in_slurm(unit_id, slurm_job_id)
                case core.Submit(unit_id, excluded):
                    self._submit(unit_id, excluded)
                case core.PollSlurmSoon(reason):
                    self.log.debug("slurm_poll_asked", reason=reason)
                    self.ask_for_poll()
                case core.FailureCounted(cause):
                    self.metrics.failures.labels(cause=cause).inc()
                case core.GenerationCounted(job_id):
                    self.metrics.generations_formed.labels(job_id=job_id).inc()
                case core.StaleMessageCounted():
                    self.metrics.stale_messages.inc()
                case core.StopTimed(seconds):
                    self.metrics.stop_duration.observe(seconds)
                case core.RecoveryTimed(seconds):
                    self.metrics.recovery_duration.observe(seconds)
                case core.Note(event, fields, warning):
                    (self.log.warning if warning else self.log.info)(event, **fields)

    def _cancel_in_slurm(self, unit_id: str, slurm_job_id: int) -> None:
        if self._slurm is None:
            return
        client = self._slurm.client
        post = self._poster()

        def cancel() -> None:
            try:
                client.cancel(slurm_job_id)
            except SlurmJobNotFound:
                pass  # (gone already: nothing left to cancel)
            except SlurmError as error:
                post(CancelFailed(unit_id, slurm_job_id, str(error), unanswered=slurmctld_unanswered(error)))

        asyncio.get_running_loop().run_in_executor(None, cancel)

    def _poster(self) -> Callable[[JobInput], None]:
        """`put` for a thread of the executor (sbatch, scancel): asyncio's queue is the event
        loop's alone; put from another thread, the actor waiting on it was not woken (until
        the loop woke for something else), and under asyncio's debug mode never was."""
        loop = asyncio.get_running_loop()

        def post(item: JobInput) -> None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: the controller stops)
                loop.call_soon_threadsafe(self.put, item)

        return post

    def _submit(self, unit_id: str, excluded: tuple[str, ...]) -> None:
        slurm = self._slurm
        if slurm is None:
            self.put(UnitSubmitted(unit_id, 0, "this controller runs no units in Slurm"))
            return
        job_id, spec, owner_uid = self.job.job_id, self.job.spec, self.job.owner_uid
        post = self._poster()

        def submit() -> None:
            # As the job's owner: the account is read when the unit is submitted, the unit's
            # output folder made (by the owner) if it went missing.
            try:
                owner = owners.account(owner_uid)
                files = slurm.files(owner, job_id)
                owners.make_private_folder(owner, files.folder)
                submission = units.unit_submission(
                    spec, job_id=job_id, unit_id=unit_id, launcher=slurm.launcher,
                    controller=slurm.controller_address, secret_path=files.secret, output_dir=files.folder,
                    exclude=excluded, owner=owner)
                slurm_job_id = slurm.client.submit(submission)
            except SlurmError as error:
                post(UnitSubmitted(unit_id, 0, str(error), answer_lost=answer_lost(error)))
            except (OSError, owners.UnknownOwner, subprocess.SubprocessError) as error:
                post(UnitSubmitted(unit_id, 0, str(error)))
            else:
                post(UnitSubmitted(unit_id, slurm_job_id))

        asyncio.get_running_loop().run_in_executor(None, submit)

    def _observe_throughput(self, now: float) -> None:
        world = self.state.training_world
        # The world that trains: its members' workers (a joiner's workers on standby report
        # step 0 and would pull the step, hence the rate, down while they start).
        members = ([session for m in world.members if (session := self.sessions.get(m.unit_id)) is not None]
                   if world is not None else [])
        steps = [step for s in members for step in s.steps.values()]
        # Between worlds (none trains, or its members have not said yet) the count stands
        # where it was: it is the job's, not a world's.
        samples = (max((s.samples for s in members), default=0)
                   or (self.last_progress.samples if self.last_progress is not None else 0))
        training = sum(len(m.nodes) for m in world.members if m.unit_id in self.sessions) if world else 0
        held = sum(len(self.units[u].nodes) or 1 for u in self.sessions if u in self.units)
        step = min(steps) if steps else self.job.step
        self.throughput.observe(now, step, samples, held, training)
        # The newest loss said: that of the member with the most samples trained.
        newest = max(((s.samples, s.loss) for s in members if s.loss is not None), default=(0, None))
        self._keep_progress(step, samples, world.world_size if world is not None else 0, newest[1])

    def _keep_progress(self, step: int, samples: int, world_size: int, loss: float | None) -> None:
        sample = ProgressSample(time=time.time(), step=step, samples=samples, world_size=world_size, loss=loss)
        if not sample_due(self.last_progress, sample):
            return
        try:
            self.store.add_progress(self.job.job_id, sample)
        except sqlite3.Error as error:
            # The history is a picture, not state: a write that fails is logged, not fatal.
            self.log.warning("progress_not_kept", error=str(error))
            return
        self.last_progress = sample

    # Cluster-wide plans (controller/server.py) ask each job.

    def growing_job(self, view: ClusterView, now: float) -> sharing.GrowingJob | None:
        return core.growing_job(self.state, view, now)

    def yielding_job(self, view: ClusterView) -> sharing.YieldingJob | None:
        return core.yielding_job(self.state, view)

    # What the state gauges read (metrics.JobView).

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def job_state(self) -> str:
        return self.job.state.value

    @property
    def unit_states(self) -> list[str]:
        return [unit.state.value for unit in self.units.values()]

    @property
    def world_size(self) -> int:
        """The world training in now: while a live change is in flight, the old one."""
        return core.world_size(self.state)

    @property
    def generation_number(self) -> int:
        return self.job.generation

    @property
    def connected_launchers(self) -> int:
        return len(self.sessions)

    @property
    def unit_compute(self) -> dict[str, tuple[float, bool]]:
        """Per unit with a scored worker: its slowest worker's compute per sample against
        its peers' median, and whether one of its workers is a straggler (one pass)."""
        found: dict[str, tuple[float, bool]] = {}
        for (unit_id, _), worker in self.state.compute.items():
            if worker.ratio <= 0 and not worker.suspected:
                continue
            ratio, slow = found.get(unit_id, (0.0, False))
            found[unit_id] = (max(ratio, worker.ratio), slow or worker.suspected)
        return found

    # Admin views.

    def to_proto(self) -> admin_pb2.Job:
        job = self.job
        generation = self.generation
        running = generation is not None and job.state is JobState.RUNNING
        units = []
        compute = self.unit_compute
        for unit in self.units.values():
            session = self.sessions.get(unit.unit_id)
            ratio, straggler = compute.get(unit.unit_id, (0.0, False))
            entry = admin_pb2.Unit(unit_id=unit.unit_id, slurm_job_id=unit.slurm_job_id, nodes=unit.nodes,
                                   state=unit.state.to_proto(), group_rank=unit.group_rank,
                                   replica=unit.replica, node_index=unit.node_index, compute_ratio=ratio,
                                   straggler=straggler)
            if session is not None:
                entry.last_heartbeat.FromNanoseconds(
                    int((time.time() - (time.monotonic() - session.last_heartbeat_at)) * 1e9))
            units.append(entry)
        message = admin_pb2.Job(job_id=job.job_id, spec=job.spec, state=job.state.to_proto(),
                                owner_uid=job.owner_uid, generation=job.generation,
                                world_size=self.world_size,
                                replicas=(len(generation.members) // replicas.nodes_per_replica(job.spec)
                                          if running and generation else 0),
                                step=job.step, units=units)
        _, message.samples_per_second = self.throughput.rates(time.monotonic(), job.spec.global_batch)
        message.goodput = self.throughput.goodput
        message.created_at.FromNanoseconds(int(job.created_at * 1e9))
        last = self.store.last_event(job.job_id)
        if last is not None:
            message.last_event.CopyFrom(event_to_proto(last))
        return message


def event_to_proto(event: EventRecord) -> admin_pb2.Event:
    message = admin_pb2.Event(sequence=event.sequence, job_id=event.job_id, unit_id=event.unit_id,
                              generation=event.generation, kind=event.kind, reason=event.reason, fields=event.fields)
    message.time.FromNanoseconds(int(event.time * 1e9))
    return message

