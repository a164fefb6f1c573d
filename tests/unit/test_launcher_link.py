"""The launcher's link to the controller, closed while the controller is away: what waits
for a session goes out if the controller comes back in time, and the link gives up
after the time it was given, not before and not never; and the end of training's reports,
written to a session whose controller dies before reading them, go out again."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc

from tidal.controller.ratelimit import TokenBucket
from tidal.launcher.link import Backoff, ControllerLink
from tidal.proto import launcher_pb2, launcher_pb2_grpc


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


class ForgetfulController(launcher_pb2_grpc.LauncherServiceServicer):
    """A controller on a real gRPC server whose first session dies before reading past
    the registration (as one SIGKILLed with the launcher's last reports unread); later
    sessions read to the launcher's end of stream, keeping what they read."""

    def __init__(self, refuse_later: bool = False) -> None:
        self.sessions = 0
        self.read: list[launcher_pb2.LauncherMessage] = []
        # Later sessions refused, as a restarted controller refuses a unit that already left.
        self.refuse_later = refuse_later

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.sessions += 1
        await context.read()
        if self.sessions > 1 and self.refuse_later:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unit u1 has left")
        await context.write(launcher_pb2.ControllerMessage(registered=launcher_pb2.Registered()))
        if self.sessions == 1:
            await asyncio.sleep(0.5)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "controller gone")
        while (message := await context.read()) is not grpc.aio.EOF:
            self.read.append(message)


def finished_report(step: int) -> launcher_pb2.LauncherMessage:
    return launcher_pb2.LauncherMessage(generation_report=launcher_pb2.GenerationReport(
        generation=4, phase=launcher_pb2.GENERATION_PHASE_FINISHED, step=step))


async def last_reports_to_a_controller_that_dies(hold: bool, refuse_later: bool = False, release: bool = False,
                                                reports: int = 1) -> tuple[ControllerLink, ForgetfulController]:
    """Connect, write `reports` reports to the first session (hold_written first, if
    `hold`; release_hold after the writes, if `release`), close with 5 s to deliver, and
    return once the link is done."""
    return await with_link(ForgetfulController(refuse_later), hold, release, reports)


async def with_link(controller: launcher_pb2_grpc.LauncherServiceServicer, hold: bool, release: bool,
                    reports: int) -> tuple[ControllerLink, ForgetfulController]:
    server = grpc.aio.server()
    launcher_pb2_grpc.add_LauncherServiceServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        link = ControllerLink(f"127.0.0.1:{port}", register=launcher_pb2.Register, post=lambda event: None,
                              backoff=Backoff(initial_s=0.05, maximum_s=0.2))
        task = asyncio.create_task(link.run())
        for _ in range(100):
            if link.connected:
                break
            await asyncio.sleep(0.05)
        assert link.connected
        if hold:
            link.hold_written()
        for step in range(reports):
            link.send(finished_report(99 + step))
        if release:
            await asyncio.sleep(0.2)  # written
            link.release_hold()
        link.close(deliver_within_s=5.0)
        await asyncio.wait_for(task, timeout=10.0)
        return link, controller  # type: ignore[return-value]
    finally:
        await server.stop(grace=None)


def test_the_last_reports_written_to_a_session_that_breaks_unread_are_sent_again() -> None:
    link, controller = asyncio.run(last_reports_to_a_controller_that_dies(hold=True))
    assert controller.sessions == 2
    assert [m.generation_report.step for m in controller.read] == [99]
    assert link.delivered.is_set()
    assert link.undelivered == 0


def test_without_holding_a_report_written_to_a_session_counts_as_sent() -> None:
    # What every report before the end of training gets: no copy kept, so nothing is ever
    # sent twice to a controller that is still there.
    link, controller = asyncio.run(last_reports_to_a_controller_that_dies(hold=False))
    assert controller.sessions == 1
    assert controller.read == []
    assert not link.delivered.is_set()
    assert link.undelivered == 0


def test_a_refusal_of_the_session_that_would_send_them_again_stops_the_link_and_says_why() -> None:
    link, controller = asyncio.run(last_reports_to_a_controller_that_dies(hold=True, refuse_later=True))
    assert controller.sessions == 2 and controller.read == []
    assert link.undelivered == 1
    assert link.refusal is not None and link.refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert link.refusal.details == "unit u1 has left"


def test_a_released_hold_sends_nothing_again() -> None:
    # The exit 0 that started holding was not the end (restart mode: a new generation).
    _, controller = asyncio.run(last_reports_to_a_controller_that_dies(hold=True, release=True))
    assert controller.sessions == 1 and controller.read == []


class RateBoundController(launcher_pb2_grpc.LauncherServiceServicer):
    """A controller with the real bound on a launcher's messages (50 a second, 100 at once;
    over it, the session is refused), reading to the launcher's end of stream."""

    def __init__(self) -> None:
        self.sessions = 0
        self.read: list[launcher_pb2.LauncherMessage] = []

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.sessions += 1
        await context.read()
        await context.write(launcher_pb2.ControllerMessage(registered=launcher_pb2.Registered()))
        bucket = TokenBucket(50.0, 100, time.monotonic())
        while (message := await context.read()) is not grpc.aio.EOF:
            if not bucket.allow(time.monotonic()):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "more than 50 messages/s (burst 100)")
            self.read.append(message)


def test_many_reports_at_once_are_paced_under_the_controllers_bound_and_all_delivered() -> None:
    # A unit of 13 nodes of 8 workers each: 104 exits at once, and more.
    link, controller = asyncio.run(with_link(RateBoundController(), hold=True, release=False, reports=150))
    assert controller.sessions == 1
    assert [m.generation_report.step for m in controller.read] == list(range(99, 249))
    assert link.delivered.is_set() and link.undelivered == 0


def test_the_pacer_allows_a_burst_then_its_rate() -> None:
    now = 100.0
    pacer = TokenBucket(rate=10.0, burst=3, now=now)
    assert [pacer.wait(now) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert abs(pacer.wait(now) - 0.1) < 1e-9
    # After its wait, the next comes 0.1 s later again.
    assert abs(pacer.wait(now + 0.1) - 0.1) < 1e-9
    assert pacer.wait(now + 10.0) == 0.0


def test_a_link_that_fails_in_itself_says_so_instead_of_ending_unseen(tmp_path: Path) -> None:
    """A fault of the link itself, not the controller's absence (here its CA certificate,
    read at each session, gone since the launcher's start): it posts LinkBroken naming the
    error, and the launcher fails at once. The task ended with the exception, which nobody
    read, and the launcher waited out --connect-timeout (10 minutes by default)."""
    from tidal.launcher.link import LinkBroken, LinkEvent

    said: list[LinkEvent] = []
    link = ControllerLink(f"127.0.0.1:{unused_port()}", register=launcher_pb2.Register, post=said.append,
                          tls_ca=tmp_path / "rotated-away.pem")
    asyncio.run(asyncio.wait_for(link.run(), timeout=30))
    assert len(said) == 1 and isinstance(said[0], LinkBroken), said
    assert said[0].error.startswith("FileNotFoundError") and "rotated-away.pem" in said[0].error
