"""The job actor's live-mode decisions, driven message by message with real SQLite and
session objects (no network): who hears what, and in which order."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from tests import generations
from tidal.controller.config import ControllerConfig
from tidal.controller.events import EventLog
from tidal.controller.jobs import Connected, Disconnected, JobActor, Said, Tick
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import JobRecord, JobState
from tidal.controller.security import secret_digest
from tidal.controller.sessions import LauncherSession
from tidal.controller.spec import normalized_spec
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2, common_pb2, launcher_pb2


class Harness:
    def __init__(self, tmp_path: Path, min_replicas: int = 1, max_replicas: int = 3, **settings: object) -> None:
        self.config = ControllerConfig(state_dir=tmp_path, join_settle_s=0.0, **settings)  # type: ignore[arg-type]
        self.store = StateStore(tmp_path / "tidal.db")
        spec = normalized_spec(admin_pb2.JobSpec(name="live", min_replicas=min_replicas, max_replicas=max_replicas,
                                                 command=["train"], mode=common_pb2.JOB_MODE_LIVE))
        job = JobRecord(job_id="live-1", spec=spec, state=JobState.PENDING, owner_uid=0,
                        secret_sha256=secret_digest("s"), created_at=time.time(), updated_at=time.time())
        self.store.insert_job(job)
        self.actor = JobActor(job, [], None, generation_stopped=False, config=self.config, store=self.store,
                              events=EventLog(self.store), metrics=ControllerMetrics(), started_at=time.monotonic())
        self.sessions: dict[str, LauncherSession] = {}

    def connect(self, unit: str, port: int) -> None:
        now = time.monotonic()
        session = LauncherSession(job_id="live-1", unit_id=unit, opened_at=now, last_heartbeat_at=now,
                                  store_port=port, worker_pids=())
        self.sessions[unit] = session
        self.actor.handle(Connected(session, launcher_pb2.Register(
            job_id="live-1", unit_id=unit, secret="s", nodes=[f"node-{unit}"], address="127.0.0.1",
            store_port=port)))

    def tick(self) -> None:
        self.actor.handle(Tick())

    def say(self, unit: str, **body: object) -> None:
        self.actor.handle(Said(self.sessions[unit], launcher_pb2.LauncherMessage(**body)))
        self.actor.handle(Tick())

    def report(self, unit: str, generation: int, phase: int, step: int = 0) -> None:
        self.say(unit, generation_report=launcher_pb2.GenerationReport(generation=generation, phase=phase, step=step))

    def outbox(self, unit: str) -> list[str]:
        """What the unit was sent since last asked: 'start:E', 'reconfigure:E', 'stop:E', 'leave'."""
        said = []
        queue = self.sessions[unit].outbox
        while not queue.empty():
            said.append(generations.said(queue.get_nowait()))
        return said

    def kinds(self) -> list[str]:
        return [e.kind for e in self.store.events("live-1")]


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    h = Harness(tmp_path)
    h.connect("a", 1001)
    h.connect("b", 1002)
    h.tick()
    assert h.outbox("a") == h.outbox("b") == ["start:1"]
    return h


def test_a_grow_tells_the_joiner_first_and_the_old_world_once_it_is_ready(harness: Harness) -> None:
    harness.connect("c", 1003)
    harness.tick()
    assert harness.outbox("c") == ["reconfigure:2:a,b,c"]
    assert harness.outbox("a") == harness.outbox("b") == ["coming:2"], (
        "the old world trains on while the joiner starts, told that the change is coming")
    assert harness.actor.job.state is JobState.RUNNING and harness.actor.job.generation == 2

    harness.report("c", 2, launcher_pb2.GENERATION_PHASE_STARTED)
    assert harness.outbox("a") == harness.outbox("b") == ["reconfigure:2:a,b,c"]
    for unit in "abc":
        harness.report(unit, 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=40)
    assert harness.kinds()[-3:] == ["world_reconfiguring", "joiners_ready", "world_reconfigured"]
    assert not any(kind.startswith("generation_stop") for kind in harness.kinds()), "no survivor stopped"
    assert all(harness.outbox(unit) == [] for unit in "abc")


def test_a_leave_reconfigures_without_stopping_anyone(harness: Harness) -> None:
    harness.say("b", leave_request=launcher_pb2.LeaveRequest(generation=1, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    # The leaver hears the world it is not part of, and leaves after the agreed step.
    assert harness.outbox("a") == harness.outbox("b") == ["reconfigure:2:a"]
    harness.report("a", 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=10)
    harness.report("b", 1, launcher_pb2.GENERATION_PHASE_LEFT)
    assert "world_reconfigured" in harness.kinds() and "unit_left" in harness.kinds()
    assert not any(kind.startswith("generation_stop") for kind in harness.kinds())


def leave_messages(harness: Harness, unit: str) -> list[launcher_pb2.Generation]:
    queue = harness.sessions[unit].outbox
    messages = [queue.get_nowait() for _ in range(queue.qsize())]
    return [m.generation for m in messages if generations.said(m) == "leave"]


def test_only_the_last_member_to_leave_is_told_to_save_the_state(harness: Harness) -> None:
    harness.say("b", leave_request=launcher_pb2.LeaveRequest(generation=1, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    assert harness.outbox("a") == harness.outbox("b") == ["reconfigure:2:a"], "a keeps the state: b just leaves"
    harness.report("a", 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=10)
    harness.report("b", 1, launcher_pb2.GENERATION_PHASE_LEFT)
    assert "state_saving" not in harness.kinds()

    harness.say("a", leave_request=launcher_pb2.LeaveRequest(generation=2, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    (leave,) = leave_messages(harness, "a")
    assert leave.save_state, "a holds the last copy of the state"
    saving = [e for e in harness.store.events("live-1") if e.kind == "state_saving"]
    assert [e.unit_id for e in saving] == ["a"]


def degraded_survivor(tmp_path: Path, slurm_units: bool, release_s: float, min_replicas: int = 2) -> Harness:
    """min_replicas units train; every worker but a's dies, and a alone waits below min
    (DEGRADED)."""
    harness = Harness(tmp_path, min_replicas=min_replicas, max_replicas=4, below_min_release_s=release_s)
    harness.actor.state.slurm_units = slurm_units
    units = "abcd"[:min_replicas]
    for index, unit in enumerate(units):
        harness.connect(unit, 1001 + index)
    harness.tick()
    assert all(harness.outbox(unit) == ["start:1"] for unit in units)
    harness.actor.handle(Said(harness.sessions["b"], launcher_pb2.LauncherMessage(
        worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, signal=9))))
    for unit in units[2:]:
        harness.actor.handle(Disconnected(harness.sessions[unit], "gone"))
    harness.tick()
    assert harness.outbox("a")[:1] == ["stop:1"], "a alone is below min: it stops, keeping its state in memory"
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_STOPPED, step=30)
    assert harness.actor.job.state is JobState.DEGRADED
    return harness


def test_a_live_job_below_min_gives_its_nodes_back_after_the_release_time_and_the_last_holder_saves(
        tmp_path: Path) -> None:
    harness = degraded_survivor(tmp_path, slurm_units=True, release_s=0.2)
    harness.tick()
    assert leave_messages(harness, "a") == [], "not before below_min_release_s"
    time.sleep(0.25)
    harness.tick()
    (leave,) = leave_messages(harness, "a")
    assert leave.save_state, "a holds the only copy of the training state: it saves it as it leaves"
    released = [e for e in harness.store.events("live-1") if e.kind == "below_min_released"]
    assert len(released) == 1 and released[0].fields["units"] == "a"
    assert "state_saving" in harness.kinds()
    harness.tick()
    assert len([k for k in harness.kinds() if k == "below_min_released"]) == 1, "released once"
    assert harness.actor.state.released_below_min


def test_the_step_a_leaver_saved_the_state_at_becomes_the_jobs_step_and_the_next_worlds_target(
        tmp_path: Path) -> None:
    """The heartbeats' step lags the workers' own; the save names the step every rank
    committed, and the next world must resume there, not at the older figure."""
    harness = degraded_survivor(tmp_path, slurm_units=True, release_s=0.1)
    time.sleep(0.15)
    harness.tick()
    (leave,) = leave_messages(harness, "a")
    assert leave.save_state
    before = harness.actor.job.step
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_LEFT, step=before + 2)
    assert harness.actor.job.step == before + 2
    assert next(j for j in harness.store.jobs() if j.job_id == "live-1").step == before + 2, "on disk too"
    # A plain leave (nothing saved: step 0) never moves it back; a report from a unit no
    # longer leaving (late, repeated) never moves it on.
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_LEFT, step=0)
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_LEFT, step=before + 9)
    assert harness.actor.job.step == before + 2
    reason = harness.actor.units["a"].reason
    assert reason.startswith("released: ") and reason.endswith("; left"), "why it was asked, then how it left"


def test_a_registration_below_min_restarts_the_wait_before_the_nodes_go_back(tmp_path: Path) -> None:
    harness = degraded_survivor(tmp_path, slurm_units=True, release_s=0.3, min_replicas=3)
    time.sleep(0.2)
    harness.connect("e", 1009)  # 2 of min 3: still below, and more may be on their way
    time.sleep(0.15)
    harness.tick()
    assert harness.actor.job.state is JobState.DEGRADED
    assert "below_min_released" not in harness.kinds(), "0.35 s below min, but only 0.15 s since e registered"
    time.sleep(0.2)
    harness.tick()
    released = [e for e in harness.store.events("live-1") if e.kind == "below_min_released"]
    assert len(released) == 1 and released[0].fields["units"] == "a,e"
    (leave,) = leave_messages(harness, "a")
    assert leave.save_state and not any(m.save_state for m in leave_messages(harness, "e"))


@pytest.mark.parametrize(("slurm_units", "release_s"), [(False, 0.2), (True, 0.0)])
def test_a_live_job_below_min_holds_its_units_without_slurm_units_or_with_release_off(
        tmp_path: Path, slurm_units: bool, release_s: float) -> None:
    # Without Slurm units nobody would start the launchers again; 0 turns the release off.
    harness = degraded_survivor(tmp_path, slurm_units=slurm_units, release_s=release_s)
    time.sleep(0.25)
    harness.tick()
    assert leave_messages(harness, "a") == []
    assert "below_min_released" not in harness.kinds()


def test_a_failure_is_one_message_to_each_survivor_the_next_generation(harness: Harness) -> None:
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, signal=9))
    assert harness.outbox("b")[:1] == ["stop:1"], "the failed unit is told to kill its workers"
    assert harness.outbox("a") == ["start:2"], "no stop round first"
    assert harness.actor.job.state is JobState.RUNNING and harness.actor.job.generation == 2
    assert not any(kind.startswith("generation_stop") for kind in harness.kinds())
    assert harness.store.generation("live-1", 1)[1] is not None, "generation 1 is recorded as over"
    harness.report("a", 2, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=12)
    recovered = [e for e in harness.store.events("live-1") if e.kind == "recovered"]
    assert len(recovered) == 1 and recovered[0].fields["failed_unit"] == "b"
    assert float(recovered[0].fields["failure_to_first_step_s"]) >= 0


def test_the_survivors_first_step_ends_the_recovery_even_when_a_grow_replaced_their_world_before_it_was_heard(
        harness: Harness) -> None:
    """Seen on the mini cluster: a replacement unit registered 1.6 s after a failure, the
    grow was decided before the survivors' first step was reported, and `recovered` came
    with the next world's first step: 30 s after the failure, though the survivors had
    trained all along."""
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, signal=9))
    assert harness.outbox("a") == ["start:2"]
    harness.connect("c", 1003)
    harness.tick()
    assert harness.outbox("c") == ["reconfigure:3:a,c"], "the grow is decided before generation 2's first step"
    harness.report("a", 2, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=12)
    recovered = [e for e in harness.store.events("live-1") if e.kind == "recovered"]
    assert len(recovered) == 1, harness.kinds()
    assert recovered[0].generation == 2 and recovered[0].fields["step"] == "12"
    assert recovered[0].fields["failed_unit"] == "b" and recovered[0].fields["world_size"] == "1"
    harness.report("a", 3, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=20)
    harness.report("c", 3, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=20)
    harness.report("a", 3, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=21)
    assert [e.kind for e in harness.store.events("live-1")].count("recovered") == 1, "measured once"
    # A late first step of the broken generation itself is no recovery.
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_FIRST_STEP, step=5)
    assert [e.kind for e in harness.store.events("live-1")].count("recovered") == 1


def test_training_that_ends_while_a_grow_is_in_flight_completes_the_job(harness: Harness) -> None:
    harness.connect("c", 1003)
    harness.tick()
    assert harness.outbox("c") == ["reconfigure:2:a,b,c"]
    # The last step came before the joiner was ready: the old world's ranks exit 0.
    for unit in "ab":
        harness.say(unit, worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=1, exit_code=0))
    assert harness.actor.job.state is JobState.COMPLETED
    assert harness.outbox("c") == ["leave"]


def beat(harness: Harness, unit: str, rank: int, step: int) -> None:
    """A heartbeat naming one worker at `step` committed steps."""
    message = launcher_pb2.Heartbeat(sequence=time.monotonic_ns())
    message.sent_at.GetCurrentTime()
    worker = launcher_pb2.WorkerProgress(local_rank=0, rank=rank, pid=100 + rank, step=step)
    worker.progress_time.GetCurrentTime()
    worker.beat_time.GetCurrentTime()
    message.workers.append(worker)
    harness.actor.heartbeat(harness.sessions[unit], message)


def test_the_committed_step_follows_the_slowest_rank_and_survives_in_sqlite(harness: Harness) -> None:
    beat(harness, "a", 0, 40)
    harness.tick()
    assert harness.actor.job.step == 0, "b has not reported: nothing is known for the whole world"
    beat(harness, "b", 1, 39)
    harness.tick()
    assert harness.actor.job.step == 39
    assert harness.store.jobs()[0].step == 39


def test_a_world_with_no_state_holder_is_named_as_such_with_its_target_step(harness: Harness) -> None:
    beat(harness, "a", 0, 80)
    beat(harness, "b", 1, 80)
    harness.tick()
    assert harness.actor.job.step == 80
    # One replica dies, then the other: a fresh unit comes, and it holds nothing at step 80.
    harness.say("a", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=7, signal=9))
    assert harness.outbox("b")[-1:] == ["start:2"]
    assert harness.store.events("live-1")[-1].fields["state_holders"] == "b"
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=2, local_rank=0, pid=8, signal=9))
    assert harness.actor.job.state is JobState.DEGRADED
    harness.connect("c", 1003)
    harness.tick()
    start = None
    while not harness.sessions["c"].outbox.empty():
        message = harness.sessions["c"].outbox.get_nowait()
        if generations.said(message).startswith("start:"):
            start = message.generation
    assert start is not None and start.target_step == 80
    not_held = [e for e in harness.store.events("live-1") if e.kind == "state_not_held"]
    assert len(not_held) == 1 and not_held[0].fields["target_step"] == "80"
    harness.report("c", start.generation, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=80)
    assert harness.actor.job.state is JobState.FAILED
    assert harness.kinds()[-1] == "state_lost"


def test_after_the_last_step_exits_and_silences_are_not_failures_and_the_job_completes_once(
        harness: Harness) -> None:
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=600)
    assert harness.actor.job.state is JobState.FINISHING and harness.actor.job.step == 600
    # b's worker, finishing too, is killed (say, by a launcher that thought it frozen).
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=8, signal=9,
                                                             detail="no beat for 2.0 s"))
    assert harness.outbox("a") == [] and harness.outbox("b") == [], "no stop, no new world"
    assert "failure_detected" not in harness.kinds()
    # A unit that registers now is sent away; it never trains.
    harness.connect("c", 1003)
    harness.tick()
    assert harness.outbox("c") == ["leave"]
    harness.say("a", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=9, exit_code=0))
    assert harness.actor.job.state is JobState.COMPLETED
    completed = [e for e in harness.store.events("live-1") if e.kind == "job_completed"]
    assert len(completed) == 1
    assert completed[0].reason == "training completed at step 600; after the last step b local rank 0 killed by " \
                                  "SIGKILL (no beat for 2.0 s)"
    harness.tick()
    harness.say("c", generation_report=launcher_pb2.GenerationReport(generation=1,
                                                                     phase=launcher_pb2.GENERATION_PHASE_LEFT))
    assert [e.kind for e in harness.store.events("live-1")].count("job_completed") == 1


def restart_controller(harness: Harness, **config: float) -> None:
    """The controller restarts: a new actor from the same SQLite file; `a` comes back with
    its worker, `b` with none."""
    job = harness.store.jobs()[0]
    generation, _ = harness.store.generation(job.job_id, job.generation)
    harness.config = dataclasses.replace(harness.config, **config)
    harness.actor = JobActor(job, harness.store.units(job.job_id), generation, generation_stopped=False,
                             config=harness.config, store=harness.store, events=EventLog(harness.store),
                             metrics=ControllerMetrics(), started_at=time.monotonic())
    now = time.monotonic()
    for unit, pids in (("a", [4242]), ("b", [])):
        session = LauncherSession(job_id="live-1", unit_id=unit, opened_at=now, last_heartbeat_at=now,
                                  store_port=1, worker_pids=tuple(pids))
        harness.sessions[unit] = session
        harness.actor.handle(Connected(session, launcher_pb2.Register(
            job_id="live-1", unit_id=unit, secret="s", nodes=[f"node-{unit}"], address="127.0.0.1",
            last_generation=1, worker_pids=pids)))


def test_a_member_back_after_a_controller_restart_without_workers_gets_no_fresh_worker(harness: Harness) -> None:
    restart_controller(harness)
    # No start for b: a fresh worker would join the running world with nothing.
    assert harness.outbox("b") == [] and harness.outbox("a") == []
    # b's queued report comes next on its stream: its worker was killed while the controller was away.
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, signal=9))
    assert harness.outbox("a") == ["stop:1"]
    failure = [e for e in harness.store.events("live-1") if e.kind == "failure_detected"]
    assert len(failure) == 1 and failure[0].unit_id == "b" and "killed by SIGKILL" in failure[0].reason


def test_a_member_back_without_workers_that_says_nothing_of_them_has_failed(harness: Harness) -> None:
    restart_controller(harness, heartbeat_interval_s=0.005, heartbeat_timeout_s=0.01)
    time.sleep(0.02)
    harness.tick()
    failure = [e for e in harness.store.events("live-1") if e.kind == "failure_detected"]
    assert len(failure) == 1 and failure[0].unit_id == "b" and "no workers left" in failure[0].reason
    assert harness.outbox("a") == ["stop:1"]


def test_a_member_back_without_workers_because_training_finished_is_no_failure(harness: Harness) -> None:
    restart_controller(harness)
    harness.report("b", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=600)
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, exit_code=0))
    assert harness.actor.job.state is JobState.FINISHING
    assert "failure_detected" not in harness.kinds()


def test_a_member_back_without_workers_whose_exits_never_come_is_let_go_once_training_finished(
        harness: Harness) -> None:
    # b's exit went into the session of the controller that died: the job must not wait for
    # it for ever once a's exit 0 has finished the training.
    restart_controller(harness, heartbeat_interval_s=0.005, heartbeat_timeout_s=0.01)
    harness.say("a", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=4242, exit_code=0))
    assert harness.actor.job.state is JobState.FINISHING
    # (On a loaded machine the 0.01 s may pass before `say`'s own tick: b's leave then
    # comes with it, not with the tick after the sleep. Once, either way.)
    before = harness.outbox("b")
    time.sleep(0.02)
    harness.tick()
    assert before + harness.outbox("b") == ["leave"]
    leaving = [e for e in harness.store.events("live-1") if e.kind == "unit_leaving" and e.unit_id == "b"]
    assert len(leaving) == 1 and "never came" in leaving[0].reason
    harness.report("b", 1, launcher_pb2.GENERATION_PHASE_LEFT)
    assert harness.actor.job.state is JobState.COMPLETED
    assert "failure_detected" not in harness.kinds()


def test_a_planned_change_right_after_another_names_every_member_a_state_holder(harness: Harness) -> None:
    harness.connect("c", 1003)
    harness.tick()
    harness.report("c", 2, launcher_pb2.GENERATION_PHASE_STARTED)
    for rank, unit in enumerate("abc"):
        beat(harness, unit, rank, 38)
    # The ranks moved at step 40; the heartbeats still say 38 (they are up to a second old).
    for unit in "abc":
        harness.report(unit, 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=40)
    harness.say("c", leave_request=launcher_pb2.LeaveRequest(generation=2, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    reconfiguring = [e for e in harness.store.events("live-1") if e.kind == "world_reconfiguring"][-1]
    assert reconfiguring.fields["state_holders"] == "a,b"
    assert "state_not_held" not in harness.kinds()


def test_a_worker_that_refuses_to_train_fails_the_job_not_its_unit(harness: Harness) -> None:
    harness.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=9, exit_code=75))
    assert harness.actor.job.state is JobState.FAILED
    assert harness.kinds()[-1] == "state_lost" and "failure_detected" not in harness.kinds()


def test_a_late_state_lost_does_not_fail_a_job_past_its_last_step(harness: Harness) -> None:
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=600)
    harness.report("b", 1, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=600)
    assert harness.actor.job.state is JobState.FINISHING


def test_a_leaving_member_saves_when_the_others_hold_no_state_by_their_heartbeats(tmp_path: Path) -> None:
    """min 2: a and b train to step 40; b's workers then report no state (a joiner whose
    workers never formed a world looks like this). When a leaves, b cannot keep the state:
    a is told to save it."""
    harness = Harness(tmp_path, min_replicas=2)
    harness.connect("a", 1001)
    harness.connect("b", 1002)
    harness.tick()
    beat(harness, "a", 0, 40)
    beat(harness, "b", 1, 40)
    harness.tick()
    assert harness.actor.job.step == 40
    beat(harness, "b", 1, 0)
    harness.tick()
    harness.say("a", leave_request=launcher_pb2.LeaveRequest(generation=1, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED))
    (leave,) = leave_messages(harness, "a")
    assert leave.save_state, "b holds nothing at step 40: a's state is the last copy"


def heartbeat_of(harness: Harness, unit: str, generation: int, rank: int, step: int, samples: int, loss: float | None,
         sequence: int) -> None:
    worker = launcher_pb2.WorkerProgress(local_rank=0, rank=rank, pid=100 + rank, step=step, samples=samples)
    worker.progress_time.GetCurrentTime()
    worker.beat_time.GetCurrentTime()
    if loss is not None:
        worker.loss = loss
    message = launcher_pb2.Heartbeat(sequence=sequence, workers=[worker])
    message.sent_at.GetCurrentTime()
    harness.actor.heartbeat(harness.sessions[unit], message)


def test_the_history_follows_the_world_that_trains_not_a_joiner_still_starting(harness: Harness) -> None:
    """While a grow is in flight the old world trains on: the history keeps its size, its
    step and its loss; the joiner's standby workers (step 0, no loss) change nothing."""
    for unit in "ab":
        harness.report(unit, 1, launcher_pb2.GENERATION_PHASE_STARTED)

    def sample_after(sequence: int, step: int, samples: int, loss: float) -> tuple[object, ...]:
        for rank, unit in enumerate("ab"):
            heartbeat_of(harness, unit, 1, rank, step=step, samples=samples, loss=loss, sequence=sequence)
        harness.actor.last_progress = None  # (a sample now, whatever the interval)
        harness.tick()
        kept = harness.actor.last_progress
        assert kept is not None
        return kept.world_size, kept.step, kept.samples, kept.loss

    assert sample_after(1, step=40, samples=1280, loss=0.5) == (2, 40, 1280, 0.5)
    harness.connect("c", 1003)
    harness.tick()
    assert harness.outbox("c") == ["reconfigure:2:a,b,c"], "the grow is in flight"
    heartbeat_of(harness, "c", 2, 2, step=0, samples=0, loss=None, sequence=1)
    assert sample_after(2, step=44, samples=1408, loss=0.25) == (2, 44, 1408, 0.25)
    kept = harness.store.progress("live-1")
    assert [(s.world_size, s.step) for s in kept][-2:] == [(2, 40), (2, 44)]


