"""Live mode: a worker is killed for silence only when it is frozen, never because it is
slow. A real controller, two launchers and gloo workers running the MLP example; the
silence limit is the controller's (`worker_silence_timeout_s`, sent in Registered)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import REPO, TidalRun, alive, wait_until
from tidal.proto import common_pb2

pytestmark = pytest.mark.integration

LIVE_EXAMPLE = REPO / "examples" / "live_mode" / "train_mlp.py"
HOG_S = 6.0
BUSY_S = 6.0

# Runs the example with one more thread, which, once the test creates busy-<pid> in the
# folder given, makes one C call of about BUSY_S seconds that never lets the interpreter
# switch threads (as a long pickling or a C extension holding the GIL does): the worker
# burns CPU and its beat thread stands still. Then it writes busy-<pid>.done, holding how
# long the call took.
BUSY_WORKER = f"""
import os, runpy, sys, threading, time
from pathlib import Path

trigger = Path(sys.argv[1]) / f"busy-{{os.getpid()}}"

def timed(count):
    started = time.perf_counter()
    sum(range(count))
    return time.perf_counter() - started

def hold_the_interpreter_when_asked():
    while not trigger.exists():
        time.sleep(0.05)
    unit = 10**6
    per_unit = min(timed(unit) for _ in range(5))
    started = time.perf_counter()
    sum(range(int(unit * {BUSY_S} / per_unit)))
    # Written whole, then renamed: the test reads it as soon as it exists.
    written = trigger.with_suffix(".writing")
    written.write_text(str(time.perf_counter() - started))
    written.rename(trigger.with_suffix(".done"))

threading.Thread(target=hold_the_interpreter_when_asked, daemon=True).start()
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start_two(run: TidalRun, tmp_path: Path, silence_limit_s: float | None = None,
              busy_hook: bool = False) -> tuple[Path, dict[str, int]]:
    """A live job of two replicas (min 1), trained 10 steps at world size 2 under a
    controller whose silence limit is `silence_limit_s` (None: its default), its workers
    run under BUSY_WORKER if `busy_hook`; the ledger and each unit's worker PID."""
    controller = run.controller
    if silence_limit_s is not None:
        controller.stop()
        controller.settings["worker_silence_timeout_s"] = str(silence_limit_s)
        controller.start()
    ledger = tmp_path / "ledger"
    command = [sys.executable, str(LIVE_EXAMPLE), "--steps", "100000", "--global-batch", "24", "--micro-batch", "4",
               "--samples", "500", "--seed", "7", "--step-time", "0.01", "--ledger-dir", str(ledger)]
    if busy_hook:
        wrapper = tmp_path / "busy_worker.py"
        wrapper.write_text(BUSY_WORKER)
        command = [sys.executable, str(wrapper), str(tmp_path), *command[1:]]
    run.submit(min_replicas=1, max_replicas=2, command=command, mode=common_pb2.JOB_MODE_LIVE)
    for unit in "ab":
        run.start_launcher(unit)
    controller.wait_event(run.job_id, "world_formed", where=lambda e: e.fields["replicas"] == "2")
    wait_until(lambda: len(commits(ledger, world_size=2)) >= 2 * 10, 60, "10 steps at world size 2")
    pids: dict[str, int] = {}
    for unit in "ab":
        [pids[unit]] = run.launchers[unit].worker_pids()
    return ledger, pids


