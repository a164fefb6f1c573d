"""The job's state machine, driven through its public functions only: `restore`,
`transition`, `refusal` and the queries, with an injected clock. No SQLite, no sockets, no
asyncio: what a transition decides is in the state it returns and the effects it lists."""

from __future__ import annotations

import copy
import dataclasses
from datetime import UTC, datetime

from tests import generations
from tidal.controller.config import ControllerConfig
from tidal.controller.core import job as core
from tidal.controller.model import JobRecord, JobState, UnitState
from tidal.controller.spec import normalized_spec
from tidal.proto import admin_pb2, common_pb2, launcher_pb2
from tidal.proto.control import EXIT_STATE_LOST
from tidal.slurm.models import Job as SlurmJob
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.models import Node, NodeFlag, NodeState
from tidal.slurm.snapshot import ClusterView

CONFIG = ControllerConfig(join_settle_s=0.0, scale_up_snooze_s=0.0, heartbeat_timeout_s=3.0,
                          reconnect_grace_s=10.0)


class Driver:
    """A job's state and a clock; each call is one transition, its effects kept."""

    def __init__(self, *, mode: int = common_pb2.JOB_MODE_LIVE, min_replicas: int = 2, max_replicas: int = 3,
                 slurm_units: bool = False, config: ControllerConfig = CONFIG) -> None:
        spec = normalized_spec(admin_pb2.JobSpec(name="j", command=["train"], mode=mode, min_replicas=min_replicas,
                                                 max_replicas=max_replicas))
        job = JobRecord(job_id="j-1", spec=spec, state=JobState.PENDING, owner_uid=0, secret_sha256="")
        self.clock = 100.0
        self.state = core.restore(job, [], None, generation_stopped=False, pending={}, config=config,
                                  now=self.now, slurm_units=slurm_units)
        self.effects: list[core.Effect] = []
        self.links: dict[str, core.Link] = {}

    @property
    def now(self) -> core.Now:
        return core.Now(monotonic=self.clock, wall=1_700_000_000.0 + self.clock)

    def feed(self, event: core.Input) -> list[core.Effect]:
        given = self.state
        before = copy.deepcopy(given)
        self.state, effects = core.transition(given, event, self.now)
        assert given == before, f"the transition changed the state it was given ({type(event).__name__})"
        self.effects.extend(effects)
        return effects

    def connect(self, unit: str, port: int = 0, *, last_generation: int = 0, workers: tuple[int, ...] = (),
                node: str = "") -> None:
        self.feed(core.LauncherConnected(unit, launcher_pb2.Register(
            job_id="j-1", unit_id=unit, nodes=[node or f"node-{unit}"], address="127.0.0.1",
            store_port=port or 1000 + ord(unit[-1]), last_generation=last_generation, worker_pids=list(workers))))
        self.links[unit] = core.Link(last_heartbeat_at=self.clock)

    def beat(self, unit: str, *steps: int) -> None:
        """A heartbeat of `unit` saying its ranks' last steps (the next tick carries it)."""
        generation = self.state.generation
        assert generation is not None
        member = generation.member(unit)
        first = member.first_rank if member is not None else 0
        self.links[unit] = core.Link(last_heartbeat_at=self.clock,
                                     progress_at={first + i: self.clock for i in range(len(steps))},
                                     steps={first + i: s for i, s in enumerate(steps)})

    def tick(self, seconds: float = 0.0) -> list[core.Effect]:
        self.clock += seconds
        return self.feed(core.ClockTick(dict(self.links)))

    def say(self, unit: str, **body: object) -> list[core.Effect]:
        return self.feed(core.LauncherSaid(unit, launcher_pb2.LauncherMessage(**body)))  # type: ignore[arg-type]

    def report(self, unit: str, generation: int, phase: int, step: int = 0,
               replica_workers: int = 0) -> list[core.Effect]:
        return self.say(unit, generation_report=launcher_pb2.GenerationReport(
            generation=generation, phase=phase, step=step, replica_workers=replica_workers))

    def exit(self, unit: str, generation: int, code: int, local_rank: int = 0, signal: int = 0) -> list[core.Effect]:
        return self.say(unit, worker_exited=launcher_pb2.WorkerExited(generation=generation, local_rank=local_rank,
                                                                      pid=4000, exit_code=code, signal=signal))

    def events(self, since: list[core.Effect] | None = None) -> list[str]:
        return [e.kind for e in (self.effects if since is None else since) if isinstance(e, core.Record)]

    def event(self, kind: str) -> core.Record:
        return next(e for e in reversed(self.effects) if isinstance(e, core.Record) and e.kind == kind)


def sent(effects: list[core.Effect], unit: str | None = None) -> list[str]:
    """Messages in `effects` (to `unit`), as 'start:G', 'stop:G', 'reconfigure:G', 'leave'."""
    said = []
    for effect in effects:
        if not isinstance(effect, core.Send) or (unit is not None and effect.unit_id != unit):
            continue
        # (Members are named only in the live-mode tests: here, the kind and the number.)
        said.append(":".join(generations.said(effect.message).split(":")[:2]))
    return said


def formed(driver: Driver, *units: str) -> None:
    for unit in units:
        driver.connect(unit)
    driver.tick()
    assert driver.state.job.state is JobState.RUNNING and driver.state.generation is not None
    assert driver.state.generation.unit_ids == units


def test_a_transition_leaves_the_state_it_was_given_as_it_was() -> None:
    driver = Driver()
    driver.connect("a")
    driver.connect("b")
    before = copy.deepcopy(driver.state)
    new, effects = core.transition(driver.state, core.ClockTick(dict(driver.links)), driver.now)
    assert new.job.state is JobState.RUNNING and sent(effects) == ["start:1", "start:1"]
    assert driver.state == before, "the state passed in was changed"
    assert driver.state.job.state is JobState.PENDING


def test_a_generation_is_persisted_in_the_same_transition_that_sends_it() -> None:
    driver = Driver()
    driver.connect("a")
    driver.connect("b")
    effects = driver.tick()
    saved = [e for e in effects if isinstance(e, core.SaveGeneration)]
    assert [s.generation.number for s in saved] == [1]
    assert [e.job.generation for e in effects if isinstance(e, core.SaveJob)] == [1]
    assert {e.unit.unit_id for e in effects if isinstance(e, core.SaveUnit)} == {"a", "b"}
    # The runtime applies every persistent effect, in one transaction, before any other.
    assert sent(effects) == ["start:1", "start:1"]


def test_the_watermark_rises_with_the_slowest_rank_and_names_the_holders_of_the_next_generation() -> None:
    driver = Driver()
    formed(driver, "a", "b")
    driver.beat("a", 40)
    driver.beat("b", 38)
    driver.tick(1.0)
    assert driver.state.job.step == 38, "the committed step is the lowest every rank reports"
    driver.beat("b", 41)
    driver.tick(1.0)
    assert driver.state.job.step == 40
    driver.connect("c")
    effects = driver.tick()
    assert sent(effects, "c") == ["reconfigure:2"]
    reconfigure = next(e.message.generation for e in effects if isinstance(e, core.Send))
    assert reconfigure.target_step == 40
    fields = driver.event("world_reconfiguring").fields
    assert fields is not None and fields["target_step"] == 40 and fields["state_holders"] == "a,b"


def test_a_live_generation_that_holds_no_state_says_so_and_a_worker_that_finds_none_fails_the_job() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a")
    driver.beat("a", 25)
    driver.tick(1.0)
    assert driver.state.job.step == 25
    # The only member dies; a fresh unit comes: it holds nothing at step 25.
    driver.exit("a", 1, code=1)
    assert driver.state.units["a"].state is UnitState.FAILED
    driver.connect("b")
    effects = driver.tick()
    assert sent(effects, "b") == ["start:2"]
    assert "state_not_held" in driver.events(effects)
    start = next(e.message.generation for e in effects if isinstance(e, core.Send))
    assert start.target_step == 25 and driver.event("world_formed").fields["state_holders"] == "-"
    # Its worker finds no checkpoint: the job fails loudly, and never trains from step 0.
    effects = driver.report("b", 2, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=25)
    assert driver.state.job.state is JobState.FAILED
    assert driver.events(effects)[0] == "state_lost"


def test_a_state_lost_of_an_older_generation_does_not_fail_the_job_training_in_a_newer_one() -> None:
    """a and b hold step 25 in generation 1; a dies and b trains on in generation 2 with the
    state. A report of state lost, and a worker's exit saying so, that name generation 1
    (late: queued while the controller was away, say) are stale, as any other message of an
    older generation: the job used to fail on them. A state truly lost is reported again by
    the workers of the generation that lacks it, and that still fails the job."""
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    driver.beat("a", 25)
    driver.beat("b", 25)
    driver.tick(1.0)
    driver.exit("a", 1, code=1)
    generation = driver.state.generation
    assert generation is not None and generation.number == 2 and generation.unit_ids == ("b",)
    effects = driver.report("b", 1, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=25)
    assert driver.state.job.state is JobState.RUNNING and core.StaleMessageCounted() in effects
    effects = driver.exit("b", 1, code=EXIT_STATE_LOST)
    assert driver.state.job.state is JobState.RUNNING and core.StaleMessageCounted() in effects
    assert "state_lost" not in driver.events()
    driver.report("b", 2, launcher_pb2.GENERATION_PHASE_STATE_LOST, step=25)
    assert driver.state.job.state is JobState.FAILED and driver.events()[-1] == "state_lost"


def test_resuming_from_a_checkpoint_lowers_the_watermark_with_an_event_naming_the_steps_redone() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a")
    driver.beat("a", 30)
    driver.tick(1.0)
    driver.report("a", 1, launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT, step=20)
    assert driver.state.job.step == 20
    fields = driver.event("resumed_from_checkpoint").fields
    assert fields == {"checkpoint_step": 20, "target_step": 30, "steps_redone": 10}


def test_a_resumed_from_checkpoint_report_of_an_older_generation_leaves_the_watermark_where_it_is() -> None:
    """b resumed generation 1 from its checkpoint at step 10 and said so; its stream broke
    (a failure: generation 2 forms) and its launcher, not sure the report was taken, says it
    again in its next session, after the world trained on to step 40. That report is of a
    world already replaced: the watermark stayed at 40 for the next world's target, and no
    second resumed_from_checkpoint claimed 30 steps redone (it went back to 10)."""
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    driver.report("b", 1, launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT, step=10)
    driver.exit("a", 1, code=1)
    generation = driver.state.generation
    assert generation is not None and generation.number == 2 and generation.unit_ids == ("b",)
    driver.beat("b", 40)
    driver.tick(1.0)
    assert driver.state.job.step == 40
    effects = driver.report("b", 1, launcher_pb2.GENERATION_PHASE_RESUMED_FROM_CHECKPOINT, step=10)
    assert driver.state.job.step == 40 and core.StaleMessageCounted() in effects
    assert "resumed_from_checkpoint" not in driver.events(effects)
    driver.connect("c")
    start = next(e.message.generation for e in driver.tick() if isinstance(e, core.Send))
    assert start.target_step == 40


def start_of(effects: list[core.Effect], unit: str) -> launcher_pb2.StartGeneration:
    return next(e.message.generation for e in effects
                if isinstance(e, core.Send) and e.unit_id == unit
                and generations.change_kind(e.message.generation) == "start")


def test_a_failure_in_restart_mode_is_one_message_to_each_survivor_that_stops_and_restarts_it() -> None:
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=2)
    formed(driver, "a", "b", "c")
    effects = driver.exit("b", 1, code=137)
    assert driver.state.units["b"].state is UnitState.FAILED
    assert sent(effects, "b") == ["stop:1"] and any(isinstance(e, core.Close) and e.unit_id == "b" for e in effects)
    assert sent(effects, "a") == sent(effects, "c") == ["start:2"], "one message each, no stop round"
    assert driver.state.job.state is JobState.RUNNING and driver.state.stopping is None
    start = start_of(effects, "c")
    assert start.stop_grace.ToNanoseconds() / 1e9 == CONFIG.failure_stop_grace_s
    # Generation 1 met at a's store, still in use by its workers until they stop: the next
    # one meets at a store nobody used yet.
    assert start.rendezvous.host_unit_id == "c"
    assert "generation_stopping" not in driver.events(effects)
    # a's STARTED names its fresh store: from then on it can host again.
    driver.say("a", generation_report=launcher_pb2.GenerationReport(generation=2,
                                                                    phase=launcher_pb2.GENERATION_PHASE_STARTED,
                                                          store_port=7777))
    assert driver.state.units["a"].facts.store_port == 7777


