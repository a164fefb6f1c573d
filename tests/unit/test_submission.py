"""`tidal submit`'s arguments and a batch script's #SBATCH / #TIDAL lines, into a JobSpec."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.controller.submission import SubmitUsageError, parse_submit, script_directives
from tidal.proto import common_pb2

SCRIPT = """#!/bin/bash
#SBATCH --partition=debug
#SBATCH -t 10:00 --gres=gpu:1   # a comment
#TIDAL --max-replicas 8 --mode live
#TIDAL --env OMP_NUM_THREADS=4

python train.py --epochs 3
#SBATCH --after-the-first-command-is-not-read
"""


def test_an_existing_batch_script_becomes_elastic_with_a_tidal_line(tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT)
    spec = parse_submit(["--min-replicas", "2", "-t", "5:00", "train.sh", "--lr", "3"], cwd=tmp_path).spec
    assert (spec.min_replicas, spec.max_replicas, spec.mode) == (2, 8, common_pb2.JOB_MODE_LIVE)
    assert dict(spec.environment) == {"OMP_NUM_THREADS": "4"}
    # The script's #SBATCH lines first, the command line's after them (sbatch: the last wins).
    assert list(spec.sbatch_options) == ["--partition=debug", "-t", "10:00", "--gres=gpu:1", "-t", "5:00"]
    assert spec.partition == "debug" and spec.name == "train"
    assert list(spec.command) == ["bash", str(tmp_path / "train.sh"), "--lr", "3"]
    assert spec.working_dir == str(tmp_path)


def test_the_command_line_wins_over_tidal_lines_and_an_executable_runs_itself(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    spec = parse_submit(["--max-replicas=3", "-J", "lm", "-D", "runs", str(script)], cwd=tmp_path).spec
    assert spec.max_replicas == 3 and spec.name == "lm"
    assert list(spec.command) == [str(script)]
    assert spec.working_dir == str(tmp_path / "runs")


def test_a_plain_command_and_its_own_options_are_left_alone(tmp_path: Path) -> None:
    spec = parse_submit(["--procs-per-node", "4", "--exclusive", "python", "train.py", "--max-replicas", "9"],
                        cwd=tmp_path).spec
    assert spec.procs_per_node == 4 and spec.max_replicas == 0
    assert list(spec.command) == ["python", "train.py", "--max-replicas", "9"]
    assert list(spec.sbatch_options) == ["--exclusive"] and spec.name == "train"
    assert list(parse_submit(["--", "-weird-name"], cwd=tmp_path).spec.command) == ["-weird-name"]


@pytest.mark.parametrize(("argv", "message"), [
    ([], "no script or command"),
    (["--max-replicas"], "--max-replicas needs a value"),
    (["--max-replicas", "many", "x"], "--max-replicas: 'many' is not a whole number"),
    (["--mode", "fast", "x"], "--mode: 'fast' is not one of live, restart"),
    (["--env", "NOVALUE", "x"], "--env: 'NOVALUE' is not KEY=VALUE"),
    (["--yield-to-pending=yes", "x"], "--yield-to-pending takes no value"),
    (["-p"], "-p needs a value"),
    # Beyond what the spec's fields hold (int32; global_batch int64): a traceback, not an error.
    (["--max-replicas", "3000000000", "x"], "--max-replicas: must be at most 2147483647, got 3000000000"),
    (["--global-batch", str(2**63), "x"], f"--global-batch: must be at most {2**63 - 1}"),
])
def test_malformed_submit_lines_name_the_option(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SubmitUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_submit(argv, cwd=tmp_path)


def test_a_tidal_line_with_an_sbatch_option_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.sh").write_text("#!/bin/bash\n#TIDAL --partition debug\nsrun python x.py\n")
    with pytest.raises(SubmitUsageError, match="--partition=debug is not a Tidal option"):
        parse_submit(["bad.sh"], cwd=tmp_path)


def test_directives_stop_at_the_first_command() -> None:
    sbatch, tidal = script_directives(SCRIPT)
    assert sbatch == [["--partition=debug"], ["-t", "10:00", "--gres=gpu:1"]]
    assert tidal == [["--max-replicas", "8", "--mode", "live"], ["--env", "OMP_NUM_THREADS=4"]]


def test_a_command_given_by_a_path_that_is_not_here_is_submitted_with_a_warning(tmp_path: Path) -> None:
    """`tidal submit /path/typo.sh`: sbatch would refuse a missing batch script, but a
    command's path may be a node's own (not checked, as `srun` does not): the job goes in,
    and the submitter is told now, not after its units failed three times."""
    submission = parse_submit(["--max-replicas", "2", "/no/such/train.sh", "--lr", "3"], cwd=tmp_path)
    assert list(submission.spec.command) == ["/no/such/train.sh", "--lr", "3"]
    assert len(submission.warnings) == 1 and submission.warnings[0].startswith("/no/such/train.sh: no such file here")
    (tmp_path / "data.txt").write_text("not a program\n")
    assert "is not an executable file" in parse_submit(["./data.txt"], cwd=tmp_path).warnings[0]
    # Found in the units' folder (-D), or here; a bare name is the nodes' PATH's: no warning.
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "go").write_text("#!/bin/sh\n")
    (tmp_path / "runs" / "go").chmod(0o755)
    assert parse_submit(["-D", "runs", "./go"], cwd=tmp_path).warnings == ()
    assert parse_submit(["python", "train.py"], cwd=tmp_path).warnings == ()
    assert parse_submit(["/bin/sh", "-c", "true"], cwd=tmp_path).warnings == ()
