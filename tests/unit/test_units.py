"""Units as Slurm jobs: how many to submit on one cluster view, and the batch script."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tidal.controller.config import ControllerConfig
from tidal.controller.events import EventLog
from tidal.controller.jobs import (
    CancelRequested,
    Connected,
    JobActor,
    Said,
    SlurmObserved,
    SlurmUnits,
    Throughput,
    Tick,
)
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import JobRecord, JobState, UnitState
from tidal.controller.security import secret_digest
from tidal.controller.server import Controller
from tidal.controller.sessions import LauncherSession
from tidal.controller.spec import SpecError, normalized_spec
from tidal.controller.store import StateStore
from tidal.controller.units import (
    NodeNeeds,
    idle_nodes_for,
    node_needs,
    releasing,
    unit_script,
    unit_submission,
    units_to_submit,
)
from tidal.proto import admin_pb2, common_pb2, launcher_pb2
from tidal.slurm.cli_json import CliJsonSlurmClient
from tidal.slurm.errors import SlurmError, SlurmParseError, SlurmTimeout
from tidal.slurm.fake import FakeSlurmClient
from tidal.slurm.models import Gres, Node, NodeFlag, NodeState
from tidal.slurm.models import JobState as SlurmJobState
from tidal.slurm.snapshot import ClusterPoll


def node(name: str, state: NodeState = NodeState.IDLE, partitions: tuple[str, ...] = ("train",),
         flags: frozenset[NodeFlag] = frozenset()) -> Node:
    return Node(name=name, state=state, flags=flags, partitions=partitions, cpus=2, gres=(), features=(),
                reason="")


SPEC = admin_pb2.JobSpec(min_replicas=2, max_replicas=4, partition="train", nodes_per_replica=1)


def test_below_min_submits_the_difference_whatever_is_idle_and_more_where_idle_nodes_take_them() -> None:
    def demand(alive: int, idle: int, others: int = 0) -> tuple[int, str]:
        result = units_to_submit(SPEC, alive=alive, idle_nodes=idle, now=10.0, last_change_at=None,
                                 scale_up_snooze_s=0, others_waiting=others)
        return result.count, result.reason
    assert demand(0, 0) == (2, "0 of min 2 replicas")
    assert demand(0, 1) == (2, "0 of min 2 replicas")
    # A job starts at the size the idle nodes allow, not at min to grow onto them later.
    assert demand(0, 3) == (3, "0 of min 2 replicas; 3 idle node(s) fit; growing toward max_replicas 4")
    assert demand(1, 5)[0] == 3
    assert demand(0, 3, others=1) == (2, "0 of min 2 replicas")


def test_a_job_that_gave_its_nodes_back_below_min_waits_for_min_idle_nodes_then_grows() -> None:
    def demand(alive: int, idle: int, others: int = 0) -> tuple[int, str]:
        result = units_to_submit(SPEC, alive=alive, idle_nodes=idle, now=10.0, last_change_at=None,
                                 scale_up_snooze_s=0, others_waiting=others, released=True)
        return result.count, result.reason
    # The node it gave back is idle: a queued replacement would only take it again.
    assert demand(0, 1) == (0, "nodes given back below min_replicas 2: waiting for 2 idle node(s) (1 fit)")
    assert demand(0, 3)[0] == 3 and "toward max_replicas 4" in demand(0, 3)[1]
    assert demand(1, 1) == (1, "1 idle node(s) fit; growing toward max_replicas 4")
    assert demand(0, 2, others=1) == (0, "1 other Slurm job(s) wait for nodes")


def test_growth_takes_idle_nodes_up_to_max_and_respects_the_snooze() -> None:
    grow = units_to_submit(SPEC, alive=2, idle_nodes=5, now=10.0, last_change_at=None, scale_up_snooze_s=0)
    assert grow.count == 2 and "toward max_replicas 4" in grow.reason
    assert units_to_submit(SPEC, alive=2, idle_nodes=1, now=10.0, last_change_at=None, scale_up_snooze_s=0).count == 1
    assert units_to_submit(SPEC, alive=4, idle_nodes=3, now=10.0, last_change_at=None,
                           scale_up_snooze_s=0).reason == "at max_replicas 4"
    assert units_to_submit(SPEC, alive=2, idle_nodes=0, now=10.0, last_change_at=None,
                           scale_up_snooze_s=0).reason == "no idle node fits"
    snoozed = units_to_submit(SPEC, alive=2, idle_nodes=3, now=10.0, last_change_at=8.0, scale_up_snooze_s=5.0)
    assert snoozed.count == 0 and snoozed.reason == "scale-up snoozed for 3.0 s"
    waiting = units_to_submit(SPEC, alive=2, idle_nodes=3, now=10.0, last_change_at=None, scale_up_snooze_s=0,
                              others_waiting=1)
    assert waiting.count == 0 and waiting.reason == "1 other Slurm job(s) wait for nodes"
    assert units_to_submit(SPEC, alive=1, idle_nodes=0, now=10.0, last_change_at=None, scale_up_snooze_s=0,
                           others_waiting=3).count == 1, "a replacement below min is never held back"
    two_node = admin_pb2.JobSpec(min_replicas=1, max_replicas=4, nodes_per_replica=2)
    assert units_to_submit(two_node, alive=1, idle_nodes=5, now=0, last_change_at=None, scale_up_snooze_s=0).count == 2


def test_a_shared_allowance_bounds_growth_to_a_size_the_job_allows_never_below_min() -> None:
    """Other elastic jobs share the idle nodes by weight (`allowance`, in nodes): growth
    stops at the largest allowed size within it, whole replicas of K nodes, and a job
    below min still gets the difference."""
    stepped = admin_pb2.JobSpec(min_replicas=2, max_replicas=8, replica_step=2, nodes_per_replica=1)
    assert units_to_submit(stepped, alive=0, idle_nodes=4, now=0, last_change_at=None, scale_up_snooze_s=0,
                           allowance=3).count == 2
    assert units_to_submit(stepped, alive=2, idle_nodes=4, now=0, last_change_at=None, scale_up_snooze_s=0,
                           allowance=3).count == 2
    assert units_to_submit(stepped, alive=2, idle_nodes=4, now=0, last_change_at=None, scale_up_snooze_s=0,
                           allowance=1).count == 0
    assert units_to_submit(stepped, alive=0, idle_nodes=4, now=0, last_change_at=None, scale_up_snooze_s=0,
                           allowance=0).count == 2
    two_node = admin_pb2.JobSpec(min_replicas=1, max_replicas=4, nodes_per_replica=2, mode=common_pb2.JOB_MODE_LIVE)
    assert units_to_submit(two_node, alive=0, idle_nodes=5, now=0, last_change_at=None, scale_up_snooze_s=0,
                           allowance=3).count == 2
    assert units_to_submit(two_node, alive=0, idle_nodes=5, now=0, last_change_at=None,
                           scale_up_snooze_s=0).count == 4
    # Its reasons name the spec's replicas and the nodes they make, not max_replicas 4.
    started = units_to_submit(two_node, alive=0, idle_nodes=5, now=0, last_change_at=None, scale_up_snooze_s=0)
    assert started.reason == ("0 of 2 nodes (min_replicas 1); 5 idle node(s) fit; growing toward max_replicas 4 "
                              "(8 nodes); replicas of 2 nodes")
    released = units_to_submit(two_node, alive=0, idle_nodes=1, now=0, last_change_at=None, scale_up_snooze_s=0,
                               released=True)
    assert released.reason == ("nodes given back below min_replicas 1 (2 nodes): waiting for 2 idle node(s) "
                               "(1 fit); replicas of 2 nodes")
    # Sizes decided node by node read in nodes, the spec's max with the nodes it makes.
    full = units_to_submit(two_node, alive=8, idle_nodes=2, now=0, last_change_at=None, scale_up_snooze_s=0)
    assert full.reason == "at max_replicas 4 (8 nodes); replicas of 2 nodes"
    stepped_pairs = admin_pb2.JobSpec(min_replicas=1, max_replicas=4, replica_step=2, nodes_per_replica=2,
                                      mode=common_pb2.JOB_MODE_LIVE)
    short = units_to_submit(stepped_pairs, alive=2, idle_nodes=3, now=0, last_change_at=None, scale_up_snooze_s=0)
    assert short.reason == ("3 idle node(s) fit, too few for the next allowed size 6 nodes; replicas of 2 nodes"), \
        short.reason
    # A max of 20 replicas of 2 nodes: the spec's number, then the nodes it makes.
    wide = admin_pb2.JobSpec(min_replicas=2, max_replicas=20, nodes_per_replica=2, mode=common_pb2.JOB_MODE_LIVE)
    grown = units_to_submit(wide, alive=4, idle_nodes=4, now=0, last_change_at=None, scale_up_snooze_s=0)
    assert grown.reason == "4 idle node(s) fit; growing toward max_replicas 20 (40 nodes); replicas of 2 nodes"


def test_only_idle_usable_nodes_of_the_jobs_partition_count() -> None:
    nodes = [node("n1"), node("n2", NodeState.ALLOCATED), node("n3", flags=frozenset({NodeFlag.DRAIN})),
             node("n4", partitions=("urgent",)), node("n5", partitions=("train", "urgent"))]
    assert idle_nodes_for(SPEC, nodes) == ["n1", "n5"]
    assert idle_nodes_for(admin_pb2.JobSpec(), nodes) == ["n1", "n4", "n5"]


def test_growth_reaches_only_world_sizes_the_job_allows() -> None:
    stepped = admin_pb2.JobSpec(min_replicas=2, max_replicas=8, replica_step=2, nodes_per_replica=1)
    one_short = units_to_submit(stepped, alive=2, idle_nodes=1, now=0, last_change_at=None, scale_up_snooze_s=0)
    assert (one_short.count, one_short.reason) == (0, "1 idle node(s) fit, too few for the next allowed size "
                                                      "4 replicas")
    assert units_to_submit(stepped, alive=2, idle_nodes=3, now=0, last_change_at=None, scale_up_snooze_s=0).count == 2
    assert units_to_submit(stepped, alive=2, idle_nodes=5, now=0, last_change_at=None, scale_up_snooze_s=0).count == 4
    listed = admin_pb2.JobSpec(min_replicas=1, max_replicas=8, allowed_replicas=[1, 4, 8], nodes_per_replica=1)
    assert units_to_submit(listed, alive=1, idle_nodes=6, now=0, last_change_at=None, scale_up_snooze_s=0).count == 3
    assert units_to_submit(listed, alive=4, idle_nodes=3, now=0, last_change_at=None, scale_up_snooze_s=0).count == 0


def gpu_node(name: str, features: tuple[str, ...], gres: tuple[Gres, ...]) -> Node:
    return Node(name=name, state=NodeState.IDLE, flags=frozenset(), partitions=("train",), cpus=2, gres=gres,
                features=features, reason="")


def test_idle_nodes_must_offer_the_features_and_gres_the_units_ask_for() -> None:
    nodes = [gpu_node("a", ("a100", "ib"), (Gres("gpu", "a100", 4),)),
             gpu_node("h", ("h100", "ib"), (Gres("gpu", "h100", 8),)),
             gpu_node("c", ("cpu",), ())]

    def fitting(*options: str) -> list[str]:
        return idle_nodes_for(admin_pb2.JobSpec(partition="train", sbatch_options=list(options)), nodes)

    assert fitting() == ["a", "c", "h"]
    assert fitting("-C", "a100") == ["a"]
    assert fitting("--constraint=a100|h100") == ["a", "h"]
    assert fitting("--constraint=ib&(a100|h100)") == ["a", "h"]
    assert fitting("--constraint=cpu&ib") == []
    assert fitting("--gres=gpu:8") == ["h"]
    assert fitting("--gres=gpu:a100:2") == ["a"]
    assert fitting("--gres=gpu") == ["a", "h"]
    assert fitting("--gpus-per-node=h100:4") == ["h"]
    assert fitting("--gres=gpu:2", "--constraint", "h100") == ["h"]
    # Syntax Tidal does not evaluate (counts, brackets) or cannot parse is left to Slurm.
    assert fitting("--constraint=[a100*2&h100*2]") == ["a", "c", "h"]
    assert fitting("--constraint=a100&(h100") == ["a", "c", "h"]
    assert node_needs(admin_pb2.JobSpec(sbatch_options=["-Ca100", "--gres=gpu:a100:2,nic:1"])) == NodeNeeds(
        constraint="a100", gres=(Gres("gpu", "a100", 2), Gres("nic", None, 1)))


def test_a_units_batch_script_starts_the_launcher_and_carries_no_secret(tmp_path: Path) -> None:
    spec = admin_pb2.JobSpec(partition="train", working_dir="/work", sbatch_options=["--time=10:00", "-A", "ml"])
    submission = unit_submission(spec, job_id="lm-1a2b3c", unit_id="u7", launcher=("/venv/bin/python", "-m",
                                 "tidal.launcher.agent"), controller="ctl:7420",
                                 secret_path=tmp_path / "lm-1a2b3c.secret", output_dir=tmp_path)
    assert submission.script.splitlines()[-1] == ("exec /venv/bin/python -m tidal.launcher.agent --controller "
                                                  "ctl:7420 --job lm-1a2b3c --unit u7")
    assert "secret" not in submission.script.lower().replace("lm-1a2b3c.secret", "")
    assert submission.environment == {"TIDAL_SECRET_FILE": str(tmp_path / "lm-1a2b3c.secret")}
    assert submission.name == "tidal-lm-1a2b3c-u7" and submission.exclusive and not submission.requeue
    assert submission.extra_options == ("--time=10:00", "-A", "ml") and submission.partition == "train"


def test_a_one_node_units_script_is_the_launcher_itself_and_a_two_node_units_runs_one_launcher_per_node_with_srun(
        tmp_path: Path) -> None:
    launcher = ("/venv/bin/python", "-m", "tidal.launcher.agent")
    one = unit_script(launcher, controller="ctl:7420", job_id="lm-1a2b3c", unit_id="u7")
    assert one == unit_script(launcher, controller="ctl:7420", job_id="lm-1a2b3c", unit_id="u7", nodes=1) == (
        "#!/bin/bash\n# Tidal unit u7 of elastic job lm-1a2b3c: one data-parallel replica.\n"
        "exec /venv/bin/python -m tidal.launcher.agent --controller ctl:7420 --job lm-1a2b3c --unit u7\n")
    spec = admin_pb2.JobSpec(nodes_per_replica=2, mode=common_pb2.JOB_MODE_RESTART)
    submission = unit_submission(spec, job_id="lm-1a2b3c", unit_id="u7", launcher=launcher, controller="ctl:7420",
                                 secret_path=tmp_path / "lm-1a2b3c.secret", output_dir=tmp_path)
    assert submission.nodes == 2
    lines = submission.script.splitlines()
    assert lines[0] == "#!/bin/bash" and all(line.startswith("#") for line in lines[:-1])
    assert lines[-1] == ("exec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=60 "
                         "/venv/bin/python -m tidal.launcher.agent --controller ctl:7420 --job lm-1a2b3c --unit u7 "
                         "--unit-nodes 2")
    assert "secret" not in submission.script.lower()
    assert submission.environment == {"TIDAL_SECRET_FILE": str(tmp_path / "lm-1a2b3c.secret")}


def test_replicas_spanning_nodes_are_one_job_in_restart_mode_and_one_node_units_in_live_mode() -> None:
    from tidal.controller.units import unit_nodes

    spec = normalized_spec(admin_pb2.JobSpec(command=["train"], nodes_per_replica=2,
                                             mode=common_pb2.JOB_MODE_RESTART))
    assert spec.nodes_per_replica == 2 and unit_nodes(spec) == 2
    live = normalized_spec(admin_pb2.JobSpec(command=["train"], nodes_per_replica=2, mode=common_pb2.JOB_MODE_LIVE))
    assert live.nodes_per_replica == 2 and unit_nodes(live) == 1
    with pytest.raises(SpecError, match="nodes_per_replica: must be >= 1"):
        normalized_spec(admin_pb2.JobSpec(command=["train"], nodes_per_replica=-1))


def slurm_actor(tmp_path: Path, fake: FakeSlurmClient, **spec_fields: object) -> JobActor:
    """A job actor whose units are jobs of `fake`, as the controller builds it."""
    store = StateStore(tmp_path / "tidal.db")
    spec = normalized_spec(admin_pb2.JobSpec(name="lm", command=["train"], partition="train",
                                             mode=common_pb2.JOB_MODE_LIVE, **spec_fields))
    job = JobRecord(job_id="lm-1", spec=spec, state=JobState.PENDING, owner_uid=0, secret_sha256=secret_digest("s"),
                    created_at=time.time(), updated_at=time.time())
    store.insert_job(job)
    units = SlurmUnits(client=fake, launcher=("tidal-launcher",), controller_address="127.0.0.1:1",
                       output_template=str(tmp_path / "units"), secrets_dir=tmp_path)
    return JobActor(job, [], None, generation_stopped=False, config=ControllerConfig(state_dir=tmp_path), store=store,
                    events=EventLog(store), metrics=ControllerMetrics(), started_at=time.monotonic(), slurm=units)


async def settle(check: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the actor did not get there"
        await asyncio.sleep(0.01)


async def registered_then_cancelled(actor: JobActor, poll: ClusterPoll) -> int:
    """The actor's one unit submitted, its launcher registered, then the job cancelled:
    the unit is LEAVING. Its Slurm job id."""
    actor.put(SlurmObserved(poll.poll()))
    await settle(lambda: "u1" in actor.units and actor.units["u1"].slurm_job_id)
    now = time.monotonic()
    session = LauncherSession(job_id="lm-1", unit_id="u1", opened_at=now, last_heartbeat_at=now, store_port=1,
                              worker_pids=())
    actor.put(Connected(session, launcher_pb2.Register(job_id="lm-1", unit_id="u1", secret="s", nodes=["n1"],
                                                       address="127.0.0.1", store_port=1)))
    actor.put(CancelRequested(0))
    await settle(lambda: actor.units["u1"].state is UnitState.LEAVING)
    return actor.units["u1"].slurm_job_id


def test_a_requeued_unit_is_cancelled_and_replaced_by_a_new_unit(tmp_path: Path) -> None:
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        poll = ClusterPoll(fake)
        actor.put(SlurmObserved(poll.poll()))
        await settle(lambda: "u1" in actor.units and actor.units["u1"].slurm_job_id)
        first = actor.units["u1"].slurm_job_id
        assert fake.get_job(first).state is SlurmJobState.RUNNING
        fake.requeue(first)
        actor.put(SlurmObserved(poll.poll()))
        await settle(lambda: "u2" in actor.units and actor.units["u2"].slurm_job_id)
        kinds = [e.kind for e in actor.store.events("lm-1")]
        assert "unit_requeued" in kinds
        assert fake.get_job(first).state is SlurmJobState.CANCELLED, "the requeued copy would start again"
        assert actor.units["u1"].state is UnitState.FAILED
        task.cancel()

    asyncio.run(scenario())


def test_sbatchs_answer_from_the_executor_wakes_the_actor_under_asyncios_debug_mode(tmp_path: Path) -> None:
    """sbatch and scancel run on executor threads; their answers reach the job's actor on
    the event loop's thread (`call_soon_threadsafe`). Put on its asyncio queue from the
    thread, the actor waiting on it was not woken until the loop woke for something else,
    and under asyncio's debug mode (which checks that) never: its unit stayed with its
    sbatch in flight for good."""
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        actor.put(SlurmObserved(ClusterPoll(fake).poll()))
        await settle(lambda: "u1" in actor.units and actor.units["u1"].slurm_job_id)
        assert not actor.units["u1"].facts.sbatch_in_flight and list(fake.jobs) == [1]
        task.cancel()

    asyncio.run(scenario(), debug=True)


@pytest.mark.parametrize("lost", [
    SlurmTimeout(["sbatch", "--parsable"], 10.0),
    SlurmParseError("sbatch printed no job id: 'sbatch: warning: slurmctld slow'"),
])
def test_a_unit_whose_sbatch_answer_was_lost_is_found_by_its_name_and_not_submitted_twice(
        tmp_path: Path, lost: SlurmError) -> None:
    """sbatch timed out, or printed no job id, after slurmctld had taken the job (an
    overloaded slurmctld: 'Socket timed out on send/recv operation'). The unit was failed as
    refused ('sbatch refused the unit'), and a second unit submitted beside the Slurm job
    that did run. The unit waits for the next view instead, which shows its job by name."""
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        later = [0.0]
        poll = ClusterPoll(fake, clock=lambda: time.time() + later[0])
        fake.fail_after_next("submit", lost)
        actor.put(SlurmObserved(poll.poll()))
        await settle(lambda: "u1" in actor.units and not actor.units["u1"].facts.sbatch_in_flight)
        assert list(fake.jobs) == [1], "slurmctld took the job; only its answer was lost"
        assert actor.units["u1"].state is UnitState.SUBMITTED, actor.units["u1"].reason
        # Views taken after the lost answer: the unit is found by its job's name, and no
        # unit is submitted beside it.
        later[0] = 5.0
        for _ in range(3):
            actor.put(SlurmObserved(poll.poll()))
            await actor.settled()
        assert actor.units["u1"].slurm_job_id == 1 and actor.units["u1"].state is UnitState.SUBMITTED
        assert sorted(actor.units) == ["u1"] and list(fake.jobs) == [1]
        kinds = [e.kind for e in actor.store.events("lm-1")]
        assert "unit_submit_failed" not in kinds and "unit_submit_unanswered" in kinds
        assert str(lost) in next(e.reason for e in actor.store.events("lm-1") if e.kind == "unit_submit_unanswered")
        task.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("printed", ["99999999999999999999", "\u00b2", "0"])
def test_an_sbatch_that_prints_a_job_id_slurm_never_gives_leaves_no_unit_waiting_for_ever(
        tmp_path: Path, printed: str) -> None:
    """sbatch printed digits that are no Slurm job id (past the 32 bits Slurm's ids have,
    a superscript digit, 0). A 20-digit id did not fit SQLite: the answer's transition was
    refused (job_input_failed) and the unit stayed with its sbatch in flight for good,
    counted as on its way, so the job was never given a unit in its place; a superscript
    raised a ValueError that no one read, with the same end."""
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        sbatch = bin_dir / "sbatch"
        sbatch.write_text(f"#!/bin/sh\ncat > /dev/null\necho '{printed}'\n", encoding="utf-8")
        sbatch.chmod(0o755)
        assert actor.slurm is not None
        actor.slurm = dataclasses.replace(actor.slurm, client=CliJsonSlurmClient(bin_dir=str(bin_dir), timeout_s=10))
        task = asyncio.create_task(actor.run())
        actor.put(SlurmObserved(ClusterPoll(fake).poll()))
        await settle(lambda: "u1" in actor.units and not actor.units["u1"].facts.sbatch_in_flight)
        unanswered = [e for e in actor.store.events("lm-1") if e.kind == "unit_submit_unanswered"]
        assert len(unanswered) == 1 and "sbatch printed no job id" in unanswered[0].reason
        assert actor.units["u1"].slurm_job_id == 0
        task.cancel()

    asyncio.run(scenario())


def test_growth_takes_only_the_nodes_the_weighted_share_allows(tmp_path: Path) -> None:
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(4)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=4)
        task = asyncio.create_task(actor.run())
        poll = ClusterPoll(fake)
        actor.put(SlurmObserved(poll.poll(), grow_allowance=0))
        await settle(lambda: "u1" in actor.units and actor.units["u1"].slurm_job_id)
        # At min: growth onto the 3 idle nodes is capped by the share.
        actor.put(SlurmObserved(poll.poll(), grow_allowance=1))
        await settle(lambda: "u2" in actor.units and actor.units["u2"].slurm_job_id)
        await asyncio.sleep(0.05)
        assert sorted(actor.units) == ["u1", "u2"]
        shared = [e for e in actor.store.events("lm-1") if e.kind == "growth_shared"]
        # (Below min, the first view gave the difference and held back the rest by the share.)
        assert [e.reason.split(" go to ")[0] for e in shared] == ["3 of 4 idle node(s)", "2 of 3 idle node(s)"], shared
        task.cancel()

    asyncio.run(scenario())


def test_throughput_and_goodput_from_what_the_heartbeats_say() -> None:
    throughput = Throughput(window_s=10.0)
    # 2 nodes held for 10 s, both training; then 4 held for 10 s while 2 train (2 join).
    for second in range(0, 11):
        throughput.observe(float(second), step=second * 5, samples=second * 5 * 32, held_nodes=2, training_nodes=2)
    assert throughput.rates(10.0, global_batch=0) == (5.0, 160.0)
    for second in range(11, 21):
        throughput.observe(float(second), step=50 + (second - 10) * 5, samples=(50 + (second - 10) * 5) * 32,
                           held_nodes=4, training_nodes=2)
    assert throughput.goodput == (2 * 10 + 2 * 10) / (2 * 10 + 4 * 10)
    # Restart mode reports no samples: steps/s x the spec's global batch.
    steps_only = Throughput()
    steps_only.observe(0.0, 0, 0, 1, 1)
    steps_only.observe(4.0, 8, 0, 1, 1)
    assert steps_only.rates(4.0, global_batch=64) == (2.0, 128.0)
    # No progress for longer than the window: no rate at all.
    assert steps_only.rates(40.0, global_batch=64) == (0.0, 0.0)


def test_a_unit_that_does_not_leave_in_time_is_cancelled_in_slurm(tmp_path: Path) -> None:
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        slurm_job = await registered_then_cancelled(actor, ClusterPoll(fake))
        # The launcher was told to leave and hangs: within the grace nothing happens ...
        actor.put(Tick())
        await asyncio.sleep(0.05)
        assert fake.get_job(slurm_job).state is SlurmJobState.RUNNING
        # ... past restart_grace_s + heartbeat_timeout_s its Slurm job is cancelled.
        leaver = actor.units["u1"]
        assert leaver.facts.leaving_since is not None
        leaver.facts = dataclasses.replace(leaver.facts, leaving_since=leaver.facts.leaving_since - (
            actor.config.restart_grace_s + actor.config.heartbeat_timeout_s + 1))
        actor.put(Tick())
        await settle(lambda: fake.get_job(slurm_job).state is SlurmJobState.CANCELLED)
        overdue = [e for e in actor.store.events("lm-1") if e.kind == "unit_leave_overdue"]
        assert len(overdue) == 1 and f"Slurm job {slurm_job} cancelled" in overdue[0].reason
        task.cancel()

    asyncio.run(scenario())


def test_a_cancel_that_slurm_did_not_answer_is_made_again_on_the_next_view_that_shows_the_job(
        tmp_path: Path) -> None:
    """scancel timed out (slurmctld overloaded) for a unit whose launcher hangs: the failure
    was logged and the cancel never made again, so the hung launcher held its node until
    Slurm's time limit. A view that still shows the job running cancels it again."""
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        poll = ClusterPoll(fake)
        slurm_job = await registered_then_cancelled(actor, poll)
        leaver = actor.units["u1"]
        assert leaver.facts.leaving_since is not None
        leaver.facts = dataclasses.replace(leaver.facts, leaving_since=leaver.facts.leaving_since - (
            actor.config.restart_grace_s + actor.config.heartbeat_timeout_s + 1))
        fake.fail_next("cancel", SlurmTimeout(["scancel", str(slurm_job)], 10.0))
        actor.put(Tick())
        await settle(lambda: "unit_cancel_failed" in [e.kind for e in actor.store.events("lm-1")])
        assert fake.get_job(slurm_job).state is SlurmJobState.RUNNING
        failed = next(e for e in actor.store.events("lm-1") if e.kind == "unit_cancel_failed")
        assert f"scancel {slurm_job}: no answer within 10s" in failed.reason
        # The job ended (cancelled) meanwhile; the controller's next view still reaches it.
        assert actor.job.state is JobState.CANCELLED
        controller = Controller(actor.config, actor.store, ControllerMetrics())
        controller.actors[actor.job.job_id] = actor
        controller.observe_slurm(poll.poll(), time.monotonic())
        await settle(lambda: fake.get_job(slurm_job).state is SlurmJobState.CANCELLED)
        task.cancel()

    asyncio.run(scenario())


