"""Whose jobs a controller takes, where their files go, and sbatch run as the owner."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidal.controller.config import ConfigError, load_config, unit_folder
from tidal.controller.owners import OwnerPolicy, account, job_files, refusal, serves
from tidal.slurm.cli_json import CliJsonSlurmClient
from tidal.slurm.models import UnitOwner, UnitSubmission

ROOT_SERVICE = OwnerPolicy(controller_uid=0)


def test_a_root_controller_takes_ordinary_users_and_refuses_root_and_system_accounts() -> None:
    assert refusal(ROOT_SERVICE, 1000, "alice") is None
    assert "jobs of root are refused" in (refusal(ROOT_SERVICE, 0, "root") or "")
    said = refusal(ROOT_SERVICE, 999, "backup") or ""
    assert "uid 999 (backup) is a system account (below min_owner_uid 1000)" in said
    assert "allow_system_user_jobs" in said
    allowing = OwnerPolicy(controller_uid=0, min_uid=500, allow_root=True, allow_system_users=False)
    assert refusal(allowing, 0, "root") is None and refusal(allowing, 500, "x") is None
    assert refusal(allowing, 499, "y") is not None
    assert refusal(OwnerPolicy(controller_uid=0, allow_system_users=True), 2, "daemon") is None


def test_a_controller_of_a_normal_user_serves_that_user_only() -> None:
    own = OwnerPolicy(controller_uid=1234)
    assert refusal(own, 1234, "carol") is None and serves(own, 1234) is None and serves(own, 0) is None
    said = serves(own, 1235) or ""
    assert "runs as uid 1234 and serves that user only" in said
    assert refusal(own, 1235, "dave") == said


def test_the_unit_folder_template() -> None:
    assert unit_folder("~/.tidal/{job}", home="/home/a", user="a", job_id="lm-1") == Path("/home/a/.tidal/lm-1")
    assert unit_folder("runs/{user}/{job}", home="/home/a", user="a", job_id="j") == Path("/home/a/runs/a/j")
    assert unit_folder("/scratch/{user}", home="/home/a", user="a", job_id="j") == Path("/scratch/a")
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \{jobid\}"):
        unit_folder("~/{jobid}", home="/h", user="a", job_id="j")
    with pytest.raises(ConfigError, match="unit_output_dir: unknown placeholder"):
        load_config(environ={}, overrides={"unit_output_dir": "~/{nope}"})


def test_another_users_secret_lives_in_that_users_job_folder() -> None:
    alice = UnitOwner(uid=1001, gid=1001, groups=(1001,), name="alice", home="/home/alice")
    files = job_files(alice, "lm-1", output_template="~/.tidal/{job}", secrets_dir=Path("/var/lib/tidal/secrets"),
                      controller_uid=0)
    assert files.folder == Path("/home/alice/.tidal/lm-1") and files.secret == files.folder / "secret"
    own = job_files(alice, "lm-1", output_template="~/.tidal/{job}", secrets_dir=Path("/s"), controller_uid=1001)
    assert own.secret == Path("/s/lm-1.secret")


def test_the_owner_script_sets_the_whole_environment_after_the_sbatch_lines() -> None:
    owner = UnitOwner(uid=1001, gid=1001, groups=(1001,), name="alice", home="/home/alice", shell="/bin/bash")
    unit = UnitSubmission(name="u", script="#!/bin/bash\n#SBATCH --time=5\nexec launcher\n",
                          environment={"TIDAL_SECRET_FILE": "/home/alice/.tidal/j/secret"}, owner=owner)
    lines = unit.script_for_owner().splitlines()
    assert lines[:2] == ["#!/bin/bash", "#SBATCH --time=5"] and lines[-1] == "exec launcher"
    assert "export HOME=/home/alice" in lines and "export USER=alice" in lines
    assert "export TIDAL_SECRET_FILE=/home/alice/.tidal/j/secret" in lines
    assert "export SLURM_EXPORT_ENV=ALL" in lines


@pytest.fixture
def fake_sbatch() -> Iterator[Path]:
    """A stand-in `sbatch` (same argv and stdin as the real one) that records who ran it,
    with what, in a folder any user may enter."""
    folder = Path(tempfile.mkdtemp(prefix="tidal-fake-sbatch-"))
    folder.chmod(0o755)
    record = folder / "calls"
    record.mkdir(mode=0o777)
    record.chmod(0o777)
    script = folder / "sbatch"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(ls {record} | grep -c json); cat > {record}/$n.script\n"
        f'python3 - "$@" > {record}/$n.json <<PY\n'
        "import json, os, sys\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': sorted(os.getgroups()),\n"
        "  'umask': os.umask(0), 'argv': sys.argv[1:], 'home': os.environ.get('HOME'),\n"
        "  'secret_env': os.environ.get('TIDAL_SECRET_FILE'), 'slurm_conf': os.environ.get('SLURM_CONF'),\n"
        f"  'script': open('{record}/$n.script').read()}}))\n"
        "PY\n"
        "echo 4242\n")
    script.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_sbatch_runs_as_the_owner_with_an_explicit_environment(fake_sbatch: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    if shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") is None:
        pytest.skip("no python3 for the stand-in sbatch")
    nobody = account(pwd.getpwnam("nobody").pw_uid)
    client = CliJsonSlurmClient(bin_dir=str(fake_sbatch), slurm_conf="/etc/slurm/test.conf")
    unit = UnitSubmission(name="tidal-j-u1", script="#!/bin/bash\nexec launcher\n", nodes=1,
                          environment={"TIDAL_SECRET_FILE": "/home/x/.tidal/j/secret"}, owner=nobody)
    assert client.submit(unit) == 4242
    call = json.loads((fake_sbatch / "calls" / "0.json").read_text())
    assert (call["uid"], call["gid"]) == (nobody.uid, nobody.gid)
    assert call["groups"] == sorted(set(nobody.groups)) and call["umask"] == 0o077
    assert "--export=NONE" in call["argv"] and "--export=ALL" not in call["argv"]
    # Nothing of the controller's environment reaches sbatch; the unit's comes in the script.
    assert call["secret_env"] is None and call["slurm_conf"] == "/etc/slurm/test.conf"
    assert "export TIDAL_SECRET_FILE=/home/x/.tidal/j/secret" in call["script"]
    # The controller's own unit: as root, its environment handed on with --export=ALL.
    root_unit = UnitSubmission(name="tidal-j-u2", script="#!/bin/bash\nexec launcher\n",
                               environment={"TIDAL_SECRET_FILE": "/s"}, owner=account(0))
    client.submit(root_unit)
    call = json.loads((fake_sbatch / "calls" / "1.json").read_text())
    assert call["uid"] == 0 and "--export=ALL" in call["argv"] and call["secret_env"] == "/s"
    assert stat.S_IMODE(os.stat(fake_sbatch / "calls" / "0.json").st_mode) & 0o077 == 0
