"""tidal-controller entry point.

The daemon itself (gRPC servers, SQLite registry, health monitor, Slurm poller) is the
control-plane issue's work and does not exist yet; this entry point says so instead of
pretending to run."""

from __future__ import annotations

import argparse
import sys

import structlog

from tidal.controller.logs import configure_logging

NOT_BUILT = "the controller daemon is not built yet (it arrives with the control-plane work)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal-controller", description="Tidal's per-cluster daemon.")
    parser.parse_args(argv)
    configure_logging()
    structlog.get_logger("tidal.controller").error("controller_unavailable", reason=NOT_BUILT)
    print(f"tidal-controller: {NOT_BUILT}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
