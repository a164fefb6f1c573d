"""Units as Slurm jobs on the real mini cluster: the controller submits a live job's
units with sbatch onto the idle nodes (all at once, or growing onto them later)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import ControllerProcess
from tests.integration.test_live_mode import LIVE_EXAMPLE, commits, read_ledger
from tests.waiting import wait_for
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import CliJsonSlurmClient, JobState, UnitSubmission

pytestmark = pytest.mark.slurm


def slurm_controller(directory: Path) -> ControllerProcess:
    """A controller that runs units as Slurm jobs and polls the mini cluster every second."""
    controller = ControllerProcess(directory, {"slurm_units": "true", "slurm_poll_interval_s": "1",
                                               "join_settle_s": "1", "reconnect_grace_s": "10"})
    controller.start()
    return controller


def live_job(name: str, max_replicas: int, directory: Path, ledger: Path) -> admin_pb2.JobSpec:
    """The MLP example in live mode on the `train` partition, from 1 replica up to `max_replicas`."""
    return admin_pb2.JobSpec(
        name=name, min_replicas=1, max_replicas=max_replicas, partition="train", mode=common_pb2.JOB_MODE_LIVE,
        working_dir=str(directory), environment={"OMP_NUM_THREADS": "1"},
        command=[sys.executable, str(LIVE_EXAMPLE), "--steps", "100000", "--global-batch", "24", "--micro-batch",
                 "4", "--step-time", "0.01", "--ledger-dir", str(ledger)])


def require_four_idle_nodes(slurm: CliJsonSlurmClient) -> None:
    idle = [n for n in slurm.list_nodes() if "train" in n.partitions and n.is_idle_and_usable]
    assert len(idle) == 4, f"the test needs the 4 idle nodes of the mini cluster, found {len(idle)}"


def running_at(admin: AdminClient, job_id: str, size: int) -> Callable[[], admin_pb2.Job | None]:
    """For wait_for: the job, once it runs at world size `size`."""
    def check() -> admin_pb2.Job | None:
        job = admin.job(job_id)
        return job if job.world_size == size and job.state == admin_pb2.JOB_STATE_RUNNING else None
    return check


def wait_for_units_to_end(slurm: CliJsonSlurmClient, job_id: str) -> None:
    wait_for("the units' Slurm jobs to end", lambda: not any(
        j.is_active for j in slurm.list_jobs() if j.name.startswith(f"tidal-{job_id}-")), timeout_s=60)


def test_a_live_job_grows_onto_every_idle_node(slurm: CliJsonSlurmClient, mini_cluster: dict,
                                               tmp_path: Path) -> None:
    nodes = [n for n in slurm.list_nodes() if "train" in n.partitions]
    idle = [n for n in nodes if n.is_idle_and_usable]
    assert len(idle) >= 2, f"the mini cluster has {len(idle)} idle nodes"
    controller = slurm_controller(tmp_path)
    ledger = tmp_path / "ledger"
    try:
        spec = live_job("grow", len(idle), tmp_path, ledger)
        with controller.admin() as admin:
            job_id = admin.submit(spec).job.job_id

            def at_full_size() -> admin_pb2.Job | None:
                job = admin.job(job_id)
                return job if job.world_size == len(idle) else None

            job = wait_for(f"world size {len(idle)}", at_full_size, timeout_s=120, interval_s=0.5)
            wait_for("steps at the full size", lambda: len(commits(read_ledger(ledger), len(idle))) >= 10 * len(idle),
                     timeout_s=60)
            # Every unit is a Slurm job of its own, running where `tidal status` says.
            by_unit = {u.unit_id: u for u in job.units}
            slurm_jobs = {j.job_id: j for j in slurm.list_jobs()}
            for unit in by_unit.values():
                assert unit.slurm_job_id in slurm_jobs, unit
                assert list(slurm_jobs[unit.slurm_job_id].nodes) == list(unit.nodes)
            kinds = [e.kind for e in admin.events(job_id)]
            # One unit per idle node (whether the world formed at 4 or grew to it in-process
            # depends on how fast the units start).
            assert kinds.count("unit_submitted") == len(idle)

            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def test_an_urgent_job_preempts_two_replicas_the_job_shrinks_without_losing_a_step_and_grows_back(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    controller = slurm_controller(tmp_path)
    ledger = tmp_path / "ledger"
    try:
        spec = live_job("preempt", 4, tmp_path, ledger)
        with controller.admin() as admin:
            job_id = admin.submit(spec).job.job_id

            wait_for("world size 4", running_at(admin, job_id, 4), timeout_s=120, interval_s=0.5)
            # Preempt a world that trains: one still starting its workers is another case (a
            # leave can complete only at a step boundary, which may come after GraceTime).
            wait_for("steps at size 4", lambda: commits(read_ledger(ledger), 4), timeout_s=120)
            urgent = slurm.submit(UnitSubmission(name="urgent", script="#!/bin/sh\nsleep 600\n", partition="urgent",
                                                 nodes=2, exclusive=True, requeue=False,
                                                 output=str(tmp_path / "urgent-%j.out")))
            wait_for("world size 2", running_at(admin, job_id, 2), timeout_s=60, interval_s=0.2)
            wait_for("the urgent job to run", lambda: slurm.get_job(urgent).state is JobState.RUNNING,
                     timeout_s=60)
            events = admin.events(job_id)
            leaves = [e for e in events if e.kind == "unit_leaving"]
            assert len(leaves) == 2 and all("Slurm preempts job" in e.reason for e in leaves)
            assert not [e for e in events if e.kind == "failure_detected"]
            assert not [r for r in read_ledger(ledger) if r["kind"] == "abandoned"], "a step was lost"

            slurm.cancel(urgent)
            wait_for("world size 4 again", running_at(admin, job_id, 4), timeout_s=120, interval_s=0.5)
            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def test_two_nodes_that_free_together_join_the_world_in_one_change(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """An urgent job holds 2 of the 4 nodes; the live job trains on the other 2 and keeps a
    unit queued in Slurm. When the urgent job ends, Slurm starts the queued unit on one of
    its nodes at once, before any view of the controller (a 10 s poll) shows the other idle.
    Its registration asks for a view, and the grow waits for it and for the unit it submits
    for the other node: one world change 2 -> 4, not 2 -> 3 then 3 -> 4 a poll later."""
    require_four_idle_nodes(slurm)
    urgent = slurm.submit(UnitSubmission(name="urgent", script="#!/bin/sh\nsleep 600\n", partition="urgent",
                                         nodes=2, exclusive=True, requeue=False,
                                         output=str(tmp_path / "urgent-%j.out")))
    controller = ControllerProcess(tmp_path, {"slurm_units": "true", "slurm_poll_interval_s": "10",
                                              "reconnect_grace_s": "10"})
    controller.start()
    ledger = tmp_path / "ledger"
    try:
        wait_for("the urgent job to run", lambda: slurm.get_job(urgent).state is JobState.RUNNING, timeout_s=30)
        with controller.admin() as admin:
            job_id = admin.submit(live_job("together", 4, tmp_path, ledger)).job.job_id
            wait_for("world size 2", running_at(admin, job_id, 2), timeout_s=120, interval_s=0.5)
            wait_for("a unit queued in Slurm", lambda: [j for j in slurm.list_jobs() if j.name.startswith(
                f"tidal-{job_id}-") and j.state is JobState.PENDING], timeout_s=30, interval_s=0.5)
            last = max(e.sequence for e in admin.events(job_id))
            slurm.cancel(urgent)
            wait_for("world size 4", running_at(admin, job_id, 4), timeout_s=60, interval_s=0.2)
            changes = [e for e in admin.events(job_id) if e.kind == "world_reconfiguring" and e.sequence > last]
            assert len(changes) == 1 and changes[0].reason.startswith("grow 2 -> 4"), [e.reason for e in changes]
            assert not [r for r in read_ledger(ledger) if r["kind"] == "abandoned"], "a step was lost"
            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        with contextlib.suppress(Exception):
            slurm.cancel(urgent)
        controller.stop()


def launcher_pid(job_id: str, unit_id: str) -> int | None:
    """The PID of a unit's launcher, found by its command line (Slurm started it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "tidal.launcher.agent" in argv and job_id in argv and unit_id in argv:
            return int(entry.name)
    return None


