"""The parsers on real JSON from Slurm 23.11, 24.05, 24.11, 25.05 and 25.11 (data_parser
v0.0.40-v0.0.44), recorded by the Slurm-web project on its test clusters.

The files are read in place from shared/slurm-json/ (its SOURCES.md says where each one
came from) and are never copied into this repository. slurmrestd's /jobs and /nodes
answers have the schema of `squeue --json` and `scontrol show nodes --json`. Each file is
its own test; all of them are skipped, saying why, where the folder is absent. Point
TIDAL_SLURM_JSON_DIR at the folder when the repository is not beside shared/ (a worktree).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tidal.slurm import JobState, NodeFlag, NodeState, SlurmParseError, parse

REPO_ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = Path(os.environ.get("TIDAL_SLURM_JSON_DIR") or REPO_ROOT.parent / "shared" / "slurm-json")
ABSENT = f"no Slurm JSON recordings at {RECORDINGS} (set TIDAL_SLURM_JSON_DIR to shared/slurm-json)"

PARSERS: dict[str, Callable[[str], Sequence[Any]]] = {"jobs": parse.parse_jobs, "nodes": parse.parse_nodes}
# Every GRES string the recordings hold, and what a user reads from it.
GRES_SEEN = {
    "": (),
    "gpu:4": (("gpu", None, 4),),
    "gpu:h100:4": (("gpu", "h100", 4),),
    "gpu:h100:2,gpu:h200:4": (("gpu", "h100", 2), ("gpu", "h200", 4)),
}


def recordings(pattern: str) -> list[Any]:
    """One test parameter per recorded file, named `<release>/<schema>/<file>`."""
    files = sorted(RECORDINGS.glob(pattern))
    if not files:
        return [pytest.param(None, id="absent", marks=pytest.mark.skip(reason=ABSENT))]
    return [pytest.param(path, id=path.relative_to(RECORDINGS).as_posix()) for path in files]


def parse_recording(path: Path, key: str) -> tuple[list[dict[str, Any]], Sequence[Any]]:
    """The file's records under `key` as recorded, and what the parser makes of them; the
    document names the schema of its folder (25.11/0.0.44/ holds v0.0.44)."""
    text = path.read_text()
    document = json.loads(text)
    assert parse.schema_of(document) == f"v{path.parent.name}"
    return document[key], PARSERS[key](text)


def test_recordings_cover_every_release_since_23_11() -> None:
    if not RECORDINGS.is_dir():
        pytest.skip(ABSENT)
    schemas = {int(p.name.rsplit(".", 1)[1]) for p in RECORDINGS.glob("*/0.0.*") if p.is_dir()}
    releases = {p.parent.name for p in RECORDINGS.glob("*/0.0.4*")}
    assert {40, 41, 42, 43, 44} <= schemas
    assert {"23.11", "24.05", "24.11", "25.05", "25.11"} <= releases
    # v0.0.45 (26.05) is read too: its recording is tests/data/slurm-26.05.5 (test_parse.py).
    assert schemas - {39} <= parse.DATA_PARSER_SCHEMAS


@pytest.mark.parametrize("path", recordings("*/0.0.4*/slurm-job*.json"))
def test_jobs(path: Path) -> None:
    records, jobs = parse_recording(path, "jobs")
    assert [j.job_id for j in jobs] == [r["job_id"] for r in records] and all(j.job_id > 0 for j in jobs)
    for job, record in zip(jobs, records, strict=True):
        assert job.state is not JobState.UNKNOWN and job.state.value == record["job_state"][0]
        assert job.partition and job.partition == record["partition"]
        assert job.user == record["user_name"] and job.submit_time is not None
        if job.state is JobState.RUNNING:
            assert job.nodes and job.node_count == len(job.nodes) and job.start_time is not None
            assert job.is_active and not job.is_being_preempted
        if job.state is JobState.PENDING:
            assert job.nodes == () and job.reason not in ("", "None") and job.is_active
    expected = {"slurm-job-running.json": JobState.RUNNING, "slurm-job-pending.json": JobState.PENDING}
    if path.name in expected:
        assert [j.state for j in jobs] == [expected[path.name]]


@pytest.mark.parametrize("path", recordings("*/0.0.4*/slurm-node*.json"))
def test_nodes(path: Path) -> None:
    records, nodes = parse_recording(path, "nodes")
    names = [n.name for n in nodes]
    assert names == [r["name"] for r in records] and len(set(names)) == len(names) and all(names)
    for node, record in zip(nodes, records, strict=True):
        base, *flags = record["state"]
        assert node.state.value == base and {f.value for f in node.flags} == set(flags)
        assert node.partitions and node.partitions == tuple(record["partitions"]) and node.cpus > 0
        assert record["gres"] in GRES_SEEN, f"a GRES string not seen before: {record['gres']!r}"
        assert [(g.name, g.type, g.count) for g in node.gres] == list(GRES_SEEN[record["gres"]])
        assert node.is_idle_and_usable == (node.state is NodeState.IDLE and not node.flags)
    if path.name.startswith("slurm-node-"):
        assert len(nodes) == 1
        node = nodes[0]
        assert node.reason and not node.is_idle_and_usable
        if path.name == "slurm-node-down.json":
            assert node.state is NodeState.DOWN
        else:  # drain, draining: whatever the base state, DRAIN is set
            assert NodeFlag.DRAIN in node.flags
        if path.name == "slurm-node-draining.json":
            assert node.state is NodeState.MIXED


def test_gpu_nodes_are_recorded() -> None:
    """GRES is checked where present: make sure it is present somewhere."""
    gpus = [n.gres_count("gpu") for p in RECORDINGS.glob("*/0.0.4*/slurm-nodes.json")
            for n in parse.parse_nodes(p.read_text())]
    if not gpus:
        pytest.skip(ABSENT)
    assert max(gpus) == 6


def test_slurm_23_02_is_refused_with_a_clear_error() -> None:
    """23.02's `sinfo -N --json` (data_parser v0.0.39) is not read: the error names the
    schema and the release, it is not a KeyError or an empty list."""
    path = RECORDINGS / "23.02" / "0.0.39" / "sinfo_dataparser.json"
    if not path.exists():
        pytest.skip(ABSENT)
    for parser in (parse.parse_nodes, parse.parse_jobs):
        with pytest.raises(SlurmParseError, match=r"unsupported Slurm JSON schema v0\.0\.39 \(Slurm 23\.02's\)"):
            parser(path.read_text())
