"""The parsers on JSON recorded from real Slurm releases (tests/data/slurm-*/, made by
scripts/record-slurm-json). Both releases play the same scenario, so both must read the
same: the same jobs in the same states, the same nodes, the same partitions."""

from __future__ import annotations

import json
from datetime import UTC
from pathlib import Path

import pytest

from tidal.slurm import (
    JobFlag,
    JobState,
    NodeFlag,
    NodeState,
    PreemptMode,
    SlurmParseError,
    SlurmReportedError,
    parse,
)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
RECORDED_RELEASES = sorted(p.name.removeprefix("slurm-") for p in DATA_DIR.glob("slurm-*"))


def recorded(release: str, name: str) -> str:
    return (DATA_DIR / f"slurm-{release}" / name).read_text()


def preemption_snapshots(release: str) -> list[Path]:
    return sorted((DATA_DIR / f"slurm-{release}").glob("jobs-preempt-*.json"))


def test_both_schemas_are_recorded() -> None:
    assert "22.05.8" in RECORDED_RELEASES and "24.11.5" in RECORDED_RELEASES
    schemas = {parse.schema_of(json.loads(recorded(r, "jobs-running.json"))) for r in RECORDED_RELEASES}
    assert schemas == {"v0.0.38", "v0.0.42"}


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_version_file_names_the_release(release: str) -> None:
    assert str(parse.parse_version(recorded(release, "version.txt"))) == release


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_running_pending_and_two_node_jobs(release: str) -> None:
    jobs = {j.name: j for j in parse.parse_jobs(recorded(release, "jobs-running.json"))}
    assert set(jobs) == {"unit-a", "pair-b", "waits-c"}
    unit, pair, waiting = jobs["unit-a"], jobs["pair-b"], jobs["waits-c"]
    assert unit.state is JobState.RUNNING and unit.nodes == ("n1",) and unit.node_count == 1
    assert pair.state is JobState.RUNNING and pair.nodes == ("n2", "n3") and pair.node_count == 2
    assert waiting.state is JobState.PENDING and waiting.nodes == ()
    assert waiting.reason in ("Resources", "Priority")
    assert unit.partition == "train" and unit.user == "root"
    assert unit.start_time is not None and unit.start_time.tzinfo is UTC
    assert unit.preempt_time is None and not unit.is_being_preempted and not unit.was_requeued
    assert all(j.is_active for j in jobs.values())


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_preemption_is_seen_then_requeue(release: str) -> None:
    """What the controller must notice: preempt_time set and end_time cut to GraceTime
    while the job still runs, then the job back in PENDING with a requeue count."""
    timelines: dict[str, list] = {"unit-a": [], "pair-b": []}
    for snapshot in preemption_snapshots(release):
        for job in parse.parse_jobs(snapshot.read_text()):
            if job.name in timelines:
                timelines[job.name].append(job)
    for name, timeline in timelines.items():
        signalled = [j for j in timeline if j.is_being_preempted]
        assert signalled, f"{name}: no snapshot shows the preemption signal"
        first = signalled[0]
        assert first.state is JobState.RUNNING
        assert first.end_time is not None and first.preempt_time is not None
        grace = (first.end_time - first.preempt_time).total_seconds()
        assert 4 <= grace <= 6, f"{name}: end_time should be preempt_time + GraceTime (5 s), got {grace}"
        requeued = timeline[-1]
        assert requeued.state is JobState.PENDING and requeued.was_requeued and requeued.requeue_count == 1
        assert not requeued.is_being_preempted and requeued.nodes == ()
    # The job that was not chosen runs on untouched.
    last = {j.name: j for j in parse.parse_jobs(preemption_snapshots(release)[-1].read_text())}
    assert last["waits-c"].state is JobState.RUNNING and last["waits-c"].requeue_count == 0
    assert last["urgent-u"].state is JobState.RUNNING and len(last["urgent-u"].nodes) == 3


