"""The controller's gRPC services: the launcher session and the admin API, over a
registry of job actors."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import re
import secrets
import time
from pathlib import Path

import grpc
import structlog
from google.protobuf.message import DecodeError

from tidal.controller import owners, units
from tidal.controller.config import ControllerConfig
from tidal.controller.core import sharing
from tidal.controller.events import EventLog
from tidal.controller.history import HISTORY_EVENT_KINDS, HISTORY_MAX_EVENTS, history_reply
from tidal.controller.jobs import (
    CancelRequested,
    Connected,
    Disconnected,
    DrainRequested,
    JobActor,
    Refusal,
    ResizeRequested,
    Said,
    SlurmObserved,
    SlurmUnits,
    Tick,
    event_to_proto,
)
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import JobRecord, JobState, UnitState
from tidal.controller.ratelimit import TokenBucket
from tidal.controller.security import Caller, UnixSocketRelay, new_secret, secret_digest, write_private_file
from tidal.controller.sessions import LauncherSession, SessionClose, SessionEnded
from tidal.controller.spec import SpecError, normalized_spec
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2, admin_pb2_grpc, common_pb2, launcher_pb2, launcher_pb2_grpc
from tidal.slurm import SlurmClient, SlurmError, default_client
from tidal.slurm.errors import SlurmCommandFailed, slurmctld_unanswered
from tidal.slurm.models import UnitOwner
from tidal.slurm.snapshot import ClusterPoll, ClusterView

log = structlog.get_logger("tidal.controller.server")

GARBLED = "garbled message: not a tidal.v1.LauncherMessage"
# Polls asked for early (a job submitted or resized, units ended) come at least this long
# after the last poll ended, and no sooner than the last poll took (Slurm is never polled
# more than half the time, however often asked): a burst of asks makes one poll, and with
# a short `slurm_poll_interval_s` (1 s) a submission waits this long rather than the
# interval (the goodput bench's submissions, made just after a poll, waited 1.00-1.02 s
# for their units while this was 1 s).
EARLY_POLL_GAP_S = 0.25
# (Matched whole: see `spec._NAME`.)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def poll_interval_s(config: ControllerConfig, job_released: bool) -> float:
    """The regular wait between two Slurm polls (`Controller.poll_interval_s`):
    `slurm_poll_interval_s`, shortened to `released_poll_interval_s` (when set) while some
    job waits below min_replicas for nodes it gave back (`job_released`)."""
    interval = config.slurm_poll_interval_s
    if job_released and config.released_poll_interval_s > 0:
        return min(interval, config.released_poll_interval_s)
    return interval


class Controller:
    """Every job's actor, the event log, and what the services share."""

    def __init__(self, config: ControllerConfig, store: StateStore, metrics: ControllerMetrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.events = EventLog(store)
        self.actors: dict[str, JobActor] = {}
        self.slurm_units: SlurmUnits | None = None
        # Waiting Slurm job id -> Slurm job ids of the units that yield to it.
        self.yielded: dict[int, set[int]] = {}
        self.shutting_down = False
        self._tasks: set[asyncio.Task[None]] = set()
        # Job ids drawn by submissions not stored yet (`new_job_id`).
        self._ids_drawn: set[str] = set()
        self._poll_soon = asyncio.Event()
        metrics.read_job_states(lambda: list(self.actors.values()), [s.value for s in JobState],
                                [s.value for s in UnitState])

    def load(self) -> None:
        """Rebuild every job's actor from SQLite (a restart resumes where it stopped)."""
        started_at = time.monotonic()
        for job in self.store.jobs():
            found = self.store.generation(job.job_id, job.generation) if job.generation else None
            generation, stopped_at = found if found else (None, None)
            actor = JobActor(job, self.store.units(job.job_id), generation, generation_stopped=stopped_at is not None,
                             config=self.config, store=self.store, events=self.events, metrics=self.metrics,
                             started_at=started_at)
            self._add(actor)
            if not job.state.is_final:
                log.info("job_reloaded", job=job.job_id, state=job.state.value, generation=job.generation)

    def enable_slurm_units(self, slurm_units: SlurmUnits) -> None:
        """From now on every job's units are Slurm jobs this controller submits."""
        self.slurm_units = slurm_units
        for actor in self.actors.values():
            actor.slurm = slurm_units

    async def poll_slurm_forever(self, poll: ClusterPoll) -> None:
        """One cluster-wide view per interval for every job (`poll_interval_s`), or sooner
        when `poll_soon` asks (EARLY_POLL_GAP_S after the last at the earliest, or as long
        as the last took); after failed polls the next comes later (doubling, up to 10
        intervals, early asks ignored), and the actors see the view as stale."""
        while True:
            self._poll_soon.clear()
            started = time.monotonic()
            try:
                view = await asyncio.to_thread(poll.poll)
                gap_s = max(EARLY_POLL_GAP_S, time.monotonic() - started)
                if view.stale:
                    log.warning("slurm_poll_failed", failures=view.consecutive_failures, error=str(view.error),
                                cause=repr(view.error.__cause__) if view.error and view.error.__cause__ else None)
                self.observe_slurm(view, time.monotonic())
            except Exception:
                # A bug here must not end the polling for good (units never submitted again,
                # no loss or preemption ever seen), the daemon up all the while.
                log.exception("slurm_poll_loop_error")
                await asyncio.sleep(self.poll_interval_s())
                continue
            wait_s = self.poll_interval_s() * min(10, 2 ** view.consecutive_failures)
            if view.consecutive_failures or wait_s <= gap_s:
                await asyncio.sleep(wait_s)
                continue
            await asyncio.sleep(gap_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_soon.wait(), timeout=wait_s - gap_s)

    def poll_interval_s(self) -> float:
        """The wait before the next regular poll: `slurm_poll_interval_s`, or
        `released_poll_interval_s` when shorter while a job that gave its nodes back below
        min_replicas waits for them (it resumes once a view shows min_replicas nodes idle,
        and only a poll shows it)."""
        return poll_interval_s(self.config, any(a.state.released_below_min for a in self.actors.values()
                                                if not a.job.state.is_final))

    def poll_soon(self) -> None:
        """Ask for the next Slurm poll now rather than at the interval's end: a job just
        submitted or resized gets its units, and a unit that failed or was preempted its
        replacement, without waiting up to `slurm_poll_interval_s`."""
        self._poll_soon.set()

    def observe_slurm(self, view: ClusterView, now: float) -> None:
        """Hand one view to every job, with the cluster-wide decisions taken on it: the
        idle nodes shared by weight, and the units that yield to waiting Slurm jobs."""
        actors = [a for a in self.actors.values() if not a.job.state.is_final]
        allowances: dict[str, int] = {}
        yields: dict[str, list[sharing.YieldOrder]] = {}
        in_line: frozenset[str] | None = None
        if not view.stale and self.slurm_units is not None:
            growing = [g for a in actors if (g := a.growing_job(view, now)) is not None]
            allowances = sharing.share_idle_nodes(growing)
            in_line = sharing.next_in_line(growing)
            for order in self._plan_yields(view, actors):
                yields.setdefault(order.job_id, []).append(order)
        for actor in actors:
            job_id = actor.job.job_id
            actor.put(SlurmObserved(view, allowances.get(job_id), tuple(yields.get(job_id, ())),
                                    next_in_line=in_line is None or job_id in in_line))
        for actor in self.actors.values():
            if actor.job.state.is_final and actor.state.cancels_to_retry:
                # An ended job whose units' scancel failed: the view makes them again.
                actor.put(SlurmObserved(view))

    def _plan_yields(self, view: ClusterView, actors: list[JobActor]) -> list[sharing.YieldOrder]:
        waiting = {j.job_id: j for j in units.waiting_for_nodes(view)}
        # Forget yields for jobs that no longer wait; count units still holding a node.
        self.yielded = {job_id: held for job_id, held in self.yielded.items() if job_id in waiting}
        releasing = units.releasing(view, self.yielded)
        jobs = [y for a in actors if (y := a.yielding_job(view)) is not None]
        if not waiting or not jobs:
            return []
        idle = frozenset(n.name for n in view.nodes if n.is_idle_and_usable)
        waiters = [sharing.WaitingJob(slurm_job_id=j.job_id, nodes_needed=max(1, j.node_count),
                                      could_use=view.partition_nodes(j.partition),
                                      rank=(view.priority_tier(j.partition), j.priority)) for j in waiting.values()]
        orders = sharing.plan_yields(waiters, jobs, idle, releasing)
        for order in orders:
            unit = self.actors[order.job_id].units[order.unit_id]
            self.yielded.setdefault(order.slurm_job_id, set()).add(unit.slurm_job_id)
        return orders

    def _add(self, actor: JobActor) -> None:
        actor.slurm = self.slurm_units
        actor.ask_for_poll = self.poll_soon
        self.actors[actor.job.job_id] = actor
        task = asyncio.get_running_loop().create_task(actor.run(), name=f"job-{actor.job.job_id}")
        self._tasks.add(task)

    async def tick_forever(self) -> None:
        interval = min(0.25, self.config.heartbeat_interval_s / 4)
        while True:
            await asyncio.sleep(interval)
            for actor in self.actors.values():
                if not actor.job.state.is_final:
                    actor.put(Tick())

    def check_with_slurm(self, spec: admin_pb2.JobSpec, owner: UnitOwner) -> None:
        """Before a job is accepted, ask Slurm whether it would take the job's units (runs
        sbatch, so off the event loop): SpecError naming the field if not, SlurmError if
        Slurm does not answer (sbatch exiting 1 because slurmctld is down or overloaded
        included). Nothing is submitted."""
        if self.slurm_units is None:
            return
        client = self.slurm_units.client
        if spec.partition:
            known = sorted(p.name for p in client.list_partitions())
            if spec.partition not in known:
                raise SpecError(f"partition: {spec.partition!r} is not a partition of this cluster "
                                f"(known: {', '.join(known)})")
        self._check_gpus(spec, client)
        files = self.slurm_units.files(owner, f"{spec.name}-check")
        probe = units.unit_submission(spec, job_id=f"{spec.name}-check", unit_id="u0",
                                      launcher=self.slurm_units.launcher,
                                      controller=self.slurm_units.controller_address,
                                      secret_path=files.secret, output_dir=files.folder, owner=owner)
        try:
            client.check(probe)
        except SlurmCommandFailed as error:
            if slurmctld_unanswered(error):
                raise  # (slurmctld down or overloaded: no verdict on the spec)
            said = "; ".join(line.strip() for line in error.stderr.splitlines() if line.strip())
            raise SpecError(f"sbatch_options: Slurm would refuse the job's units: {said}") from None

    @staticmethod
    def _check_gpus(spec: admin_pb2.JobSpec, client: SlurmClient) -> None:
        """SpecError when the job's partition has GPU nodes and its units could not give each
        worker a GPU of its own (`units.gpu_shortfall`). Slurm not answering is not the job's
        fault: the check is skipped, and said in the log."""
        try:
            partitions, nodes = client.list_partitions(), client.list_nodes()
        except SlurmError as error:
            log.warning("gpu_check_skipped", job=spec.name, procs_per_node=spec.procs_per_node,
                        reason=f"Slurm did not answer: {error}")
            return
        problem = units.gpu_shortfall(spec, partitions, nodes)
        if problem is not None:
            raise SpecError(problem)

    @property
    def owner_policy(self) -> owners.OwnerPolicy:
        return owners.OwnerPolicy(controller_uid=os.geteuid(), min_uid=self.config.min_owner_uid,
                                  allow_root=self.config.allow_root_jobs,
                                  allow_system_users=self.config.allow_system_user_jobs)

    async def submit(self, spec: admin_pb2.JobSpec, owner: UnitOwner) -> tuple[JobActor, Path]:
        """Persist a new job and write its secret for the owner (as the owner, in the
        owner's job folder, when the owner is another user); SpecError if invalid,
        OwnerActionFailed if the owner's folder cannot be made."""
        spec = normalized_spec(spec)
        job_id = self.new_job_id(spec.name)
        try:
            return await self._submit(job_id, spec, owner)
        finally:
            self._ids_drawn.discard(job_id)

    def new_job_id(self, name: str) -> str:
        """`name`-<6 hex digits>, one no job has (a running one, a finished one still in
        SQLite, or one being submitted): a drawn id equal to a job's overwrote that job's
        secret file before the insert failed, and its launchers were refused from then on."""
        while True:
            job_id = f"{name}-{secrets.token_hex(3)}"
            if job_id not in self.actors and job_id not in self._ids_drawn and not self.store.has_job(job_id):
                self._ids_drawn.add(job_id)
                return job_id

    async def _submit(self, job_id: str, spec: admin_pb2.JobSpec, owner: UnitOwner) -> tuple[JobActor, Path]:
        secret = new_secret()
        now = time.time()
        job = JobRecord(job_id=job_id, spec=spec, state=JobState.PENDING, owner_uid=owner.uid,
                        secret_sha256=secret_digest(secret), created_at=now, updated_at=now)
        files = owners.job_files(owner, job_id, output_template=self.config.unit_output_dir,
                                 secrets_dir=self.config.secrets_dir, controller_uid=os.geteuid())
        secret_path = files.secret
        if owners.is_self(owner):
            self.config.secrets_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.config.secrets_dir, 0o711)
            write_private_file(secret_path, secret + "\n", owner_uid=owner.uid)
        else:
            # Another user writes into their own space (a command run as them, off the loop).
            await asyncio.to_thread(owners.write_private_file_as, owner, secret_path, secret + "\n")
        with self.store.transaction():
            self.store.insert_job(job)
            self.events.record(job_id, "job_submitted", f"by {owner.name} (uid {owner.uid})",
                               fields={"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas,
                                       "mode": common_pb2.JobMode.Name(spec.mode).removeprefix("JOB_MODE_").lower()})
        actor = JobActor(job, [], None, generation_stopped=False, config=self.config, store=self.store,
                         events=self.events, metrics=self.metrics, started_at=time.monotonic())
        self._add(actor)
        self.poll_soon()
        return actor, secret_path