def test_after_a_restart_cut_a_grow_short_the_old_world_finishing_completes_the_job_and_sends_the_joiner_away(
        harness: Harness) -> None:
    """Sharded chaos seed 302, through SQLite: c joins, generation 2 (the grow) is committed,
    and the controller restarts before c is ready. The restarted controller reads generation
    1 back as the world before it: a and b commit the last step there and exit 0, c is sent
    away, and the job completes (it stayed FINISHING, waiting for c)."""
    harness.connect("c", 1003)
    harness.tick()
    assert harness.actor.job.generation == 2
    job = harness.store.jobs()[0]
    generation, _ = harness.store.generation(job.job_id, job.generation)
    harness.actor = JobActor(job, harness.store.units(job.job_id), generation, generation_stopped=False,
                             config=harness.config, store=harness.store, events=EventLog(harness.store),
                             metrics=ControllerMetrics(), started_at=time.monotonic())
    now = time.monotonic()
    for unit, last, pids in (("a", 1, [4242]), ("b", 1, [4343]), ("c", 2, [4444])):
        session = LauncherSession(job_id="live-1", unit_id=unit, opened_at=now, last_heartbeat_at=now,
                                  store_port=1, worker_pids=tuple(pids))
        harness.sessions[unit] = session
        harness.actor.handle(Connected(session, launcher_pb2.Register(
            job_id="live-1", unit_id=unit, secret="s", nodes=[f"node-{unit}"], address="127.0.0.1",
            last_generation=last, worker_pids=pids)))
    for unit in "abc":
        harness.outbox(unit)
    harness.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=600)
    assert harness.actor.job.state is JobState.FINISHING
    assert harness.outbox("c") == ["leave"] and harness.outbox("a") == [] and harness.outbox("b") == []
    for unit, pid in (("a", 4242), ("b", 4343)):
        harness.say(unit, worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=pid, exit_code=0))
    assert harness.actor.job.state is JobState.COMPLETED
    assert harness.kinds().count("job_completed") == 1
