"""Which JSON schema the CLI client asks each Slurm release for. No Slurm is needed: the
choice is a pure function of the version, and the client's wiring is checked with stand-in
`scontrol` and `squeue` scripts in its bin_dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.slurm import CliJsonSlurmClient, SlurmError, SlurmVersion, UnitSubmission, UnsupportedSlurmVersion, parse
from tidal.slurm.cli_json import json_flag
from tidal.slurm.errors import answer_lost

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@pytest.mark.parametrize("release, flag", [
    ("21.08.8", "--json"),
    ("22.05.8", "--json"),
    ("23.11.0", "--json=v0.0.40"),
    ("23.11.10", "--json=v0.0.40"),
    ("24.05.3", "--json=v0.0.41"),
    ("24.11.5", "--json=v0.0.42"),
    ("25.05.4", "--json=v0.0.43"),
    ("25.11.0", "--json=v0.0.44"),
    ("26.05.5", "--json=v0.0.45"),
    ("26.11.0", "--json=v0.0.45"),
    ("27.05.1", "--json=v0.0.45"),
])
def test_each_release_is_asked_for_the_newest_schema_tidal_reads(release: str, flag: str) -> None:
    assert json_flag(parse.parse_version(f"slurm {release}")) == flag
    if flag != "--json":
        assert int(flag.rsplit(".", 1)[1]) in parse.DATA_PARSER_SCHEMAS


def test_slurm_23_02_is_refused_before_anything_is_asked() -> None:
    with pytest.raises(UnsupportedSlurmVersion, match=r"23\.02\.5 prints JSON schema v0\.0\.39"):
        json_flag(SlurmVersion(23, 2, 5))


def stand_in(folder: Path, name: str, body: str) -> None:
    script = folder / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


@pytest.mark.parametrize("version, recording, flag", [
    ("slurm 25.11.2", "slurm-24.11.5", "--json=v0.0.44"),
    # Debian's 26.05.5 and what it printed (tests/data/slurm-26.05.5/version.txt).
    ("slurm-wlm 26.05.5", "slurm-26.05.5", "--json=v0.0.45"),
])
def test_the_client_asks_the_release_it_finds(tmp_path: Path, version: str, recording: str, flag: str) -> None:
    stand_in(tmp_path, "scontrol", f'echo "{version}"')
    jobs_file = DATA_DIR / recording / "jobs-running.json"
    stand_in(tmp_path, "squeue", f'echo "$@" > "{tmp_path}/squeue-args"\ncat "{jobs_file}"')
    jobs = CliJsonSlurmClient(bin_dir=str(tmp_path), timeout_s=10).list_jobs()
    assert (tmp_path / "squeue-args").read_text().split() == [flag]
    assert {j.name for j in jobs} == {"unit-a", "pair-b", "waits-c"}


def test_bytes_slurm_prints_that_are_not_utf8_are_replaced_not_fatal(tmp_path: Path) -> None:
    """Any user's job name or comment in Latin-1, printed raw by squeue: strict decoding
    raised a UnicodeDecodeError, which no poll caught, and the controller never polled
    Slurm again. The byte is replaced; the rest of the cluster reads as it is."""
    stand_in(tmp_path, "scontrol", 'echo "slurm 24.11.5"')
    jobs_file = DATA_DIR / "slurm-24.11.5" / "jobs-running.json"
    latin1 = tmp_path / "jobs.json"
    latin1.write_bytes(jobs_file.read_bytes().replace(b'"unit-a"', b'"caf\xe9"'))
    stand_in(tmp_path, "squeue", f'cat "{latin1}"')
    jobs = CliJsonSlurmClient(bin_dir=str(tmp_path), timeout_s=10).list_jobs()
    assert {j.name for j in jobs} == {"caf\ufffd", "pair-b", "waits-c"}


def test_a_slurm_command_that_cannot_be_run_is_a_slurm_error(tmp_path: Path) -> None:
    (tmp_path / "squeue").write_text("#!/bin/sh\necho\n")  # not executable
    stand_in(tmp_path, "scontrol", 'echo "slurm 24.11.5"')
    with pytest.raises(SlurmError, match="cannot run it"):
        CliJsonSlurmClient(bin_dir=str(tmp_path), timeout_s=10).list_jobs()


@pytest.mark.parametrize("body, lost", [
    # slurmctld took the job and timed out answering (nextflow-io/nextflow#970).
    ('echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1', True),
    ('exec sleep 5', True),
    ('echo "Submitted batch job"', True),
    ('echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1', False),
])
def test_an_sbatch_whose_answer_may_hide_a_submitted_job_says_so(tmp_path: Path, body: str, lost: bool) -> None:
    stand_in(tmp_path, "sbatch", f"cat > /dev/null\n{body}")
    with pytest.raises(SlurmError) as raised:
        CliJsonSlurmClient(bin_dir=str(tmp_path), timeout_s=1).submit(UnitSubmission(name="u", script="#!/bin/sh\n"))
    assert answer_lost(raised.value) is lost, raised.value