def test_each_survivor_of_a_restart_mode_failure_gets_the_world_and_its_own_assignment_only() -> None:
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=2, max_replicas=4)
    formed(driver, "a", "b", "c", "d")
    effects = driver.exit("b", 1, code=1)
    generation = driver.state.generation
    assert generation is not None and generation.number == 2
    told = {e.unit_id: e.message.generation for e in effects if isinstance(e, core.Send) and e.unit_id != "b"}
    assert sorted(told) == ["a", "c", "d"]
    for unit, message in told.items():
        member = generation.member(unit)
        assert member is not None
        assert (message.generation, message.rank_table.world_size, message.rank_table.groups) == (2, 3, 3)
        assert [(a.unit_id, a.group_rank, a.first_rank, list(a.nodes)) for a in message.rank_table.assignments] == [
            (unit, member.group_rank, member.first_rank, [f"node-{unit}"])], "its own assignment, no other"
        assert message.rendezvous == told["a"].rendezvous and message.rendezvous.host_unit_id in told
        assert message.stop_grace.ToNanoseconds() / 1e9 == CONFIG.failure_stop_grace_s
        assert message.reason == told["a"].reason and "unit b failed" in message.reason
    assert sorted(member.group_rank for member in generation.members) == [0, 1, 2]


def test_restart_mode_grows_and_leaves_with_one_message_each() -> None:
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=3)
    formed(driver, "a", "b")
    driver.connect("c")
    effects = driver.tick()
    assert sent(effects) == ["start:2", "start:2", "start:2"] and driver.state.stopping is None
    assert start_of(effects, "a").stop_grace.ToNanoseconds() / 1e9 == CONFIG.restart_grace_s
    effects = driver.feed(core.DrainRequested(("b",), uid=0))
    assert sent(effects, "b") == ["leave"] and sent(effects, "a") == sent(effects, "c") == ["start:3"]
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "c")


def test_a_survivor_that_never_confirms_a_stop_round_fails_at_the_deadline() -> None:
    # Two survivors of three make no size the job allows: the generation is stopped first.
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1)
    driver.state.job.spec.allowed_replicas[:] = [1, 3]
    formed(driver, "a", "b", "c")
    effects = driver.exit("b", 1, code=1)
    assert sent(effects, "a") == sent(effects, "c") == ["stop:1"]
    # (A launcher's reports name the store its next generation would meet at.)
    driver.say("a", generation_report=launcher_pb2.GenerationReport(generation=1,
                                                                    phase=launcher_pb2.GENERATION_PHASE_STOPPED,
                                                          store_port=2001))
    assert driver.state.job.state is JobState.RECONFIGURING, "one survivor has not confirmed yet"
    driver.links.pop("b")
    effects = driver.tick(CONFIG.restart_grace_s + CONFIG.heartbeat_timeout_s + CONFIG.reconnect_grace_s + 1)
    assert driver.state.units["c"].state is UnitState.FAILED
    assert driver.state.job.state is JobState.RUNNING and driver.state.generation is not None
    assert driver.state.generation.unit_ids == ("a",)
    assert "start:2" in sent(effects, "a")
    assert driver.events(effects)[-2:] == ["generation_stopped", "world_formed"]


def test_silence_of_heartbeats_past_the_timeout_fails_the_unit_and_nothing_earlier() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    driver.clock += CONFIG.reconnect_grace_s + 1
    driver.links = {u: core.Link(last_heartbeat_at=driver.clock) for u in "ab"}
    driver.tick(CONFIG.heartbeat_timeout_s - 0.5)
    assert driver.state.units["b"].state is UnitState.ACTIVE
    driver.links["a"] = core.Link(last_heartbeat_at=driver.clock)
    effects = driver.tick(1.0)
    assert driver.state.units["b"].state is UnitState.FAILED
    assert driver.event("failure_detected").fields == {"cause": "heartbeat"}
    assert core.FailureCounted("heartbeat") in effects


def test_a_leave_during_a_live_change_waits_for_it_and_is_persisted_meanwhile() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    driver.connect("c")
    driver.tick()
    assert driver.state.changing is not None
    effects = driver.feed(core.DrainRequested(("a",), uid=0))
    assert driver.state.deferred_leaves == {"a": ("drained", "drained by uid 0")}
    assert core.SavePending("deferred_leaves", {"a": ["drained", "drained by uid 0"]}) in effects
    assert driver.state.units["a"].state is UnitState.ACTIVE
    driver.report("c", 2, launcher_pb2.GENERATION_PHASE_STARTED)
    for unit in "abc":
        effects = driver.report(unit, 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=7)
    assert driver.state.units["a"].state is UnitState.LEAVING
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("b", "c")
    assert "world_reconfigured" in driver.events(effects) and "unit_leaving" in driver.events(effects)


def test_a_leave_deferred_behind_a_change_that_a_stop_replaced_is_carried_out_when_the_stop_ends() -> None:
    """min 3: a, b and c train; d joins (a live change in flight) and b is drained, which
    waits for the change. a fails, then c: the change is replaced by a stop, and b and d
    alone form no world. b used to stay active with its leave deferred for as long as the
    job waited (its node held, the drain never done), and to be put in the next world
    that formed. The stop done, b is told to leave, and the next world forms without it."""
    driver = Driver(min_replicas=3, max_replicas=4)
    formed(driver, "a", "b", "c")
    for unit in "abc":
        driver.beat(unit, 25)
    driver.tick(1.0)
    driver.connect("d")
    driver.tick()
    assert driver.state.changing is not None
    driver.feed(core.DrainRequested(("b",), uid=0))
    assert driver.state.deferred_leaves == {"b": ("drained", "drained by uid 0")}
    driver.exit("a", 1, code=1)
    assert driver.state.stopping is not None
    driver.feed(core.LauncherClosed("c", "connection lost"))
    driver.links.pop("c")
    effects: list[core.Effect] = []
    for unit in "bd":
        effects += driver.report(unit, 2, launcher_pb2.GENERATION_PHASE_STOPPED)
    assert driver.state.stopping is None and driver.state.job.state is JobState.DEGRADED
    assert driver.state.units["b"].state is UnitState.LEAVING and sent(effects, "b") == ["leave"]
    assert driver.state.deferred_leaves == {}
    # (It held the last copy of the state: it saved it as it left, and the next world resumes from it.)
    driver.report("b", 2, launcher_pb2.GENERATION_PHASE_LEFT, step=25)
    driver.connect("e")
    driver.connect("f")
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None and generation.number == 3 and generation.unit_ids == ("d", "e", "f")


def test_a_restart_resumes_deferred_leaves_and_node_cool_downs() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    job = dataclasses.replace(driver.state.job)
    units = list(driver.state.units.values())
    wall = driver.now.wall
    pending = {"deferred_leaves": {"b": ["drained", "by uid 0"]}, "node_cooldown": {"node-x": [2, wall + 50.0]}}
    later = core.Now(monotonic=5.0, wall=wall + 10.0)
    restored = core.restore(job, units, driver.state.generation, generation_stopped=False, pending=pending,
                            config=CONFIG, now=later, slurm_units=True)
    assert restored.deferred_leaves == {"b": ("drained", "by uid 0")}
    assert restored.excluded_nodes(later.monotonic) == ("node-x",)
    assert restored.excluded_nodes(later.monotonic + 41.0) == ()


def test_completion_happens_once_after_the_last_step_and_late_exits_are_no_failure() -> None:
    driver = Driver(min_replicas=2)
    formed(driver, "a", "b")
    effects = driver.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=599)
    assert driver.state.job.state is JobState.FINISHING and driver.state.job.step == 599
    assert driver.events(effects) == ["job_finishing"]
    # A silenced worker of b after the last step is no failure, and nothing re-forms.
    driver.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=1, exit_code=0, signal=9,
                                                            detail="no beat for 2 s (frozen)"))
    assert driver.state.units["b"].state is UnitState.ACTIVE and "failure_detected" not in driver.events()
    assert driver.state.job.state is JobState.FINISHING
    effects = driver.exit("a", 1, code=0)
    assert driver.state.job.state is JobState.COMPLETED
    assert driver.events(effects)[-1:] == ["job_completed"] or "job_completed" in driver.events(effects)
    reason = driver.event("job_completed").reason
    assert "killed by SIGKILL" in reason
    # Anything later changes nothing.
    driver.exit("b", 1, code=1)
    driver.tick(100.0)
    assert driver.events().count("job_completed") == 1 and driver.state.job.state is JobState.COMPLETED


def test_a_finishing_member_whose_launcher_falls_silent_with_its_session_open_does_not_keep_the_job_finishing(
) -> None:
    """a commits the last step and its worker exits 0; b's launcher then stops heartbeating
    (its loop stuck, say on a hung file system) while its session stays open, and its
    workers never report an exit. The job used to stay FINISHING for ever: after the last
    step only a closed session was judged. Past heartbeat_timeout_s + reconnect_grace_s of
    silence, b counts as gone (as a closed session does after its grace), its session is
    closed, and the job completes, once."""
    driver = Driver(min_replicas=2)
    formed(driver, "a", "b")
    driver.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=599)
    driver.exit("a", 1, code=0)
    assert driver.state.job.state is JobState.FINISHING
    silent_since = driver.clock
    driver.links["b"] = core.Link(last_heartbeat_at=silent_since)
    while driver.clock - silent_since <= CONFIG.heartbeat_timeout_s + CONFIG.reconnect_grace_s - 1.0:
        driver.links["a"] = core.Link(last_heartbeat_at=driver.clock)
        driver.tick(1.0)
    assert driver.state.job.state is JobState.FINISHING, "no sooner than a closed session's grace"
    effects: list[core.Effect] = []
    for _ in range(3):
        effects += driver.tick(1.0)
    assert driver.state.job.state is JobState.COMPLETED
    assert driver.state.units["b"].state is UnitState.LEFT and "no heartbeat" in driver.state.units["b"].reason
    assert any(isinstance(e, core.Close) and e.unit_id == "b" for e in effects)
    driver.tick(1.0)
    assert driver.events().count("job_completed") == 1


def test_the_last_step_committed_in_the_old_world_of_a_grow_a_restart_cut_short_completes_without_the_joiners() -> None:
    """Sharded chaos seed 302: a and b train in generation 1; c joins and generation 2 (the
    grow, target step 40) is committed and sent; the controller restarts before the change
    is done, so it knows generation 2 only. a and b commit the last step in generation 1 and
    exit 0. c never trained: it is told to leave, and the job completes. It used to wait for
    c as a member of the finished world, FINISHING until it was cancelled."""
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b")
    first = driver.state.generation
    for unit in "ab":
        driver.beat(unit, 40)
    driver.tick(0.25)
    driver.connect("c")
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None and generation.number == 2 and driver.state.changing is not None
    assert generation.unit_ids == ("a", "b", "c") and generation.resume_step == 40
    # (SQLite holds every generation; the restarted controller is given the one before.)
    driver.state = core.restore(dataclasses.replace(driver.state.job), list(driver.state.units.values()), generation,
                                generation_stopped=False, pending={}, config=CONFIG, now=driver.now, previous=first)
    for unit in "abc":
        driver.connect(unit, last_generation=1 if unit != "c" else 2, workers=(4000,))
    # No heartbeat since the restart yet: a and b are the finished world by its record.
    effects = driver.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=60)
    assert driver.state.job.state is JobState.FINISHING
    assert sent(effects, "c") == ["leave"], "c was never in the world that finished"
    driver.exit("a", 1, code=0)
    driver.exit("b", 1, code=0)
    assert driver.state.job.state is JobState.COMPLETED, driver.events()


