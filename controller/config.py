"""The controller's one typed configuration object.

Precedence, lowest first: the defaults below, a TOML file (`--config`, default
/etc/tidal/controller.toml when it exists), `TIDAL_<FIELD>` environment variables
(`TIDAL_HEARTBEAT_INTERVAL_S=0.5`), then command-line flags. Every field is named with its
unit (`_s` for seconds, `_bytes`)."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_FILE = Path("/etc/tidal/controller.toml")
ENV_PREFIX = "TIDAL_"


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range; the message
    names the field and where the value came from."""


_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def unit_folder(template: str, *, home: str, user: str, job_id: str) -> Path:
    """The folder a template names for one job: `~` is `home`, `{job}` and `{user}` are
    replaced, and a relative result is taken from `home`. ValueError for an empty template
    or an unknown placeholder."""
    if not template.strip():
        raise ValueError("empty; give a folder such as ~/.tidal/{job}")
    unknown = sorted({name for name in _PLACEHOLDER.findall(template) if name not in ("job", "user")})
    if unknown:
        raise ValueError(f"unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)} in {template!r} "
                         "(known: {job}, {user})")
    text = template.replace("{job}", job_id).replace("{user}", user)
    if text == "~" or text.startswith("~/"):
        text = home + text[1:]
    path = Path(text)
    return path if path.is_absolute() else Path(home) / path


