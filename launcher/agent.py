"""tidal-launcher entry point.

The launcher (registration, heartbeats, worker processes) is the control-plane issue's
work and does not exist yet; this entry point says so instead of pretending to run."""

from __future__ import annotations

import sys

from tidal.controller.daemon import refuse_unbuilt


def main(argv: list[str] | None = None) -> int:
    return refuse_unbuilt("tidal-launcher", "Tidal's per-unit agent.", argv)


if __name__ == "__main__":
    sys.exit(main())