def unit_processes(launcher: int) -> list[int]:
    """The launcher, its workers, and the slurmstepd that runs it: what a node failure
    takes with it."""
    def parent(pid: int) -> int:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])

    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if parent(int(entry.name)) == launcher:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    stepd = parent(launcher)
    found = [launcher, *children]
    if Path(f"/proc/{stepd}/comm").read_text().startswith("slurmstepd"):
        found.append(stepd)
    return found


def minicluster(*args: str) -> None:
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "minicluster"), *args], check=True, timeout=120,
                   capture_output=True)


def test_a_node_failure_the_job_recovers_and_the_replacement_avoids_the_node(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    controller = slurm_controller(tmp_path)
    failed_node = ""
    restarted = False
    try:
        with controller.admin() as admin:
            job_id = admin.submit(live_job("replace", 3, tmp_path, tmp_path / "ledger")).job.job_id

            job = wait_for("world size 3", running_at(admin, job_id, 3), timeout_s=120, interval_s=0.5)
            # Hurt the world once it trains: a failure while workers still start is another case.
            wait_for("steps at size 3", lambda: commits(read_ledger(tmp_path / "ledger"), 3), timeout_s=60)
            victim = next(u for u in job.units if u.state == admin_pb2.UNIT_STATE_ACTIVE)
            (failed_node,) = victim.nodes
            pid = wait_for("the victim's launcher", lambda: launcher_pid(job_id, victim.unit_id), timeout_s=10)
            # The node dies: its slurmd, then everything the unit ran there.
            minicluster("kill-node", failed_node)
            for process in unit_processes(pid):
                os.kill(process, signal.SIGKILL)

            recovered = wait_for("the recovery at 2", lambda: [e for e in admin.events(job_id)
                                                             if e.kind == "recovered"], timeout_s=60)
            assert recovered[0].fields["world_size"] == "2", recovered[0]
            excluded = [e for e in admin.events(job_id) if e.kind == "node_excluded"]
            assert [e.fields["node"] for e in excluded] == [failed_node]
            back = wait_for("world size 3 again", running_at(admin, job_id, 3), timeout_s=120, interval_s=0.5)
            replacement = next(u for u in back.units if u.state == admin_pb2.UNIT_STATE_ACTIVE
                               and u.unit_id not in {x.unit_id for x in job.units})
            assert failed_node not in replacement.nodes, (replacement, victim)
            # Submitted with the node excluded (squeue shows what sbatch was given).
            shown = subprocess.run(["squeue", "--noheader", "-j", str(replacement.slurm_job_id), "--format=%x"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            assert failed_node in shown, shown
            admin.cancel(job_id)
        # The dead node set DOWN, as an admin would, then started again: the cancelled unit's
        # Slurm job there ends only when slurmctld sets the node DOWN (by hand, or itself after
        # SlurmdTimeout) or resends its kill to a slurmd back up (40 s later here). Either wait
        # was most of this test's time.
        subprocess.run(["scontrol", "update", f"NodeName={failed_node}", "State=DOWN",
                        "Reason=tidal test: node failure"], check=True, timeout=30, capture_output=True)
        minicluster("start-node", failed_node)
        restarted = True
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
        if failed_node and not restarted:
            minicluster("start-node", failed_node)
        if failed_node:
            wait_for("every node idle again", lambda: all(n.is_idle_and_usable for n in slurm.list_nodes()),
                     timeout_s=90, interval_s=0.5)


def test_with_yield_enabled_a_waiting_higher_priority_job_gets_nodes_before_any_preemption(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    controller = slurm_controller(tmp_path)
    ledger = tmp_path / "ledger"
    try:
        spec = live_job("yield", 4, tmp_path, ledger)
        spec.yield_to_pending = True
        with controller.admin() as admin:
            job_id = admin.submit(spec).job.job_id

            wait_for("world size 4", running_at(admin, job_id, 4), timeout_s=120, interval_s=0.5)
            wait_for("steps at size 4", lambda: commits(read_ledger(ledger), 4), timeout_s=60)
            # A job of the same partition (Slurm never preempts within it) that outranks the
            # units and needs 2 nodes: without Tidal it would wait for as long as the job runs.
            submitted_at = time.monotonic()
            important = slurm.submit(UnitSubmission(
                name="important", script="#!/bin/sh\nsleep 600\n", partition="train", nodes=2, exclusive=True,
                requeue=False, output=str(tmp_path / "important-%j.out"), extra_options=("--priority=4294967000",)))
            wait_for("the important job to run", lambda: slurm.get_job(important).state is JobState.RUNNING,
                     timeout_s=60, interval_s=0.2)
            print(f"yield: the waiting job ran {time.monotonic() - submitted_at:.1f} s after its submission")
            job = wait_for("world size 2", running_at(admin, job_id, 2), timeout_s=30, interval_s=0.2)
            events = admin.events(job_id)
            leaves = [e for e in events if e.kind == "unit_leaving"]
            assert [e.fields["cause"] for e in leaves] == ["yielded", "yielded"], leaves
            assert all(f"Slurm job {important}" in e.reason for e in leaves)
            assert not [e for e in events if e.kind == "failure_detected"]
            assert not [r for r in read_ledger(ledger) if r["kind"] == "abandoned"], "a step was lost"
            # The important job runs where the yielding units ran; nobody was preempted.
            left = {e.unit_id for e in leaves}
            yielded_nodes = {n for u in job.units if u.unit_id in left for n in u.nodes}
            assert set(slurm.get_job(important).nodes) == yielded_nodes
            assert not any(j.preempt_time for j in slurm.list_jobs() if j.name.startswith(f"tidal-{job_id}-"))
            admin.cancel(job_id)
        slurm.cancel(important)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def test_a_controller_restart_while_the_job_grows_stops_no_training_and_tidal_agrees_with_squeue(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    require_four_idle_nodes(slurm)
    controller = slurm_controller(tmp_path)
    ledger = tmp_path / "ledger"
    try:
        with controller.admin() as admin:
            job_id = admin.submit(live_job("restart", 1, tmp_path, ledger)).job.job_id
            wait_for("the first steps", lambda: len(commits(read_ledger(ledger))) >= 20, timeout_s=120)
            # (A job submitted at max 4 would start on the 4 idle nodes at once: grown by a resize.)
            admin.resize(job_id, max_replicas=4)
            wait_for("the growth's units in Slurm", lambda: sum(
                1 for e in admin.events(job_id) if e.kind == "unit_submitted") >= 2, timeout_s=30, interval_s=0.1)
        # Mid-growth: the first unit trains, the others are submitted or joining.
        controller.kill()
        down_at = time.time()
        time.sleep(2.0)
        controller.start()
        up_at = time.time()
        with controller.admin() as admin:
            wait_for("world size 4 after the restart", running_at(admin, job_id, 4), timeout_s=120, interval_s=0.5)
            wait_for("steps at size 4", lambda: len(commits(read_ledger(ledger), 4)) >= 40, timeout_s=60)
            events = admin.events(job_id)
        records = read_ledger(ledger)
        assert not [r for r in records if r["kind"] == "abandoned"], "a step was lost"
        assert not [e for e in events if e.kind == "failure_detected"], [e.reason for e in events]
        # Training went on while no controller ran, and no step was taken twice.
        assert [r for r in commits(records) if down_at < r["time"] < up_at], "training paused with the controller"
        steps = [r["step"] for r in commits(records) if r["rank"] == 0]
        assert steps == list(range(steps[0], steps[0] + len(steps))), "a step was repeated or skipped"

        # `tidal status --json` and `tidal events` say what squeue says of the units.
        status = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket),
                                 "status", job_id, "--json"], capture_output=True, text=True, check=True)
        (shown,) = json.loads(status.stdout)
        active = {int(u["slurm_job_id"]): u["nodes"] for u in shown["units"] if u["state"] == "UNIT_STATE_ACTIVE"}
        queue = subprocess.run(["squeue", "--noheader", "--format=%i %T %N %j"], capture_output=True, text=True,
                               check=True).stdout.split("\n")
        running = {int(i): [node] for i, state, node, name in (line.split() for line in queue if line)
                   if name.startswith(f"tidal-{job_id}-") and state == "RUNNING"}
        assert active == running and len(active) == 4, (active, running)
        timeline = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket),
                                   "events", job_id], capture_output=True, text=True, check=True).stdout
        for slurm_job_id in running:
            assert f"slurm_job_id={slurm_job_id}" in timeline, timeline
        nodes = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket),
                                "nodes", "--json"], capture_output=True, text=True, check=True).stdout
        used = {n["name"]: n["tidal"]["unit_id"] for n in json.loads(nodes)["nodes"] if n["tidal"]}
        assert used == {u["nodes"][0]: u["unit_id"] for u in shown["units"] if u["state"] == "UNIT_STATE_ACTIVE"}
        # The table shows samples/s and goodput while the job trains (a rate needs two
        # progress reports in its window: asked again for a few seconds, as a user would).
        def table_with_rates() -> str | None:
            table = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket",
                                    str(controller.socket), "status"], capture_output=True, text=True,
                                   check=True).stdout
            row = next(line for line in table.splitlines() if line.startswith(job_id)).split()
            shown_tables.append(table)
            return table if row[7] != "-" and float(row[7]) > 0 and row[8].endswith("%") else None

        shown_tables: list[str] = []
        try:
            wait_for("samples/s and goodput in `tidal status`", table_with_rates, timeout_s=20, interval_s=2.0)
        except AssertionError as error:
            with controller.admin() as admin:
                timeline = [(e.kind, e.reason) for e in admin.events(job_id)][-15:]
            raise AssertionError(f"{shown_tables[-1:]} {timeline} (after the restart at {up_at:.1f}, now "
                                 f"{time.time():.1f}, last commit {commits(read_ledger(ledger))[-1]['time']:.1f})") \
                from error
        with controller.admin() as admin:
            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def test_an_invalid_spec_is_refused_at_submit_naming_the_field_and_leaves_nothing_in_slurm(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    controller = slurm_controller(tmp_path)
    try:
        before = {j.job_id for j in slurm.list_jobs()}
        command = [sys.executable, "-c", "pass"]

        def submit(*options: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(controller.socket),
                                   "submit", "--json", *options, *command], capture_output=True, text=True,
                                  timeout=60)

        refusals = {
            ("--partition", "nope"): "partition: 'nope' is not a partition of this cluster (known: train, urgent)",
            ("--min-replicas", "4", "--max-replicas", "2"): "max_replicas: 2 is below min_replicas 4",
            ("--global-batch", "0"): "--global-batch",
            ("--global-batch", "-8"): "--global-batch",
            # Only Slurm knows that no node has 9 GPUs: sbatch --test-only says so.
            ("--gres=gpu:9",): "sbatch_options: Slurm would refuse the job's units",
        }
        for options, named in refusals.items():
            result = submit(*options)
            assert result.returncode == 2, (options, result.stdout, result.stderr)
            assert named in result.stderr, (options, result.stderr)
        with controller.admin() as admin:
            assert list(admin.jobs(include_finished=True)) == []
        # No new Slurm job (earlier tests' finished jobs may age out of squeue meanwhile).
        assert {j.job_id for j in slurm.list_jobs()} - before == set(), "a refused job left something in Slurm"
        # The controller is still up and takes a valid job.
        accepted = submit("--partition", "train")
        assert accepted.returncode == 0, accepted.stderr
        with controller.admin() as admin:
            admin.cancel(json.loads(accepted.stdout)["job"]["job_id"])
    finally:
        controller.stop()


