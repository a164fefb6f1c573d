"""tidal-launcher: the command that starts a unit's launcher on each node (`python -m
tidal.launcher.agent`, or `tidal-launcher`).

On a unit's first node it runs the unit's agent (`leader.Agent`), which registers with the
controller and runs the workers; on the other nodes of a unit spanning several, a follower
(`follower.Follower`) that its leader drives. A one-node unit is a leader with no
followers."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from tidal.controller.logs import configure_logging
from tidal.launcher.follower import Follower, FollowerOptions
from tidal.launcher.leader import Agent, LauncherOptions
from tidal.launcher.lifecycle import EXIT_USAGE
from tidal.launcher.nodes import DEFAULT_PORT_BASE, UnitNodes, unit_nodes

__all__ = ["Agent", "LauncherOptions", "build_parser", "main", "read_secret"]


def read_secret(secret_file: str | None) -> str:
    """The job's secret: from --secret-file / $TIDAL_SECRET_FILE, else $TIDAL_JOB_SECRET."""
    path = secret_file or os.environ.get("TIDAL_SECRET_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("TIDAL_JOB_SECRET", "").strip()


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="tidal-launcher", description="Tidal's per-unit agent. The job's secret comes from --secret-file, "
        "$TIDAL_SECRET_FILE or $TIDAL_JOB_SECRET, never from the command line.")
    parser.add_argument("--controller", default=env("TIDAL_CONTROLLER"), help="host:port ($TIDAL_CONTROLLER)")
    parser.add_argument("--job", default=env("TIDAL_JOB_ID"), help="job id ($TIDAL_JOB_ID)")
    parser.add_argument("--unit", default=env("TIDAL_UNIT_ID"),
                        help="unit id ($TIDAL_UNIT_ID; default <host>-<Slurm job id or pid>)")
    parser.add_argument("--secret-file", default=None, help="file holding the job's secret ($TIDAL_SECRET_FILE)")
    parser.add_argument("--address", default=env("TIDAL_ADDRESS"),
                        help="address other nodes reach this one at ($TIDAL_ADDRESS; default the host name)")
    parser.add_argument("--tls-ca", type=Path, default=env("TIDAL_TLS_CA") or None,
                        help="CA certificate to verify the controller's TLS ($TIDAL_TLS_CA)")
    parser.add_argument("--leave-timeout", type=float, default=20.0,
                        help="seconds after SIGTERM to wait for the controller before leaving alone")
    parser.add_argument("--finish-report-timeout", type=float, default=60.0,
                        help="when training finished while the controller is unreachable, seconds to wait for it "
                        "to take this unit's last reports before exiting without them")
    parser.add_argument("--connect-timeout", type=float, default=600.0,
                        help="give up when not registered after this many seconds")
    parser.add_argument("--stop-grace", type=float, default=10.0, help="SIGTERM-to-SIGKILL grace for workers")
    parser.add_argument("--no-prestart", action="store_true",
                        help="live mode: start workers only once a world names this unit")
    parser.add_argument("--unit-nodes", type=int, default=int(env("TIDAL_UNIT_NODES") or 1),
                        help="nodes the unit spans ($TIDAL_UNIT_NODES): with more than one, srun starts one "
                        "launcher per node; the one on SLURM_NODEID 0 leads, the others follow it")
    parser.add_argument("--node-port-base", type=int, default=int(env("TIDAL_NODE_PORT_BASE") or DEFAULT_PORT_BASE),
                        help="multi-node units: the leader serves its followers on a port from this base "
                        "(derived from SLURM_JOB_ID, the first free of a few) ($TIDAL_NODE_PORT_BASE)")
    parser.add_argument("--node-timeout", type=float, default=10.0,
                        help="multi-node units: a node silent this many seconds is lost, and the replica with it")
    parser.add_argument("--worker-silence-timeout", type=float, default=2.0,
                        help="live mode: a worker whose beats stopped this many seconds ago is killed if it is "
                        "frozen (stopped, or no CPU time since), never if it is busy; a limit the controller "
                        "sends wins (0: never, unless the controller sends one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    missing = [name for name in ("controller", "job") if not getattr(args, name)]
    if missing:
        print(f"tidal-launcher: missing --{' and --'.join(missing)} (or their TIDAL_* variables)", file=sys.stderr)
        return EXIT_USAGE
    try:
        secret = read_secret(args.secret_file)
    except OSError as error:
        print(f"tidal-launcher: cannot read the job's secret: {error}", file=sys.stderr)
        return EXIT_USAGE
    if not secret:
        print("tidal-launcher: no job secret (set --secret-file, $TIDAL_SECRET_FILE or $TIDAL_JOB_SECRET)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.tls_ca is not None:
        # Read by each session with the controller: unreadable, the link ended unseen and the
        # launcher waited out --connect-timeout, then exited with a traceback.
        try:
            args.tls_ca.read_bytes()
        except OSError as error:
            print(f"tidal-launcher: cannot read the TLS CA certificate (--tls-ca): {error}", file=sys.stderr)
            return EXIT_USAGE
    host = socket.gethostname()
    slurm_job_id = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    nodename = os.environ.get("SLURMD_NODENAME", host)
    layout: UnitNodes | None = None
    if args.unit_nodes > 1:
        try:
            layout = unit_nodes(os.environ, args.unit_nodes, args.node_port_base)
        except ValueError as error:
            print(f"tidal-launcher: {error}", file=sys.stderr)
            return EXIT_USAGE
    unit_id = args.unit or f"{layout.nodes[0] if layout else nodename}-{slurm_job_id or os.getpid()}"
    if layout is not None and not layout.is_leader:
        return asyncio.run(Follower(FollowerOptions(
            job_id=args.job, unit_id=unit_id, secret=secret, layout=layout, slurm_job_id=slurm_job_id,
            connect_timeout_s=args.connect_timeout, node_timeout_s=args.node_timeout,
            stop_grace_s=args.stop_grace, leave_timeout_s=args.leave_timeout)).run())
    options = LauncherOptions(
        controller=args.controller, job_id=args.job, unit_id=unit_id,
        secret=secret, address=args.address or host, nodes=layout.nodes if layout else (nodename,),
        slurm_job_id=slurm_job_id, tls_ca=args.tls_ca, leave_timeout_s=args.leave_timeout,
        connect_timeout_s=args.connect_timeout, stop_grace_s=args.stop_grace,
        worker_silence_timeout_s=args.worker_silence_timeout, prestart_workers=not args.no_prestart,
        unit_nodes=layout, node_timeout_s=args.node_timeout, finish_report_timeout_s=args.finish_report_timeout)
    return asyncio.run(Agent(options).run())


if __name__ == "__main__":
    sys.exit(main())

