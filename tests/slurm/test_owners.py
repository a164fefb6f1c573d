"""A root controller runs each user's units as that user, on the real mini cluster, with
real Unix accounts made (and removed) here: alice's job runs as alice, bob cannot touch it
or read its secret, and a system account's job is refused.

What another user runs needs a Python that user may execute: this machine's default one
lives in root's home (0700), so the users' CLI, launchers and workers run Debian's own
python3 in a virtual environment that sees this test run's packages."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import ControllerProcess
from tests.integration.test_live_mode import LIVE_EXAMPLE
from tests.slurm.test_autoscaling import require_four_idle_nodes, running_at, wait_for_units_to_end
from tests.waiting import wait_for
from tidal.controller.owners import account, run_as
from tidal.slurm import CliJsonSlurmClient
from tidal.slurm.models import UnitOwner

pytestmark = pytest.mark.slurm

DEBIAN_PYTHON = Path("/usr/bin/python3.11")
MARK = "Tidal test user"
EXIT_DENIED = 6


def _make_account(name: str, *, system: bool) -> UnitOwner:
    try:
        existing = pwd.getpwnam(name)
    except KeyError:
        existing = None
    if existing is not None:
        if existing.pw_gecos != MARK:
            pytest.skip(f"an account named {name} exists and is not this test's")
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True, timeout=60)
    options = ["--system", "--no-create-home", "--shell", "/usr/sbin/nologin"] if system else [
        "--create-home", "--shell", "/bin/bash"]
    subprocess.run(["useradd", *options, "--user-group", "--comment", MARK, name], check=True, capture_output=True,
                   timeout=60)
    return account(pwd.getpwnam(name).pw_uid)


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except FileNotFoundError:
                continue
    return found


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, UnitOwner]]:
    """alice and bob (ordinary users, uid >= 1000) and tidalsys (a system account)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make test users")
    made: dict[str, UnitOwner] = {}
    try:
        made["alice"] = _make_account("alice", system=False)
        made["bob"] = _make_account("bob", system=False)
        made["tidalsys"] = _make_account("tidalsys", system=True)
        yield made
    finally:
        for owner in made.values():
            for pid in _processes_of(owner.uid):
                # Anything of the test users' still running is this test's: stopped by PID.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            subprocess.run(["userdel", "--remove", owner.name], check=False, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def users_python() -> Iterator[Path]:
    """Debian's python3 in a virtual environment every user may run, seeing this run's
    packages (and PYTHONPATH) through a .pth file."""
    if not DEBIAN_PYTHON.exists():
        pytest.skip(f"{DEBIAN_PYTHON} (Debian's python3) is not installed")
    for parent in [REPO_ROOT, *REPO_ROOT.parents]:
        if not parent.stat().st_mode & stat.S_IXOTH:
            pytest.skip(f"{parent} is closed to other users, who must read the repository")
    folder = Path(tempfile.mkdtemp(prefix="tidal-users-python-"))
    folder.chmod(0o755)
    try:
        subprocess.run([str(DEBIAN_PYTHON), "-m", "venv", "--without-pip", str(folder / "venv")], check=True,
                       capture_output=True, timeout=120)
        site = Path(subprocess.run([str(folder / "venv" / "bin" / "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True, timeout=60).stdout.strip())
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        lines = [f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})",
                 *(f"import sys; sys.path.insert(0, {p!r})" for p in extra)]
        (site / "tidal-test-run.pth").write_text("\n".join(lines) + "\n")
        yield folder / "venv" / "bin" / "python"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cli_as(owner: UnitOwner, python: Path, controller: ControllerProcess,
           *args: str) -> subprocess.CompletedProcess[str]:
    """`tidal ARGS` run by `owner` (ids, groups, environment), over the Unix socket."""
    return run_as(owner, [str(python), "-m", "tidal.controller.cli", "--socket", str(controller.socket), *args],
                  timeout_s=120)


def process_owners(job_id: str) -> dict[int, tuple[int, str]]:
    """pid -> (uid, what) for the job's launchers and workers on this machine."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            uid = entry.stat().st_uid
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        text = b" ".join(argv).decode(errors="replace")
        if "tidal.launcher.agent" in text and f"--job {job_id}" in text:
            found[int(entry.name)] = (uid, "launcher")
        elif str(LIVE_EXAMPLE) in text and f"TIDAL_JOB_ID={job_id}".encode() in environ:
            found[int(entry.name)] = (uid, "worker")
    return found


def test_units_run_as_their_owner_and_other_users_cannot_touch_them(
        accounts: dict[str, UnitOwner], users_python: Path, slurm: CliJsonSlurmClient, mini_cluster: dict,
        tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    alice, bob, system = accounts["alice"], accounts["bob"], accounts["tidalsys"]
    controller = ControllerProcess(tmp_path, {
        "slurm_units": "true", "slurm_poll_interval_s": "1", "join_settle_s": "1",
        "unit_launcher": f"{users_python} -m tidal.launcher.agent", "unit_output_dir": "~/.tidal/{job}"})
    controller.start()
    job_id = ""
    try:
        job_line = ["--min-replicas", "1", "--max-replicas", "2", "--mode", "live", "-p", "train",
                    "--env", "OMP_NUM_THREADS=1", "--", str(users_python), str(LIVE_EXAMPLE), "--steps", "100000",
                    "--global-batch", "24", "--micro-batch", "4", "--step-time", "0.01"]
        submitted = cli_as(alice, users_python, controller, "submit", "--json", *job_line)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        reply = json.loads(submitted.stdout)
        job_id, secret = reply["job"]["job_id"], Path(reply["secret_path"])
        assert int(reply["job"]["owner_uid"]) == alice.uid

        with controller.admin() as admin:
            wait_for("alice's job at 2 replicas", running_at(admin, job_id, 2), timeout_s=180, interval_s=0.5)

        # Slurm shows the units as alice's.
        units = [j for j in slurm.list_jobs() if j.name.startswith(f"tidal-{job_id}-") and j.is_active]
        assert len(units) == 2 and {j.user for j in units} == {"alice"}, [(j.name, j.user) for j in units]
        # Its launchers and workers run as alice.
        def both_units_processes() -> dict[int, tuple[int, str]] | None:
            found = process_owners(job_id)
            kinds = [what for _, what in found.values()]
            return found if kinds.count("launcher") >= 2 and kinds.count("worker") >= 2 else None

        processes = wait_for("the job's launchers and workers", both_units_processes, timeout_s=30)
        assert {uid for uid, _ in processes.values()} == {alice.uid}, processes
        # Its output and its secret are alice's, readable by her only.
        folder = Path(alice.home) / ".tidal" / job_id
        assert secret == folder / "secret"
        outputs = wait_for("the units' output files", lambda: sorted(folder.glob(f"{job_id}-*.out")) or None,
                           timeout_s=30)
        for path in [folder, secret, *outputs]:
            info = path.stat()
            assert info.st_uid == alice.uid, f"{path} belongs to uid {info.st_uid}"
            assert stat.S_IMODE(info.st_mode) & 0o077 == 0, f"{path} has mode {stat.S_IMODE(info.st_mode):o}"

        # bob may not cancel, drain or resize it, nor read its secret.
        for args in (["cancel", job_id], ["drain", job_id], ["resize", job_id, "--max", "1"]):
            refused = cli_as(bob, users_python, controller, *args)
            assert refused.returncode == EXIT_DENIED, (args, refused.returncode, refused.stdout + refused.stderr)
            assert f"belongs to uid {alice.uid}, not to uid {bob.uid}" in refused.stdout + refused.stderr
        peek = run_as(bob, ["cat", str(secret)])
        assert peek.returncode != 0 and "Permission denied" in peek.stderr
        with controller.admin() as admin:
            assert running_at(admin, job_id, 2)() is not None, "bob's attempts changed alice's job"

        # A system account's job is refused, saying why; nothing is submitted.
        refused = cli_as(system, users_python, controller, "submit", *job_line)
        said = refused.stdout + refused.stderr
        assert refused.returncode == EXIT_DENIED, said
        assert f"uid {system.uid} (tidalsys) is a system account (below min_owner_uid 1000)" in said
        with controller.admin() as admin:
            assert [j.job_id for j in admin.jobs()] == [job_id]
    finally:
        if job_id:
            with controller.admin() as admin:
                admin.cancel(job_id)
            wait_for_units_to_end(slurm, job_id)
        controller.stop()
    assert not process_owners(job_id), "a launcher or worker of the job outlived it"
