"""When the controller polls Slurm: once `slurm_poll_interval_s` (every
`released_poll_interval_s` while a job waits for nodes it gave back below min_replicas),
and sooner when a job is submitted or resized (`Controller.poll_soon`), never closer than
EARLY_POLL_GAP_S however many ask; polls that fail keep their backoff."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path

from tidal.controller.config import ControllerConfig
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.model import JobState
from tidal.controller.server import EARLY_POLL_GAP_S, Controller, poll_interval_s
from tidal.controller.store import StateStore
from tidal.slurm import SlurmError
from tidal.slurm.snapshot import ClusterView


class RecordedPoll:
    """ClusterPoll's interface: each `poll()` answers a view (empty, or failed) after
    `takes_s`, and is timed."""

    def __init__(self, failing: bool = False, takes_s: float = 0.0) -> None:
        self.failing = failing
        self.takes_s = takes_s
        self.at: list[float] = []

    def poll(self) -> ClusterView:
        self.at.append(time.monotonic())
        time.sleep(self.takes_s)
        if self.failing:
            return ClusterView((), (), 0.0, stale=True, error=SlurmError("slurmctld does not answer"),
                               consecutive_failures=len(self.at))
        return ClusterView((), (), time.time(), stale=False)


def run_polls(tmp_path: Path, poll: RecordedPoll, script: Callable[[Controller], Awaitable[None]],
              interval_s: float = 30.0) -> None:
    async def main() -> None:
        controller = Controller(ControllerConfig(slurm_poll_interval_s=interval_s), StateStore(tmp_path / "tidal.db"),
                                ControllerMetrics())
        polling = asyncio.create_task(controller.poll_slurm_forever(poll))  # type: ignore[arg-type]
        try:
            await script(controller)
        finally:
            polling.cancel()
    asyncio.run(main())


def test_a_poll_asked_for_comes_after_the_gap_not_the_interval_and_asks_in_a_burst_make_one(tmp_path: Path) -> None:
    poll = RecordedPoll()

    async def script(controller: Controller) -> None:
        await asyncio.sleep(0.3)
        assert len(poll.at) == 1
        controller.poll_soon()  # a job submitted: poll once the gap since the last is over
        await asyncio.sleep(EARLY_POLL_GAP_S + 0.5)
        assert len(poll.at) == 2
        for _ in range(5):  # five submissions at once
            controller.poll_soon()
        await asyncio.sleep(EARLY_POLL_GAP_S + 0.5)
        assert len(poll.at) == 3
        await asyncio.sleep(EARLY_POLL_GAP_S + 0.5)  # nobody asked: the 30 s interval holds
        assert len(poll.at) == 3

    run_polls(tmp_path, poll, script)
    gaps = [b - a for a, b in zip(poll.at, poll.at[1:], strict=False)]
    assert all(gap >= EARLY_POLL_GAP_S for gap in gaps), gaps


def test_while_slurm_fails_an_asked_poll_waits_for_the_backoff(tmp_path: Path) -> None:
    poll = RecordedPoll(failing=True)

    async def script(controller: Controller) -> None:
        await asyncio.sleep(0.3)
        controller.poll_soon()
        await asyncio.sleep(EARLY_POLL_GAP_S + 0.7)
        assert len(poll.at) == 1

    run_polls(tmp_path, poll, script)


def test_with_a_one_second_interval_a_submission_is_polled_for_after_the_gap_not_the_interval(tmp_path: Path) -> None:
    # The goodput bench polls every 1 s and submits right after a poll: its units were
    # submitted 1.00-1.02 s after the job while EARLY_POLL_GAP_S was 1 s.
    poll = RecordedPoll()
    asked_at: list[float] = []

    async def script(controller: Controller) -> None:
        await asyncio.sleep(0.05)
        assert len(poll.at) == 1
        asked_at.append(time.monotonic())
        controller.poll_soon()
        await asyncio.sleep(0.6)

    run_polls(tmp_path, poll, script, interval_s=1.0)
    assert len(poll.at) == 2, poll.at  # within 0.6 s of the ask, not at the 1 s interval
    assert poll.at[1] - asked_at[0] < 0.6
    assert poll.at[1] - poll.at[0] >= EARLY_POLL_GAP_S


def released_actor(released: bool, job_state: JobState = JobState.DEGRADED) -> object:
    """What `Controller.poll_interval_s` reads of a job's actor."""
    return types.SimpleNamespace(state=types.SimpleNamespace(released_below_min=released),
                                 job=types.SimpleNamespace(state=job_state))


def test_while_a_job_waits_for_nodes_it_gave_back_slurm_is_polled_every_released_interval(tmp_path: Path) -> None:
    poll = RecordedPoll()

    async def script(controller: Controller) -> None:
        # (A stand-in actor: only the views' timing is under test, not what jobs make of them.)
        controller.observe_slurm = lambda view, now: None  # type: ignore[method-assign]
        controller.actors["waiting"] = released_actor(True)  # type: ignore[assignment]
        await asyncio.sleep(0.05)
        assert len(poll.at) == 1
        await asyncio.sleep(ControllerConfig().released_poll_interval_s + 0.3)
        assert len(poll.at) == 2  # not the 30 s interval
        controller.actors["waiting"] = released_actor(False, JobState.RUNNING)  # it resumed
        await asyncio.sleep(ControllerConfig().released_poll_interval_s + 0.3)
        assert len(poll.at) == 3  # (the wait decided at the last poll)
        await asyncio.sleep(ControllerConfig().released_poll_interval_s + 0.3)
        assert len(poll.at) == 3  # the 30 s interval again

    run_polls(tmp_path, poll, script)


def test_the_regular_poll_interval() -> None:
    config = ControllerConfig(slurm_poll_interval_s=30.0)
    assert poll_interval_s(config, job_released=False) == 30.0
    assert poll_interval_s(config, job_released=True) == config.released_poll_interval_s == 2.0
    assert poll_interval_s(ControllerConfig(slurm_poll_interval_s=1.0), job_released=True) == 1.0
    assert poll_interval_s(ControllerConfig(slurm_poll_interval_s=30.0, released_poll_interval_s=0),
                           job_released=True) == 30.0


def test_however_often_asked_slurm_is_polled_at_most_half_the_time(tmp_path: Path) -> None:
    # A slow slurmctld (each poll 0.6 s) and asks all the time (units of a large job ending
    # one after another): each poll is followed by as long a pause.
    poll = RecordedPoll(takes_s=0.6)

    async def script(controller: Controller) -> None:
        for _ in range(30):
            controller.poll_soon()
            await asyncio.sleep(0.1)

    run_polls(tmp_path, poll, script)
    gaps = [b - a for a, b in zip(poll.at, poll.at[1:], strict=False)]
    assert len(poll.at) >= 2, poll.at
    assert all(gap >= 2 * 0.6 for gap in gaps), gaps