def test_a_unit_that_registers_after_the_last_step_is_sent_away() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a")
    driver.report("a", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=9)
    driver.connect("b")
    assert driver.state.units["b"].state is UnitState.LEAVING
    assert sent(driver.effects, "b") == ["leave"]
    assert driver.state.generation is not None and driver.state.generation.number == 1


def node(name: str) -> Node:
    return Node(name=name, state=NodeState.IDLE, flags=frozenset(), partitions=("train",), cpus=4, gres=(),
                features=(), reason="")


def slurm_job(job_id: int, state: SlurmJobState, *, preempted: bool = False) -> SlurmJob:
    at = datetime(2026, 11, 23, tzinfo=UTC)
    return SlurmJob(job_id=job_id, name=f"tidal-j-1-u{job_id}", user="u", state=state, flags=frozenset(),
                    partition="train", nodes=(), node_count=1, priority=1, submit_time=at, start_time=at,
                    end_time=None, preempt_time=at if preempted else None, requeue_count=0, reason="")


def view(driver: Driver, nodes: tuple[Node, ...], jobs: tuple[SlurmJob, ...] = ()) -> ClusterView:
    return ClusterView(nodes=nodes, jobs=jobs, observed_at=driver.now.wall, stale=False)


def test_slurm_units_are_submitted_to_min_replicas_and_a_node_is_avoided_after_a_second_failure() -> None:
    """A worker killed while its launcher stays healthy does not exclude its node at once
    (torchrun restarts in place): the replacement may go there. A second failure there
    within node_cooldown_s excludes it, and the next replacement is submitted without it."""
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True)
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    submits = [e for e in effects if isinstance(e, core.Submit)]
    assert [s.unit_id for s in submits] == ["u1", "u2"] and all(s.excluded == () for s in submits)
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.feed(core.UnitSubmitted("u2", 502))
    for unit in ("u1", "u2"):
        driver.connect(unit)
    driver.tick()
    assert driver.state.job.state is JobState.RUNNING
    # (Exit 137: killed by SIGKILL under a wrapper, as its launcher reports it.)
    effects = driver.exit("u2", 1, code=137)
    assert core.CancelInSlurm("u2", 502) in effects
    assert driver.state.excluded_nodes(driver.clock) == ()
    assert driver.event("node_suspect").fields["node"] == "node-u2"
    driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_STOPPED)
    assert driver.state.job.state is JobState.DEGRADED
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    replacement = [e for e in effects if isinstance(e, core.Submit)]
    assert [(s.unit_id, s.excluded) for s in replacement] == [("u3", ())]

    # Slurm puts the replacement on the same node, and its worker is killed there too.
    driver.feed(core.UnitSubmitted("u3", 503))
    driver.tick(5.0)
    driver.connect("u3", node="node-u2")
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None and generation.member("u3") is not None
    driver.feed(core.LauncherSaid("u3", launcher_pb2.LauncherMessage(worker_exited=launcher_pb2.WorkerExited(
        generation=generation.number, local_rank=0, pid=4001, signal=9))))
    assert driver.state.excluded_nodes(driver.clock) == ("node-u2",)
    assert driver.event("node_excluded").fields == {"node": "node-u2", "failures": 1,
                                                    "for_s": f"{CONFIG.node_cooldown_s:.0f}"}
    report = driver.state.generation
    assert report is not None
    driver.report("u1", report.number, launcher_pb2.GENERATION_PHASE_STOPPED)
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    assert [(s.unit_id, s.excluded) for s in effects if isinstance(s, core.Submit)] == [("u4", ("node-u2",))]


def test_a_unit_whose_sbatch_answer_was_never_recorded_is_named_by_its_slurm_job_when_it_registers() -> None:
    """The controller stopped between sbatch's answer and its unit_submitted record (a
    restart mid-grow): the launcher's registration says the Slurm job it runs in, and the
    timeline names it there, as `tidal events` readers match units to squeue."""
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True)
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u1", "u2"]
    driver.feed(core.UnitSubmitted("u1", 501))
    # No UnitSubmitted for u2: its launcher alone says where it runs.
    driver.connect("u1")
    assert driver.event("unit_registered").fields["slurm_job_id"] == "501"
    driver.feed(core.LauncherConnected("u2", launcher_pb2.Register(
        job_id="j-1", unit_id="u2", nodes=["n2"], address="127.0.0.1", store_port=1002, slurm_job_id=502)))
    registered = driver.event("unit_registered")
    assert registered.unit_id == "u2" and registered.fields["slurm_job_id"] == "502"
    assert driver.state.units["u2"].slurm_job_id == 502


def test_a_unit_whose_sbatch_answer_was_lost_and_whose_job_never_ran_is_lost_on_a_later_view_only() -> None:
    """sbatch timed out and slurmctld had not taken the job: a view taken before the answer
    was lost proves nothing; the first one after it, without the job, loses the unit, and a
    replacement follows once the submission backoff is over."""
    driver = Driver(min_replicas=1, max_replicas=1, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    before = view(driver, (node("n1"),))
    driver.feed(core.UnitSubmitted("u1", 0, "sbatch --parsable: no answer within 10s", answer_lost=True))
    assert driver.state.units["u1"].state is UnitState.SUBMITTED
    assert "no answer within 10s" in driver.event("unit_submit_unanswered").reason
    assert not [e for e in driver.feed(core.SlurmObserved(before)) if isinstance(e, core.Submit)]
    assert driver.state.units["u1"].state is UnitState.SUBMITTED
    driver.clock += 2.0
    driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    assert driver.state.units["u1"].state is UnitState.FAILED
    assert driver.state.units["u1"].reason == "no Slurm job tidal-j-1-u1: sbatch's answer was lost, and none ran"
    driver.clock += 60.0
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u2"]


def test_a_cancel_slurm_did_not_answer_is_made_again_once_per_failure_and_a_refused_one_is_not() -> None:
    driver = Driver(min_replicas=1, max_replicas=1, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.clock += 2.0
    running = view(driver, (node("n1"),), (slurm_job(501, SlurmJobState.RUNNING),))

    def cancels(effects: list[core.Effect]) -> list[core.CancelInSlurm]:
        return [e for e in effects if isinstance(e, core.CancelInSlurm)]

    driver.feed(core.CancelFailed("u1", 501, "scancel 501: exit 1: Access/permission denied"))
    assert driver.event("unit_cancel_failed").reason.endswith("not asked again")
    assert cancels(driver.feed(core.SlurmObserved(running))) == []
    driver.feed(core.CancelFailed("u1", 501, "scancel 501: no answer within 10s", unanswered=True))
    stale = dataclasses.replace(running, stale=True)
    assert cancels(driver.feed(core.SlurmObserved(stale))) == []
    assert cancels(driver.feed(core.SlurmObserved(running))) == [core.CancelInSlurm("u1", 501)]
    assert cancels(driver.feed(core.SlurmObserved(running))) == [], "made again once per failure"
    driver.feed(core.CancelFailed("u1", 501, "scancel 501: no answer within 10s", unanswered=True))
    ended = view(driver, (node("n1"),), (slurm_job(501, SlurmJobState.CANCELLED),))
    assert cancels(driver.feed(core.SlurmObserved(ended))) == []


def test_a_silent_worker_or_an_error_excludes_its_node_at_once_and_a_first_kill_is_forgotten() -> None:
    """A worker its launcher had to end (silent, hung; a node lost from a unit is said the
    same way) or one that exits with its own error (a crash loop counts those) excludes the
    node at the first failure; a worker's first kill is forgiven again once
    node_cooldown_s has passed since it."""
    driver = Driver(min_replicas=1, max_replicas=3, slurm_units=True)
    for unit in ("a", "b", "c"):
        driver.connect(unit)
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and driver.state.job.state is JobState.RUNNING
    driver.say("a", worker_exited=launcher_pb2.WorkerExited(generation=generation.number, pid=7, signal=9,
                                                           detail="stopped beating for 3 s"))
    assert driver.state.excluded_nodes(driver.clock) == ("node-a",)
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None
    driver.exit("b", generation.number, code=0, signal=9)
    assert driver.state.excluded_nodes(driver.clock) == ("node-a",)
    assert driver.event("node_suspect").fields == {"node": "node-b"}
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None
    driver.exit("c", generation.number, code=1)
    assert driver.state.excluded_nodes(driver.clock) == ("node-a", "node-c")
    # Past node_cooldown_s the first failure there is forgotten: another is a first again.
    driver.clock += CONFIG.node_cooldown_s + 1.0
    driver.connect("d", node="node-b")
    driver.connect("e")
    driver.tick(1.0)
    generation = driver.state.generation
    assert generation is not None and generation.member("d") is not None, driver.events()
    before = len(driver.effects)
    driver.exit("d", generation.number, code=0, signal=9)
    assert driver.state.excluded_nodes(driver.clock) == ()
    assert "node_suspect" in driver.events(driver.effects[before:])


def test_a_restart_mode_error_that_a_killed_peer_caused_gives_its_node_back() -> None:
    """Restart mode: a rank raises when a peer is killed, and its error may reach the
    controller before the kill. Its node is excluded at once (an error of its own), and
    given back when the killed worker's report, stale by then, says it died first: the
    replacement is submitted without the exclusion. An error after a kill that came later
    keeps its node excluded."""
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=2, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    for number, unit in enumerate(("u1", "u2")):
        driver.feed(core.UnitSubmitted(unit, 501 + number))
        driver.connect(unit)
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and driver.state.job.state is JobState.RUNNING
    error_at = driver.now.wall
    erred = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4000, exit_code=1)
    erred.exited_at.FromNanoseconds(int(error_at * 1e9))
    driver.say("u1", worker_exited=erred)
    assert driver.state.excluded_nodes(driver.clock) == ("node-u1",)
    killed = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4001, signal=9)
    killed.exited_at.FromNanoseconds(int((error_at - 0.05) * 1e9))
    effects = driver.say("u2", worker_exited=killed)
    assert driver.state.excluded_nodes(driver.clock) == ()
    lifted = [e for e in effects if isinstance(e, core.Record) and e.kind == "node_exclusion_lifted"]
    assert [(e.unit_id, e.fields) for e in lifted] == [("u2", {"node": "node-u1"})]
    # u1's node is back as it was; u2's, where the kill was, is suspect (not excluded).
    assert {node: failures for node, (failures, _) in driver.state.node_cooldown.items()} == {"node-u2": 0}
    driver.report("u2", generation.number, launcher_pb2.GENERATION_PHASE_STOPPED)
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")),
                                                  (slurm_job(502, SlurmJobState.RUNNING),))))
    assert [(s.unit_id, s.excluded) for s in effects if isinstance(s, core.Submit)] == [("u3", ())]

    # The same error with the kill after it: the node stays excluded.
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=2, max_replicas=2, slurm_units=True)
    for unit in ("a", "b"):
        driver.connect(unit)
    driver.tick()
    generation = driver.state.generation
    assert generation is not None
    driver.say("a", worker_exited=erred)
    later = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4001, signal=9)
    later.exited_at.FromNanoseconds(int((error_at + 0.5) * 1e9))
    driver.say("b", worker_exited=later)
    assert driver.state.excluded_nodes(driver.clock) == ("node-a",)
    assert "node_exclusion_lifted" not in driver.events()


