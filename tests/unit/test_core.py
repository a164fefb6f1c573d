"""The controller's pure core, through its public functions only."""

from __future__ import annotations

from tidal.controller.core import (
    Completed,
    FinishingMember,
    MemberProgress,
    committed_step,
    completion_verdict,
    state_holders,
)


def test_the_committed_step_is_the_lowest_step_every_rank_reports() -> None:
    members = [MemberProgress("a", 2, {0: 41, 1: 40}), MemberProgress("b", 1, {2: 42})]
    assert committed_step(10, members) == 40


def test_the_committed_step_waits_for_every_rank_and_never_goes_down() -> None:
    # b's worker has not reported yet (a fresh joiner): nothing is known for the world.
    assert committed_step(10, [MemberProgress("a", 1, {0: 50}), MemberProgress("b", 1, {})]) == 10
    # A rank behind the watermark (a report older than the last one taken) lowers nothing.
    assert committed_step(30, [MemberProgress("a", 1, {0: 29})]) == 30
    assert committed_step(7, []) == 7


def test_a_rank_that_committed_and_died_does_not_raise_the_watermark_past_the_survivors() -> None:
    # The dead rank's step is gone with it; the survivors' lowest is what the world holds.
    assert committed_step(0, [MemberProgress("a", 1, {0: 101}), MemberProgress("b", 1, {1: 100})]) == 100


def test_state_holders_are_the_units_whose_every_worker_is_at_the_target() -> None:
    steps = {"a": [120, 120], "b": [119, 120], "c": [0], "d": []}
    assert state_holders(120, steps) == ("a",)
    assert state_holders(119, steps) == ("a", "b")


def test_nobody_needs_to_hold_step_zero() -> None:
    assert state_holders(0, {"a": [0], "b": [5]}) == ()


def test_a_finishing_job_completes_once_every_member_is_done() -> None:
    running = FinishingMember("a", workers=2, exited_ok=frozenset({0}))
    assert completion_verdict(600, [running, FinishingMember("b", 1, frozenset({0}))]) is None
    done = FinishingMember("a", workers=2, exited_ok=frozenset({0, 1}))
    gone = FinishingMember("b", workers=1, gone=True)
    assert completion_verdict(600, [done, gone]) == Completed("training completed at step 600")


def test_a_worker_that_fails_after_the_last_step_is_named_but_does_not_fail_the_job() -> None:
    member = FinishingMember("a", workers=2, exited_ok=frozenset({0}), exited_failed={1: "killed by SIGKILL"})
    verdict = completion_verdict(600, [member])
    assert verdict is not None
    assert verdict.reason == "training completed at step 600; after the last step a local rank 1 killed by SIGKILL"


def test_the_pure_core_imports_nothing_that_does_io_or_awaits() -> None:
    """The job's state machine reads no clock, file or socket: importing it pulls in no
    subprocess, asyncio, gRPC, SQLite or logging machinery (a fresh interpreter)."""
    import subprocess
    import sys

    probe = ("import sys, tidal.controller.core.job; "
             "print(','.join(m for m in ('subprocess', 'asyncio', 'grpc', 'sqlite3', 'structlog', 'torch') "
             "if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert found.stdout.strip() == ""