class LauncherServicer(launcher_pb2_grpc.LauncherServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        config = self.controller.config
        try:
            first = await asyncio.wait_for(context.read(), timeout=config.register_timeout_s)
        except TimeoutError:
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no register message within {config.register_timeout_s:g} s")
            return
        except DecodeError:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, GARBLED)
            return
        if first is grpc.aio.EOF:
            return
        assert isinstance(first, launcher_pb2.LauncherMessage)
        if first.WhichOneof("body") != "register":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message must be register")
        register = first.register
        for field in ("job_id", "unit_id"):
            if not _ID.fullmatch(getattr(register, field)):
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{field} must be 1-128 letters, digits, '.', '_', ':' or '-'")
        actor = self.controller.actors.get(register.job_id)
        if actor is None:
            await self._refuse(context, grpc.StatusCode.NOT_FOUND, f"no job {register.job_id}")
            return
        try:
            registered = actor.admit(register)
        except Refusal as refusal:
            log.warning("launcher_refused", job=register.job_id, unit=register.unit_id, code=refusal.code.name,
                        reason=refusal.details, peer=context.peer())
            await self._refuse(context, refusal.code, refusal.details)
            return
        now = time.monotonic()
        session = LauncherSession(job_id=register.job_id, unit_id=register.unit_id, opened_at=now,
                                  last_heartbeat_at=now, store_port=register.store_port,
                                  worker_pids=tuple(register.worker_pids))
        await context.write(launcher_pb2.ControllerMessage(registered=registered))
        actor.put(Connected(session, register))
        bucket = TokenBucket(config.launcher_messages_per_s, config.launcher_message_burst, now)
        # One task reads; this one writes whatever the outbox holds (commands from the
        # job actor, or how the session ends), so no message waits on a poll.
        reader = asyncio.create_task(self._read(context, actor, session, bucket))
        reason = "session ended"
        try:
            while True:
                item = await session.outbox.get()
                if isinstance(item, SessionEnded):
                    reason = item.reason
                    return
                if isinstance(item, SessionClose):
                    reason = item.details
                    await context.abort(item.code, item.details)
                await context.write(item)
        except asyncio.CancelledError:
            reason = "stream cancelled (launcher gone or connection lost)"
            raise
        finally:
            reader.cancel()
            if not self.controller.shutting_down:
                actor.put(Disconnected(session, reason))

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        self.controller.metrics.refused_calls.labels(code=code.name).inc()
        await context.abort(code, details)

    async def _read(self, context: grpc.aio.ServicerContext, actor: JobActor, session: LauncherSession,
                    bucket: TokenBucket) -> None:
        """Read the launcher's messages until its stream ends or it breaks a rule; either
        way, tell the writing side through the outbox."""
        config = self.controller.config
        while True:
            try:
                message = await context.read()
            except DecodeError:
                self._refuse_session(session, grpc.StatusCode.INVALID_ARGUMENT, GARBLED)
                return
            except grpc.RpcError as error:
                session.end(f"read failed: {error}")
                return
            if message is grpc.aio.EOF:
                # A launcher takes a clean end of its session as proof that the controller
                # has what it said (`ControllerLink.hold_written`: the end of training's
                # reports), so the session ends only once the job has handled all of it and
                # written what it decided to SQLite. A controller that dies first breaks
                # the stream instead, and the launcher sends them again.
                await actor.settled()
                session.end("launcher closed its stream")
                return
            assert isinstance(message, launcher_pb2.LauncherMessage)
            if not bucket.allow(time.monotonic()):
                self._refuse_session(session, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"more than {config.launcher_messages_per_s:g} messages/s "
                                     f"(burst {config.launcher_message_burst})")
                return
            kind = message.WhichOneof("body")
            if kind is None or kind == "register":
                self._refuse_session(session, grpc.StatusCode.INVALID_ARGUMENT,
                                     "register may only be the first message" if kind else "empty message")
                return
            if kind == "heartbeat":
                actor.heartbeat(session, message.heartbeat)
            else:
                actor.put(Said(session, message))

    def _refuse_session(self, session: LauncherSession, code: grpc.StatusCode, details: str) -> None:
        self.controller.metrics.refused_calls.labels(code=code.name).inc()
        log.warning("launcher_session_refused", job=session.job_id, unit=session.unit_id, code=code.name,
                    reason=details)
        session.close(code, details)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, controller: Controller, admin_token: str, relay: UnixSocketRelay | None) -> None:
        self.controller = controller
        self.admin_token = admin_token
        self.relay = relay

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        if self.relay is not None:
            uid = self.relay.uid_for_peer(context.peer())
            if uid is not None:
                turned_away = owners.serves(self.controller.owner_policy, uid)
                if turned_away is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, turned_away)
                return Caller(uid=uid, is_admin=uid == 0, via="unix")
        metadata = dict(context.invocation_metadata() or ())
        presented = str(metadata.get("authorization", "")).removeprefix("Bearer ").strip()
        if presented and hmac.compare_digest(presented.encode(), self.admin_token.encode()):
            # The token's holder acts as the controller's own user (an admin).
            return Caller(uid=os.geteuid(), is_admin=True, via="token")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "admin calls need the controller's Unix socket or its admin token over TCP")
        raise AssertionError("unreachable")

    async def _actor(self, context: grpc.aio.ServicerContext, job_id: str, caller: Caller) -> JobActor:
        actor = self.controller.actors.get(job_id)
        if actor is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
            raise AssertionError("unreachable")
        if not caller.may_act_on(actor.job.owner_uid):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"job {job_id} belongs to uid {actor.job.owner_uid}, not to uid {caller.uid}")
        return actor

    async def _owner(self, context: grpc.aio.ServicerContext, request: admin_pb2.SubmitJobRequest,
                     caller: Caller) -> UnitOwner:
        """The account a new job runs as: the caller, or the user an admin names; refused
        (PERMISSION_DENIED, saying why) where the controller does not take that user's jobs."""
        try:
            if request.owner and not caller.is_admin:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"only an admin submits a job for another user (owner {request.owner!r})")
            owner = owners.account_named(request.owner) if request.owner else owners.account(caller.uid)
        except owners.UnknownOwner as error:
            code = grpc.StatusCode.INVALID_ARGUMENT if request.owner else grpc.StatusCode.PERMISSION_DENIED
            await context.abort(code, str(error))
            raise
        refused = owners.refusal(self.controller.owner_policy, owner.uid, owner.name)
        if refused is not None:
            self.controller.metrics.refused_calls.labels(code=grpc.StatusCode.PERMISSION_DENIED.name).inc()
            log.warning("submission_refused", uid=owner.uid, user=owner.name, reason=refused)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"job refused: {refused}")
        return owner

    async def SubmitJob(self, request: admin_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.SubmitJobResponse:
        caller = await self._caller(context)
        owner = await self._owner(context, request, caller)
        try:
            spec = normalized_spec(request.spec)
            await asyncio.to_thread(self.controller.check_with_slurm, spec, owner)
            actor, secret_path = await self.controller.submit(spec, owner)
        except owners.OwnerActionFailed as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the job's folder could not be made: {error}")
            raise
        except SpecError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec: {error}")
            raise
        except SlurmError as error:
            # Not UNAVAILABLE: the controller answered; Slurm did not.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"Slurm did not answer the check of the job's units, nothing was submitted: {error}")
            raise
        return admin_pb2.SubmitJobResponse(job=actor.to_proto(), secret_path=str(secret_path))

    async def GetJob(self, request: admin_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> admin_pb2.Job:
        caller = await self._caller(context)
        return (await self._actor(context, request.job_id, caller)).to_proto()

    async def ListJobs(self, request: admin_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.ListJobsResponse:
        await self._caller(context)
        jobs = [a.to_proto() for a in self.controller.actors.values()
                if request.include_finished or not a.job.state.is_final]
        return admin_pb2.ListJobsResponse(jobs=jobs)

    async def GetJobHistory(self, request: admin_pb2.GetJobHistoryRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.JobHistory:
        caller = await self._caller(context)
        actor = await self._actor(context, request.job_id, caller)
        store = self.controller.store
        job_id = actor.job.job_id
        events = [event_to_proto(e) for e in store.events_of_kinds(job_id, HISTORY_EVENT_KINDS,
                                                                     limit=HISTORY_MAX_EVENTS)]
        # Within the message limit, with room for gRPC's own framing.
        return history_reply(job_id, actor.job.spec.global_batch, store.progress(job_id), events,
                             budget_bytes=int(self.controller.config.max_message_bytes * 0.9))

    async def ListEvents(self, request: admin_pb2.ListEventsRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.ListEventsResponse:
        caller = await self._caller(context)
        if request.job_id:
            await self._actor(context, request.job_id, caller)
        limit = request.limit if 0 < request.limit <= 10000 else 1000
        events = self.controller.store.events(request.job_id, after_sequence=request.after_sequence, limit=limit)
        return admin_pb2.ListEventsResponse(events=[event_to_proto(e) for e in events])

    async def WatchEvents(self, request: admin_pb2.ListEventsRequest,
                          context: grpc.aio.ServicerContext) -> None:
        caller = await self._caller(context)
        if request.job_id:
            await self._actor(context, request.job_id, caller)
        queue = self.controller.events.watch()
        try:
            last = request.after_sequence
            for event in self.controller.store.events(request.job_id, after_sequence=last, limit=10000):
                await context.write(event_to_proto(event))
                last = event.sequence
            while True:
                event = await queue.get()
                if event.sequence > last and (not request.job_id or event.job_id == request.job_id):
                    await context.write(event_to_proto(event))
                    last = event.sequence
        finally:
            self.controller.events.unwatch(queue)

    async def ListNodes(self, request: admin_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.ListNodesResponse:
        await self._caller(context)
        try:
            nodes = await asyncio.to_thread(lambda: default_client(timeout_s=10.0).list_nodes())
        except SlurmError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Slurm did not answer: {error}")
            raise
        where = {n: (a.job.job_id, u.unit_id) for a in self.controller.actors.values() for u in a.units.values()
                 if u.state in (UnitState.ACTIVE, UnitState.JOINING, UnitState.LEAVING) for n in u.nodes}
        response = admin_pb2.ListNodesResponse()
        response.observed_at.GetCurrentTime()
        for node in nodes:
            job_id, unit_id = where.get(node.name, ("", ""))
            response.nodes.append(admin_pb2.Node(
                name=node.name, state=node.state.value, flags=sorted(f.value for f in node.flags),
                partitions=list(node.partitions), cpus=node.cpus,
                gres=",".join(f"{g.name}:{g.count}" for g in node.gres), reason=node.reason or "",
                job_id=job_id, unit_id=unit_id))
        return response

    async def ResizeJob(self, request: admin_pb2.ResizeJobRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.Job:
        caller = await self._caller(context)
        actor = await self._actor(context, request.job_id, caller)
        if actor.job.state.is_final:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"resize refused: job {actor.job.job_id} is {actor.job.state.value}")
        spec = actor.job.spec
        new_min = request.min_replicas or spec.min_replicas
        new_max = request.max_replicas or spec.max_replicas
        if request.min_replicas < 0 or request.max_replicas < 0 or new_min < 1 or new_max < new_min:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"min_replicas {new_min} / max_replicas {new_max}: need 1 <= min <= max")
        # The new bounds must leave the job a size it may take, as a submission's must
        # (allowed_replicas 4,8 resized to 3..3 left it none, and no world ever formed).
        resized = admin_pb2.JobSpec()
        resized.CopyFrom(spec)
        resized.min_replicas, resized.max_replicas = new_min, new_max
        try:
            normalized_spec(resized)
        except SpecError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"resize refused: {error}")
        await actor.put_and_wait(ResizeRequested(request.min_replicas, request.max_replicas, caller.uid))
        self.controller.poll_soon()
        return actor.to_proto()

    async def Drain(self, request: admin_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.DrainResponse:
        caller = await self._caller(context)
        target = request.target
        job_id, slash, unit_id = target.rpartition("/")
        if target in self.controller.actors:
            actor = await self._actor(context, target, caller)
            unit_ids = tuple(actor.units)
        elif slash:
            actor = await self._actor(context, job_id, caller)
            if unit_id not in actor.units:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id} has no unit {unit_id!r}")
            unit_ids = (unit_id,)
        else:
            # Unit ids are a job's own (u1, u2, ...): a bare one names a unit only where
            # one job the caller may act on has it live.
            owners = [a for a in self.controller.actors.values() if target in a.units]
            if not owners:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no job or unit {target!r}")
            mine = [a for a in owners if caller.may_act_on(a.job.owner_uid)] or owners
            live = [a for a in mine if not a.units[target].state.is_final] or mine
            if len(live) > 1:
                choices = ", ".join(f"{a.job.job_id}/{target}" for a in live)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"unit {target} is in {len(live)} jobs: say which ({choices})")
            actor = await self._actor(context, live[0].job.job_id, caller)
            unit_ids = (target,)
        # A unit that already ended is not drained again: nothing to drain.
        unit_ids = tuple(u for u in unit_ids if not actor.units[u].state.is_final)
        await actor.put_and_wait(DrainRequested(unit_ids, caller.uid))
        return admin_pb2.DrainResponse(unit_ids=list(unit_ids))

    async def CancelJob(self, request: admin_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.Job:
        caller = await self._caller(context)
        actor = await self._actor(context, request.job_id, caller)
        await actor.put_and_wait(CancelRequested(caller.uid))
        return actor.to_proto()
