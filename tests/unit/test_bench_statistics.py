"""What the benchmarks' figures rest on (bench/common.py, bench/overhead.py, bench/goodput.py):
the interval of a median, CPU seconds per step read from the runs' own records, and the
node-seconds of progress a run's committed steps are worth."""

from __future__ import annotations

import itertools
import math
import random

from bench.common import CpuSampler, median_interval
from bench.goodput import progress_node_seconds
from bench.overhead import steady_run


def test_the_median_interval_is_the_textbook_order_statistics_and_covers_the_median() -> None:
    # n = 15 at 95%: the 4th and 12th values (P(Binomial(15, ½) ≤ 3) = 0.018 ≤ 0.025 < P(≤ 4)).
    assert median_interval([float(v) for v in range(15, 0, -1)]) == (4.0, 12.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    low, high = median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert math.isnan(low) and math.isnan(high)  # 5 values cannot give 95%: [min, max] covers 93.75%
    # Over many samples of a known distribution the interval holds the true median (0) at
    # least 95% of the time.
    generator = random.Random(7)
    covered = 0
    for _ in range(2000):
        low, high = median_interval([generator.gauss(0.0, 1.0) for _ in range(15)])
        covered += low <= 0.0 <= high
    assert covered / 2000 >= 0.95


def test_cpu_per_step_counts_every_process_over_the_steady_steps_only() -> None:
    agents = CpuSampler()
    agents.samples = [(100.0, 5.0), (110.0, 6.0), (120.0, 7.0)]
    records = []
    for rank in (0, 1):
        for step in range(21):
            # Each rank costs 2 s of CPU for the first 5 steps (start-up), then 0.1 s a step.
            cpu = 2.0 * min(step, 5) + 0.1 * max(0, step - 5)
            records.append({"rank": rank, "time": 100.0 + step, "cpu_s": cpu})
    run = steady_run(records, 10, agents)
    assert run.steps_per_s == 1.0
    assert math.isclose(run.worker_cpu_per_step, 0.2)  # two ranks × 0.1 s, start-up left out
    assert math.isclose(run.agent_cpu_per_step, 0.1)  # 1 CPU second over the 10 steps from t=110 to 120


def test_a_step_counts_once_at_its_world_size_times_the_typical_step_time() -> None:
    # Steps 1-4 at world 2 (1 s apart), a stall, step 4 again (redone after a restart), 5-6 at world 4 (0.5 s apart).
    steps = [(1, 10.0, 2), (2, 11.0, 2), (3, 12.0, 2), (4, 13.0, 2), (4, 30.0, 4), (5, 30.5, 4), (6, 31.0, 4)]
    progress, distinct = progress_node_seconds(steps)
    assert distinct == 6
    # Steps 1-4 cost 2 × 1 s each; 5 and 6 cost 4 × 0.5 s each; the stall is not progress.
    assert math.isclose(progress, 4 * 2.0 + 2 * 2.0)


def test_goodput_counts_each_committed_step_once_at_its_ideal_cost_and_splits_the_held_node_seconds() -> None:
    from bench.goodput import PARTS, Commit, ideal_step_node_seconds, outcome
    from tidal.train.simulated import ACCELERATORS, Simulation

    simulation = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)
    at_two = ideal_step_node_seconds(simulation, 32, 2, 16)
    # Each of 2 replicas: one micro-batch of 16 (0.99 s) and the all-reduce at 2 (40 ms).
    assert math.isclose(at_two, 2 * (simulation.micro_batch_seconds(16) + simulation.reduction_seconds(2)))
    # 32 over 3: the largest share, 11, sets the step.
    assert math.isclose(ideal_step_node_seconds(simulation, 32, 3, 16),
                        3 * (simulation.micro_batch_seconds(11) + simulation.reduction_seconds(3)))
    step_s = at_two / 2
    # 2 nodes held from t=0 to 40; steps 1..10 committed 1.2 ideal steps apart from t=10; step 5
    # redone at t=30 (counts once); nothing else.
    commits = [Commit(step, 10.0 + (step - 1) * 1.2 * step_s, 2, 32) for step in range(1, 11)]
    commits.append(Commit(5, 30.0, 2, 32))
    squeue = [(float(t), 2, 1) for t in range(41)]
    result = outcome(commits, squeue, 4, simulation, 2)
    assert result.steps == 10 and result.samples == 320
    assert math.isclose(result.progress, 10 * at_two)
    assert math.isclose(result.held, 80.0) and math.isclose(result.free, 120.0)
    assert math.isclose(sum(result.parts.values()), result.held)
    assert math.isclose(result.parts[PARTS[0]], result.progress)
    # 9 gaps of 1.2 ideal steps at 2 nodes trained; the ideal share of the first step has no gap.
    assert math.isclose(result.parts[PARTS[0]] + result.parts[PARTS[1]], 9 * 1.2 * at_two)
    assert result.parts[PARTS[2]] == 0.0 and result.parts[PARTS[4]] == 0.0
    # One node held below a min of 3: all of the held time is below min but the trained spans.
    below = outcome(commits, [(float(t), 1, 1) for t in range(41)], 4, simulation, 3)
    assert below.parts[PARTS[4]] > 0 and below.parts[PARTS[3]] == 0.0