def test_a_replacement_queued_without_a_node_given_back_later_is_submitted_again_with_it() -> None:
    """The killed worker's report comes after its peer's error, after the survivors formed
    the next world and a Slurm view got the replacement submitted with the erring unit's
    node excluded: that replacement, still waiting in Slurm's queue, is cancelled, and the
    next poll submits one that may go there. The killed worker's node is judged as a kill
    reported first is (node_suspect)."""
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=3, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2"), node("n3")))))
    for number, unit in enumerate(("u1", "u2", "u3")):
        driver.feed(core.UnitSubmitted(unit, 501 + number))
        driver.connect(unit)
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and len(generation.members) == 3
    error_at = driver.now.wall
    erred = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4000, exit_code=1)
    erred.exited_at.FromNanoseconds(int(error_at * 1e9))
    driver.say("u1", worker_exited=erred)
    assert driver.state.excluded_nodes(driver.clock) == ("node-u1",)
    for unit in ("u2", "u3"):
        driver.report(unit, generation.number, launcher_pb2.GENERATION_PHASE_STOPPED)
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n2"), busy("n3"), node("n4")),
                                                  (slurm_job(502, SlurmJobState.RUNNING),
                                                   slurm_job(503, SlurmJobState.RUNNING)))))
    [queued] = [e for e in effects if isinstance(e, core.Submit)]
    assert queued.excluded == ("node-u1",)
    driver.feed(core.UnitSubmitted(queued.unit_id, 600))
    killed = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4001, signal=9)
    killed.exited_at.FromNanoseconds(int((error_at - 0.05) * 1e9))
    effects = driver.say("u2", worker_exited=killed)
    assert driver.state.excluded_nodes(driver.clock) == ()
    assert core.CancelInSlurm(queued.unit_id, 600) in effects
    assert driver.state.units[queued.unit_id].state is UnitState.LEFT
    assert any(isinstance(e, core.PollSlurmSoon) for e in effects)
    suspects = [e.fields for e in effects if isinstance(e, core.Record) and e.kind == "node_suspect"]
    assert suspects == [{"node": "node-u2"}]
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n2"), busy("n3"), node("n4")),
                                                  (slurm_job(502, SlurmJobState.RUNNING),
                                                   slurm_job(503, SlurmJobState.RUNNING)))))
    assert [(e.unit_id, e.excluded) for e in effects if isinstance(e, core.Submit)] == [("u5", ())]


def three_units_submitted(driver: Driver) -> tuple[Node, ...]:
    """Three idle nodes in two views: u1, u2 and u3 are submitted (Slurm jobs 501-503);
    returns the nodes."""
    nodes = (node("n1"), node("n2"), node("n3"))
    effects = driver.feed(core.SlurmObserved(view(driver, nodes)))
    driver.clock += 0.5
    effects += driver.feed(core.SlurmObserved(view(driver, nodes)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u1", "u2", "u3"]
    for number, unit in enumerate(("u1", "u2", "u3"), start=501):
        driver.feed(core.UnitSubmitted(unit, number))
    return nodes


def test_the_first_world_waits_for_a_unit_slurm_started_and_forms_with_it_once_it_registers() -> None:
    """Three units submitted at once; two launchers register, and a Slurm view shows the
    third's job running: the world does not form without it at the end of join_settle_s
    (it would grow onto it right after), but forms with all three once it registers. A
    unit queued ahead (queued_units) that Slurm holds pending for a node is not waited for;
    a pending unit that was not queued ahead is."""
    config = dataclasses.replace(CONFIG, join_settle_s=1.0, queued_units=1)
    driver = Driver(min_replicas=2, max_replicas=4, slurm_units=True, config=config)
    nodes = three_units_submitted(driver)
    driver.clock += 1.0
    driver.connect("u1")
    driver.connect("u2")
    driver.clock += 0.5
    # The view shows the three started, 0.3 s before it was taken.
    started_at = datetime.fromtimestamp(driver.now.wall - 0.3, UTC)
    jobs = tuple(dataclasses.replace(slurm_job(501 + i, SlurmJobState.RUNNING), start_time=started_at)
                 for i in range(3))
    busy = tuple(dataclasses.replace(n, state=NodeState.ALLOCATED) for n in nodes)
    effects = driver.feed(core.SlurmObserved(view(driver, busy, jobs)))
    assert abs(driver.state.units["u3"].facts.started_seen_at - (driver.clock - 0.3)) < 1e-6
    # Nothing idle: one unit is queued ahead in Slurm for the next free node.
    assert [(e.unit_id, driver.state.units[e.unit_id].facts.queued_ahead)
            for e in effects if isinstance(e, core.Submit)] == [("u4", True)]
    driver.feed(core.UnitSubmitted("u4", 504))
    # Queued ahead from its submission, before any view shows it.
    assert driver.state.units["u4"].facts.queued_in_slurm
    with_queued = view(driver, busy, (*jobs, slurm_job(504, SlurmJobState.PENDING)))
    driver.feed(core.SlurmObserved(with_queued))
    assert driver.state.units["u4"].facts.queued_in_slurm
    # Slurm not answering: what the views said of it no longer holds (it counts as expected).
    driver.feed(core.SlurmObserved(dataclasses.replace(with_queued, stale=True)))
    assert not driver.state.units["u4"].facts.queued_in_slurm
    driver.feed(core.SlurmObserved(with_queued))
    driver.tick(0.6)  # 1.1 s after the registrations: settled, but u3 started 0.9 s ago
    assert driver.state.generation is None and driver.state.job.state is not JobState.RUNNING
    driver.clock += 0.05
    driver.connect("u3")
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and sorted(generation.unit_ids) == ["u1", "u2", "u3"], generation


def test_a_unit_queued_ahead_is_not_waited_for_before_a_view_shows_it() -> None:
    """Seen in bench.goodput: the poll that saw the first units running queued one ahead
    before the last launcher registered, and the world formed join_settle_s later, when
    the next view showed the queued unit pending (3 nodes idle 1.15 s). A unit queued ahead
    waits in Slurm's queue from its submission: the world forms as the last member
    registers."""
    config = dataclasses.replace(CONFIG, join_settle_s=1.0, queued_units=1)
    driver = Driver(min_replicas=2, max_replicas=4, slurm_units=True, config=config)
    nodes = three_units_submitted(driver)
    driver.clock += 0.5
    driver.connect("u1")
    driver.connect("u2")
    busy = tuple(dataclasses.replace(n, state=NodeState.ALLOCATED) for n in nodes)
    jobs = tuple(slurm_job(501 + i, SlurmJobState.RUNNING) for i in range(3))
    effects = driver.feed(core.SlurmObserved(view(driver, busy, jobs)))
    assert [(e.unit_id, driver.state.units[e.unit_id].facts.queued_ahead)
            for e in effects if isinstance(e, core.Submit)] == [("u4", True)]
    driver.feed(core.UnitSubmitted("u4", 504))
    driver.clock += 0.05
    driver.connect("u3")
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and sorted(generation.unit_ids) == ["u1", "u2", "u3"], generation


def test_a_unit_pending_in_slurm_that_was_not_queued_ahead_is_waited_for() -> None:
    """A unit submitted onto an idle node that a view still shows PENDING (Slurm has not
    scheduled it yet) is on its way: forming waits join_settle_s after the registrations
    for it, as for any unit submitted and not registered."""
    config = dataclasses.replace(CONFIG, join_settle_s=1.0)
    driver = Driver(min_replicas=2, max_replicas=3, slurm_units=True, config=config)
    nodes = three_units_submitted(driver)
    driver.clock += 0.5
    jobs = (slurm_job(501, SlurmJobState.RUNNING), slurm_job(502, SlurmJobState.RUNNING),
            slurm_job(503, SlurmJobState.PENDING))
    driver.feed(core.SlurmObserved(view(driver, nodes, jobs)))
    assert not driver.state.units["u3"].facts.queued_in_slurm
    driver.connect("u1")
    driver.connect("u2")
    driver.tick(0.5)
    assert driver.state.generation is None
    driver.tick(0.6)
    generation = driver.state.generation
    assert generation is not None and sorted(generation.unit_ids) == ["u1", "u2"]


def polls_asked(effects: list[core.Effect]) -> list[str]:
    return [e.reason for e in effects if isinstance(e, core.PollSlurmSoon)]


def test_a_unit_that_ends_asks_for_a_slurm_poll_at_once_so_its_replacement_is_not_left_to_the_interval() -> None:
    # The replacement is decided on a Slurm view; with the default 30 s poll it waited
    # up to 30 s for one. A unit's end asks for a poll in the transition that ends it.
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.feed(core.UnitSubmitted("u2", 502))
    for unit in ("u1", "u2"):
        driver.connect(unit)
    assert polls_asked(driver.effects) == []
    driver.tick()
    effects = driver.exit("u2", 1, code=1)
    assert driver.state.units["u2"].state is UnitState.FAILED
    assert polls_asked(effects) == ["unit(s) u2 ended"]
    # Below min, the survivor stops first: no replacement is submitted while the stop is in
    # flight, so its end asks again.
    assert driver.state.stopping is not None
    assert polls_asked(driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_STOPPED)) == [
        "the stop before the next generation finished"]
    assert polls_asked(driver.tick(1.0)) == []
    # A view of Slurm decides on itself: it asks for no other, even where it ends a unit
    # (u3's Slurm job gone before its launcher registered; u4 replaces it in that view).
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"] and polls_asked(effects) == []
    driver.feed(core.UnitSubmitted("u3", 503))
    driver.clock += 2.0
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    assert driver.state.units["u3"].state is UnitState.FAILED and "unit_lost" in driver.events(effects)
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u4"] and polls_asked(effects) == []


def test_a_unit_ending_asks_for_no_poll_without_slurm_units_or_once_the_job_has_ended() -> None:
    driver = Driver(min_replicas=1, max_replicas=2)
    formed(driver, "u1", "u2")
    assert driver.state.units["u2"].state is UnitState.ACTIVE
    effects = driver.exit("u2", 1, code=1)
    assert driver.state.units["u2"].state is UnitState.FAILED and polls_asked(effects) == []
    driver = Driver(min_replicas=1, max_replicas=1, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    driver.feed(core.UnitSubmitted("u1", 701))
    driver.connect("u1")
    driver.tick()
    driver.feed(core.CancelRequested(0))
    assert driver.state.job.state.is_final and driver.state.units["u1"].state is UnitState.LEAVING
    driver.say("u1", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=4000, exit_code=0))
    driver.feed(core.LauncherClosed("u1", "left"))
    assert driver.state.units["u1"].state.is_final
    assert polls_asked(driver.effects) == []


def crash_once(driver: Driver, nodes: tuple[Node, ...], *, code: int = 1, signal: int = 0,
               after_s: float = 1.0, step: int | None = None, detail: str = "") -> list[core.Effect]:
    """One generation of a one-unit job: a unit submitted, registered, formed, and its
    worker exiting `after_s` later (an error, or killed by `signal`), having reported
    `step` first if given."""
    effects = driver.feed(core.SlurmObserved(view(driver, nodes)))
    (submit,) = [e for e in effects if isinstance(e, core.Submit)]
    driver.feed(core.UnitSubmitted(submit.unit_id, 900 + len(driver.state.units)))
    driver.connect(submit.unit_id)
    driver.tick()
    generation = driver.state.generation
    assert generation is not None and generation.unit_ids == (submit.unit_id,)
    driver.clock += after_s
    if step is not None:
        driver.beat(submit.unit_id, step)
        driver.tick()
    exited = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4000, exit_code=code,
                                       signal=signal, detail=detail, error="ValueError: boom 42",
                                       traceback="Traceback (most recent call last):\n  ...\nValueError: boom 42")
    return driver.feed(core.LauncherSaid(submit.unit_id, launcher_pb2.LauncherMessage(worker_exited=exited)))


def test_workers_that_fail_by_an_error_in_three_generations_in_a_row_fail_the_job_with_the_error() -> None:
    # Before: such a job replaced its units forever, each failure cooling down one more node.
    nodes = tuple(node(f"n{i}") for i in range(6))
    for mode in (common_pb2.JOB_MODE_RESTART, common_pb2.JOB_MODE_LIVE):
        driver = Driver(mode=mode, min_replicas=1, max_replicas=1, slurm_units=True)
        crash_once(driver, nodes)
        crash_once(driver, nodes)
        assert driver.state.job.state is JobState.DEGRADED and "job_failed" not in driver.events()
        effects = crash_once(driver, nodes)
        assert driver.state.job.state is JobState.FAILED
        ended = driver.event("job_failed")
        assert "3 generations in a row" in ended.reason and ended.reason.endswith("ValueError: boom 42"), ended
        assert ended.fields is not None and ended.fields["traceback"].endswith("ValueError: boom 42")
        assert ended.fields["cause"] == "crash_loop"
        # Nothing more is submitted for it.
        assert not [e for e in driver.feed(core.SlurmObserved(view(driver, nodes))) if isinstance(e, core.Submit)]
        assert [e for e in effects if isinstance(e, core.SaveJob)][-1].job.state is JobState.FAILED


