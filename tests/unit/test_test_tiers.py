"""`make test` (scripts/test-tiers) runs tests/unit and tests/integration in two streams at
once, then tests/slurm, tests/gpu and the tests marked `alone` one after another. It picks
the first part by folder and the second by mark, so the marks must match the folders, or a
test would run twice or never: these checks read the files as the script does."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

TESTS = REPO_ROOT / "tests"
SCRIPT = REPO_ROOT / "scripts" / "test-tiers"


def marked(path: Path, mark: str) -> bool:
    return re.search(rf"pytest\.mark\.{mark}\b", path.read_text()) is not None


def listed(name: str) -> list[str]:
    found = re.search(rf"^{name}=\(([^)]*)\)$", SCRIPT.read_text(), re.MULTILINE)
    assert found, f"scripts/test-tiers has no {name}=(...) line"
    return found.group(1).split()


def test_slurm_tests_live_in_tests_slurm_and_every_file_there_is_marked() -> None:
    """The Slurm tests share one mini cluster: one in another folder would run in the
    first part, beside other tests and perhaps beside the cluster's next user."""
    outside = [path.relative_to(REPO_ROOT) for path in TESTS.rglob("*.py")
               if path.relative_to(TESTS).parts[0] != "slurm" and marked(path, "slurm")]
    # (This file names the mark in its pattern only.)
    assert [str(p) for p in outside if p.name != Path(__file__).name] == []
    unmarked = [path.name for path in sorted((TESTS / "slurm").glob("test_*.py"))
                if not re.search(r"^pytestmark = pytest\.mark\.slurm$", path.read_text(), re.MULTILINE)]
    assert unmarked == []
    assert sorted((TESTS / "slurm").glob("test_*.py")), "no Slurm tier found"


def test_every_integration_file_is_marked_and_no_other_folder_is() -> None:
    """The second part leaves out `integration` tests (the first ran them): an unmarked
    file in tests/integration would run twice, a marked one in tests/slurm or tests/gpu never."""
    files = sorted((TESTS / "integration").glob("test_*.py"))
    module_mark = re.compile(r"^pytestmark = .*pytest\.mark\.integration\b", re.MULTILINE)
    assert files and [path.name for path in files if not module_mark.search(path.read_text())] == []
    elsewhere = [str(path.relative_to(REPO_ROOT)) for folder in ("slurm", "gpu")
                 for path in (TESTS / folder).glob("test_*.py") if marked(path, "integration")]
    assert elsewhere == []


def test_the_tests_marked_alone_are_integration_or_slurm_tests() -> None:
    """`alone` moves a test from the first part to the second; the second does not read
    tests/unit, so a unit test marked so would never run."""
    alone = [path for path in TESTS.rglob("test_*.py") if marked(path, "alone") and path.name != Path(__file__).name]
    assert alone and all(path.parent.name in ("integration", "slurm") for path in alone), alone


def test_make_test_runs_every_folder_of_tests_and_the_side_streams_files_exist() -> None:
    """A new folder of tests left off TIERS, or a renamed file of the side stream (left out
    of the first stream by name), would silently never run."""
    tiers = listed("TIERS")
    assert tiers == ["tests/unit", "tests/integration", "tests/slurm", "tests/gpu"], tiers
    folders = {str(path.parent.relative_to(REPO_ROOT)) for path in TESTS.rglob("test_*.py")}
    missed = sorted(folder for folder in folders
                    if not any(folder == tier or folder.startswith(tier + "/") for tier in tiers))
    assert missed == [], f"folders of tests that make test does not run: {missed}"
    beside = listed("BESIDE")
    assert beside and all((REPO_ROOT / file).is_file() and file.startswith("tests/integration/test_")
                          for file in beside), beside
