"""The controller's state in SQLite: jobs, units, generations (with their rank tables) and the
event log. The controller writes a decision here before it sends it, so a controller
killed at any point and started again reloads what it had decided.

One connection, used from the controller's event-loop thread only. WAL journal with
synchronous=FULL: a commit survives the process being killed and the machine losing
power."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from tidal.controller.history import HISTORY_MAX_SAMPLES, ProgressSample, thinned
from tidal.controller.model import (
    EventRecord,
    GenerationRecord,
    JobRecord,
    JobState,
    UnitRecord,
    UnitState,
    members_from_rank_table,
)
from tidal.proto import admin_pb2, common_pb2

# 2: a world's version is a "generation" everywhere (schema 1 said "epoch": the `epochs`
# table, `epoch` columns, `epoch_*` event kinds).
# 3: a unit's place in a replica of several nodes (`units.replica`, `units.node_index`).
# `_migrate` converts a schema-1 or -2 file in place.
SCHEMA_VERSION = 3
# A record read back from a row (JobRecord, UnitRecord).
RecordT = TypeVar("RecordT")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    spec BLOB NOT NULL,
    state TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    secret_sha256 TEXT NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS units (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    unit_id TEXT NOT NULL,
    state TEXT NOT NULL,
    nodes TEXT NOT NULL DEFAULT '[]',
    address TEXT NOT NULL DEFAULT '',
    procs_per_node INTEGER NOT NULL DEFAULT 1,
    slurm_job_id INTEGER NOT NULL DEFAULT 0,
    group_rank INTEGER NOT NULL DEFAULT -1,
    registered_at REAL NOT NULL DEFAULT 0,
    reason TEXT NOT NULL DEFAULT '',
    replica INTEGER NOT NULL DEFAULT 0,
    node_index INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, unit_id)
);
CREATE TABLE IF NOT EXISTS generations (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    generation INTEGER NOT NULL,
    rank_table BLOB NOT NULL,
    rendezvous BLOB NOT NULL,
    reason TEXT NOT NULL,
    resume_step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    stopped_at REAL,
    PRIMARY KEY (job_id, generation)
);
CREATE TABLE IF NOT EXISTS events (
    sequence INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    job_id TEXT NOT NULL,
    unit_id TEXT NOT NULL DEFAULT '',
    generation INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    fields TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, sequence);
-- A job's progress over time, sampled from heartbeats (controller/history.py; tidal plot).
CREATE TABLE IF NOT EXISTS progress (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    time REAL NOT NULL,
    step INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    loss REAL
);
CREATE INDEX IF NOT EXISTS progress_by_job ON progress (job_id, time);
-- What a job has in flight besides its state: node cool-downs, leaves deferred behind a
-- world change (JSON per key), so that a restarted controller resumes them.
CREATE TABLE IF NOT EXISTS job_pending (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (job_id, key)
);
"""