def test_kills_long_lived_generations_and_committed_steps_are_no_crash_loop() -> None:
    nodes = tuple(node(f"n{i}") for i in range(12))
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=1, slurm_units=True)
    # Killed by a signal (an OOM kill, chaos, a node's end) counts for nothing, nor does a
    # worker whose wrapper (`bash -c`) says it was killed (128 + N), nor one its launcher
    # ended (`detail`: silent past the progress timeout).
    for _ in range(3):
        crash_once(driver, nodes, code=0, signal=9)
    for _ in range(3):
        crash_once(driver, nodes, code=137)
    for _ in range(3):
        crash_once(driver, nodes, code=1, detail="silent for 60 s")
    assert driver.state.job.state is JobState.DEGRADED and driver.state.crash_loop is None
    # A generation that lived the window long starts the count again.
    crash_once(driver, nodes)
    crash_once(driver, nodes)
    crash_once(driver, nodes, after_s=CONFIG.crash_loop_window_s)
    crash_once(driver, nodes)
    crash_once(driver, nodes)
    assert driver.state.job.state is JobState.DEGRADED
    # A step committed between two failures starts it again too.
    crash_once(driver, nodes, step=5)
    assert driver.state.job.step == 5
    crash_once(driver, nodes)
    assert driver.state.job.state is JobState.DEGRADED and "job_failed" not in driver.events()
    crash_once(driver, nodes)
    assert driver.state.job.state is JobState.FAILED
    # 0: never.
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=1, slurm_units=True,
                    config=dataclasses.replace(CONFIG, crash_loop_generations=0))
    for _ in range(5):
        crash_once(driver, nodes)
    assert driver.state.job.state is JobState.DEGRADED


def test_an_error_that_came_first_because_a_peer_was_killed_is_no_crash_and_other_failures_end_the_run() -> None:
    # Restart mode: a rank raises when a peer dies; its error may reach the controller
    # before the killed peer's signal. The killed worker's report, stale by then, uncounts
    # the generation.
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=2)
    formed(driver, "u1", "u2")
    generation = driver.state.generation
    assert generation is not None
    error_at = driver.now.wall
    exited = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4000, exit_code=1)
    exited.exited_at.FromNanoseconds(int(error_at * 1e9))
    driver.say("u1", worker_exited=exited)
    assert driver.state.crash_loop is not None and driver.state.crash_loop.generations == 1
    # A peer that aborted after the error (NCCL's async error handling: SIGABRT) leaves it counted.
    aborted = launcher_pb2.WorkerExited(generation=generation.number, local_rank=0, pid=4001, signal=6)
    aborted.exited_at.FromNanoseconds(int((error_at + 0.2) * 1e9))
    driver.say("u2", worker_exited=aborted)
    assert driver.state.crash_loop is not None and driver.state.crash_loop.generations == 1
    # One killed before it: the error was the reaction.
    killed = launcher_pb2.WorkerExited(generation=generation.number, local_rank=1, pid=4002, signal=9)
    killed.exited_at.FromNanoseconds(int((error_at - 0.05) * 1e9))
    driver.say("u2", worker_exited=killed)
    assert driver.state.crash_loop is None
    # A failure of another kind (here a broken session) ends a run of crashes too.
    nodes = tuple(node(f"n{i}") for i in range(3, 9))
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=1, slurm_units=True)
    crash_once(driver, nodes)
    crash_once(driver, nodes)
    effects = driver.feed(core.SlurmObserved(view(driver, nodes)))
    (submit,) = [e for e in effects if isinstance(e, core.Submit)]
    driver.feed(core.UnitSubmitted(submit.unit_id, 990))
    driver.connect(submit.unit_id)
    driver.tick()
    driver.feed(core.LauncherClosed(submit.unit_id, "connection reset"))
    assert driver.state.units[submit.unit_id].state is UnitState.FAILED and driver.state.crash_loop is None
    crash_once(driver, nodes)
    crash_once(driver, nodes)
    assert driver.state.job.state is JobState.DEGRADED


