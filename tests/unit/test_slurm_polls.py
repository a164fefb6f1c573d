"""When the controller polls Slurm: once `slurm_poll_interval_s`, and sooner when a job is
submitted or resized (`Controller.poll_soon`), never closer than EARLY_POLL_GAP_S however
many ask; polls that fail keep their backoff."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from tidal.controller.config import ControllerConfig
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.server import EARLY_POLL_GAP_S, Controller
from tidal.controller.store import StateStore
from tidal.slurm import SlurmError
from tidal.slurm.snapshot import ClusterView


class RecordedPoll:
    """ClusterPoll's interface: each `poll()` answers a view (empty, or failed) and is timed."""

    def __init__(self, failing: bool = False) -> None:
        self.failing = failing
        self.at: list[float] = []

    def poll(self) -> ClusterView:
        self.at.append(time.monotonic())
        if self.failing:
            return ClusterView((), (), 0.0, stale=True, error=SlurmError("slurmctld does not answer"),
                               consecutive_failures=len(self.at))
        return ClusterView((), (), time.time(), stale=False)


def run_polls(tmp_path: Path, poll: RecordedPoll, script: Callable[[Controller], Awaitable[None]]) -> None:
    async def main() -> None:
        controller = Controller(ControllerConfig(slurm_poll_interval_s=30.0), StateStore(tmp_path / "tidal.db"),
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