def test_a_yielded_units_node_counts_as_being_released_until_it_is_idle() -> None:
    fake = FakeSlurmClient.with_nodes(3)
    running, ended, gone = (fake.submit(unit_submission(SPEC, job_id="lm", unit_id=u, launcher=("l",), controller="c",
                                                        secret_path=Path("/s"), output_dir=Path("/o")))
                            for u in ("u1", "u2", "u3"))
    poll = ClusterPoll(fake)
    assert releasing(poll.poll(), {99: {running, ended, gone}}) == {99: 3}
    # u2's job ended but its node still completes; u3's job ended and its node is idle.
    ended_node = fake.get_job(ended).nodes[0]
    fake.finish(ended)
    fake.finish(gone)
    fake.set_node(ended_node, NodeState.IDLE, frozenset({NodeFlag.COMPLETING}))
    assert releasing(poll.poll(), {99: {running, ended, gone}}) == {99: 2}
    fake.set_node(ended_node, NodeState.IDLE)
    assert releasing(poll.poll(), {99: {running, ended, gone}}) == {99: 1}
    # A view whose sinfo still shows the ended job's node allocated (taken before its
    # squeue): still on its way. Seen in CI, where it made a third unit yield for 2 nodes.
    fake.set_node(ended_node, NodeState.ALLOCATED)
    assert releasing(poll.poll(), {99: {running, ended, gone}}) == {99: 2}
    # Once another job runs there, the node is that job's, not on its way.
    other = fake.submit(unit_submission(SPEC, job_id="lm", unit_id="u4", launcher=("l",), controller="c",
                                        secret_path=Path("/s"), output_dir=Path("/o")))
    assert fake.get_job(other).nodes == fake.get_job(gone).nodes, "u4 starts where u3 was"
    fake.set_node(fake.get_job(gone).nodes[0], NodeState.ALLOCATED)
    assert releasing(poll.poll(), {99: {running, ended, gone}}) == {99: 2}


