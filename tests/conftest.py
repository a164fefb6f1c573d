"""Fixtures shared by every tier.

Tests marked `slurm` need the real mini cluster (`scripts/minicluster up`, SLURM_CONF
set; `make test` does both). Without one they are skipped, except when
TIDAL_TEST_REQUIRE_SLURM=1 (as in `make test` and CI), where a missing cluster fails them.

Tests marked `gpu` (tests/gpu) need CUDA GPUs, `gpu(devices=N)` N of them. Asked for by
name (`-m gpu`, `make test-gpu`), one that cannot run is skipped with its reason; in a
wider run (`make test`) the ones that cannot run are left out (deselected) and the run
ends with one line saying how many and why. Their skip is never a failure: no machine
of CI has a GPU.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidal.slurm import CliJsonSlurmClient, SlurmError
from tidal.train import quick_exit

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


# The GPU tier.
GPU_MARK = "gpu"
GPU_SUMMARY: pytest.StashKey[str] = pytest.StashKey()


def cuda_device_count() -> int:
    """How many CUDA GPUs torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_needed(item: pytest.Item) -> int | None:
    """How many GPUs a test asks for (None: not a GPU test)."""
    mark = item.get_closest_marker(GPU_MARK)
    return None if mark is None else int(mark.kwargs.get("devices", 1))


def gpu_tier_asked(markexpr: str) -> bool:
    """Whether the run names the GPU tier (`-m gpu`) rather than just not excluding it."""
    return GPU_MARK in markexpr.split() and f"not {GPU_MARK}" not in markexpr


def gpu_left_out_line(left_out: int, total: int, needed: int, available: int) -> str:
    """The one line a run prints about the GPU tests it left out."""
    return (f"gpu tier skipped: {left_out} of {total} tests not run, they need {needed} or more CUDA GPUs and "
            f"torch.cuda.device_count() is {available} here (make test-gpu runs them on a GPU machine)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [(item, needed) for item in items if (needed := gpus_needed(item)) is not None]
    if not gpu_items:
        return
    available = cuda_device_count()
    unrunnable = [(item, needed) for item, needed in gpu_items if needed > available]
    if not unrunnable:
        return
    if gpu_tier_asked(config.getoption("markexpr") or ""):
        for item, needed in unrunnable:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, torch.cuda.device_count() is {available}"))
        return
    left_out = {id(item) for item, _ in unrunnable}
    config.hook.pytest_deselected(items=[item for item, _ in unrunnable])
    items[:] = [item for item in items if id(item) not in left_out]
    config.stash[GPU_SUMMARY] = gpu_left_out_line(len(unrunnable), len(gpu_items),
                                                  min(needed for _, needed in unrunnable), available)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    line = config.stash.get(GPU_SUMMARY, None)
    if line is not None:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def no_quick_exit_left_armed() -> Iterator[None]:
    """A test that runs a worker's leave in this process arms `quick_exit`: the process would
    end with exit code 0 right after its atexit handlers, so pytest's own exit status (its
    failures) was lost and `make test` passed a failed run. Disarmed after each test."""
    yield
    if quick_exit._Armed.code is not None:
        atexit.unregister(quick_exit._end)
        quick_exit._Armed.code = None
