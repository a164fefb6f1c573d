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
