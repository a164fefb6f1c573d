"""The parsers on JSON recorded from real Slurm releases (tests/data/slurm-*/, made by
scripts/record-slurm-json): 22.05.8 (openapi v0.0.38), 24.11.5 (data_parser v0.0.42) and
26.05.5 (v0.0.45). Every release plays the same scenario, so all must read the same: the
same jobs in the same states, the same nodes, the same partitions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC
from pathlib import Path

import pytest

from tidal.slurm import (
    Job,
    JobFlag,
    JobState,
    Node,
    NodeFlag,
    NodeState,
    PreemptMode,
    SlurmParseError,
    SlurmReportedError,
    SlurmVersion,
    parse,
)
from tidal.slurm.cli_json import json_flag

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
RECORDED_RELEASES = sorted(p.name.removeprefix("slurm-") for p in DATA_DIR.glob("slurm-*"))


def recorded(release: str, name: str) -> str:
    return (DATA_DIR / f"slurm-{release}" / name).read_text()


def preemption_snapshots(release: str) -> list[Path]:
    return sorted((DATA_DIR / f"slurm-{release}").glob("jobs-preempt-*.json"))


def test_each_schema_family_is_recorded() -> None:
    assert {"22.05.8", "24.11.5", "26.05.5"} <= set(RECORDED_RELEASES)
    schemas = {parse.schema_of(json.loads(recorded(r, "jobs-running.json"))) for r in RECORDED_RELEASES}
    assert schemas == {"v0.0.38", "v0.0.42", "v0.0.45"}


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_recording_has_the_schema_the_client_asks_for(release: str) -> None:
    """Each recording holds what CliJsonSlurmClient reads on that release: the recorder asks
    with the client's own json_flag, and the release printed that schema."""
    version = parse.parse_version(recorded(release, "version.txt"))
    for name in ("jobs-running.json", "nodes-busy.json"):
        schema = parse.schema_of(json.loads(recorded(release, name)))
        # 21.08/22.05 take no schema version: their own openapi one is printed.
        expected = "--json" if version < SlurmVersion(23, 11) else f"--json={schema}"
        assert json_flag(version) == expected


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


@pytest.mark.parametrize("new_release", ["24.11.5", "26.05.5"])
def test_completing_while_requeued_job_is_killed(new_release: str) -> None:
    """unit-a ignores SIGTERM, so after preemption it stays COMPLETING for KillWait.
    24.11 and 26.05 list the flag beside the base state (["PENDING", "COMPLETING"]); 22.05
    prints the flag's name alone, so the base state is not visible then."""
    def completing(release: str) -> list:
        return [j for s in preemption_snapshots(release) for j in parse.parse_jobs(s.read_text())
                if JobFlag.COMPLETING in j.flags]

    new = completing(new_release)
    assert new and all(j.state is JobState.PENDING and j.requeue_count == 1 for j in new)
    # Still preempted while it holds its node: the controller must not count it as gone.
    assert all(j.is_being_preempted and j.nodes for j in new)
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


def as_printed_by_26_05(line: str) -> str:
    """A 24.11 partition line as 26.05 prints the same partition (slurm_sprint_partition_info
    in src/api/partition_info.c, tag slurm-26-05-3-1): one `Exclusive=` for ExclusiveUser and
    ExclusiveTopo, NODE where OverSubscribe was EXCLUSIVE, which now reads NO; and a
    `Topology=` where the partition names one."""
    line = line.replace("ExclusiveUser=NO ExclusiveTopo=NO", "Exclusive=NODE")
    return line.replace("OverSubscribe=EXCLUSIVE", "OverSubscribe=NO") + " Topology=default"


def test_partitions_as_26_05_prints_them_read_the_same() -> None:
    text = recorded("24.11.5", "partitions.txt")
    changed = "\n".join(as_printed_by_26_05(line) for line in text.splitlines() if line.strip())
    assert "Exclusive=NODE" in changed and "OverSubscribe=EXCLUSIVE" not in changed
    assert parse.parse_partitions_oneliner(changed) == parse.parse_partitions_oneliner(text)


def test_recorded_26_05_partitions_are_the_24_11_lines_as_the_source_said() -> None:
    """The real 26.05.5 text is the 24.11.5 text changed exactly as as_printed_by_26_05 says
    (the mini cluster's partitions name no topology, so no `Topology=`), and reads the same."""
    old, new = recorded("24.11.5", "partitions.txt"), recorded("26.05.5", "partitions.txt")
    predicted = [as_printed_by_26_05(line).removesuffix(" Topology=default") for line in old.splitlines()]
    assert new.splitlines() == predicted
    assert parse.parse_partitions_oneliner(new) == parse.parse_partitions_oneliner(old)