def test_with_a_30_s_poll_a_submitted_resized_or_failed_job_gets_its_units_within_seconds(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """The controller's Slurm poll comes every 30 s (the default), but a job submitted or
    resized, or a unit that failed, does not wait for it: the controller polls at once (1 s
    after the last poll at the earliest) and submits the units."""
    require_four_idle_nodes(slurm)
    controller = ControllerProcess(tmp_path, {"slurm_units": "true", "slurm_poll_interval_s": "30",
                                              "join_settle_s": "1", "reconnect_grace_s": "10"})
    controller.start()
    try:
        with controller.admin() as admin:
            job_id = admin.submit(live_job("prompt", 1, tmp_path, tmp_path / "ledger")).job.job_id

            def first(kind: str, after: int = 0) -> admin_pb2.Event | None:
                return next((e for e in admin.events(job_id) if e.kind == kind and e.sequence > after), None)

            submitted = wait_for("the job's first unit in Slurm", lambda: first("unit_submitted"), timeout_s=30)
            job_event = first("job_submitted")
            assert job_event is not None
            waited_s = submitted.time.ToNanoseconds() / 1e9 - job_event.time.ToNanoseconds() / 1e9
            assert waited_s <= 5.0, f"the first unit reached Slurm {waited_s:.1f} s after the job was submitted"
            wait_for("one replica training", running_at(admin, job_id, 1), timeout_s=120, interval_s=0.5)
            last = max(e.sequence for e in admin.events(job_id))
            resized_at = time.time()
            admin.resize(job_id, max_replicas=2)
            grown = wait_for("a second unit in Slurm", lambda: first("unit_submitted", last), timeout_s=30)
            waited_s = grown.time.ToNanoseconds() / 1e9 - resized_at
            assert waited_s <= 5.0, f"the second unit reached Slurm {waited_s:.1f} s after the resize"
            # The grown unit's workers die: its replacement (onto an idle node) is decided on
            # a Slurm view, and the failure asks for one at once rather than at the poll.
            job = wait_for("two replicas training", running_at(admin, job_id, 2), timeout_s=120, interval_s=0.5)
            victim = next(u for u in job.units if u.unit_id == grown.unit_id)
            pid = wait_for("the grown unit's launcher", lambda: launcher_pid(job_id, victim.unit_id), timeout_s=10)
            last = max(e.sequence for e in admin.events(job_id))
            for worker in unit_processes(pid)[1:]:
                if Path(f"/proc/{worker}/comm").read_text().startswith("python"):
                    os.kill(worker, signal.SIGKILL)
            failed = wait_for("the failure", lambda: first("failure_detected", last), timeout_s=30)
            replaced = wait_for("a replacement unit in Slurm", lambda: first("unit_submitted", failed.sequence),
                                timeout_s=30)
            waited_s = (replaced.time.ToNanoseconds() - failed.time.ToNanoseconds()) / 1e9
            assert waited_s <= 5.0, f"the replacement reached Slurm {waited_s:.1f} s after the failure"
            admin.cancel(job_id)
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()


def test_a_job_whose_workers_fail_by_an_error_every_time_fails_with_it_after_three_generations(
        slurm: CliJsonSlurmClient, mini_cluster: dict, tmp_path: Path) -> None:
    """A script that fails the same way at every start (here: a missing dataset) does not
    make the controller replace its units forever: after 3 generations in a row failed by a
    worker's error with no step between, the job fails, saying why, and leaves Slurm."""
    require_four_idle_nodes(slurm)
    controller = ControllerProcess(tmp_path, {"slurm_units": "true", "slurm_poll_interval_s": "30",
                                              "reconnect_grace_s": "10"})
    controller.start()
    try:
        with controller.admin() as admin:
            job_id = admin.submit(admin_pb2.JobSpec(
                name="crashes", min_replicas=1, max_replicas=1, partition="train",
                mode=common_pb2.JOB_MODE_RESTART, working_dir=str(tmp_path),
                command=[sys.executable, "-c", "import sys; sys.exit('no dataset at /data/missing')"])).job.job_id
            job = wait_for("the job failed", lambda: (j := admin.job(job_id)).state == admin_pb2.JOB_STATE_FAILED
                           and j, timeout_s=120, interval_s=0.5)
            assert job
            events = admin.events(job_id)
            failures = [e for e in events if e.kind == "failure_detected"]
            assert len(failures) == 3 and all("exit code 1" in e.reason for e in failures), failures
            (ended,) = [e for e in events if e.kind == "job_failed"]
            assert "3 generations in a row" in ended.reason and ended.fields["cause"] == "crash_loop", ended
            # Each generation's replacement went in at once (a 30 s poll would not have).
            assert len([e for e in events if e.kind == "unit_submitted"]) == 3
            assert ended.time.ToNanoseconds() - events[0].time.ToNanoseconds() < 60e9, ended
        wait_for_units_to_end(slurm, job_id)
    finally:
        controller.stop()