def test_completing_while_requeued_job_is_killed() -> None:
    """unit-a ignores SIGTERM, so after preemption it stays COMPLETING for KillWait.
    24.11 lists the flag beside the base state (["PENDING", "COMPLETING"]); 22.05 prints
    the flag's name alone, so the base state is not visible then."""
    def completing(release: str) -> list:
        return [j for s in preemption_snapshots(release) for j in parse.parse_jobs(s.read_text())
                if JobFlag.COMPLETING in j.flags]

    new = completing("24.11.5")
    assert new and all(j.state is JobState.PENDING and j.requeue_count == 1 for j in new)
    old = completing("22.05.8")
    assert old and all(j.state is JobState.UNKNOWN for j in old)
    assert all(j.is_active for j in new + old)


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_nodes_idle_busy_and_drained(release: str) -> None:
    idle = parse.parse_nodes(recorded(release, "nodes-idle.json"))
    assert [n.name for n in idle] == ["n1", "n2", "n3", "n4"]
    for node in idle:
        assert node.state is NodeState.IDLE and not node.flags and node.is_idle_and_usable
        assert node.partitions == ("train", "urgent") and node.cpus == 2
        assert node.gres_count("gpu") == 2 and node.features == ("cpu", "fake-gpu")
    busy = {n.name: n for n in parse.parse_nodes(recorded(release, "nodes-busy.json"))}
    assert all(busy[n].state is NodeState.ALLOCATED for n in ("n1", "n2", "n3"))
    drained = busy["n4"]
    assert drained.state is NodeState.IDLE and NodeFlag.DRAIN in drained.flags
    assert drained.reason == "recorded drain" and not drained.is_idle_and_usable


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_partitions(release: str) -> None:
    partitions = {p.name: p for p in parse.parse_partitions_oneliner(recorded(release, "partitions.txt"))}
    train, urgent = partitions["train"], partitions["urgent"]
    assert train.is_default and train.priority_tier == 1 and train.grace_time_s == 5
    assert train.preempt_mode == {PreemptMode.REQUEUE}
    assert urgent.priority_tier == 100 and urgent.preempt_mode == {PreemptMode.OFF}
    assert train.nodes == urgent.nodes == ("n1", "n2", "n3", "n4")


@pytest.mark.parametrize("text, message", [
    ("", "no valid JSON"),
    ("squeue: error: Unable to contact slurm controller", "no valid JSON"),
    ('{"meta": {}, "jobs": "nope"}', "no 'jobs' list"),
    ('{"meta": {"plugin": {"type": "openapi/v0.0.39"}}, "jobs": []}', "unsupported Slurm JSON schema v0.0.39"),
    ('{"meta": {}, "jobs": []}', "names no schema version"),
    ('{"meta": {"plugin": {"type": "openapi/v0.0.38"}}, "jobs": [{"name": "no id"}]}', "unexpected jobs record"),
])
def test_nonsense_is_a_typed_error(text: str, message: str) -> None:
    with pytest.raises(SlurmParseError, match=message):
        parse.parse_jobs(text)


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_controller_down_is_an_error_not_an_empty_list(release: str) -> None:
    """Recorded with slurmctld unreachable. 22.05 exits 0 with `"jobs": []` and errors
    (SlurmReportedError); 24.11 exits 1 and prints no JSON (the recording keeps its
    message; the CLI client raises SlurmCommandFailed on the exit status)."""
    with pytest.raises((SlurmReportedError, SlurmParseError)):
        parse.parse_jobs(recorded(release, "jobs-controller-down.json"))
    with pytest.raises((SlurmReportedError, SlurmParseError)):
        parse.parse_nodes(recorded(release, "nodes-controller-down.json"))


def test_truncated_recorded_output_is_refused() -> None:
    text = recorded("24.11.5", "jobs-running.json")
    with pytest.raises(SlurmParseError):
        parse.parse_jobs(text[: len(text) // 2])


@pytest.mark.parametrize("value, expected", [
    (5, 5), (None, None), ({"set": True, "infinite": False, "number": 7}, 7),
    ({"set": False, "infinite": False, "number": 7}, None), ({"set": True, "infinite": True, "number": 0}, None),
])
def test_number_both_shapes(value: object, expected: int | None) -> None:
    assert parse.number(value) == expected


def test_gres_strings() -> None:
    gres = parse.parse_gres("gpu:a100:4(S:0-1),nic:1,gpu:2")
    assert [(g.name, g.type, g.count) for g in gres] == [("gpu", "a100", 4), ("nic", None, 1), ("gpu", None, 2)]
    assert parse.parse_gres("(null)") == ()


@pytest.mark.parametrize("words, base, flags", [
    (["idle"], NodeState.IDLE, set()),
    (["IDLE+DRAIN"], NodeState.IDLE, {NodeFlag.DRAIN}),
    (["drained"], NodeState.IDLE, {NodeFlag.DRAIN}),
    (["down*"], NodeState.DOWN, {NodeFlag.NOT_RESPONDING}),
    (["MIXED", "PLANNED"], NodeState.MIXED, {NodeFlag.PLANNED}),
])
def test_node_state_spellings(words: list[str], base: NodeState, flags: set[NodeFlag]) -> None:
    assert parse.node_state_from_names(words) == (base, frozenset(flags))


def test_unknown_state_words_do_not_stop_parsing() -> None:
    assert parse.job_state_from_names(["RUNNING", "SOME_FUTURE_FLAG"]) == (JobState.RUNNING, frozenset())
    assert parse.job_state_from_names(["COMPLETING"]) == (JobState.UNKNOWN, frozenset({JobFlag.COMPLETING}))


def test_sbatch_output() -> None:
    assert parse.parse_sbatch_parsable("42\n") == 42
    assert parse.parse_sbatch_parsable("42;tidalmini\n") == 42
    with pytest.raises(SlurmParseError):
        parse.parse_sbatch_parsable("sbatch: error: Batch job submission failed")