class StoreError(RuntimeError):
    """The database cannot be opened or is of an unknown schema."""


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring a state file of an earlier schema to this one, in one transaction, before the
    schema is applied; a file of a newer schema is refused (the check after the schema)."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "meta" not in tables:
        return
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None or not str(row[0]).isdigit() or int(row[0]) >= SCHEMA_VERSION:
        return  # (a version that is no number is refused by the check after the schema)
    version = int(row[0])
    db.execute("BEGIN IMMEDIATE")
    try:
        if version == 1:
            db.execute("ALTER TABLE epochs RENAME TO generations")
            db.execute("ALTER TABLE generations RENAME COLUMN epoch TO generation")
            db.execute("ALTER TABLE jobs RENAME COLUMN epoch TO generation")
            db.execute("ALTER TABLE events RENAME COLUMN epoch TO generation")
            db.execute("UPDATE events SET kind = 'generation' || substr(kind, 6) WHERE kind LIKE 'epoch%'")
            db.execute("UPDATE events SET fields = replace(fields, '\"from_epoch\"', '\"from_generation\"')")
        if version <= 2 and "units" in tables:
            db.execute("ALTER TABLE units ADD COLUMN replica INTEGER NOT NULL DEFAULT 0")
            db.execute("ALTER TABLE units ADD COLUMN node_index INTEGER NOT NULL DEFAULT 0")
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
        db.execute("COMMIT")
    except sqlite3.DatabaseError as error:
        db.execute("ROLLBACK")
        raise StoreError(f"{path}: converting schema {version} to {SCHEMA_VERSION} failed, nothing changed: "
                         f"{error}") from error


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Callbacks waiting for the transaction in progress to commit (None: none in progress).
        self._after_commit: list[Callable[[], None]] | None = None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            _migrate(self._db, path)
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif str(row[0]) != str(SCHEMA_VERSION):
                raise StoreError(f"{path}: schema version {row[0]}, this controller knows {SCHEMA_VERSION}")
            # A file it may read but not write (its mode, its owner, an immutable flag) opens
            # and answers reads: a write, rolled back, says so now rather than at each decision.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE meta SET value=value WHERE key='schema_version'")
            finally:
                self._db.execute("ROLLBACK")
        except sqlite3.DatabaseError as error:
            raise StoreError(f"cannot open state database {path}: {error}") from error

    def close(self) -> None:
        self._db.close()

    def ping(self) -> None:
        """Raise if the database does not answer (readiness check)."""
        self._db.execute("SELECT count(*) FROM jobs").fetchone()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes so a decision lands whole or not at all; what was asked to follow
        the commit (`after_commit`) runs once it is done, and not at all if it is not."""
        self._db.execute("BEGIN IMMEDIATE")
        self._after_commit = []
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._after_commit = None
            # (A COMMIT that failed leaves the transaction open: close it, or every later
            # BEGIN fails.)
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        follow, self._after_commit = self._after_commit, None
        for callback in follow:
            callback()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` once what was written so far is committed: at the end of the
        transaction in progress (never, if it rolls back), else now."""
        if self._after_commit is None:
            callback()
        else:
            self._after_commit.append(callback)

    # What a job has in flight.

    def save_pending(self, job_id: str, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO job_pending VALUES (?,?,?)", (job_id, key, json.dumps(value)))

    def pending(self, job_id: str) -> dict[str, Any]:
        rows = self._db.execute("SELECT key, value FROM job_pending WHERE job_id=?", (job_id,)).fetchall()
        return {key: json.loads(value) for key, value in rows}

    # Jobs.

    def insert_job(self, job: JobRecord) -> None:
        self._db.execute(
            "INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?)",
            (job.job_id, job.spec.SerializeToString(), job.state.value, job.owner_uid, job.secret_sha256,
             job.generation, job.step, job.created_at, job.updated_at))

    def has_job(self, job_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)).fetchone() is not None

    def update_job(self, job: JobRecord) -> None:
        job.updated_at = time.time()
        self._db.execute(
            "UPDATE jobs SET spec=?, state=?, generation=?, step=?, updated_at=? WHERE job_id=?",
            (job.spec.SerializeToString(), job.state.value, job.generation, job.step, job.updated_at, job.job_id))

    def jobs(self) -> list[JobRecord]:
        rows = self._db.execute(
            "SELECT job_id, spec, state, owner_uid, secret_sha256, generation, step, created_at, updated_at "
            "FROM jobs ORDER BY created_at").fetchall()
        return self._records(rows, lambda r: f"job {r[0]!r}", lambda r: JobRecord(
            job_id=r[0], spec=admin_pb2.JobSpec.FromString(r[1]), state=JobState(r[2]), owner_uid=r[3],
            secret_sha256=r[4], generation=r[5], step=r[6], created_at=r[7], updated_at=r[8]))

    def _records(self, rows: Sequence[Any], name: Callable[[Any], str],
                 make: Callable[[Any], RecordT]) -> list[RecordT]:
        """Rows read into records. One that does not read back (a state no controller
        writes, a spec that does not parse: a file edited by hand) is a StoreError naming
        the file and the record, not a traceback at the controller's start."""
        records = []
        for row in rows:
            try:
                records.append(make(row))
            except (ValueError, TypeError, DecodeError) as error:
                raise StoreError(f"{self.path}: {name(row)} does not read back: {error}") from error
        return records

    # Units.

    def upsert_unit(self, unit: UnitRecord) -> None:
        self._db.execute(
            "INSERT INTO units VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (job_id, unit_id) DO UPDATE SET "
            "state=excluded.state, nodes=excluded.nodes, address=excluded.address, "
            "procs_per_node=excluded.procs_per_node, slurm_job_id=excluded.slurm_job_id, "
            "group_rank=excluded.group_rank, registered_at=excluded.registered_at, reason=excluded.reason, "
            "replica=excluded.replica, node_index=excluded.node_index",
            (unit.job_id, unit.unit_id, unit.state.value, json.dumps(unit.nodes), unit.address, unit.procs_per_node,
             unit.slurm_job_id, unit.group_rank, unit.registered_at, unit.reason, unit.replica, unit.node_index))

    def units(self, job_id: str) -> list[UnitRecord]:
        rows = self._db.execute(
            "SELECT job_id, unit_id, state, nodes, address, procs_per_node, slurm_job_id, group_rank, "
            "registered_at, reason, replica, node_index FROM units WHERE job_id=? ORDER BY registered_at, unit_id",
            (job_id,)).fetchall()
        return self._records(rows, lambda r: f"unit {r[1]!r} of job {r[0]!r}", lambda r: UnitRecord(
            job_id=r[0], unit_id=r[1], state=UnitState(r[2]), nodes=json.loads(r[3]), address=r[4],
            procs_per_node=r[5], slurm_job_id=r[6], group_rank=r[7], registered_at=r[8], reason=r[9],
            replica=r[10], node_index=r[11]))

    # Generations.

    def insert_generation(self, generation: GenerationRecord) -> None:
        self._db.execute(
            "INSERT INTO generations (job_id, generation, rank_table, rendezvous, reason, resume_step, created_at) "
            "VALUES (?,?,?,?,?,?,?)",
            (generation.job_id, generation.number, generation.rank_table().SerializeToString(),
             generation.rendezvous().SerializeToString(), generation.reason, generation.resume_step,
             generation.created_at))

    def mark_generation_stopped(self, job_id: str, number: int, at: float) -> None:
        self._db.execute("UPDATE generations SET stopped_at=? WHERE job_id=? AND generation=? AND stopped_at IS NULL",
                         (at, job_id, number))

    def generation(self, job_id: str, number: int) -> tuple[GenerationRecord, float | None] | None:
        """The generation and when it stopped (None while it runs)."""
        row = self._db.execute(
            "SELECT rank_table, rendezvous, reason, resume_step, created_at, stopped_at FROM generations "
            "WHERE job_id=? AND generation=?", (job_id, number)).fetchone()
        if row is None:
            return None
        rendezvous = common_pb2.Rendezvous.FromString(row[1])
        record = GenerationRecord(job_id=job_id, number=number,
                             members=members_from_rank_table(common_pb2.RankTable.FromString(row[0])),
                             rendezvous_host=rendezvous.host, rendezvous_port=rendezvous.port,
                             rendezvous_unit_id=rendezvous.host_unit_id, reason=row[2], resume_step=row[3],
                             created_at=row[4])
        return record, row[5]

    # Events.

    def append_event(self, job_id: str, kind: str, reason: str = "", *, unit_id: str = "", generation: int = 0,
                     fields: Mapping[str, object] | None = None, at: float | None = None) -> EventRecord:
        at = time.time() if at is None else at
        text_fields = {k: str(v) for k, v in (fields or {}).items()}
        cursor = self._db.execute(
            "INSERT INTO events (time, job_id, unit_id, generation, kind, reason, fields) VALUES (?,?,?,?,?,?,?)",
            (at, job_id, unit_id, generation, kind, reason, json.dumps(text_fields, sort_keys=True)))
        return EventRecord(sequence=int(cursor.lastrowid or 0), time=at, job_id=job_id, unit_id=unit_id,
                           generation=generation, kind=kind, reason=reason, fields=text_fields)

    _EVENT_COLUMNS = "sequence, time, job_id, unit_id, generation, kind, reason, fields"

    # Progress history.

    def add_progress(self, job_id: str, sample: ProgressSample, *, limit: int = HISTORY_MAX_SAMPLES) -> None:
        """Keep `sample`; past `limit` samples for the job, thin the older half."""
        with self.transaction():
            self._db.execute("INSERT INTO progress (job_id, time, step, samples, world_size, loss) "
                             "VALUES (?,?,?,?,?,?)",
                             (job_id, sample.time, sample.step, sample.samples, sample.world_size, sample.loss))
            (count,) = self._db.execute("SELECT count(*) FROM progress WHERE job_id=?", (job_id,)).fetchone()
            if count > limit:
                times = [row[0] for row in self._db.execute("SELECT time FROM progress WHERE job_id=?", (job_id,))]
                self._db.executemany("DELETE FROM progress WHERE job_id=? AND time=?",
                                     [(job_id, at) for at in thinned(times, limit)])

    def progress(self, job_id: str) -> list[ProgressSample]:
        rows = self._db.execute("SELECT time, step, samples, world_size, loss FROM progress WHERE job_id=? "
                                "ORDER BY time", (job_id,)).fetchall()
        return [ProgressSample(time=row[0], step=row[1], samples=row[2], world_size=row[3], loss=row[4])
                for row in rows]

    @staticmethod
    def _event(row: tuple[Any, ...]) -> EventRecord:
        return EventRecord(sequence=row[0], time=row[1], job_id=row[2], unit_id=row[3], generation=row[4], kind=row[5],
                           reason=row[6], fields=json.loads(row[7]))

    def events(self, job_id: str = "", *, after_sequence: int = 0, limit: int = 1000) -> list[EventRecord]:
        query = f"SELECT {self._EVENT_COLUMNS} FROM events WHERE sequence > ?"
        params: list[object] = [after_sequence]
        if job_id:
            query += " AND job_id = ?"
            params.append(job_id)
        query += " ORDER BY sequence LIMIT ?"
        params.append(limit)
        return [self._event(row) for row in self._db.execute(query, params).fetchall()]

    def events_of_kinds(self, job_id: str, kinds: Sequence[str], *, limit: int) -> list[EventRecord]:
        """The job's newest `limit` events of these kinds, oldest first."""
        marks = ",".join("?" * len(kinds))
        rows = self._db.execute(f"SELECT {self._EVENT_COLUMNS} FROM events WHERE job_id=? AND kind IN ({marks}) "
                                "ORDER BY sequence DESC LIMIT ?", (job_id, *kinds, limit)).fetchall()
        return [self._event(row) for row in reversed(rows)]

    def last_event(self, job_id: str) -> EventRecord | None:
        row = self._db.execute(f"SELECT {self._EVENT_COLUMNS} FROM events WHERE job_id=? "
                               "ORDER BY sequence DESC LIMIT 1", (job_id,)).fetchone()
        return None if row is None else self._event(row)