def test_goodput_against_the_trace_schedule_counts_only_the_nodes_it_left_free() -> None:
    from pathlib import Path
    from typing import cast

    from bench.goodput import Commit, Trace, ideal_step_node_seconds, outcome
    from tidal.slurm import CliJsonSlurmClient
    from tidal.train.simulated import ACCELERATORS, Simulation

    simulation = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)
    # The trace's schedule over a 100 s play started at t=1000: the background node until 40 s,
    # 1 more at 20-35 s, 2 at 55-70 s, 3 at 85-95 s.
    trace = Trace(cast(CliJsonSlurmClient, None), Path("/nonexistent"), 100.0, lambda: None)
    trace.started = 1000.0
    assert [trace.scheduled_nodes(1000.0 + t) for t in (0, 20, 35, 40, 55, 70, 85, 95)] == [1, 2, 1, 0, 2, 0, 3, 0]
    # World 2, a step a second from t=1001: even while the schedule leaves only 2 of the 4
    # nodes free (t=1020-1035), every step counts in full.
    commits = [Commit(step, 1000.0 + step, 2, 32) for step in range(1, 40)]
    # The samples show the urgent job starting 5 s late: training held 3 nodes until t=1025.
    squeue = [(1000.0 + t, 3 if t < 25 else 2, 1 if t < 25 or t >= 35 else 2) for t in range(41)]
    trace.waits = {"trace-urgent-1": 5.0}
    result = outcome(commits, squeue, 4, simulation, 2, trace)
    at_two = ideal_step_node_seconds(simulation, 32, 2, 16)
    assert math.isclose(result.free, 3 * 25 + 2 * 10 + 3 * 5)  # what the samples show the trace held
    assert math.isclose(result.scheduled_free, 3 * 20 + 2 * 15 + 3 * 5)  # what the schedule left free
    assert math.isclose(result.scheduled_progress, result.progress) and math.isclose(result.progress, 39 * at_two)
    assert result.urgent_waits == (5.0,)
    # At world 4 a step while the schedule leaves 2 nodes free counts half, one while it
    # leaves 3 three quarters; a step after the last sample is not counted at all.
    wide = outcome([Commit(1, 1030.0, 4, 32), Commit(2, 1038.0, 4, 32), Commit(3, 1045.0, 4, 32)], squeue, 4,
                   simulation, 2, trace)
    at_four = ideal_step_node_seconds(simulation, 32, 4, 16)
    assert wide.steps == 2 and math.isclose(wide.progress, 2 * at_four)
    assert math.isclose(wide.scheduled_progress, at_four / 2 + at_four * 3 / 4)