def test_node_cool_downs_survive_a_controller_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        fake = FakeSlurmClient.with_nodes(2)
        actor = slurm_actor(tmp_path, fake, min_replicas=1, max_replicas=1)
        task = asyncio.create_task(actor.run())
        poll = ClusterPoll(fake)
        actor.put(SlurmObserved(poll.poll()))
        await settle(lambda: "u1" in actor.units and actor.units["u1"].slurm_job_id)
        placed_on = fake.get_job(actor.units["u1"].slurm_job_id).nodes
        now = time.monotonic()
        session = LauncherSession(job_id="lm-1", unit_id="u1", opened_at=now, last_heartbeat_at=now, store_port=1,
                                  worker_pids=())
        actor.put(Connected(session, launcher_pb2.Register(job_id="lm-1", unit_id="u1", secret="s",
                                                           nodes=list(placed_on), address="127.0.0.1",
                                                           store_port=1)))
        actor.put(Tick())
        await settle(lambda: actor.job.state is JobState.RUNNING)
        actor.put(Said(session, launcher_pb2.LauncherMessage(worker_exited=launcher_pb2.WorkerExited(
            generation=1, local_rank=0, pid=5, signal=9, detail="stopped beating for 3 s"))))
        # (A silent worker excludes its node at once; a worker's first kill would not.)
        await settle(lambda: any(e.kind == "node_excluded" for e in actor.store.events("lm-1")))
        task.cancel()

        # The controller is killed and starts again from the same SQLite file.
        restarted = JobActor(actor.store.jobs()[0], actor.store.units("lm-1"), None, generation_stopped=True,
                             config=actor.config, store=actor.store, events=actor.events,
                             metrics=ControllerMetrics(), started_at=time.monotonic(), slurm=actor.slurm)
        growing = restarted.growing_job(poll.poll(), time.monotonic())
        assert growing is not None
        assert not set(placed_on) & growing.fits, "the failed node stays excluded after the restart"
        assert growing.fits, "the other node is still there to grow onto"

    asyncio.run(scenario())


