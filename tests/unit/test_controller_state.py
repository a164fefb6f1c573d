"""Configuration, the SQLite store, job specs, secrets, and the launcher's worker
environment."""

from __future__ import annotations

import os
import socket
import sqlite3
from pathlib import Path

import pytest

from tidal.controller.config import ConfigError, load_config
from tidal.controller.events import EventLog
from tidal.controller.model import GenerationRecord, JobRecord, JobState, Member, UnitRecord, UnitState
from tidal.controller.security import (
    Caller,
    load_or_create_admin_token,
    peer_uid,
    secret_digest,
    secret_matches,
    write_private_file,
)
from tidal.controller.spec import SpecError, normalized_spec
from tidal.controller.store import StateStore, StoreError
from tidal.launcher.link import Backoff
from tidal.launcher.workers import Placement, read_progress, worker_environment
from tidal.proto import admin_pb2, common_pb2


def test_config_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "controller.toml"
    file.write_text('[controller]\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 2\nlisten = "127.0.0.1:9"\n')
    config = load_config(file, environ={"TIDAL_HEARTBEAT_TIMEOUT_S": "4", "TIDAL_UNRELATED": "x"},
                         overrides={"listen": "127.0.0.1:10", "state_dir": None})
    assert config.heartbeat_interval_s == 0.5 and config.heartbeat_timeout_s == 4.0
    assert config.listen == "127.0.0.1:10" and config.state_dir == Path("/var/lib/tidal")
    assert config.database_path == Path("/var/lib/tidal/tidal.db")


