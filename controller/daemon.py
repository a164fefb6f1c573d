"""tidal-controller: the per-cluster daemon (run by systemd, in the foreground).

gRPC on TCP for launchers (and admins with the token), on a Unix socket for the CLI;
`grpc.health.v1` SERVING once the database (and, when required, Slurm) answers; SIGTERM
drains gracefully. Launchers keep training while it is down or restarting."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import gc
import json
import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import IO, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from tidal.controller.config import ConfigError, ControllerConfig, config_as_dict, load_config, split_host_port
from tidal.controller.jobs import SlurmUnits
from tidal.controller.logs import configure_logging
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.security import UnixSocketRelay, load_or_create_admin_token
from tidal.controller.server import AdminServicer, Controller, LauncherServicer
from tidal.controller.store import StateStore, StoreError
from tidal.proto import admin_pb2, admin_pb2_grpc, launcher_pb2, launcher_pb2_grpc
from tidal.slurm import SlurmError, default_client
from tidal.slurm.snapshot import ClusterPoll

log = structlog.get_logger("tidal.controller")

EXIT_CONFIG = 2
EXIT_STARTUP = 1

SERVICE_NAMES = ("", launcher_pb2.DESCRIPTOR.services_by_name["LauncherService"].full_name,
                 admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name)


def notify_systemd(state: str) -> None:
    """sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET, if set."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), address)


