"""Fixtures shared by every tier.

Tests marked `slurm` need the real mini cluster (`scripts/minicluster up`, SLURM_CONF
set; `make test` does both). Without one they are skipped, except when
TIDAL_TEST_REQUIRE_SLURM=1 (as in `make test` and CI), where a missing cluster fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidal.slurm import CliJsonSlurmClient, SlurmError

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mini_cluster() -> dict:
    """The running mini cluster's record (scripts/minicluster's cluster.json)."""
    conf = os.environ.get("SLURM_CONF", "")
    record = Path(conf).parent / "cluster.json" if conf else None
    problem = None
    if not conf or record is None or not record.exists():
        problem = "no mini cluster: run `scripts/minicluster up` and export SLURM_CONF"
    else:
        try:
            CliJsonSlurmClient(timeout_s=10).version()
        except SlurmError as error:
            problem = f"the mini cluster does not answer: {error}"
    if problem:
        if os.environ.get("TIDAL_TEST_REQUIRE_SLURM") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return json.loads(record.read_text())


@pytest.fixture
def slurm(mini_cluster: dict) -> Iterator[CliJsonSlurmClient]:
    """A client for the mini cluster; every job still active when the test ends is cancelled."""
    client = CliJsonSlurmClient(timeout_s=10)
    before = {job.job_id for job in client.list_jobs()}
    yield client
    leftovers = [j.job_id for j in client.list_jobs() if j.job_id not in before and j.is_active]
    if leftovers:
        subprocess.run(["scancel", *map(str, leftovers)], check=False, timeout=10)
        # Gone before the next test looks for idle nodes, so one failure does not become many.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                j.job_id in leftovers and j.is_active for j in client.list_jobs()):
            time.sleep(0.5)


# Under TIDAL_TEST_REQUIRE_SLURM=1 (`make test`, CI) a test of the Slurm or integration tier
# that skips has not run, and a run that reports it as anything but a failure lets a broken
# tier pass unseen: its skip (pytest.skip, a skipif mark, a module's importorskip) fails,
# with the skip's reason. Expected failures (xfail) are left alone.
REQUIRED_TIERS = ("slurm", "integration")


def skips_must_fail() -> bool:
    return os.environ.get("TIDAL_TEST_REQUIRE_SLURM") == "1"


def in_required_tier(path: Path) -> bool:
    """Whether `path` lies in tests/slurm/ or tests/integration/ (of this repository or of
    a copy of its layout)."""
    parts = path.parts
    return any(parts[i] == "tests" and parts[i + 1] in REQUIRED_TIERS for i in range(len(parts) - 1))


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def failed_skip_message(reason: str) -> str:
    return (f"skipped under TIDAL_TEST_REQUIRE_SLURM=1, which requires every test of the {'/'.join(REQUIRED_TIERS)} "
            f"tiers to run: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and skips_must_fail()
            and in_required_tier(Path(str(item.path)))):
        report.outcome = "failed"
        report.longrepr = failed_skip_message(skip_reason(report))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and skips_must_fail() and in_required_tier(Path(str(collector.path))):
        report.outcome = "failed"
        report.longrepr = failed_skip_message(skip_reason(report))
