"""The launcher's link to the controller, closed while the controller is away: what waits
for a session goes out if the controller comes back in time, and the link gives up
after the time it was given, not before and not never."""

from __future__ import annotations

import asyncio
import socket
import time

from tidal.launcher.link import Backoff, ControllerLink
from tidal.proto import launcher_pb2


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def closed_link() -> ControllerLink:
    """A link to a port nothing listens on, one reliable report queued."""
    link = ControllerLink(f"127.0.0.1:{unused_port()}", register=launcher_pb2.Register, post=lambda event: None,
                          backoff=Backoff(initial_s=0.05, maximum_s=0.2))
    link.send(launcher_pb2.LauncherMessage(generation_report=launcher_pb2.GenerationReport(generation=3)))
    return link


async def run_then_close(link: ControllerLink, deliver_within_s: float) -> float:
    task = asyncio.create_task(link.run())
    await asyncio.sleep(0.3)  # a few failed sessions
    started = time.monotonic()
    link.close(deliver_within_s=deliver_within_s)
    await asyncio.wait_for(task, timeout=deliver_within_s + 5.0)
    return time.monotonic() - started


def test_closed_without_time_to_deliver_the_link_stops_at_once_and_says_what_was_not_sent() -> None:
    link = closed_link()
    elapsed = asyncio.run(run_then_close(link, 0.0))
    assert elapsed < 1.0
    assert link.undelivered == 1


def test_closed_with_time_to_deliver_the_link_keeps_trying_that_long_then_gives_up() -> None:
    link = closed_link()
    elapsed = asyncio.run(run_then_close(link, 1.5))
    assert 1.4 <= elapsed < 4.0, elapsed
    assert link.undelivered == 1
