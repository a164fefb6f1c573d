"""tidal-controller entry point.

The daemon itself (gRPC servers, SQLite registry, health monitor, Slurm poller) is the
control-plane issue's work and does not exist yet; this entry point says so instead of
pretending to run."""

from __future__ import annotations

import argparse
import sys

import structlog

from tidal.controller.logs import configure_logging


def refuse_unbuilt(program: str, description: str, argv: list[str] | None) -> int:
    """Entry point of a component that is not built yet: say so, exit 2."""
    argparse.ArgumentParser(prog=program, description=description).parse_args(argv)
    configure_logging()
    reason = f"{program} is not built yet (it arrives with the control-plane work)"
    structlog.get_logger(program).error("component_unavailable", reason=reason)
    print(f"{program}: {reason}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    return refuse_unbuilt("tidal-controller", "Tidal's per-cluster daemon.", argv)


if __name__ == "__main__":
    sys.exit(main())
