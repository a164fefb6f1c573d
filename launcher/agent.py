"""tidal-launcher entry point.

The launcher (registration, heartbeats, worker processes) is the control-plane issue's
work and does not exist yet; this entry point says so instead of pretending to run."""

from __future__ import annotations

import argparse
import sys

import structlog

from tidal.controller.logs import configure_logging

NOT_BUILT = "the launcher is not built yet (it arrives with the control-plane work)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal-launcher", description="Tidal's per-unit agent.")
    parser.parse_args(argv)
    configure_logging()
    structlog.get_logger("tidal.launcher").error("launcher_unavailable", reason=NOT_BUILT)
    print(f"tidal-launcher: {NOT_BUILT}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