def test_a_unit_slurm_preempts_leaves_and_a_stale_view_decides_nothing() -> None:
    driver = Driver(min_replicas=1, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"),))))
    driver.feed(core.UnitSubmitted("u1", 601))
    driver.connect("u1")
    driver.tick()
    stale = dataclasses.replace(view(driver, (), (slurm_job(601, SlurmJobState.RUNNING, preempted=True),)),
                                stale=True)
    assert driver.feed(core.SlurmObserved(stale)) == []
    driver.feed(core.SlurmObserved(view(driver, (), (slurm_job(601, SlurmJobState.RUNNING, preempted=True),))))
    assert driver.state.units["u1"].state is UnitState.LEAVING
    assert driver.state.units["u1"].reason.startswith("preempted")


def test_a_unit_slurm_preempts_after_the_last_step_finishes_the_scripts_own_code_rather_than_leave() -> None:
    """The job committed its last step; Slurm then preempts a member of the finished world
    (an urgent job). Its workers are in the script's code after train(), which under
    HybridSharded gathers the sharded tensors with the unit's peers: it is not asked to
    leave (it has until Slurm's grace time ends), an event says so once, and the job
    completes when its workers end. Asked to leave at once, its workers were stopped in
    the gather and a peer's broke (sharded chaos, seed 300: no final parameters)."""
    driver = Driver(min_replicas=1, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    driver.feed(core.UnitSubmitted("u1", 601))
    driver.feed(core.UnitSubmitted("u2", 602))
    formed(driver, "u1", "u2")
    driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=400)
    assert driver.state.job.state is JobState.FINISHING
    preempted = view(driver, (), (slurm_job(601, SlurmJobState.RUNNING),
                                  slurm_job(602, SlurmJobState.RUNNING, preempted=True)))
    effects = driver.feed(core.SlurmObserved(preempted)) + driver.feed(core.SlurmObserved(preempted))
    assert driver.state.units["u2"].state is UnitState.ACTIVE
    assert driver.events(effects) == ["unit_preempted_after_training"]
    assert not [e for e in effects if isinstance(e, core.Send)], "nothing stops its workers"
    driver.exit("u1", 1, code=0)
    driver.exit("u2", 1, code=0)
    assert driver.state.job.state is JobState.COMPLETED


def test_a_restarted_controller_does_not_record_a_preemption_after_the_last_step_again() -> None:
    """Slurm preempts a member of the finished world; the controller restarts before the
    job completes. The member is still not asked to leave, and the event that says so is
    not recorded a second time."""
    driver = Driver(min_replicas=1, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    driver.feed(core.UnitSubmitted("u1", 601))
    driver.feed(core.UnitSubmitted("u2", 602))
    formed(driver, "u1", "u2")
    finishing = driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_FINISHED, step=400)
    preempted = view(driver, (), (slurm_job(601, SlurmJobState.RUNNING),
                                  slurm_job(602, SlurmJobState.RUNNING, preempted=True)))
    effects = finishing + driver.feed(core.SlurmObserved(preempted))
    assert driver.events(effects) == ["job_finishing", "unit_preempted_after_training"]
    pending = {e.key: e.value for e in effects if isinstance(e, core.SavePending)}
    job, units = dataclasses.replace(driver.state.job), list(driver.state.units.values())
    driver.state = core.restore(job, units, driver.state.generation, generation_stopped=False, pending=pending,
                                config=CONFIG, now=driver.now, slurm_units=True)
    # (Their workers run on: the script's code after train().)
    driver.connect("u1", last_generation=1, workers=(101,))
    driver.connect("u2", last_generation=1, workers=(102,))
    effects = driver.feed(core.SlurmObserved(preempted))
    assert driver.events(effects) == []
    assert driver.state.units["u2"].state is UnitState.ACTIVE
    assert not [e for e in effects if isinstance(e, core.Send) and e.message.WhichOneof("body") == "leave"]


def two_slurm_units_training(driver: Driver, nodes: tuple[Node, ...]) -> None:
    """u1 and u2 (Slurm jobs 501, 502) submitted on the first view, registered, and formed
    into the world once join_settle_s (5 s) passed."""
    driver.feed(core.SlurmObserved(view(driver, nodes)))
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.feed(core.UnitSubmitted("u2", 502))
    driver.connect("u1")
    driver.connect("u2")
    driver.tick(6.0)


def test_a_joining_unit_whose_launcher_is_gone_fails_after_the_reconnect_grace_and_is_replaced() -> None:
    """A unit registers and waits to join (join_settle_s); its node dies before a world
    takes it in. Nothing else ends a joiner out of touch: it stayed JOINING for good,
    counted among the job's units, and no unit was submitted in its place."""
    config = dataclasses.replace(CONFIG, join_settle_s=5.0)
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True, config=config)
    nodes = (node("n1"), node("n2"), node("n3"))
    two_slurm_units_training(driver, nodes)
    assert driver.state.job.state is JobState.RUNNING
    driver.feed(core.LauncherClosed("u2", "node died"))
    driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_STOPPED)
    driver.clock += 2.0
    effects = driver.feed(core.SlurmObserved(view(driver, nodes, (slurm_job(501, SlurmJobState.RUNNING),))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"]
    driver.feed(core.UnitSubmitted("u3", 503))
    driver.connect("u3")
    assert driver.state.units["u3"].state is UnitState.JOINING
    driver.feed(core.LauncherClosed("u3", "node died"))
    driver.tick(9.0)
    assert driver.state.units["u3"].state is UnitState.JOINING, "within reconnect_grace_s it may come back"
    effects = driver.tick(2.0)
    assert driver.state.units["u3"].state is UnitState.FAILED
    assert "failure_detected" in driver.events(effects)
    assert [e.slurm_job_id for e in effects if isinstance(e, core.CancelInSlurm)] == [503]
    effects = driver.feed(core.SlurmObserved(view(driver, nodes, (slurm_job(501, SlurmJobState.RUNNING),))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u4"]
    # One that comes back within the grace joins as before.
    driver.feed(core.UnitSubmitted("u4", 504))
    driver.connect("u4")
    driver.feed(core.LauncherClosed("u4", "blip"))
    driver.tick(5.0)
    driver.connect("u4")
    driver.tick(20.0)
    assert driver.state.units["u4"].state is not UnitState.FAILED


def test_restart_mode_counts_a_pending_unit_of_k_nodes_as_taking_k_idle_nodes() -> None:
    """Replicas of 2 nodes (one Slurm job each): two units pending on 5 idle nodes take 4
    of them, and the fifth fits none; counted as taking one node each, a third unit was
    submitted that could only wait in Slurm's queue (and showed as waiting to other jobs)."""
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=1, max_replicas=4, slurm_units=True)
    driver.state.job.spec.nodes_per_replica = 2
    nodes = tuple(node(f"n{i}") for i in range(1, 6))
    effects = driver.feed(core.SlurmObserved(view(driver, nodes)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u1", "u2"]
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.feed(core.UnitSubmitted("u2", 502))
    driver.clock += 5.0
    pending = (slurm_job(501, SlurmJobState.PENDING), slurm_job(502, SlurmJobState.PENDING))
    effects = driver.feed(core.SlurmObserved(view(driver, nodes, pending)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == []
    # A sixth node idle: a third unit fits.
    effects = driver.feed(core.SlurmObserved(view(driver, (*nodes, node("n6")), pending)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"]


def test_a_unit_a_stopped_controller_decided_is_found_in_slurm_by_its_name_or_replaced() -> None:
    """The controller stops between saving a unit SUBMITTED and reading sbatch's answer
    (or before sbatch ran): restarted, it holds the unit with no Slurm job id. It is found
    in Slurm's view by its name and its id kept; with none there, it is lost and replaced.
    It stayed SUBMITTED for good, counted as alive and on its way, and the job waited."""
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True)
    nodes = (node("n1"), node("n2"), node("n3"))
    driver.feed(core.SlurmObserved(view(driver, nodes)))
    # Before any answer the view decides nothing of them (sbatch is running).
    effects = driver.feed(core.SlurmObserved(view(driver, nodes)))
    assert driver.state.units["u1"].state is UnitState.SUBMITTED and not driver.events(effects)
    driver.feed(core.UnitSubmitted("u1", 501))
    job, units = dataclasses.replace(driver.state.job), list(driver.state.units.values())
    driver.clock += 5.0
    driver.state = core.restore(job, units, None, generation_stopped=False, pending={}, config=CONFIG,
                                now=driver.now, slurm_units=True)
    assert driver.state.units["u2"].slurm_job_id == 0
    # Slurm shows u2's job (sbatch ran; its answer was lost with the controller).
    found = dataclasses.replace(slurm_job(777, SlurmJobState.PENDING), name="tidal-j-1-u2")
    effects = driver.feed(core.SlurmObserved(view(driver, nodes, (slurm_job(501, SlurmJobState.RUNNING), found))))
    assert driver.state.units["u2"].slurm_job_id == 777 and driver.state.units["u2"].state is UnitState.SUBMITTED
    assert driver.events(effects) == ["unit_submitted"]
    # Another restart, and this time sbatch never ran for u2: lost, and replaced.
    driver.state.units["u2"].slurm_job_id = 0
    driver.state = core.restore(dataclasses.replace(driver.state.job), list(driver.state.units.values()), None,
                                generation_stopped=False, pending={}, config=CONFIG, now=driver.now, slurm_units=True)
    effects = driver.feed(core.SlurmObserved(view(driver, nodes, (slurm_job(501, SlurmJobState.RUNNING),))))
    assert driver.state.units["u2"].state is UnitState.FAILED
    assert "unit_lost" in driver.events(effects)
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"]


def test_a_resize_below_the_units_there_sends_away_queued_and_joining_units_first() -> None:
    """max_replicas 4 → 2 with two members, one unit waiting to join and one queued in
    Slurm: the queued one is cancelled there and the joiner asked to leave; the members
    train on. Only surplus members were asked to leave, and at max the others never
    joined: the joiner held its node, the queued unit took the next free one."""
    config = dataclasses.replace(CONFIG, join_settle_s=5.0)
    driver = Driver(min_replicas=1, max_replicas=4, slurm_units=True, config=config)
    nodes = (node("n1"), node("n2"))
    two_slurm_units_training(driver, nodes)
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("u1", "u2")
    jobs = (slurm_job(501, SlurmJobState.RUNNING), slurm_job(502, SlurmJobState.RUNNING))
    driver.clock += 60.0
    driver.feed(core.SlurmObserved(view(driver, (*nodes, node("n3"), node("n4")), jobs)))
    driver.feed(core.UnitSubmitted("u3", 503))
    driver.feed(core.UnitSubmitted("u4", 504))
    driver.connect("u3")
    assert driver.state.units["u3"].state is UnitState.JOINING
    assert driver.state.units["u4"].state is UnitState.SUBMITTED
    effects = driver.feed(core.ResizeRequested(min_replicas=0, max_replicas=2, uid=0))
    assert [e.slurm_job_id for e in effects if isinstance(e, core.CancelInSlurm)] == [504]
    assert driver.state.units["u4"].state is UnitState.LEFT
    assert driver.state.units["u3"].state is UnitState.LEAVING
    assert driver.state.units["u1"].state is UnitState.ACTIVE and driver.state.units["u2"].state is UnitState.ACTIVE
    # Down to 1: the newest member leaves too (a world change), as before.
    effects = driver.feed(core.ResizeRequested(min_replicas=0, max_replicas=1, uid=0))
    assert driver.state.units["u2"].state is UnitState.LEAVING


def test_members_back_without_workers_after_a_restart_fail_together_and_the_world_re_forms_once() -> None:
    """Two of three members come back after a controller restart with no workers and say
    nothing of them: both fail in one tick and one world forms, of the third. Failed one
    at a time, the first's world still named the second, dead, and another followed."""
    driver = Driver(min_replicas=1, max_replicas=3)
    formed(driver, "a", "b", "c")
    driver.state = core.restore(dataclasses.replace(driver.state.job), list(driver.state.units.values()),
                                driver.state.generation, generation_stopped=False, pending={}, config=CONFIG,
                                now=driver.now)
    driver.connect("a", last_generation=1, workers=(4000,))
    driver.connect("b", last_generation=1)
    driver.connect("c", last_generation=1)
    effects = driver.tick(4.0)
    assert driver.events(effects).count("world_formed") == 1
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a",)
    assert driver.state.units["b"].state is UnitState.FAILED and driver.state.units["c"].state is UnitState.FAILED


def four_slurm_units_training(min_replicas: int) -> Driver:
    driver = Driver(min_replicas=min_replicas, max_replicas=4, slurm_units=True)
    effects = driver.feed(core.SlurmObserved(view(driver, tuple(node(f"n{i}") for i in range(1, 5)))))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u1", "u2", "u3", "u4"]
    for index, unit in enumerate(("u1", "u2", "u3", "u4")):
        driver.feed(core.UnitSubmitted(unit, 601 + index))
        driver.connect(unit)
    driver.tick()
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("u1", "u2", "u3", "u4")
    return driver


def preempting(driver: Driver, *preempted: int) -> ClusterView:
    return view(driver, (), tuple(slurm_job(job, SlurmJobState.RUNNING, preempted=job in preempted)
                                  for job in range(601, 605)))


def test_units_slurm_preempts_together_leave_in_one_world_change_or_one_stop() -> None:
    # bench.goodput: Slurm preempted 3 units at once for an urgent job, and they left one
    # world change after another (0.8-1.5 s each): the urgent job waited for the last.
    driver = four_slurm_units_training(min_replicas=2)
    effects = driver.feed(core.SlurmObserved(preempting(driver, 603, 604)))
    assert driver.events(effects).count("unit_leaving") == 2
    assert driver.events(effects).count("world_reconfiguring") == 1
    assert driver.event("world_reconfiguring").fields["leaving"] == "u3,u4"
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("u1", "u2")
    # Every old member moves at one step boundary: the leavers out, the rest on.
    assert all(sent(effects, unit) == ["reconfigure:2"] for unit in ("u1", "u2", "u3", "u4"))
    # Three of four with min 2: the one left cannot train; one stop, each leaver told to leave.
    driver = four_slurm_units_training(min_replicas=2)
    effects = driver.feed(core.SlurmObserved(preempting(driver, 602, 603, 604)))
    assert driver.events(effects).count("world_reconfiguring") == 0
    assert driver.events(effects).count("generation_stopping") == 1
    for unit in ("u2", "u3", "u4"):
        assert driver.state.units[unit].state is UnitState.LEAVING
        assert sent(effects, unit) == ["leave"], unit
    assert sent(effects, "u1") == ["stop:1"]
    assert driver.state.stopping is not None and driver.state.stopping.waiting_for == {"u1", "u2", "u3", "u4"}


def test_a_register_that_claims_a_generation_the_job_never_had_is_refused() -> None:
    driver = Driver()
    formed(driver, "a", "b")
    ahead = launcher_pb2.Register(job_id="j-1", unit_id="a", last_generation=5)
    assert "claims generation 5" in (core.refusal(driver.state, ahead) or "")
    unknown = launcher_pb2.Register(job_id="j-1", unit_id="zz", last_generation=1)
    assert "no record of it" in (core.refusal(driver.state, unknown) or "")
    assert core.refusal(driver.state, launcher_pb2.Register(job_id="j-1", unit_id="c")) is None
    driver.feed(core.CancelRequested(uid=0))
    assert "cancelled" in (core.refusal(driver.state, launcher_pb2.Register(job_id="j-1", unit_id="c")) or "")


def test_a_live_failure_is_one_message_to_each_survivor_unless_a_change_is_in_flight() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b", "c")
    effects = driver.exit("b", 1, code=1)
    assert sent(effects, "b") == ["stop:1"], "the failed unit kills its workers"
    assert sent(effects, "a") == sent(effects, "c") == ["start:2"]
    assert driver.state.stopping is None and driver.state.job.state is JobState.RUNNING
    assert core.GenerationStopped("j-1", 1, driver.now.wall) in effects
    # With a joiner's change in flight, the generation is stopped first.
    driver.connect("d")
    driver.tick()
    assert driver.state.changing is not None
    effects = driver.exit("c", 3, code=1)
    assert sent(effects, "a") == ["stop:3"] and driver.state.job.state is JobState.RECONFIGURING


def test_a_live_failure_that_leaves_a_size_the_job_does_not_allow_stops_first() -> None:
    driver = Driver(min_replicas=2, max_replicas=4)
    driver.state.job.spec.allowed_replicas[:] = [2, 4]
    formed(driver, "a", "b", "c", "d")
    effects = driver.exit("d", 1, code=1)
    assert sent(effects, "a") == ["stop:1"], "3 survivors make no allowed world"
    for unit in "abc":
        effects = driver.report(unit, 1, launcher_pb2.GENERATION_PHASE_STOPPED)
    assert driver.state.generation is not None and len(driver.state.generation.members) == 2
    [left_out] = set("abc") - set(driver.state.generation.unit_ids)
    standby = driver.event("unit_standby")
    assert standby.unit_id == left_out and driver.state.units[left_out].state is UnitState.JOINING


def test_a_failure_while_a_member_is_not_back_after_a_restart_waits_for_it_in_a_stop_round() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b", "c")
    job, units = driver.state.job, list(driver.state.units.values())
    driver.state = core.restore(job, units, driver.state.generation, generation_stopped=False, pending={},
                                config=CONFIG, now=driver.now)
    driver.connect("a", last_generation=1, workers=(11,))
    driver.connect("b", last_generation=1, workers=(12,))
    effects = driver.exit("b", 1, code=1)
    assert sent(effects, "a") == ["stop:1"], "c, not back yet, would be left out of a generation formed now"
    assert driver.state.stopping is not None and "c" in driver.state.stopping.waiting_for


def test_members_found_failed_in_the_same_tick_re_form_the_world_once() -> None:
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b", "c")
    driver.clock += CONFIG.reconnect_grace_s + 1
    driver.links = {u: core.Link(last_heartbeat_at=driver.clock) for u in "abc"}
    driver.tick(CONFIG.heartbeat_timeout_s - 0.5)
    assert driver.events().count("failure_detected") == 0
    driver.links["a"] = core.Link(last_heartbeat_at=driver.clock)
    effects = driver.tick(1.0)
    assert driver.events(effects).count("failure_detected") == 2
    assert driver.events(effects).count("world_formed") == 1 and sent(effects, "a") == ["start:2"]
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a",)


def test_a_settled_joiner_comes_along_into_the_generation_a_failure_forms() -> None:
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART, min_replicas=2, max_replicas=2)
    formed(driver, "a", "b")
    driver.connect("c")
    driver.tick(CONFIG.join_settle_s + 1)
    assert driver.state.units["c"].state is UnitState.JOINING, "at max_replicas: c waits"
    effects = driver.exit("b", 1, code=1)
    assert sent(effects, "a") == sent(effects, "c") == ["start:2"]
    assert driver.state.generation is not None and set(driver.state.generation.unit_ids) == {"a", "c"}


def test_liveness_is_judged_in_one_pure_function_of_the_records_and_now() -> None:
    """`health.judge` names every verdict a tick acts on; the state it reads is untouched."""
    from tidal.controller.core import health

    driver = Driver(mode=common_pb2.JOB_MODE_LIVE, min_replicas=2, max_replicas=2)
    formed(driver, "a", "b")
    state = driver.state
    before = copy.deepcopy(state)
    assert health.judge(state, driver.clock) == health.Verdicts(members_of=state.job.generation)
    at = driver.clock + CONFIG.heartbeat_timeout_s + 0.5
    later = health.judge(dataclasses.replace(state, last_tick_at=at - 0.25), at)
    assert {f.unit_id for f in later.members} == {"a", "b"} and {f.cause for f in later.members} == {"heartbeat"}
    # The same silence seen by a tick long after the previous one: the controller was held up.
    assert health.judge(state, at).members == ()
    assert later.members_of == state.job.generation and not later.leave_overdue
    assert state == before
    # A unit asked to leave is overdue only past restart_grace_s + heartbeat_timeout_s.
    driver.feed(core.DrainRequested(("b",), 0))
    leaving_at = driver.clock
    overdue_s = CONFIG.restart_grace_s + CONFIG.heartbeat_timeout_s
    assert health.judge(driver.state, leaving_at + overdue_s - 0.1).leave_overdue == ()
    assert health.judge(driver.state, leaving_at + overdue_s + 0.1).leave_overdue == (("b", leaving_at),)


def test_a_unit_that_left_while_the_controller_was_away_is_gone_once_slurm_says_its_job_ended() -> None:
    """Chaos seeds 2 and 9 (hardened harness): a unit asked to leave that left while the
    controller restarted kept the stop round waiting until it was overdue. Its Slurm job's
    end settles it at once."""
    driver = Driver(min_replicas=2, max_replicas=2, slurm_units=True)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    driver.feed(core.UnitSubmitted("u1", 701))
    driver.feed(core.UnitSubmitted("u2", 702))
    driver.connect("u1")
    driver.connect("u2")
    driver.tick()
    assert driver.state.generation is not None and len(driver.state.generation.members) == 2
    driver.feed(core.DrainRequested(("u2",), uid=0))
    assert driver.state.units["u2"].state is UnitState.LEAVING
    # The controller restarts; u2's launcher left meanwhile, u1's comes back.
    job, units = driver.state.job, list(driver.state.units.values())
    driver.state = core.restore(job, units, driver.state.generation, generation_stopped=False, pending={},
                                config=CONFIG, now=driver.now, slurm_units=True)
    driver.connect("u1", last_generation=driver.state.job.generation, workers=(11,))
    driver.clock += 1.5
    running = (slurm_job(701, SlurmJobState.RUNNING),)
    effects = driver.feed(core.SlurmObserved(view(driver, (), (*running, slurm_job(702, SlurmJobState.RUNNING)))))
    assert driver.state.units["u2"].state is UnitState.LEAVING, "its Slurm job still runs: it may come back"
    effects = driver.feed(core.SlurmObserved(view(driver, (), (*running, slurm_job(702, SlurmJobState.COMPLETED)))))
    assert driver.state.units["u2"].state is UnitState.LEFT
    assert "unit_left" in driver.events(effects) and "unit_leave_overdue" not in driver.events()


def test_a_tick_after_the_controller_was_held_up_judges_no_heartbeat_silence_until_the_next() -> None:
    """Chaos seed 4 (hardened harness): a healthy unit was failed for 3.1 s without a
    heartbeat while the machine was loaded. A tick that comes more than a heartbeat interval
    after the previous one says the controller itself was held up; silence is judged at the
    next tick, once the heartbeats waiting unread are read. A unit really gone still fails."""
    driver = Driver(min_replicas=1, max_replicas=2)
    formed(driver, "a", "b")
    driver.tick(0.25)
    driver.links["a"] = core.Link(last_heartbeat_at=driver.clock)
    # The controller is held up for 3.5 s: neither heartbeat was read meanwhile.
    effects = driver.tick(3.5)
    assert "failure_detected" not in driver.events(effects)
    # Read now: a's heartbeat is fresh, b's launcher really went silent.
    driver.links["a"] = core.Link(last_heartbeat_at=driver.clock)
    effects = driver.tick(0.25)
    assert [e.unit_id for e in effects if isinstance(e, core.Record) and e.kind == "failure_detected"] == ["b"]


def test_a_joiner_that_reached_the_world_holds_the_state_before_its_heartbeats_say_so() -> None:
    """Chaos seed 1 (hardened harness): the only holder by heartbeats failed a moment after
    a grow; the joiners held the state (they had reported reaching the world, state
    verified) but their heartbeats still said step 0, and the next generation was said to
    hold no state. Reports count as well as heartbeats."""
    driver = Driver(min_replicas=1, max_replicas=3)
    formed(driver, "a")
    driver.beat("a", 40)
    driver.tick(0.25)
    assert driver.state.job.step == 40
    driver.connect("b")
    driver.connect("c")
    driver.tick(0.25)
    for unit in "bc":
        driver.report(unit, 2, launcher_pb2.GENERATION_PHASE_STARTED)
    for unit in "abc":
        driver.report(unit, 2, launcher_pb2.GENERATION_PHASE_RECONFIGURED, step=42)
    assert driver.state.changing is None
    driver.beat("b", 0)
    driver.beat("c", 0)
    effects = driver.exit("a", 2, code=1)
    assert "state_not_held" not in driver.events(effects)
    fields = driver.event("world_formed").fields
    assert fields is not None and fields["state_holders"] == "b,c"


def test_members_not_heard_from_since_a_controller_restart_are_not_said_to_hold_no_state() -> None:
    """Chaos seed 10 (at 0a2acef): a launcher was killed 1 s after a controller restart;
    the survivors, reattached with their workers but with no heartbeat since, formed the
    next generation, which was said to hold no state (its workers found it among
    themselves). Not heard from is unknown, not "holds nothing"."""
    driver = Driver(min_replicas=1)
    formed(driver, "a", "b", "c")
    for unit in "abc":
        driver.beat(unit, 40)
    driver.tick(0.25)
    assert driver.state.job.step == 40
    job, units = driver.state.job, list(driver.state.units.values())
    driver.state = core.restore(job, units, driver.state.generation, generation_stopped=False, pending={},
                                config=CONFIG, now=driver.now)
    for pid, unit in enumerate("abc"):
        driver.connect(unit, last_generation=1, workers=(11 + pid,))
    effects = driver.exit("c", 1, code=1)
    assert "world_formed" in driver.events(effects) and "state_not_held" not in driver.events(effects)
    assert any(isinstance(e, core.Note) and e.event == "state_holders_unknown" for e in effects)
    # Heard from, and holding nothing at the target: said so.
    driver.beat("a", 0)
    driver.beat("b", 0)
    driver.tick(0.25)
    effects = driver.exit("b", 2, code=1)
    assert "state_not_held" in driver.events(effects)


def busy(name: str) -> Node:
    return dataclasses.replace(node(name), state=NodeState.ALLOCATED)


def test_a_job_below_max_keeps_one_unit_queued_in_slurm_by_default_and_none_when_asked_or_not_next_in_line() -> None:
    driver = Driver(min_replicas=1, max_replicas=3, slurm_units=True)
    assert CONFIG.queued_units == 1, "the default"
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), busy("n2")))))
    driver.feed(core.UnitSubmitted("u1", 801))
    driver.connect("u1")
    driver.tick()
    assert driver.state.job.state is JobState.RUNNING
    running = (slurm_job(801, SlurmJobState.RUNNING),)
    # No node idle: one unit goes into Slurm's queue, to start when a node frees.
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")), running)))
    submits = [e for e in effects if isinstance(e, core.Submit)]
    assert [s.unit_id for s in submits] == ["u2"]
    assert driver.state.units["u2"].state is UnitState.SUBMITTED
    assert any(isinstance(e, core.Record) and e.kind == "unit_submitting"
               and e.reason.startswith("queued in Slurm for the next free node") for e in effects)
    driver.feed(core.UnitSubmitted("u2", 802))
    # While it waits in the queue no other is added, nor while another Slurm job waits.
    pending = (*running, slurm_job(802, SlurmJobState.PENDING))
    assert not [e for e in driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")), pending)))
                if isinstance(e, core.Submit)]
    # Slurm started it (not registered yet): the next one is queued, up to max_replicas.
    started = (*running, slurm_job(802, SlurmJobState.RUNNING))
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")), started)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"]
    driver.feed(core.UnitSubmitted("u3", 803))
    full = (*started, slurm_job(803, SlurmJobState.RUNNING))
    assert not [e for e in driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")), full)))
                if isinstance(e, core.Submit)], "at max_replicas nothing more is queued"

    def busy_cluster_submits(config: ControllerConfig, next_in_line: bool = True) -> list[core.Submit]:
        plain = Driver(min_replicas=1, max_replicas=3, slurm_units=True, config=config)
        plain.feed(core.SlurmObserved(view(plain, (node("n1"), busy("n2")))))
        plain.feed(core.UnitSubmitted("u1", 901))
        plain.connect("u1")
        plain.tick()
        return [e for e in plain.feed(core.SlurmObserved(
            view(plain, (busy("n1"), busy("n2")), (slurm_job(901, SlurmJobState.RUNNING),)),
            next_in_line=next_in_line)) if isinstance(e, core.Submit)]
    # queued_units 0: a busy cluster gets no unit queued; nor does a job that another
    # elastic job precedes by weight for the next free node.
    assert not busy_cluster_submits(dataclasses.replace(CONFIG, queued_units=0))
    assert not busy_cluster_submits(CONFIG, next_in_line=False)
    assert len(busy_cluster_submits(CONFIG)) == 1


def test_nodes_that_free_together_join_in_one_world_change_though_slurm_starts_the_queued_unit_first() -> None:
    """bench.goodput: a 2-node urgent job ended; Slurm started the unit queued ahead on one of
    its nodes, which registered before any view showed the other idle. The world grew onto
    it alone, the next view submitted a unit for the other node, and a second world change
    followed. The registration now asks for a view and the grow waits for it (join_settle_s
    at most), then for the unit that view submits: one change, both joiners."""
    driver = Driver(min_replicas=1, max_replicas=3, slurm_units=True,
                    config=dataclasses.replace(CONFIG, join_settle_s=1.0))
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), busy("n2"), busy("n3")))))
    driver.feed(core.UnitSubmitted("u1", 801))
    driver.connect("u1")
    driver.tick()
    assert driver.state.job.state is JobState.RUNNING
    running = (slurm_job(801, SlurmJobState.RUNNING),)
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), busy("n3")), running)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u2"]
    driver.feed(core.UnitSubmitted("u2", 802))
    driver.tick(0.5)
    # The other job's two nodes free; Slurm starts u2 at once and its launcher registers.
    driver.connect("u2")
    asked = [e for e in driver.effects[-10:] if isinstance(e, core.PollSlurmSoon)]
    assert asked and "u2" in asked[0].reason
    assert not reconfigurings(driver.tick(0.3)), "no grow before a view shows what else freed"
    # The view: n3 idle. A unit is submitted for it, and the grow waits for it.
    started = (*running, slurm_job(802, SlurmJobState.RUNNING))
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), node("n3")), started)))
    assert [e.unit_id for e in effects if isinstance(e, core.Submit)] == ["u3"]
    driver.feed(core.UnitSubmitted("u3", 803))
    assert not reconfigurings(driver.tick(0.8)), "u3 is waited for join_settle_s from its submission"
    driver.connect("u3")
    (grow,) = reconfigurings(driver.tick(0.1))
    assert grow.fields["joiners"] == "u2,u3" and grow.fields["world_size"] == 3, grow