def test_goodput_cuts_the_trace_at_its_events_and_tells_where_each_stretch_lost() -> None:
    import json
    import tempfile
    from pathlib import Path
    from typing import cast

    import pytest

    from bench.goodput import (
        MODEL,
        PARTS,
        SIMULATION,
        Commit,
        Trace,
        ideal_step_node_seconds,
        losses_by_segment,
        outcome,
        result_text,
        retell,
        trace_segments,
    )
    from bench.scaling import simulation_flags
    from tidal.slurm import CliJsonSlurmClient
    from tidal.train.simulated import ACCELERATORS, Simulation

    segments = trace_segments(100.0)
    # Every start and end of the schedule and the kill, in order, covering the trace.
    assert [(event, begin) for event, begin, _ in segments] == [
        ("start", 0.0), ("urgent-1 submitted", 20.0), ("urgent-1 ended", 35.0), ("background ended", 40.0),
        ("urgent-2 submitted", 55.0), ("urgent-2 ended", 70.0), ("kill -9 of a worker", 80.0),
        ("urgent-3 submitted", 85.0), ("urgent-3 ended", 95.0)]
    assert all(end == after for (_, _, end), (_, after, _) in itertools.pairwise(segments))
    assert segments[-1][2] == 100.0
    simulation = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)
    at_two = ideal_step_node_seconds(simulation, 32, 2, 16)
    # A play started at t=1000: 3 nodes free until 20 s, 2 until 35 s, then 4. World 2 commits
    # a step a second from 1 s to 50 s, and nothing after (a stall the rest of the trace).
    squeue = [(1000.0 + t, 2, 1 if t < 20 else (2 if t < 35 else 0)) for t in range(101)]
    commits = [Commit(step, 1000.0 + step, 2, 32) for step in range(1, 51)]
    found = losses_by_segment(commits, squeue, 4, 1000.0, 100.0, simulation, 16)
    assert [event for event, _, _ in found] == [event for event, _, _ in segments]
    free = {event: free for event, free, _ in found}
    lost = {event: lost for event, _, lost in found}
    assert math.isclose(free["start"], 3 * 20) and math.isclose(free["urgent-1 submitted"], 2 * 15)
    assert math.isclose(lost["start"], 3 * 20 - 19 * at_two)  # steps 1..19
    assert math.isclose(lost["background ended"], 4 * 15 - 11 * at_two)  # steps 40..50
    # After the last commit every free node-second is lost; the last sample closes the last stretch.
    assert math.isclose(lost["urgent-3 ended"], free["urgent-3 ended"]) and math.isclose(free["urgent-3 ended"], 4 * 5)
    assert math.isclose(sum(f for _, f, _ in found), sum((4 - o) * 1.0 for _, _, o in squeue[:-1]))
    # Samples and commits past the trace's end count in its last stretch.
    late = losses_by_segment([*commits, Commit(51, 1101.0, 2, 32)], [*squeue, (1102.0, 2, 0)], 4, 1000.0, 100.0,
                             simulation, 16)
    assert math.isclose(late[-1][1], 4 * 7) and math.isclose(late[-1][2], 4 * 7 - at_two)  # 95 s to 102 s
    # A played trace's outcome carries them; a stored result's text is rebuilt from its plays,
    # its parts as fractions of the held node-seconds, as the run wrote them.
    trace = Trace(cast(CliJsonSlurmClient, None), Path("/nonexistent"), 100.0, lambda: None)
    trace.started = 1000.0
    played = outcome(commits, squeue, 4, simulation, 2, trace)
    assert list(played.segments) == found and played.started == 1000.0 and played.nodes == 4
    settings = {"duration_s": 100.0, "model": " ".join(MODEL), "simulation": " ".join(simulation_flags(SIMULATION))}
    # torchft's play kept no `started`: its first squeue sample, 5 s late, is its time 0.
    shifted = [(t + 5.0, held, other) for t, held, other in squeue]
    with tempfile.TemporaryDirectory() as folder:
        stored = Path(folder) / "goodput.json"
        stored.write_text(json.dumps({
            "quick": False, "settings": settings, "text": "old", "rows": [],
            "parts": {"tidal": [played.parts], "torchft": [played.parts]},
            "plays": {"tidal": [{"started": 1000.0, "nodes": 4, "squeue": played.samples_taken,
                                 "first_commits": played.commits}],
                      "torchft": [{"squeue": shifted, "first_commits": [[c.step, c.time + 5.0, c.world, c.samples]
                                                                         for c in commits]}]}}))
        retell(stored)
        text = json.loads(stored.read_text())["text"]
        assert result_text({"tidal": [(played.parts, played.held)], "torchft": [(played.parts, played.held)]},
                           {"tidal": [found], "torchft": [found]}) in text
        fractions = " | ".join(f"{played.parts[part] / played.held:.1%}" for part in PARTS)
        assert f"| tidal | {fractions} |" in text and f"| torchft | {fractions} |" in text
        # Another model's run is refused, its text kept.
        stored.write_text(json.dumps({"quick": False, "settings": {**settings, "model": "--width 8"}, "text": "old"}))
        with pytest.raises(SystemExit, match="another model or simulation"):
            retell(stored)
        assert json.loads(stored.read_text())["text"] == "old"
        # What is not a result with its plays is refused with a clear error, the file untouched.
        for garbled in ("{", "[1]", json.dumps({"settings": settings, "text": "old"}),
                        json.dumps({"settings": settings, "text": "old", "parts": {"tidal": [played.parts]},
                                    "plays": {"tidal": [{"squeue": [[1.0, 2]], "first_commits": []}]}})):
            stored.write_text(garbled)
            with pytest.raises(SystemExit, match="cannot retell"):
                retell(stored)
            assert stored.read_text() == garbled
    assert "| urgent-3 ended | 20 | 20 (20) | 20 | 20 (20) |" in text
    assert f"| start | 60 | {3 * 20 - 19 * at_two:.0f} ({3 * 20 - 19 * at_two:.0f}) |" in text


