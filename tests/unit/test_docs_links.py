"""The README and docs/*.md hold together: every relative link names a file that exists
and every #anchor a heading of that file (GitHub's rules), the README starts with the two
commands and lists every `tidal` command, and docs/configuration.md every setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tidal.controller.cli import build_parser
from tidal.controller.config import ControllerConfig

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _CODE_SPAN.sub("``", line)))
    return lines


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: the text without markup, lower case, every character
    that is not a letter, digit, space, '-' or '_' dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ids of the page's headings (outside code blocks; GitHub numbers repeats)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            found.add(anchor if count == 0 else f"{anchor}-{count}")
            seen[anchor] = count + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    return [(number, match.group(1)) for number, line in _prose_lines(page.read_text())
            for match in _LINK.finditer(line)]


def test_github_anchor_follows_githubs_rules() -> None:
    assert github_anchor("Units as Slurm jobs") == "units-as-slurm-jobs"
    assert github_anchor("The access layer (`tidal.slurm`)") == "the-access-layer-tidalslurm"
    assert github_anchor("Submitting: `tidal submit` and `tidal-sbatch`") == "submitting-tidal-submit-and-tidal-sbatch"
    assert github_anchor("Preemption, as seen by polling (22.05, 24.11 and 26.05 alike)") == (
        "preemption-as-seen-by-polling-2205-2411-and-2605-alike")
    assert github_anchor("Flows (restart mode)") == "flows-restart-mode"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{page.name}:{number}: {target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{page.name}:{number}: {target}: no heading #{anchor} in "
                          f"{destination.relative_to(REPO)} (has: {', '.join(sorted(anchors(destination)))})")
    assert not broken, "\n".join(broken)


def test_the_readme_starts_with_the_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("```sh\n") < text.index("\n## "), "the two commands come before any section"


def test_the_readme_is_read_in_five_minutes() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) < 200


def test_the_readme_lists_every_tidal_command() -> None:
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    assert commands is not None
    readme = (REPO / "README.md").read_text()
    missing = [name for name in commands if name != "sbatch" and f"`tidal {name}" not in readme]
    assert not missing, f"README.md's CLI table lacks: {missing}"
    assert "tidal-sbatch" in readme  # `tidal sbatch` is what scripts/tidal-sbatch runs


def test_every_controller_setting_is_documented() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in ControllerConfig.__dataclass_fields__ if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not describe: {missing}"