def server_options(config: ControllerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", 1000),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]


def _slurm_problem() -> str | None:
    """Why Slurm does not answer, or None: its commands run and slurmctld answers them
    (`scontrol --version` alone is answered by the local binary with slurmctld down)."""
    try:
        client = default_client(timeout_s=10.0)
        client.version()
        client.list_partitions()
    except SlurmError as error:
        return f"Slurm does not answer: {error}"
    return None


async def _watch_readiness(config: ControllerConfig, store: StateStore, servicer: health.aio.HealthServicer) -> None:
    """SERVING while the database (on this thread: SQLite connections stay on theirs) and,
    when required, Slurm (in a worker thread: a slow Slurm must not block the loop) answer."""
    last: str | None = "starting"
    while True:
        try:
            store.ping()
            problem = await asyncio.to_thread(_slurm_problem) if config.require_slurm else None
        except Exception as error:
            problem = f"database does not answer: {error}"
        if problem != last:
            status = (health_pb2.HealthCheckResponse.SERVING if problem is None
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in SERVICE_NAMES:
                await servicer.set(name, status)
            if problem is None:
                log.info("controller_ready")
            else:
                log.warning("controller_not_ready", reason=problem)
            last = problem
        await asyncio.sleep(config.readiness_check_interval_s if problem is None else 1.0)


def unit_address(listen: str, port: int) -> str:
    """What a unit's launcher dials: the listen address, with a wildcard host replaced by
    this machine's name and the port actually bound."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


def hold_state_lock(database: Path) -> IO[str] | str:
    """Take `database`'s lock file (`tidal.db.lock`) for this process's life, its pid in it:
    the open file, or why not (another controller holds it). Two controllers on one state
    file both decided for its jobs, and the second took the first one's Unix socket."""
    lock_path = database.with_name(database.name + ".lock")
    lock = open(lock_path, "a+")  # noqa: SIM115 (held until the process ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        return f"another tidal-controller (pid {holder}) uses {database} (its lock: {lock_path})"
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


async def serve(config: ControllerConfig, ready_file: Path | None = None) -> int:
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        config.database_path.parent.mkdir(parents=True, exist_ok=True)
        state_lock = hold_state_lock(config.database_path)
    except OSError as error:
        log.error("controller_start_failed", reason=f"cannot use the state folder {config.database_path.parent}: "
                  f"{error.strerror or error}")
        return EXIT_STARTUP
    if isinstance(state_lock, str):
        log.error("controller_start_failed", reason=state_lock)
        return EXIT_STARTUP
    try:
        store = StateStore(config.database_path)
    except StoreError as error:
        log.error("controller_start_failed", reason=str(error))
        return EXIT_STARTUP
    metrics = ControllerMetrics()
    metrics_port = 0
    metrics_server = None
    try:
        admin_token = load_or_create_admin_token(config.admin_token_path)
        tls = ((config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())
               if config.tls_cert_file and config.tls_key_file else None)
        if config.metrics_listen:
            host, port = split_host_port(config.metrics_listen, "metrics_listen")
            try:
                metrics_server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
            except OSError as error:
                raise OSError(error.errno, f"cannot serve metrics on {config.metrics_listen}: {error.strerror}") \
                    from error
            metrics_port = metrics_server.server_port
    except OSError as error:
        # (A file it cannot read or make, a metrics port already taken: named, not a traceback.)
        where = f" ({error.filename})" if error.filename else ""
        log.error("controller_start_failed", reason=f"{error.strerror or error}{where}")
        store.close()
        return EXIT_STARTUP

    controller = Controller(config, store, metrics)
    try:
        controller.load()
    except StoreError as error:
        log.error("controller_start_failed", reason=str(error))
        store.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        return EXIT_STARTUP
    server = grpc.aio.server(options=server_options(config))
    health_servicer = health.aio.HealthServicer()
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    launcher_pb2_grpc.add_LauncherServiceServicer_to_server(LauncherServicer(controller), server)

    if tls is not None:
        tcp_port = server.add_secure_port(config.listen, grpc.ssl_server_credentials([tls]))
    else:
        tcp_port = server.add_insecure_port(config.listen)
    relay_port = server.add_insecure_port("127.0.0.1:0")
    if not tcp_port or not relay_port:
        log.error("controller_start_failed", reason=f"cannot listen on {config.listen}")
        return EXIT_STARTUP
    relay = UnixSocketRelay(config.unix_socket, relay_port)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(controller, admin_token, relay), server)
    await server.start()
    try:
        await relay.start()
    except OSError as error:
        log.error("controller_start_failed", reason=f"cannot listen on {config.unix_socket}: {error}")
        await server.stop(None)
        return EXIT_STARTUP

    background = [asyncio.create_task(controller.tick_forever(), name="ticker"),
                  asyncio.create_task(_watch_readiness(config, store, health_servicer), name="readiness")]
    if config.slurm_units:
        client = default_client()
        controller.enable_slurm_units(SlurmUnits(
            client=client, launcher=tuple(shlex.split(config.unit_launcher)) or (
                sys.executable, "-m", "tidal.launcher.agent"),
            controller_address=config.unit_controller_address or unit_address(config.listen, tcp_port),
            output_template=config.unit_output_dir, secrets_dir=config.secrets_dir))
        background.append(asyncio.create_task(controller.poll_slurm_forever(ClusterPoll(client)), name="slurm-poll"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    endpoint = {"pid": os.getpid(), "listen": config.listen, "tcp_port": tcp_port,
                "unix_socket": str(config.unix_socket), "metrics_port": metrics_port,
                "database": str(config.database_path), "tls": bool(config.tls_cert_file)}
    log.info("controller_started", **endpoint)
    if ready_file is not None:
        temporary = ready_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(endpoint))
        temporary.replace(ready_file)
    notify_systemd("READY=1")

    await stop.wait()
    log.info("controller_stopping", reason="signal")
    notify_systemd("STOPPING=1")
    controller.shutting_down = True
    await health_servicer.enter_graceful_shutdown()
    await relay.stop()
    await server.stop(grace=3.0)
    for task in background:
        task.cancel()
    store.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    state_lock.close()
    log.info("controller_stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal-controller", description="Tidal's per-cluster daemon.")
    parser.add_argument("--config", type=Path, help="TOML file (default /etc/tidal/controller.toml if present)")
    parser.add_argument("--state-dir", help="where SQLite, secrets and the admin token live")
    parser.add_argument("--listen", help="host:port for launchers and token-holding admins")
    parser.add_argument("--unix-socket", help="Unix socket for the CLI")
    parser.add_argument("--metrics-listen", help="host:port for Prometheus metrics ('' disables)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other setting, e.g. --set heartbeat_interval_s=0.5 (repeatable)")
    parser.add_argument("--ready-file", type=Path, help="write the bound endpoints here (JSON) once serving")
    parser.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    return parser


# Python's collector runs its youngest generation every 700 net allocations of objects it
# tracks, by default. With 2,000 launchers, each session's pending read (a future, a task's
# coroutine, gRPC's operation) lives for about a heartbeat interval: young collections
# promoted thousands of them a second, and a collection of the whole heap (about 200,000
# objects: 100-150 ms with the event loop stopped) followed every 3 s or so, wherever it
# fell, a failure's fan-out included. A youngest generation larger than what one heartbeat
# interval keeps alive lets those objects die young, uncollected; cycles are still found.
GC_YOUNGEST_THRESHOLD = 50_000


def tune_garbage_collection() -> None:
    """Collect the youngest generation every `GC_YOUNGEST_THRESHOLD` allocations (the older
    generations' thresholds unchanged)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNGEST_THRESHOLD, middle, oldest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {"state_dir": args.state_dir, "listen": args.listen,
                                 "unix_socket": args.unix_socket, "metrics_listen": args.metrics_listen}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"tidal-controller: --set needs KEY=VALUE, got {item!r}", file=sys.stderr)
            return EXIT_CONFIG
        overrides[key.strip()] = value
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as error:
        print(f"tidal-controller: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(json.dumps(config_as_dict(config), indent=2))
        return 0
    configure_logging(level=config.log_level, json={"json": True, "console": False}.get(config.log_format))
    tune_garbage_collection()
    return asyncio.run(serve(config, args.ready_file))


if __name__ == "__main__":
    sys.exit(main())
