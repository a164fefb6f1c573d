"""`make test-streams` runs tests/slurm as one stream and every other folder beside it
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
