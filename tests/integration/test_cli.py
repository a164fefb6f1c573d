"""The `tidal` job commands against a real controller over its Unix socket: what a user
types, what they read, and the exit codes scripts rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ControllerProcess, TidalRun
from tests.unit.test_logging_and_cli import run_into_a_closed_pipe

pytestmark = pytest.mark.integration


def tidal(controller: ControllerProcess, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket), *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_submit_status_events_resize_drain_cancel(tidal_run: TidalRun, tmp_path: Path) -> None:
    controller = tidal_run.controller
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\n#SBATCH --time=10:00\n#TIDAL --min-replicas 1 --max-replicas 2\n"
                      "python train.py\n")
    submitted = tidal(controller, "submit", "--json", "--procs-per-node", "2", "train.sh", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    reply = json.loads(submitted.stdout)
    job_id = reply["job"]["job_id"]
    assert reply["job"]["spec"]["max_replicas"] == 2 and reply["job"]["spec"]["sbatch_options"] == ["--time=10:00"]
    assert Path(reply["secret_path"]).stat().st_mode & 0o077 == 0

    table = tidal(controller, "status")
    assert table.returncode == 0 and job_id in table.stdout and "pending" in table.stdout
    assert table.stdout.splitlines()[0].split()[:3] == ["JOB", "STATE", "MODE"]
    one = json.loads(tidal(controller, "status", job_id, "--json").stdout)
    assert one[0]["job_id"] == job_id and one[0]["spec"]["procs_per_node"] == 2

    resized = tidal(controller, "resize", job_id, "--max", "3")
    assert resized.returncode == 0 and "replicas 1..3" in resized.stdout

    tidal_run.job_id, tidal_run.secret_path = job_id, reply["secret_path"]
    tidal_run.start_launcher("u1")
    controller.wait_event(job_id, "unit_registered")
    drained = tidal(controller, "drain", "u1")
    assert drained.returncode == 0 and "draining u1" in drained.stdout
    controller.wait_event(job_id, "unit_left")
    # Drained again, gone already: nothing to do, and nothing said to be draining.
    again = tidal(controller, "drain", f"{job_id}/u1")
    assert again.returncode == 0 and again.stdout.strip() == f"{job_id}/u1: nothing to drain", again.stdout

    cancelled = tidal(controller, "cancel", job_id)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    events = tidal(controller, "events", job_id)
    kinds = [line.split()[2] for line in events.stdout.splitlines()]
    assert kinds[0] == "job_submitted" and "job_resized" in kinds and kinds[-1] in ("job_cancelled", "unit_left")
    as_json = [json.loads(line) for line in tidal(controller, "events", job_id, "--json").stdout.splitlines()]
    assert [e["kind"] for e in as_json] == kinds
    assert job_id not in tidal(controller, "status").stdout
    assert job_id in tidal(controller, "status", "--all").stdout


def test_errors_are_one_clear_line_and_an_exit_code(tidal_run: TidalRun, tmp_path: Path) -> None:
    controller = tidal_run.controller
    unknown = tidal(controller, "status", "nope-000000")
    assert unknown.returncode == 5 and "nope-000000" in unknown.stderr and "Traceback" not in unknown.stderr
    assert tidal(controller, "events", "nope-000000").returncode == 5
    assert tidal(controller, "cancel", "nope-000000").returncode == 5

    invalid = tidal(controller, "submit", "--min-replicas", "3", "--max-replicas", "2", "python", "x.py")
    assert invalid.returncode == 2 and "max_replicas" in invalid.stderr
    bad_option = tidal(controller, "submit", "--mode", "fast", "python", "x.py")
    assert bad_option.returncode == 2 and "--mode: 'fast'" in bad_option.stderr
    assert tidal(controller, "resize", "x").returncode == 2
    too_many = tidal(controller, "resize", "x", "--max", "3000000000")
    assert too_many.returncode == 2 and "--max must be within 1..2147483647" in too_many.stderr, too_many.stderr
    assert "no jobs" in tidal(controller, "status").stdout, "a refused submit leaves nothing behind"
    # `tidal status | head -1`, the reader gone before the output is written: quiet, 141.
    into_closed_pipe = run_into_a_closed_pipe([sys.executable, "-m", "tidal.controller.cli",
                                               "--socket", str(controller.socket), "status"])
    assert (into_closed_pipe.returncode, into_closed_pipe.stderr) == (141, "")

    controller.stop()
    down = tidal(controller, "status")
    assert down.returncode == 4
    assert "cannot reach the controller" in down.stderr and str(controller.socket) in down.stderr


def test_tidal_sbatch_is_a_drop_in_for_sbatch(tidal_run: TidalRun, tmp_path: Path) -> None:
    controller = tidal_run.controller
    wrapper = Path(__file__).resolve().parents[2] / "scripts" / "tidal-sbatch"
    env_socket = {"TIDAL_CONTROLLER_SOCKET": str(controller.socket)}

    def sbatch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(wrapper), *args], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path, env={**os.environ, **env_socket})

    parsable = sbatch("--parsable", "--max-replicas", "2", "-p", "debug", "--wrap", "python train.py --lr 3")
    assert parsable.returncode == 0, parsable.stderr
    job_id = parsable.stdout.strip()
    job = json.loads(tidal(controller, "status", job_id, "--json").stdout)[0]
    assert job["spec"]["command"] == ["bash", "-c", "python train.py --lr 3"]
    assert job["spec"]["partition"] == "debug" and job["spec"]["max_replicas"] == 2
    (tmp_path / "run.sbatch").write_text("#!/bin/bash\n#SBATCH -J lm\n#TIDAL --mode live\npython lm.py\n")
    plain = sbatch("run.sbatch")
    assert plain.returncode == 0 and plain.stdout.startswith("Submitted elastic job lm-")
    refused = sbatch("--min-replicas", "0")
    assert refused.returncode == 2 and "no script or command" in refused.stderr
    # As sbatch: a script that is not there, or is no batch script, is refused; nothing submitted.
    missing = sbatch("--parsable", "nonexist.sh")
    assert missing.returncode == 2 and "unable to open file nonexist.sh" in missing.stderr, missing.stderr
    (tmp_path / "notes.txt").write_text("python lm.py\n")
    not_a_script = sbatch("notes.txt")
    assert not_a_script.returncode == 2 and "does not look like a batch script" in not_a_script.stderr
    listed = json.loads(tidal(controller, "status", "--all", "--json").stdout)
    assert not any(job["spec"]["name"] in ("nonexist", "notes") for job in listed)


def test_an_ended_job_is_cancelled_again_but_never_resized(tidal_run: TidalRun) -> None:
    """Cancelling an ended job again says what it is; a resize of one is refused, naming
    why (it used to change the ended job's bounds and log a job_resized after its end)."""
    controller = tidal_run.controller
    submitted = tidal(controller, "submit", "--json", "--", "true")
    job_id = json.loads(submitted.stdout)["job"]["job_id"]
    for _ in range(2):
        cancelled = tidal(controller, "cancel", job_id)
        assert cancelled.returncode == 0 and f"{job_id}: cancelled" in cancelled.stdout, cancelled.stderr
    resized = tidal(controller, "resize", job_id, "--max", "4")
    assert resized.returncode == 2, (resized.stdout, resized.stderr)
    assert f"job {job_id} is cancelled" in resized.stderr and "Traceback" not in resized.stderr
    job = json.loads(tidal(controller, "status", job_id, "--json").stdout)[0]
    assert job["state"] == "JOB_STATE_CANCELLED" and job["spec"]["max_replicas"] == 1
    kinds = [line.split()[2] for line in tidal(controller, "events", job_id).stdout.splitlines()]
    assert kinds == ["job_submitted", "job_cancelled"]