def commits(ledger: Path, world_size: int | None = None) -> list[dict[str, Any]]:
    records = []
    for path in sorted(ledger.glob("ledger-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a SIGKILL
                continue
            if record["kind"] == "commit" and (world_size is None or record["world_size"] == world_size):
                records.append(record)
    return records


def highest_step(ledger: Path) -> int:
    return max((r["step"] for r in commits(ledger)), default=-1)


def launcher_events(run: TidalRun, event: str) -> list[dict[str, Any]]:
    return [r for launcher in run.launchers.values() for r in launcher.log_records() if r.get("event") == event]


def test_busy_workers_on_a_loaded_node_are_not_killed_for_silence(tidal_run: TidalRun, tmp_path: Path) -> None:
    # A limit just above the beat interval (0.5 s): on a node this loaded, beats come late
    # and the launcher judges its workers many times; it must find them slow, not frozen.
    ledger, pids = start_two(tidal_run, tmp_path, silence_limit_s=0.6)
    # More CPU hogs than the cores this test may use (up to 16), at the workers' priority,
    # for HOG_S seconds.
    cores = min(len(os.sched_getaffinity(0)), 16)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(cores + 1):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        before = highest_step(ledger)
        progress = [before]
        deadline = time.monotonic() + HOG_S
        while time.monotonic() < deadline:
            time.sleep(1.0)
            progress.append(highest_step(ledger))
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(10)
    after_hog = progress[-1]
    wait_until(lambda: highest_step(ledger) >= after_hog + 10, 30, "10 more steps after the load")

    events = tidal_run.controller.events(tidal_run.job_id)
    assert not [e for e in events if e.kind in ("failure_detected", "generation_stopping")], \
        [(e.kind, e.reason) for e in events]
    # Training went on under the load, and the same two workers still train.
    assert after_hog > before, progress
    assert all(alive(pid) for pid in pids.values())
    assert {unit: tidal_run.launchers[unit].worker_pids() for unit in "ab"} == {u: [p] for u, p in pids.items()}
    assert not launcher_events(tidal_run, "worker_frozen")


def test_a_worker_busy_and_silent_for_seconds_is_not_killed(tidal_run: TidalRun, tmp_path: Path) -> None:
    # The controller's default limit (2 s): the worker's beats stop for about BUSY_S while
    # it burns CPU; its launcher finds it slow, never frozen, and training goes on after.
    ledger, pids = start_two(tidal_run, tmp_path, busy_hook=True)
    (tmp_path / f"busy-{pids['b']}").touch()
    done = tmp_path / f"busy-{pids['b']}.done"
    wait_until(lambda: done.exists() or not alive(pids["b"]), 30, "the busy call to end")
    assert alive(pids["b"]), [(e.kind, e.reason) for e in tidal_run.controller.events(tidal_run.job_id)]
    busy_s = float(done.read_text())
    resumed_at = highest_step(ledger)
    wait_until(lambda: highest_step(ledger) >= resumed_at + 10, 30, "10 more steps after the busy call")

    events = tidal_run.controller.events(tidal_run.job_id)
    assert not [e for e in events if e.kind in ("failure_detected", "generation_stopping")], \
        [(e.kind, e.reason) for e in events]
    assert busy_s > 3.0, f"the call held the interpreter only {busy_s:.1f} s, not well past the 2 s limit"
    assert all(alive(pid) for pid in pids.values())
    assert {unit: tidal_run.launchers[unit].worker_pids() for unit in "ab"} == {u: [p] for u, p in pids.items()}
    assert not launcher_events(tidal_run, "worker_frozen")
    # Judged once in its silent spell, as busy.
    [slow] = launcher_events(tidal_run, "worker_slow")
    assert slow["pid"] == pids["b"] and "busy:" in slow["reason"], slow


def test_a_stopped_worker_is_killed_for_silence_and_the_job_recovers(tidal_run: TidalRun, tmp_path: Path) -> None:
    # The controller's limit, 1 s, not the launchers' own default (2 s): one limit, sent.
    ledger, pids = start_two(tidal_run, tmp_path, silence_limit_s=1.0)
    stopped_at = time.time()
    os.kill(pids["b"], signal.SIGSTOP)
    try:
        failure = tidal_run.controller.wait_event(tidal_run.job_id, "failure_detected", timeout=20)
    finally:
        if alive(pids["b"]):
            os.kill(pids["b"], signal.SIGCONT)
    # Its own launcher judged it frozen (stopped), killed it, and said why.
    assert failure.unit_id == "b" and failure.fields["cause"] == "silent", failure
    assert "stopped (SIGSTOP)" in failure.reason and "killed by its launcher" in failure.reason, failure.reason
    [frozen] = launcher_events(tidal_run, "worker_frozen")
    assert frozen["pid"] == pids["b"] and 1.0 < frozen["silent_s"] < 2.0, frozen
    # The limit runs from its last beat, up to 0.5 s before the SIGSTOP.
    detected_after = failure.time.ToNanoseconds() / 1e9 - stopped_at
    assert 0.5 <= detected_after < 4.0, detected_after
    wait_until(lambda: not alive(pids["b"]), 10, "the stopped worker to be killed")

    # The survivor goes on alone, in-process.
    recovered = tidal_run.controller.wait_event(tidal_run.job_id, "recovered", timeout=30)
    assert recovered.fields["world_size"] == "1"
    wait_until(lambda: len(commits(ledger, world_size=1)) >= 10, 30, "10 steps at world size 1")
    assert tidal_run.launchers["a"].worker_pids() == [pids["a"]] and alive(pids["a"])