# What the controller does about a straggler (`straggler_action`).
STRAGGLER_ACTIONS = ("report", "replace")


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    # Where SQLite, job secrets and the admin token live.
    state_dir: Path = Path("/var/lib/tidal")
    # SQLite file; empty means <state_dir>/tidal.db.
    database: Path | None = None
    # TCP address launchers (and token-holding admins) connect to.
    listen: str = "0.0.0.0:7420"
    # Unix socket for the CLI; the caller's uid is checked (job owner or root).
    unix_socket: Path = Path("/run/tidal/controller.sock")
    # Admin token for admin calls over TCP; empty means <state_dir>/admin.token, made
    # (mode 0600) at first start.
    admin_token_file: Path | None = None
    # TLS for the TCP listener: both set, or neither.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Prometheus metrics (host:port); empty disables.
    metrics_listen: str = "127.0.0.1:9464"
    # Health.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    # A worker that reported progress once and then none for this long is hung.
    progress_timeout_s: float = 300.0
    # Live mode: sent to launchers (Registered.worker_silence_timeout). A worker whose
    # beats stopped this long is judged by its own launcher, which kills it only if it is
    # frozen (stopped, or no CPU time through the silence); a busy one is left to
    # progress_timeout_s. The controller judges no beat silence of its own.
    worker_silence_timeout_s: float = 2.0
    # A launcher must send Register within this long after opening its session.
    register_timeout_s: float = 10.0
    # After a controller (re)start, launchers of running generations get this long to reconnect.
    reconnect_grace_s: float = 15.0
    # Wait this long after the last registration before forming or growing a world, so
    # launchers that start together form one generation.
    join_settle_s: float = 2.0
    # SIGTERM-to-SIGKILL grace for workers on a planned change (restart mode).
    restart_grace_s: float = 10.0
    # SIGTERM-to-SIGKILL grace for workers when the generation stops for a failure.
    failure_stop_grace_s: float = 0.5
    # No grow within this long after a world change.
    scale_up_snooze_s: float = 0.0
    # Live mode with Slurm units: a job below min_replicas this long gives its nodes back
    # (its last replica saves the training state as it leaves; the job resumes from it once
    # min_replicas nodes are idle) instead of holding them idle. 0: hold them.
    below_min_release_s: float = 30.0
    # ... and sooner, after this long, while Slurm's views show nothing on its way: no
    # idle node the job could take (none, or other jobs wait for them) and none of its
    # units started and not registered yet. Holding then only waits for another job to
    # end. 0: always the full below_min_release_s.
    below_min_blocked_release_s: float = 5.0
    # ... and then resumes once a Slurm view shows min_replicas nodes idle: while a job
    # waits so, Slurm is polled at least this often (rather than every
    # slurm_poll_interval_s, 30 s), so that it takes them back within seconds of their
    # freeing. 0: every slurm_poll_interval_s.
    released_poll_interval_s: float = 2.0
    # Live mode with Slurm units, replicas of one node: keep this many units queued in
    # Slurm (pending) while the job runs at or above min_replicas and below max_replicas
    # with no idle node to grow onto, so Slurm starts one the moment a node frees instead
    # of the next poll submitting it (as torchft's requeued replica groups wait). Not while
    # other Slurm jobs wait for nodes the job could take, and, of elastic jobs sharing
    # nodes, only the one next in line by weight (`sharing.next_in_line`). Which queued
    # unit Slurm starts is Slurm's (priority). 0: grow only onto nodes a poll saw idle,
    # at most `slurm_poll_interval_s` (30 s) after they free.
    queued_units: int = 1
    # Live mode, replicas of several nodes: a replica that lost a node waits this long for
    # a node to take its place; then its other nodes are given back (the job keeps its
    # other replicas). 0: wait as long as it takes. 30 minutes: on a busy cluster a
    # replica given back needs K free nodes at once to return, which may never come, while
    # a node frees within minutes (bench.cluster_sim's busy scenarios: at 600 s 10 of
    # about 24 patches a run gave up at 1,024 GPUs).
    replica_patch_wait_s: float = 1800.0
    # Live mode: stragglers (tidal.controller.core.stragglers). A worker whose own compute
    # per sample (forward and backward, before it waits for peers), the median of its last
    # `straggler_window` heartbeat intervals with steps, is `straggler_ratio` times its
    # peers' median for `straggler_confirm` intervals in a row is a straggler (event
    # straggler_suspected); below `straggler_clear_ratio` it is cleared. `straggler_action`:
    # "report" (events, metric, `tidal status`) or "replace" (also: its unit leaves at a
    # step boundary when the job stays at or above min_replicas without it, its node is
    # cooled down, and growth puts a replacement elsewhere; one at a time per job).
    straggler_action: str = "report"
    straggler_ratio: float = 1.5
    straggler_clear_ratio: float = 1.2
    straggler_window: int = 8
    straggler_confirm: int = 3
    # Live mode: a world change (joiners' workers ready, every member re-formed) must
    # complete within this long, or the units holding it up count as failed.
    reconfigure_timeout_s: float = 120.0
    # A job whose workers fail the same way every time (a bug, a missing file) fails,
    # rather than replace its units forever: `crash_loop_generations` generations in a row
    # whose failure was a worker exiting with an error (a non-zero exit code; not a
    # signal, not ended by its launcher), each within `crash_loop_window_s` of forming
    # and with no step committed between them, end the job (event `job_failed`, with the
    # last worker's error and traceback). A generation that ran longer, or a step
    # committed, starts the count again. 0: never.
    crash_loop_generations: int = 3
    crash_loop_window_s: float = 300.0
    # Units as Slurm jobs: the controller submits each job's units with sbatch (at least
    # min_replicas; more onto idle nodes, up to max_replicas) and polls Slurm.
    slurm_units: bool = False
    # Seconds between two cluster-wide polls of Slurm (one squeue and one sinfo each).
    slurm_poll_interval_s: float = 30.0
    # Where a unit's Slurm output (and, for a job of another user, the job's secret) goes:
    # `~` is the job owner's home, `{job}` the job id, `{user}` the owner's name; a relative
    # path is taken from the owner's home. Made by the owner, mode 0700.
    unit_output_dir: str = "~/.tidal/{job}"
    # Whose jobs this controller takes. Accounts below this uid are system users; their jobs
    # and root's are refused unless allowed here. A controller that is not root serves its
    # own user only.
    min_owner_uid: int = 1000
    allow_root_jobs: bool = False
    allow_system_user_jobs: bool = False
    # What a unit's launcher dials; empty: `listen` with a wildcard host replaced by this
    # machine's name.
    unit_controller_address: str = ""
    # The launcher command in a unit's batch script; empty: this Python's
    # `-m tidal.launcher.agent`.
    unit_launcher: str = ""
    # A node where a unit failed gets no unit of the job for this long; each further
    # failure there doubles it (up to 8 times).
    node_cooldown_s: float = 300.0
    # Bounds on what a launcher may send.
    max_message_bytes: int = 1 << 20
    launcher_messages_per_s: float = 50.0
    launcher_message_burst: int = 100
    # SERVING only once Slurm answers too (a controller that manages Slurm units).
    require_slurm: bool = False
    # Seconds between health re-checks of the database (and Slurm).
    readiness_check_interval_s: float = 10.0
    log_level: str = "info"
    # json, console, or empty for "json unless stderr is a terminal".
    log_format: str = ""

    def __post_init__(self) -> None:
        positive = ["heartbeat_interval_s", "heartbeat_timeout_s", "progress_timeout_s", "worker_silence_timeout_s",
                    "register_timeout_s", "restart_grace_s", "failure_stop_grace_s", "reconfigure_timeout_s",
                    "slurm_poll_interval_s", "node_cooldown_s", "launcher_messages_per_s",
                    "readiness_check_interval_s", "crash_loop_window_s"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ["reconnect_grace_s", "join_settle_s", "scale_up_snooze_s", "below_min_release_s",
                     "below_min_blocked_release_s", "released_poll_interval_s",
                     "replica_patch_wait_s", "queued_units", "crash_loop_generations"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        if not 1024 <= self.max_message_bytes <= 64 << 20:
            raise ConfigError(f"max_message_bytes must be within 1 KiB..64 MiB, got {self.max_message_bytes}")
        try:
            unit_folder(self.unit_output_dir, home="/home/user", user="user", job_id="job")
        except ValueError as error:
            raise ConfigError(f"unit_output_dir: {error}") from None
        if self.min_owner_uid < 0:
            raise ConfigError(f"min_owner_uid must be >= 0, got {self.min_owner_uid}")
        if self.launcher_message_burst < 1:
            raise ConfigError("launcher_message_burst must be >= 1")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.straggler_action not in STRAGGLER_ACTIONS:
            raise ConfigError(f"straggler_action must be one of {', '.join(STRAGGLER_ACTIONS)}, "
                              f"got {self.straggler_action!r}")
        if not 1.0 < self.straggler_clear_ratio <= self.straggler_ratio:
            raise ConfigError(f"straggler_clear_ratio ({self.straggler_clear_ratio}) must be above 1 and at most "
                              f"straggler_ratio ({self.straggler_ratio})")
        if self.straggler_window < 3 or self.straggler_confirm < 1:
            raise ConfigError("straggler_window must be >= 3 and straggler_confirm >= 1")
        if self.log_format not in ("", "json", "console"):
            raise ConfigError(f"log_format must be json, console or empty, got {self.log_format!r}")
        split_host_port(self.listen, "listen")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "metrics_listen")

    @property
    def database_path(self) -> Path:
        return self.database or self.state_dir / "tidal.db"

    @property
    def admin_token_path(self) -> Path:
        return self.admin_token_file or self.state_dir / "admin.token"

    @property
    def secrets_dir(self) -> Path:
        return self.state_dir / "secrets"


def split_host_port(address: str, field: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` into its parts; ConfigError naming `field` otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{field} must be host:port, got {address!r}")
    return host.strip("[]"), int(port_text)


_FIELDS = {f.name: f for f in dataclasses.fields(ControllerConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Turn a TOML, environment or flag value into the field's type."""
    kind = str(_FIELDS[name].type)
    try:
        if "Path" in kind:
            if not isinstance(value, str):
                raise ValueError(value)
            if value:
                return Path(value)
            if "None" in kind:
                return None
            raise ValueError(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{name} ({source}) must be {kind}, got {value!r}") from None


def load_config(path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> ControllerConfig:
    """Build the config from defaults, the TOML file, the environment and `overrides`
    (flags), in that order. An unknown key in the file is an error (a typo must not pass
    silently); unknown `TIDAL_*` variables are ignored (the launcher has its own)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    file = path if path is not None else (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
    if file is not None:
        try:
            with open(file, "rb") as handle:
                document = tomllib.load(handle)
        except OSError as error:
            raise ConfigError(f"cannot read config file {file}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {file} is not valid TOML: {error}") from None
        table = document.get("controller", document)
        for key, value in table.items():
            if key not in _FIELDS:
                raise ConfigError(f"unknown setting {key!r} in {file}; known: {', '.join(sorted(_FIELDS))}")
            values[key] = _coerce(key, value, str(file))
    for name in _FIELDS:
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = _coerce(name, environ[env_name], f"${env_name}")
    for name, value in (overrides or {}).items():
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = _coerce(name, value, "command line")
    return ControllerConfig(**values)


def config_as_dict(config: ControllerConfig) -> dict[str, Any]:
    """Printable form (`tidal-controller --print-config`); holds no secret, only paths."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()}