@pytest.mark.parametrize(("content", "message"), [
    ("heartbeat_intervl_s = 1", "unknown setting 'heartbeat_intervl_s'"),
    ("heartbeat_interval_s = 'fast'", "heartbeat_interval_s"),
    ("heartbeat_interval_s = 5", "must exceed heartbeat_interval_s"),
    ("listen = 'nowhere'", "listen must be host:port"),
    ("tls_cert_file = '/c.pem'", "tls_cert_file and tls_key_file go together"),
    ("heartbeat_interval_s = [", "not valid TOML"),
])
def test_bad_configuration_names_the_field(tmp_path: Path, content: str, message: str) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(content + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(file, environ={})


def test_environment_values_are_typed() -> None:
    with pytest.raises(ConfigError, match=r"\$TIDAL_REQUIRE_SLURM"):
        load_config(None, environ={"TIDAL_REQUIRE_SLURM": "maybe"})
    assert load_config(None, environ={"TIDAL_REQUIRE_SLURM": "yes"}).require_slurm is True


def test_store_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tidal.db"
    store = StateStore(path)
    spec = admin_pb2.JobSpec(name="lm", min_replicas=1, max_replicas=4, command=["python", "train.py"])
    job = JobRecord(job_id="lm-1", spec=spec, state=JobState.PENDING, owner_uid=1000, secret_sha256="ab",
                    created_at=1.0, updated_at=1.0)
    members = (Member("u1", ("n1",), 2, 0, 0), Member("u2", ("n2",), 2, 1, 2))
    generation = GenerationRecord(job_id="lm-1", number=1, members=members,
                        rendezvous_host="n1", rendezvous_port=29500, rendezvous_unit_id="u1", reason="formed",
                        created_at=2.0, resume_step=0)
    with store.transaction():
        store.insert_job(job)
        store.upsert_unit(UnitRecord("lm-1", "u1", UnitState.ACTIVE, ["n1"], "n1", 2, 77, 0, 1.5))
        store.insert_generation(generation)
        job.state, job.generation = JobState.RUNNING, 1
        store.update_job(job)
        store.append_event("lm-1", "world_formed", "formed", generation=1, fields={"world_size": 4})
    with pytest.raises(RuntimeError), store.transaction():
        store.append_event("lm-1", "lost", "rolled back")
        raise RuntimeError("boom")
    store.close()

    reopened = StateStore(path)
    [loaded] = reopened.jobs()
    assert loaded.state is JobState.RUNNING and loaded.generation == 1 and loaded.spec == spec
    [unit] = reopened.units("lm-1")
    assert unit.state is UnitState.ACTIVE and unit.slurm_job_id == 77 and unit.nodes == ["n1"]
    found = reopened.generation("lm-1", 1)
    assert found is not None and found[0] == generation and found[1] is None
    assert [(e.kind, e.fields) for e in reopened.events("lm-1")] == [("world_formed", {"world_size": "4"})]
    reopened.mark_generation_stopped("lm-1", 1, 3.0)
    assert reopened.generation("lm-1", 1)[1] == 3.0  # type: ignore[index]


def test_a_state_file_of_schema_1_is_converted_in_place_and_a_newer_one_refused(tmp_path: Path) -> None:
    """Schema 1 called a generation an epoch (table `epochs`, `epoch` columns and event kinds):
    a controller of a later schema converts such a file once, losing nothing; a file of a schema it
    does not know is refused with a clear error, untouched."""
    import sqlite3

    from tidal.controller.store import SCHEMA_VERSION

    path = tmp_path / "old.db"
    spec = admin_pb2.JobSpec(name="lm", min_replicas=1, max_replicas=2, command=["python", "train.py"])
    members = (Member("u1", ("n1",), 1, 0, 0),)
    table = common_pb2.RankTable(world_size=1, assignments=[common_pb2.RankAssignment(
        unit_id="u1", nodes=["n1"], group_rank=0, first_rank=0, procs_per_node=1)], groups=1)
    rendezvous = common_pb2.Rendezvous(host="n1", port=29500, host_unit_id="u1")
    old = sqlite3.connect(str(path))
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, spec BLOB NOT NULL, state TEXT NOT NULL,
            owner_uid INTEGER NOT NULL, secret_sha256 TEXT NOT NULL, epoch INTEGER NOT NULL DEFAULT 0,
            step INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE epochs (job_id TEXT NOT NULL REFERENCES jobs(job_id), epoch INTEGER NOT NULL,
            rank_table BLOB NOT NULL, rendezvous BLOB NOT NULL, reason TEXT NOT NULL,
            resume_step INTEGER NOT NULL, created_at REAL NOT NULL, stopped_at REAL, PRIMARY KEY (job_id, epoch));
        CREATE TABLE events (sequence INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL,
            job_id TEXT NOT NULL, unit_id TEXT NOT NULL DEFAULT '', epoch INTEGER NOT NULL DEFAULT 0,
            kind TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', fields TEXT NOT NULL DEFAULT '{}');
    """)
    old.execute("INSERT INTO jobs VALUES ('lm-1', ?, 'running', 1000, 'ab', 3, 40, 1.0, 2.0)",
                (spec.SerializeToString(),))
    old.execute("INSERT INTO epochs VALUES ('lm-1', 3, ?, ?, 'grow', 40, 2.0, NULL)",
                (table.SerializeToString(), rendezvous.SerializeToString()))
    old.execute("INSERT INTO events (time, job_id, epoch, kind, reason, fields) "
                "VALUES (2.5, 'lm-1', 3, 'epoch_stopped', 'stopped', '{\"from_epoch\": 2}')")
    old.commit()
    old.close()

    store = StateStore(path)
    [job] = store.jobs()
    assert job.generation == 3 and job.step == 40 and job.state is JobState.RUNNING
    found = store.generation("lm-1", 3)
    assert found is not None and found[0].members == members and found[0].resume_step == 40
    [event] = store.events("lm-1")
    assert (event.kind, event.generation, event.fields) == ("generation_stopped", 3, {"from_generation": 2})
    store.close()
    assert StateStore(path).jobs()[0].generation == 3, "a converted file opens as it is"

    newer = tmp_path / "newer.db"
    StateStore(newer).close()
    db = sqlite3.connect(str(newer))
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}"):
        StateStore(newer)
    # A version that is no number (a file edited by hand, another program's): refused alike.
    db = sqlite3.connect(str(newer))
    db.execute("UPDATE meta SET value='v3' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=f"schema version v3, this controller knows {SCHEMA_VERSION}"):
        StateStore(newer)


def test_a_state_file_the_controller_may_read_but_not_write_is_refused_at_start(tmp_path: Path) -> None:
    """A state file left read-only (its mode, another owner, an immutable flag) in a folder
    the controller may write: it opened, health said SERVING (a read answers), and then
    every decision failed to be written (a submission refused with an internal error, every
    launcher's session broken again and again). It is refused at start, saying why."""
    import subprocess

    path = tmp_path / "tidal.db"
    StateStore(path).close()
    # (Root writes whatever the mode says: an immutable file is one it may only read.)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("needs chattr +i (root, and a file system that has the flag)")
    try:
        with pytest.raises(StoreError, match="readonly"):
            StateStore(path)
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    store = StateStore(path)
    assert store.jobs() == []
    store.close()


def test_a_state_file_of_schema_2_gains_the_units_replica_places(tmp_path: Path) -> None:
    """Schema 3 stores a unit's place in a replica of several nodes: a schema-2 file's units
    are converted in place, each its own replica (0), nothing else changed."""
    import sqlite3

    from tidal.controller.store import SCHEMA_VERSION

    path = tmp_path / "two.db"
    old = sqlite3.connect(str(path))
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '2');
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, spec BLOB NOT NULL, state TEXT NOT NULL,
            owner_uid INTEGER NOT NULL, secret_sha256 TEXT NOT NULL, generation INTEGER NOT NULL DEFAULT 0,
            step INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE units (job_id TEXT NOT NULL REFERENCES jobs(job_id), unit_id TEXT NOT NULL,
            state TEXT NOT NULL, nodes TEXT NOT NULL DEFAULT '[]', address TEXT NOT NULL DEFAULT '',
            procs_per_node INTEGER NOT NULL DEFAULT 1, slurm_job_id INTEGER NOT NULL DEFAULT 0,
            group_rank INTEGER NOT NULL DEFAULT -1, registered_at REAL NOT NULL DEFAULT 0,
            reason TEXT NOT NULL DEFAULT '', PRIMARY KEY (job_id, unit_id));
    """)
    spec = admin_pb2.JobSpec(name="lm", min_replicas=1, max_replicas=2, command=["python", "train.py"])
    old.execute("INSERT INTO jobs VALUES ('lm-1', ?, 'running', 1000, 'ab', 3, 40, 1.0, 2.0)",
                (spec.SerializeToString(),))
    old.execute("INSERT INTO units VALUES ('lm-1', 'u1', 'active', '[\"n1\"]', 'n1', 2, 17, 0, 5.0, '')")
    old.commit()
    old.close()

    store = StateStore(path)
    [unit] = store.units("lm-1")
    assert (unit.unit_id, unit.state, unit.nodes, unit.procs_per_node, unit.slurm_job_id) == (
        "u1", UnitState.ACTIVE, ["n1"], 2, 17)
    assert (unit.replica, unit.node_index) == (0, 0)
    unit.replica, unit.node_index = 4, 1
    store.upsert_unit(unit)
    assert [(u.replica, u.node_index) for u in store.units("lm-1")] == [(4, 1)]
    store.close()
    db = sqlite3.connect(str(path))
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


def test_spec_defaults_and_errors_name_the_field() -> None:
    spec = normalized_spec(admin_pb2.JobSpec(command=["python", "train.py"]))
    assert (spec.min_replicas, spec.max_replicas, spec.nodes_per_replica, spec.procs_per_node) == (1, 1, 1, 1)
    assert spec.mode == common_pb2.JOB_MODE_RESTART
    with pytest.raises(SpecError) as error:
        normalized_spec(admin_pb2.JobSpec(name="x y", min_replicas=4, max_replicas=2, global_batch=-1,
                                          environment={"TIDAL_JOB_SECRET": "x"}))
    message = str(error.value)
    for field in ("name:", "max_replicas:", "global_batch:", "command:", "environment:"):
        assert field in message


@pytest.mark.parametrize("bad", [
    {"name": "job\n"},  # `$` alone matched before the newline: accepted, and no unit could register
    {"environment": {"A=B": "1"}},  # no process can have these: every worker's start failed
    {"environment": {"A\0B": "1"}},
    {"environment": {"A": "x\0y"}},
    {"command": ["python", "a\0b"]},
    {"working_dir": "/w\0"},
    {"partition": "p\0"},
    {"sbatch_options": ["--time=1\0"]},
])
def test_a_spec_no_process_could_run_is_refused_at_submission(bad: dict[str, object]) -> None:
    spec = admin_pb2.JobSpec(name="job", command=["python", "train.py"])
    for field, value in bad.items():
        if isinstance(value, dict):
            getattr(spec, field).update(value)
        elif isinstance(value, list):
            del getattr(spec, field)[:]
            getattr(spec, field).extend(value)
        else:
            setattr(spec, field, value)
    with pytest.raises(SpecError, match=f"{next(iter(bad))}:"):
        normalized_spec(spec)


def test_a_watcher_is_shown_an_event_once_it_is_committed_never_one_a_rollback_undid(tmp_path: Path) -> None:
    """`tidal events --follow` was shown an event inside its transaction; rolled back (a
    write failed, the disk full), it was never stored, and the real event that then took
    its sequence number was filtered out as already shown."""
    store = StateStore(tmp_path / "state.db")
    events = EventLog(store)
    store.insert_job(JobRecord(job_id="j", spec=admin_pb2.JobSpec(name="j"), state=JobState.PENDING, owner_uid=0,
                               secret_sha256="x", created_at=0, updated_at=0))
    queue = events.watch()
    with pytest.raises(sqlite3.OperationalError), store.transaction():
        events.record("j", "world_formed", "undone")
        assert queue.empty(), "not before the commit"
        raise sqlite3.OperationalError("database or disk is full")
    with store.transaction():
        events.record("j", "job_cancelled", "kept")
    events.record("j", "job_note", "outside a transaction: at once")
    shown = [queue.get_nowait().reason for _ in range(queue.qsize())]
    assert shown == ["kept", "outside a transaction: at once"] == [e.reason for e in store.events("j")]
    store.close()


def test_secrets_are_stored_as_digests_and_written_privately(tmp_path: Path) -> None:
    digest = secret_digest("s3cret")
    assert secret_matches("s3cret", digest) and not secret_matches("s3cret ", digest) and "s3cret" not in digest
    target = tmp_path / "secrets" / "job.secret"
    write_private_file(target, "s3cret\n")
    assert target.read_text() == "s3cret\n" and target.stat().st_mode & 0o777 == 0o600
    token_file = tmp_path / "admin.token"
    token = load_or_create_admin_token(token_file)
    assert len(token) > 30 and load_or_create_admin_token(token_file) == token
    assert token_file.stat().st_mode & 0o777 == 0o600


def test_peer_uid_is_the_kernels_word_and_callers_act_on_their_own_jobs() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert peer_uid(left) == os.geteuid()
    assert Caller(1000, False, "unix").may_act_on(1000)
    assert not Caller(1001, False, "unix").may_act_on(1000)
    assert Caller(0, True, "token").may_act_on(1000)


def test_worker_environment_is_torchrun_compatible_and_holds_no_secret(tmp_path: Path) -> None:
    placement = Placement(generation=3, first_rank=4, group_rank=2, group_world_size=3, procs_per_node=2, world_size=6,
                          master_addr="n1", master_port=29400)
    env = worker_environment({"PATH": "/bin", "TIDAL_JOB_SECRET": "s", "TIDAL_SECRET_FILE": "/s"}, {"FOO": "bar"},
                             placement=placement, local_rank=1, job_id="j", unit_id="u", progress_file=tmp_path / "p",
                             error_file=tmp_path / "e.json")
    # Every variable torchrun 2.13's agent sets (LocalElasticAgent._start_workers), one role.
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
        "GROUP_WORLD_SIZE": "3", "ROLE_NAME": "default", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "6",
        "MASTER_ADDR": "n1", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "2147483647", "TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "e.json")}
    assert env["TIDAL_GENERATION"] == "3" and env["FOO"] == "bar"
    assert "TIDAL_JOB_SECRET" not in env and "TIDAL_SECRET_FILE" not in env and env["OMP_NUM_THREADS"] == "1"
    # As under torchrun, a value the job sets wins over the default.
    own = worker_environment({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "OMP_NUM_THREADS": "4"},
                             placement=placement, local_rank=0, job_id="j", unit_id="u", progress_file=tmp_path / "p",
                             error_file=tmp_path / "e.json")
    assert own["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and own["OMP_NUM_THREADS"] == "4"
    # Live mode: the worker library sets the NCCL settings its groups need; the launcher sets
    # none (else the library would report every worker's as a job's value it replaced).
    live = worker_environment({}, {"TIDAL_CONTROL_SOCKET": "/run/c.sock"}, placement=placement, local_rank=0,
                              job_id="j", unit_id="u", progress_file=tmp_path / "p", error_file=tmp_path / "e.json")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in live


def test_progress_file_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.train.progress import report_progress

    target = tmp_path / "progress-0"
    assert read_progress(target) is None
    monkeypatch.setenv("TIDAL_PROGRESS_FILE", str(target))
    report_progress(41)
    progress = read_progress(target)
    assert progress is not None and progress.step == 41 and progress.at > 1.7e9


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    import random

    backoff = Backoff(initial_s=0.1, maximum_s=2.0)
    rng = random.Random(7)
    delays = [backoff.delay(attempt, rng) for attempt in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(1.0 <= d <= 2.0 for d in delays[5:])
    assert len({round(d, 6) for d in delays}) == len(delays)


def test_state_gauges_are_read_from_the_jobs_at_scrape_time() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from tidal.controller.metrics import ControllerMetrics

    jobs = [SimpleNamespace(job_id="j", job_state="running", unit_states=["active", "active", "left"],
                            world_size=2, generation_number=3, connected_launchers=2,
                            unit_compute={"u2": (1.72, True)})]
    metrics = ControllerMetrics()
    metrics.read_job_states(lambda: jobs, ["pending", "running"], ["active", "left"])
    text = generate_latest(metrics.registry).decode()
    for line in ('tidal_jobs{state="running"} 1.0', 'tidal_jobs{state="pending"} 0.0',
                 'tidal_units{state="active"} 2.0', 'tidal_world_size{job_id="j"} 2.0',
                 'tidal_generation{job_id="j"} 3.0', "tidal_launchers_connected 2.0",
                 'tidal_unit_compute_ratio{job_id="j",unit_id="u2"} 1.72',
                 'tidal_unit_straggler{job_id="j",unit_id="u2"} 1.0'):
        assert line in text
    jobs.clear()
    assert 'tidal_jobs{state="running"} 0.0' in generate_latest(metrics.registry).decode()


@pytest.mark.parametrize(("column", "value", "message"), [
    ("state", "flying", "job 'lm-1' does not read back: 'flying' is not a valid JobState"),
    ("spec", b"\xff\xff\xff", "job 'lm-1' does not read back: Error parsing message"),
])
def test_a_job_row_that_does_not_read_back_stops_the_start_naming_it(tmp_path: Path, column: str, value: object,
                                                                     message: str) -> None:
    """A state file edited by hand (a state no controller writes, a spec that does not
    parse): the controller does not start, and says which job of which file, in one line,
    not a ValueError traceback (the file is left as it is for the admin to mend)."""
    import json
    import subprocess
    import sys

    path = tmp_path / "state" / "tidal.db"
    store = StateStore(path)
    with store.transaction():
        store.insert_job(JobRecord(job_id="lm-1", spec=admin_pb2.JobSpec(name="lm", command=["x"]),
                                   state=JobState.RUNNING, owner_uid=0, secret_sha256="ab", created_at=1.0,
                                   updated_at=1.0))
    store.close()
    db = sqlite3.connect(str(path))
    db.execute(f"UPDATE jobs SET {column}=?", (value,))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=message.replace("(", r"\(")):
        StateStore(path).jobs()
    result = subprocess.run([sys.executable, "-m", "tidal.controller.daemon", "--state-dir", str(path.parent),
                             "--unix-socket", str(tmp_path / "controller.sock"), "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    failed = [json.loads(line) for line in result.stderr.splitlines() if "controller_start_failed" in line]
    assert len(failed) == 1 and message in failed[0]["reason"] and str(path) in failed[0]["reason"]