@pytest.mark.parametrize("text, message", [
    ("", "no valid JSON"),
    ("squeue: error: Unable to contact slurm controller", "no valid JSON"),
    # Nested deeper than Python's recursion limit: json raised a RecursionError, which the
    # submit check (`sinfo`) and `tidal nodes` passed on as gRPC UNKNOWN, not Slurm's fault.
    ("[" * 100_000 + "]" * 100_000, "no valid JSON"),
    ('{"meta": {}, "jobs": "nope"}', "no 'jobs' list"),
    ('{"meta": {"plugin": {"type": "openapi/v0.0.39"}}, "jobs": []}', "unsupported Slurm JSON schema v0.0.39"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.46"}}, "jobs": []}',
     r"unsupported Slurm JSON schema v0.0.46; Tidal reads .* v0.0.40-45"),
    ('{"meta": {"plugins": {"data_parser": "data_parser/v0.0.39"}}, "sinfo": []}',
     r"schema v0.0.39 \(Slurm 23.02's\)"),
    ("[1, 2]", "no 'jobs' list"),
    ('{"meta": {}, "jobs": []}', "names no schema version"),
    ('{"meta": {"plugin": {"type": "openapi/v0.0.38"}}, "jobs": [{"name": "no id"}]}', "unexpected jobs record"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.45"}}, "jobs": [{"job_id": 1, "job_state": {}}]}',
     "unexpected jobs record in v0.0.45"),
    # Each of these raised something else (AttributeError, OverflowError, TypeError), which
    # no poll caught: the controller's polling ended for good.
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": [null]}', "unexpected jobs record"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": ["7"]}', "unexpected jobs record"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": [], "errors": 5}',
     "'errors' that is not a list"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": [{"job_id": 1e400, '
     '"job_state": ["RUNNING"]}]}', "unexpected jobs record"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": [{"job_id": 7, "job_state": ["RUNNING"], '
     '"priority": {"set": true, "infinite": false, "number": 1e400}}]}', "not a finite number"),
    ('{"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "jobs": [{"job_id": 7, "job_state": ["RUNNING"], '
     '"nodes": "n[0-999999999]"}]}', "unexpected jobs record"),
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
    # v0.0.44 (25.11) adds EXTERNAL and BLOCKED; v0.0.45 (26.05) adds POWER_DOWN_ASAP and
    # POWER_DOWN_FORCE, printed beside the bits they stand for, which carry the meaning.
    (["IDLE", "EXTERNAL", "BLOCKED"], NodeState.IDLE, {NodeFlag.EXTERNAL, NodeFlag.BLOCKED}),
    (["IDLE", "POWER_DOWN", "POWER_DRAIN", "POWER_DOWN_ASAP"], NodeState.IDLE,
     {NodeFlag.POWER_DOWN, NodeFlag.POWER_DRAIN}),
    (["DOWN", "SOME_FUTURE_FLAG"], NodeState.DOWN, set()),
])
def test_node_state_spellings(words: list[str], base: NodeState, flags: set[NodeFlag]) -> None:
    assert parse.node_state_from_names(words) == (base, frozenset(flags))


def test_unknown_state_words_do_not_stop_parsing() -> None:
    assert parse.job_state_from_names(["RUNNING", "SOME_FUTURE_FLAG"]) == (JobState.RUNNING, frozenset())
    assert parse.job_state_from_names(["COMPLETING"]) == (JobState.UNKNOWN, frozenset({JobFlag.COMPLETING}))


@pytest.mark.parametrize("release", RECORDED_RELEASES)
@pytest.mark.parametrize("name, key, identity", [("jobs-running.json", "jobs", "job_id"),
                                                 ("nodes-busy.json", "nodes", "name")])
def test_fields_a_newer_schema_drops_read_as_empty(release: str, name: str, key: str, identity: str) -> None:
    """Recorded records with every field but their identity taken away, as a later schema
    might: they still parse, to an unknown state and empty values, not a KeyError."""
    document = json.loads(recorded(release, name))
    document[key] = [{identity: record[identity]} for record in document[key]]
    parsed: Sequence[Job | Node] = (parse.parse_jobs if key == "jobs" else parse.parse_nodes)(json.dumps(document))
    assert parsed and all(getattr(item, identity) for item in parsed)
    assert all(item.state.value == "UNKNOWN" and not item.flags and not item.reason for item in parsed)


def test_sbatch_output() -> None:
    assert parse.parse_sbatch_parsable("42\n") == 42
    assert parse.parse_sbatch_parsable("42;tidalmini\n") == 42
    # Digits that are no Slurm job id: ids are 32 bits and never 0, and only ASCII digits.
    for nonsense in ("0", "4294967296", "99999999999999999999", "\u00b2", "\u0661\u0662"):
        with pytest.raises(SlurmParseError, match="sbatch printed no job id"):
            parse.parse_sbatch_parsable(nonsense)
    with pytest.raises(SlurmParseError):
        parse.parse_sbatch_parsable("sbatch: error: Batch job submission failed")