def reconfigurings(effects: list[core.Effect]) -> list[core.Record]:
    return [e for e in effects if isinstance(e, core.Record) and e.kind == "world_reconfiguring"]


def test_a_member_leaving_with_the_last_copy_of_the_state_saves_it_rather_than_leave_a_world_without_it() -> None:
    """bench.goodput --quick: a worker was killed while a joiner's workers were still
    starting; the world re-formed with the joiner, and the only holder of the state was
    preempted before that world trained. Its graceful leave made a world of the joiners
    alone, which held no state (`state_lost`, the job failed). It now saves the state as it
    leaves, and the next world resumes from it."""
    driver = Driver(min_replicas=1, max_replicas=3)
    formed(driver, "a", "x")
    driver.beat("a", 40)
    driver.beat("x", 40)
    driver.tick(0.25)
    driver.connect("b")
    driver.tick(0.25)
    driver.exit("x", 2, code=1)
    for unit in "ab":
        driver.report(unit, 2, launcher_pb2.GENERATION_PHASE_STOPPED)
    assert driver.state.generation is not None and driver.state.generation.unit_ids == ("a", "b")
    effects = driver.feed(core.DrainRequested(("a",), uid=0))
    # It saves and leaves; the others stop, and their next world resumes from what it saved.
    assert driver.events(effects) == ["unit_leaving", "state_saving", "generation_stopping"]
    leave = next(e.message.generation for e in effects if isinstance(e, core.Send) and e.unit_id == "a")
    assert leave.save_state and "a" in leave.leaving
    # Once b holds the state (its heartbeats say the job's step), a drain is a graceful leave.
    driver = Driver(min_replicas=1, max_replicas=3)
    formed(driver, "a", "b")
    driver.beat("a", 40)
    driver.beat("b", 40)
    driver.tick(0.25)
    assert driver.events(driver.feed(core.DrainRequested(("a",), uid=0))) == ["unit_leaving", "world_reconfiguring"]


