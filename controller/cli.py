"""The `tidal` command.

Today it has `tidal nodes` (read straight from Slurm) and `tidal version`. The job
commands (submit, status, events, resize, drain, cancel) go through the controller's admin
API and arrive with the controller.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from tidal.slurm import Node, SlurmError, default_client

EXIT_OK = 0
EXIT_SLURM_UNAVAILABLE = 3


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _node_row(node: Node) -> list[str]:
    flags = ",".join(sorted(f.value for f in node.flags)) or "-"
    gres = ",".join(f"{g.name}{':' + g.type if g.type else ''}:{g.count}" for g in node.gres) or "-"
    usable = "yes" if node.is_idle_and_usable else "no"
    return [node.name, node.state.value, flags, ",".join(node.partitions), str(node.cpus), gres,
            usable, node.reason or "-"]


def _node_dict(node: Node) -> dict[str, object]:
    return {"name": node.name, "state": node.state.value, "flags": sorted(f.value for f in node.flags),
            "partitions": list(node.partitions), "cpus": node.cpus,
            "gres": [{"name": g.name, "type": g.type, "count": g.count} for g in node.gres],
            "features": list(node.features), "idle_and_usable": node.is_idle_and_usable,
            "reason": node.reason}


def command_nodes(args: argparse.Namespace) -> int:
    client = default_client(timeout_s=args.timeout)
    try:
        nodes = sorted(client.list_nodes(), key=lambda n: n.name)
        version = client.version()
    except SlurmError as error:
        print(f"tidal nodes: Slurm did not answer: {error}", file=sys.stderr)
        return EXIT_SLURM_UNAVAILABLE
    if args.json:
        print(json.dumps({"slurm_version": str(version), "nodes": [_node_dict(n) for n in nodes]}, indent=2))
        return EXIT_OK
    headers = ["NODE", "STATE", "FLAGS", "PARTITIONS", "CPUS", "GRES", "GROW-ONTO", "REASON"]
    print(_format_table(headers, [_node_row(n) for n in nodes]))
    usable = sum(n.is_idle_and_usable for n in nodes)
    print(f"\n{len(nodes)} nodes, {usable} idle and usable (Slurm {version})")
    return EXIT_OK


def command_version(args: argparse.Namespace) -> int:
    try:
        print(package_version("tidal-elastic"))
    except PackageNotFoundError:
        print("unknown (not installed)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="Elastic, checkpointless PyTorch training on Slurm.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    nodes = sub.add_parser("nodes", help="what Slurm shows of its nodes, and which Tidal could grow onto")
    nodes.add_argument("--json", action="store_true", help="machine-readable output")
    nodes.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for Slurm (default 10)")
    nodes.set_defaults(handler=command_nodes)
    version = sub.add_parser("version", help="print Tidal's version")
    version.set_defaults(handler=command_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
