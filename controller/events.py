"""The event log: every state change is one row in SQLite, one structured log line, and
one message to whoever watches (`tidal events --follow`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog

from tidal.controller.model import EventRecord
from tidal.controller.store import StateStore

log = structlog.get_logger("tidal.controller.events")


class EventLog:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._watchers: set[asyncio.Queue[EventRecord]] = set()

    def record(self, job_id: str, kind: str, reason: str = "", *, unit_id: str = "", generation: int = 0,
               fields: Mapping[str, object] | None = None) -> EventRecord:
        """Append the event (inside the caller's transaction, if any) and announce it once
        it is committed: a watcher shown an event a rollback undid would then miss the real
        one that took its sequence number."""
        event = self.store.append_event(job_id, kind, reason, unit_id=unit_id, generation=generation, fields=fields)

        def announce() -> None:
            log.info(kind, job=job_id, unit=unit_id or None, generation=generation, reason=reason or None,
                     **event.fields)
            for queue in self._watchers:
                queue.put_nowait(event)

        self.store.after_commit(announce)
        return event

    def watch(self) -> asyncio.Queue[EventRecord]:
        queue: asyncio.Queue[EventRecord] = asyncio.Queue(maxsize=0)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[EventRecord]) -> None:
        self._watchers.discard(queue)