def test_a_unit_is_queued_ahead_only_for_a_live_one_node_job_between_min_and_max_with_nothing_idle() -> None:
    from tidal.controller.units import units_to_queue

    live = admin_pb2.JobSpec(min_replicas=2, max_replicas=4, mode=common_pb2.JOB_MODE_LIVE)

    def queue(spec: admin_pb2.JobSpec = live, *, alive: int = 2, pending: int = 0, idle: int = 0, others: int = 0,
              released: bool = False, queued: int = 1) -> int:
        return units_to_queue(spec, alive=alive, pending=pending, idle_nodes=idle, others_waiting=others,
                              released=released, queued_units=queued).count
    assert queue() == 1 and queue(queued=2) == 2 and queue(alive=3, queued=2) == 1
    assert queue(queued=0) == 0 and queue(pending=1) == 0 and queue(idle=1) == 0 and queue(others=1) == 0
    assert queue(alive=1) == 0 and queue(alive=4) == 0 and queue(released=True) == 0
    assert queue(admin_pb2.JobSpec(min_replicas=2, max_replicas=4, mode=common_pb2.JOB_MODE_RESTART)) == 0
    assert queue(admin_pb2.JobSpec(min_replicas=2, max_replicas=4, mode=common_pb2.JOB_MODE_LIVE,
                                   nodes_per_replica=2)) == 0
    # A world one larger must be allowed: with steps of 2, one queued unit could not join.
    assert queue(admin_pb2.JobSpec(min_replicas=2, max_replicas=6, mode=common_pb2.JOB_MODE_LIVE,
                                   replica_step=2)) == 0