class FakeSlurm:
    """The three calls `Trace` makes, on jobs the test sets up (a unit-test fake of
    CliJsonSlurmClient)."""

    def __init__(self) -> None:
        self.jobs: dict[int, object] = {}
        self.cancelled: list[int] = []
        self.submitted = 0

    def submit(self, submission: object) -> int:
        self.submitted += 1
        return 6 + self.submitted

    def cancel(self, job_id: int) -> None:
        self.cancelled.append(job_id)

    def list_jobs(self) -> list[object]:
        return list(self.jobs.values())


def test_an_urgent_jobs_wait_is_slurms_start_minus_submit_or_its_whole_window_when_it_never_started() -> None:
    import datetime
    import time
    from pathlib import Path
    from typing import cast

    from bench.goodput import Trace
    from tidal.slurm import CliJsonSlurmClient, Job, JobState

    slurm = FakeSlurm()
    trace = Trace(cast(CliJsonSlurmClient, slurm), Path("/nonexistent"), 100.0, lambda: None)
    trace.submit("urgent-1", 1)
    trace.submit("urgent-2", 2)
    submitted = datetime.datetime(2026, 11, 29, 10, 0, 0, tzinfo=datetime.UTC)

    def job(job_id: int, name: str, state: JobState, waited_s: float) -> Job:
        return Job(job_id=job_id, name=f"trace-{name}", user="root", state=state, flags=frozenset(),
                   partition="urgent", nodes=("n1",) if state is JobState.RUNNING else (), node_count=1, priority=1,
                   submit_time=submitted, start_time=submitted + datetime.timedelta(seconds=waited_s), end_time=None,
                   preempt_time=None, requeue_count=0, reason="")

    # urgent-1 started 4 s after its submission, after the last sample (so only its end sees
    # it); urgent-2 is still pending, its start only Slurm's estimate.
    slurm.jobs = {trace.jobs["urgent-1"]: job(trace.jobs["urgent-1"], "urgent-1", JobState.RUNNING, 4.0),
                  trace.jobs["urgent-2"]: job(trace.jobs["urgent-2"], "urgent-2", JobState.PENDING, 30.0)}
    trace.submitted["urgent-2"] = time.time() - 12.0
    trace.end("urgent-1")
    trace.end("urgent-2")
    assert trace.waits["trace-urgent-1"] == 4.0
    assert 12.0 <= trace.waits["trace-urgent-2"] < 13.0 and trace.unstarted == {"trace-urgent-2"}
    assert sorted(slurm.cancelled) == sorted([7, 8])


def test_the_static_jobs_script_outlives_torchruns_exit_on_sigterm_so_that_slurm_can_requeue_it(tmp_path) -> None:
    """Slurm requeues a preempted job at the end of its GraceTime only if it still runs:
    the static baseline's script must not end when srun (torchrun) exits on the SIGTERM."""
    import os
    import signal
    import subprocess
    import time

    from bench.goodput import SIMULATION, static_script

    fake = tmp_path / "bin"
    fake.mkdir()
    # srun stands in for the preempted step: it dies of the SIGTERM Slurm sends (exit 1, as
    # torchrun's SignalException ends it).
    (fake / "srun").write_text("#!/bin/bash\ntrap 'exit 1' TERM\nsleep 30 & wait\n")
    (fake / "srun").chmod(0o755)
    script = tmp_path / "static.sh"
    script.write_text(static_script(1234, tmp_path, tmp_path / "logs", SIMULATION, requeue_wait_s=2))
    environment = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    process = subprocess.Popen(["bash", str(script)], env=environment, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        time.sleep(0.5)
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)  # Slurm signals the whole job: script and step
        output, _ = process.communicate(timeout=20)
        lived = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1, "the script ends with srun's status"
    assert lived >= 2.0, f"the script ended {lived:.1f} s after the SIGTERM: Slurm would not requeue it"
    assert "waiting for Slurm to requeue the job" in output
