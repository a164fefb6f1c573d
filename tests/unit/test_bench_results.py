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


def test_controller_scale_clients_read_back_a_secret_that_starts_with_a_dash(tmp_path: Path) -> None:
    """A job secret is token_urlsafe: one in 64 starts with "-". Passed as `--secret VALUE`,
    argparse took it for an option, every client exited at once, and the benchmark (in
    `make test`, bench-quick) waited 300 s for a world that never formed."""
    from bench.controller_scale import client_arguments, command_line

    for secret in ("-Xy_0", "--looks-like-an-option", "plain"):
        arguments = client_arguments(target="127.0.0.1:1", job_id="j-1", secret=secret, first=0, count=5,
                                     trigger=tmp_path / "t", done=tmp_path / "d", out=tmp_path / "o", victims=1)
        args = command_line().parse_args(arguments)
        assert (args.client, args.secret, args.job, args.count, args.victim) == (True, secret, "j-1", 5, True)
