"""tests/conftest.py: under TIDAL_TEST_REQUIRE_SLURM=1 (`make test`), a skip in the Slurm or
integration tier fails, with its reason; elsewhere, and without the variable, it skips. The
GPU tier's tests that this machine cannot run are left out of a whole run with one line
saying why, and skipped with their reason when the tier is asked for by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# The repository's hooks, loaded into a scratch suite that has the same layout.
SCRATCH_CONFTEST = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("tidal_tests_conftest", {str(REPO_ROOT / "tests" / "conftest.py")!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
pytest_runtest_makereport = _module.pytest_runtest_makereport
pytest_make_collect_report = _module.pytest_make_collect_report
pytest_collection_modifyitems = _module.pytest_collection_modifyitems
pytest_terminal_summary = _module.pytest_terminal_summary
"""

SKIPS = """
import pytest

def test_skips_in_its_body():
    pytest.skip("needs root and useradd to make test users")

@pytest.mark.skipif(True, reason="needs the openssl command")
def test_skipped_by_a_mark():
    pass

@pytest.fixture
def missing():
    pytest.skip("no mini cluster")

def test_skipped_by_a_fixture(missing):
    pass

@pytest.mark.xfail(reason="a known bug", strict=False)
def test_expected_to_fail():
    assert False

def test_passes():
    pass
"""

IMPORTORSKIP = """
import pytest

pytest.importorskip("a_module_that_is_not_installed_anywhere")

def test_never_collected():
    pass
"""


def scratch_suite(root: Path, module: str) -> Path:
    """`module` as tests/<tier>/test_<tier>.py for each tier, under `root`."""
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(SCRATCH_CONFTEST)
    for tier in ("slurm", "integration", "unit"):
        folder = root / "tests" / tier
        folder.mkdir(parents=True)
        (folder / f"test_{tier}.py").write_text(module)
    return root


def run_suite(root: Path, require: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_TEST_REQUIRE_SLURM"}
    if require:
        env["TIDAL_TEST_REQUIRE_SLURM"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-c",
                           str(root / "pytest.ini"), "--rootdir", str(root), str(root / "tests")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def outcomes(output: str) -> dict[str, str]:
    """'-rA' summary lines: node id -> PASSED/FAILED/SKIPPED/XFAIL/ERROR."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "SKIPPED", "XFAIL", "ERROR") and rest:
            if word == "SKIPPED":
                # "SKIPPED [1] tests/unit/test_x.py:5: reason"
                found[rest.split(" ", 1)[1].split(":", 1)[0]] = word
            else:
                found[rest.split(" - ", 1)[0].strip()] = word
    return found


def test_under_require_slurm_every_skip_of_the_slurm_and_integration_tiers_fails_with_its_reason(
        tmp_path: Path) -> None:
    suite = scratch_suite(tmp_path, SKIPS)
    result = run_suite(suite, require=True)
    found = outcomes(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    for tier in ("slurm", "integration"):
        assert found.get(f"tests/{tier}/test_{tier}.py::test_skips_in_its_body") == "FAILED", result.stdout
        # A mark's or a fixture's skip fails the test's setup: pytest calls that an error.
        for test in ("test_skipped_by_a_mark", "test_skipped_by_a_fixture"):
            assert found.get(f"tests/{tier}/test_{tier}.py::{test}") == "ERROR", result.stdout
        assert found.get(f"tests/{tier}/test_{tier}.py::test_passes") == "PASSED", result.stdout
        assert found.get(f"tests/{tier}/test_{tier}.py::test_expected_to_fail") == "XFAIL", result.stdout
    assert "skipped under TIDAL_TEST_REQUIRE_SLURM=1" in result.stdout
    for reason in ("needs root and useradd to make test users", "needs the openssl command", "no mini cluster"):
        assert reason in result.stdout, reason
    # The unit tier keeps its skips.
    assert found.get("tests/unit/test_unit.py") == "SKIPPED", result.stdout
    assert found.get("tests/unit/test_unit.py::test_passes") == "PASSED", result.stdout


def test_under_require_slurm_a_modules_importorskip_is_a_collection_error_that_stops_the_run(
        tmp_path: Path) -> None:
    """(pytest stops before any test runs when a module cannot be collected: a `make test`
    that cannot run its recipes' tests says so at once, not after 35 minutes.)"""
    suite = scratch_suite(tmp_path, IMPORTORSKIP)
    result = run_suite(suite, require=True)
    found = outcomes(result.stdout)
    assert result.returncode == 2, result.stdout + result.stderr
    for tier in ("slurm", "integration"):
        assert found.get(f"tests/{tier}/test_{tier}.py") == "ERROR", result.stdout
    assert ("skipped under TIDAL_TEST_REQUIRE_SLURM=1, which requires every test of the slurm/integration tiers "
            "to run: could not import 'a_module_that_is_not_installed_anywhere'") in result.stdout
    assert found.get("tests/unit/test_unit.py") == "SKIPPED", result.stdout


@pytest.mark.parametrize("module", [SKIPS, IMPORTORSKIP], ids=["skips", "importorskip"])
def test_without_require_slurm_the_same_skips_skip(module: str, tmp_path: Path) -> None:
    result = run_suite(scratch_suite(tmp_path, module), require=False)
    assert result.returncode in (0, 5), result.stdout + result.stderr  # (5: nothing collected)
    assert not re.search(r"\b\d+ (failed|errors?)\b", result.stdout.splitlines()[-1]), result.stdout
    assert "skipped under TIDAL_TEST_REQUIRE_SLURM=1" not in result.stdout


GPU_TESTS = """
import pytest

@pytest.mark.gpu(devices=100000)
def test_on_many_gpus():
    pass

@pytest.mark.gpu(devices=200000)
def test_on_more_gpus():
    pass

def test_passes():
    pass
"""


def test_gpu_tests_this_machine_cannot_run_are_left_out_with_one_line_even_under_require_slurm(
        tmp_path: Path) -> None:
    suite = scratch_suite(tmp_path, "def test_passes():\n    pass\n")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu(devices=1): needs CUDA GPUs\n")
    (suite / "tests" / "gpu").mkdir()
    (suite / "tests" / "gpu" / "test_gpu.py").write_text(GPU_TESTS)
    result = run_suite(suite, require=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "gpu tier" in line or "GPU" in line]
    assert len(lines) == 1, result.stdout
    assert lines[0].startswith("gpu tier skipped: 2 of 2 tests not run, they need 100000 or more CUDA GPUs and "
                               "torch.cuda.device_count() is "), lines
    assert outcomes(result.stdout).get("tests/gpu/test_gpu.py::test_passes") == "PASSED"
    # Asked for by name, each says why it skips.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TIDAL_TEST_REQUIRE_SLURM": "1"}
    named = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-m", "gpu", "-c",
                            str(suite / "pytest.ini"), "--rootdir", str(suite), str(suite / "tests" / "gpu")],
                           cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert named.returncode == 0, named.stdout + named.stderr
    assert "needs 100000 CUDA GPUs, torch.cuda.device_count() is" in named.stdout
    assert "needs 200000 CUDA GPUs" in named.stdout and "gpu tier skipped" not in named.stdout
