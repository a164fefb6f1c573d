"""`make test` runs the folders of tests that scripts/test-tiers names, one test after
another; `make test-streams` runs tests/slurm as one stream and every other folder beside it
(scripts/test-streams), then the Slurm tests marked `alone`: a test that needs the mini
cluster must live in tests/slurm, or it would share the cluster with the Slurm tier's test
of the moment."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

SLURM_MARK = re.compile(r"pytest\.mark\.slurm\b")


def test_slurm_tests_live_in_tests_slurm_and_every_file_there_is_marked() -> None:
    tests = REPO_ROOT / "tests"
    outside = [path.relative_to(REPO_ROOT) for path in tests.rglob("*.py")
               if "slurm" not in path.relative_to(tests).parts[:1] and SLURM_MARK.search(path.read_text())]
    # (This file names the mark in its pattern only.)
    assert [str(p) for p in outside if p.name != "test_test_streams.py"] == []
    unmarked = [path.name for path in sorted((tests / "slurm").glob("test_*.py"))
                if not re.search(r"^pytestmark = pytest\.mark\.slurm$", path.read_text(), re.MULTILINE)]
    assert unmarked == []
    assert sorted((tests / "slurm").glob("test_*.py")), "no Slurm tier found"


def test_the_tests_that_run_alone_are_slurm_tests() -> None:
    """`alone` (run after both streams, on a machine left to them) is read in tests/slurm
    only: a test marked so elsewhere would still run beside the Slurm tier."""
    tests = REPO_ROOT / "tests"
    alone = [path for path in tests.rglob("test_*.py") if re.search(r"pytest\.mark\.alone\b", path.read_text())]
    assert alone and all(path.parent == tests / "slurm" for path in alone), alone


def test_make_test_runs_every_folder_of_tests() -> None:
    """`make test` names the folders of tests it runs (scripts/test-tiers, the unit tier
    first): a new folder of tests left off that list would silently never run."""
    script = (REPO_ROOT / "scripts" / "test-tiers").read_text()
    listed = re.search(r"^TIERS=\(([^)]*)\)$", script, re.MULTILINE)
    assert listed, "scripts/test-tiers has no TIERS=(...) line"
    tiers = listed.group(1).split()
    assert tiers[0] == "tests/unit", tiers
    tests = REPO_ROOT / "tests"
    folders = {str(path.parent.relative_to(REPO_ROOT)) for path in tests.rglob("test_*.py")}
    missed = sorted(folder for folder in folders
                    if not any(folder == tier or folder.startswith(tier + "/") for tier in tiers))
    assert missed == [], f"folders of tests that make test does not run: {missed}"
    assert all((REPO_ROOT / tier).is_dir() for tier in tiers), tiers
    # What runs beside the unit tier (and is left out of the later run) must exist: a
    # renamed file would otherwise run in neither.
    beside = re.search(r"^BESIDE_UNIT=\(([^)]*)\)$", script, re.MULTILINE)
    assert beside, "scripts/test-tiers has no BESIDE_UNIT=(...) line"
    files = beside.group(1).split()
    assert files and all((REPO_ROOT / file).is_file() for file in files), files
    assert not any(file.startswith(("tests/unit/", "tests/slurm/")) for file in files), files
