"""bench/common.py's result files say which code they measured and when; bench/report.py
shows it."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import pytest

from bench import common, report


def test_a_result_file_records_the_code_version_and_the_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    path = common.write_result("example", [common.Row(benchmark="example", metric="m", unit="s", tidal=1.0,
                                                      goal="none", met=True)], quick=True, settings={})
    document = json.loads(path.read_text())
    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=common.REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    assert document["code"] == (described or "unknown")
    date = datetime.datetime.fromisoformat(document["date"])
    assert abs((datetime.datetime.now(datetime.UTC) - date).total_seconds()) < 600


def test_the_report_names_the_code_a_result_measured_and_says_when_it_was_not_recorded() -> None:
    assert report.measured_code({"code": "01a7e50-dirty", "settings": {}}) == "01a7e50-dirty"
    # (chaos kept it in its settings before every result file did)
    assert report.measured_code({"settings": {"code": "7df2574 with uncommitted changes"}}) == (
        "7df2574 with uncommitted changes")
    assert report.measured_code({"settings": {}}) == "not recorded"