def degraded_with_slurm_units(config: ControllerConfig = CONFIG) -> Driver:
    """u1 and u2 train as Slurm units on n1 and n2; u2's worker fails and u1 alone waits
    below min 2 (DEGRADED), holding its node and the training state."""
    driver = Driver(min_replicas=2, max_replicas=3, slurm_units=True, config=config)
    driver.feed(core.SlurmObserved(view(driver, (node("n1"), node("n2")))))
    driver.feed(core.UnitSubmitted("u1", 501))
    driver.feed(core.UnitSubmitted("u2", 502))
    for unit in ("u1", "u2"):
        driver.connect(unit)
    driver.tick()
    driver.exit("u2", 1, code=1)
    driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_STOPPED, step=40)
    assert driver.state.job.state is JobState.DEGRADED
    return driver


def released(effects: list[core.Effect]) -> list[core.Record]:
    return [e for e in effects if isinstance(e, core.Record) and e.kind == "below_min_released"]


def blocked_view(driver: Driver) -> list[core.Effect]:
    """A view with every node taken (u1's and an urgent job's) and nothing of the job's
    starting: the replacements it asks for are queued in Slurm (pending)."""
    urgent = dataclasses.replace(slurm_job(900, SlurmJobState.RUNNING), name="urgent")
    pending = tuple(slurm_job(u.slurm_job_id, SlurmJobState.PENDING) for u in driver.state.units.values()
                    if u.state is UnitState.SUBMITTED and u.slurm_job_id)
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING), urgent, *pending))))
    for number, submit in enumerate(e for e in effects if isinstance(e, core.Submit)):
        driver.feed(core.UnitSubmitted(submit.unit_id, 700 + len(driver.state.units) + number))
    return effects


def test_below_min_with_nothing_on_its_way_the_job_gives_its_nodes_back_after_the_blocked_wait() -> None:
    # Seen in bench.goodput: an urgent job of 3 nodes took every node but one; the last
    # unit held its node idle for the whole 30 s below_min_release_s, though no Slurm view
    # showed anything that could bring the job back to min before another job ended.
    driver = degraded_with_slurm_units()
    blocked_view(driver)
    assert driver.state.blocked_below_min_since == driver.clock
    assert released(driver.tick(CONFIG.below_min_blocked_release_s - 0.5)) == []
    # The wait is over, but the only view is as old as it: a fresh one first.
    effects = driver.tick(0.5)
    assert released(effects) == [] and polls_asked(effects), effects
    blocked_view(driver)
    effects = driver.tick()
    (record,) = released(effects)
    assert "below_min_blocked_release_s" in record.reason and (record.fields or {})["units"] == "u1"
    (leave,) = [e.message.generation for e in effects
                if isinstance(e, core.Send) and e.unit_id == "u1" and generations.said(e.message) == "leave"]
    assert leave.save_state, "u1 holds the only copy of the state: it saves it as it leaves"


def test_below_min_a_unit_that_slurm_started_after_the_blocked_view_keeps_the_job_holding() -> None:
    # A review's scenario: blocked at T; another job ends, and Slurm starts the queued
    # replacement, whose launcher takes longer than the blocked wait to register.
    driver = degraded_with_slurm_units()
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    (replacement,) = [e for e in effects if isinstance(e, core.Submit)]
    driver.feed(core.UnitSubmitted(replacement.unit_id, 503))
    blocked_view(driver)
    assert driver.state.blocked_below_min_since == driver.clock
    driver.tick(CONFIG.below_min_blocked_release_s)
    started = (slurm_job(501, SlurmJobState.RUNNING), slurm_job(503, SlurmJobState.RUNNING))
    driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")), started)))
    assert driver.state.blocked_below_min_since is None
    assert released(driver.tick(1.0)) == [], "its launcher is on its way"
    assert driver.state.units[replacement.unit_id].state is UnitState.SUBMITTED, "not cancelled"


def release_after_blocked_wait(driver: Driver, config: ControllerConfig) -> list[core.Effect]:
    """Blocked views across below_min_blocked_release_s: the tick after the last releases."""
    blocked_view(driver)
    driver.tick(config.below_min_blocked_release_s)
    blocked_view(driver)
    return driver.tick()


def resume_on_two_idle_nodes(driver: Driver) -> list[core.Effect]:
    """After a release: n3 and n4 idle; the two units submitted onto them register, and
    the tick after (a world formed) is returned."""
    effects = driver.feed(core.SlurmObserved(view(driver, (node("n3"), node("n4")))))
    units = [e.unit_id for e in effects if isinstance(e, core.Submit)]
    assert len(units) == 2, effects
    for number, unit in enumerate(units):
        driver.feed(core.UnitSubmitted(unit, 600 + number))
        driver.connect(unit)
    return driver.tick()


def test_a_restarted_controller_keeps_a_release_below_min_until_a_world_forms() -> None:
    """The release is persisted: a controller restarted after it waits for min_replicas
    idle nodes rather than queueing a replacement that would hold a node below min."""
    config = dataclasses.replace(CONFIG, queued_units=1)
    driver = degraded_with_slurm_units(config)
    effects = release_after_blocked_wait(driver, config)
    assert released(effects)
    pending = {e.key: e.value for e in effects if isinstance(e, core.SavePending)}
    assert pending["released_below_min"] is True
    effects = driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_LEFT, step=40)
    job, units = dataclasses.replace(driver.state.job), list(driver.state.units.values())
    driver.state = core.restore(job, units, driver.state.generation, generation_stopped=False, pending=pending,
                                config=config, now=driver.now, slurm_units=True)
    assert driver.state.released_below_min
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), node("n3")))))
    assert not [e for e in effects if isinstance(e, core.Submit)], "one idle node of 2: nothing queued"
    effects = resume_on_two_idle_nodes(driver)
    assert driver.state.job.state is JobState.RUNNING and not driver.state.released_below_min
    assert [e.value for e in effects if isinstance(e, core.SavePending) and e.key == "released_below_min"] == [False]
    # A job that is running again when the controller restarts is not released.
    assert not core.restore(driver.state.job, list(driver.state.units.values()), driver.state.generation,
                            generation_stopped=False, pending=pending, config=config, now=driver.now,
                            slurm_units=True).released_below_min


def test_a_job_resumed_after_a_release_queues_units_again() -> None:
    """The release below min holds back replacements and queued units until a world forms
    again; a world formed directly (not through a state change's event) ended it too."""
    config = dataclasses.replace(CONFIG, queued_units=1)
    driver = degraded_with_slurm_units(config)
    assert released(release_after_blocked_wait(driver, config))
    driver.report("u1", 1, launcher_pb2.GENERATION_PHASE_LEFT, step=40)
    assert driver.state.released_below_min
    resume_on_two_idle_nodes(driver)
    assert driver.state.job.state is JobState.RUNNING
    assert not driver.state.released_below_min and driver.state.degraded_since is None
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n3"), busy("n4")),
                                                  (slurm_job(600, SlurmJobState.RUNNING),
                                                   slurm_job(601, SlurmJobState.RUNNING)))))
    assert [e for e in effects if isinstance(e, core.Submit)], "one unit queued ahead, as before the release"



def test_below_min_an_idle_node_or_a_starting_unit_keeps_the_full_release_wait() -> None:
    # (No unit queued ahead once the replacement makes min_replicas: one submitted and
    # not shown by a view yet would count as on its way.)
    driver = degraded_with_slurm_units(dataclasses.replace(CONFIG, queued_units=0))
    # An idle node (n3): a replacement is submitted onto it; while Slurm starts it, it is
    # on its way, and the job keeps its state in memory for it.
    effects = driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), node("n3")),
                                                  (slurm_job(501, SlurmJobState.RUNNING),))))
    (submit,) = [e for e in effects if isinstance(e, core.Submit)]
    driver.feed(core.UnitSubmitted(submit.unit_id, 503))
    assert driver.state.blocked_below_min_since is None
    driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), busy("n3")),
                                        (slurm_job(501, SlurmJobState.RUNNING),
                                         slurm_job(503, SlurmJobState.RUNNING)))))
    assert driver.state.blocked_below_min_since is None, "u3's job runs: its launcher is on its way"
    assert released(driver.tick(CONFIG.below_min_blocked_release_s + 1)) == []
    # An idle node that another job waits for is not the job's: nothing on its way.
    waiting = dataclasses.replace(slurm_job(901, SlurmJobState.PENDING), name="urgent", reason="Resources")
    driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), node("n3")),
                                        (slurm_job(501, SlurmJobState.RUNNING), waiting))))
    assert driver.state.blocked_below_min_since == driver.clock


def test_the_blocked_release_is_off_when_the_release_is_off_or_its_own_wait_is_zero() -> None:
    for settings in ({"below_min_release_s": 0.0}, {"below_min_blocked_release_s": 0.0}):
        driver = degraded_with_slurm_units(dataclasses.replace(CONFIG, **settings))
        driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2")),
                                            (slurm_job(501, SlurmJobState.RUNNING),))))
        assert released(driver.tick(10.0)) == [], settings


def test_a_restarted_controller_counts_a_degraded_jobs_release_wait_from_its_start() -> None:
    # A review found that it never released: the wait ran from `degraded_since`, which a
    # restarted controller did not know, so every tick counted it from that tick.
    driver = degraded_with_slurm_units()
    driver.tick(10.0)
    driver.state = core.restore(dataclasses.replace(driver.state.job), list(driver.state.units.values()),
                                driver.state.generation, generation_stopped=True, pending={}, config=CONFIG,
                                now=driver.now, slurm_units=True)
    driver.connect("u1", last_generation=1)
    assert driver.state.job.state is JobState.DEGRADED
    assert released(driver.tick(CONFIG.below_min_release_s - 1)) == [], "counted from the restart"
    (record,) = released(driver.tick(1.0))
    assert (record.fields or {})["units"] == "u1"


def test_below_min_a_node_whose_last_job_is_completing_is_on_its_way_and_a_stale_view_proves_nothing() -> None:
    driver = degraded_with_slurm_units()
    blocked_view(driver)
    assert driver.state.blocked_below_min_since == driver.clock
    completing = dataclasses.replace(node("n3"), flags=frozenset({NodeFlag.COMPLETING}))
    driver.feed(core.SlurmObserved(view(driver, (busy("n1"), busy("n2"), completing),
                                        (slurm_job(501, SlurmJobState.RUNNING),))))
    assert driver.state.blocked_below_min_since is None, "n3 is idle in a moment"
    blocked_view(driver)
    assert driver.state.blocked_below_min_since == driver.clock
    driver.feed(core.SlurmObserved(dataclasses.replace(view(driver, ()), stale=True)))
    assert driver.state.blocked_below_min_since is None, "Slurm did not answer: nothing is known"
    driver.tick(CONFIG.below_min_blocked_release_s + 1)
    assert released(driver.effects) == []
