"""Where a step's CPU goes: the overhead benchmark's two runs (Tidal's live mode and plain
DDP under torchrun, the small LM at world 2) with each worker under cProfile, timed by the
training thread's own CPU clock (`bench/baselines/profiled.py`). Each is run twice, for
`--short` and `--long` steps; the difference of the two profiles, per worker and step, is
a steady step's cost by function, start-up and the end left out.

Prints, for each run, the training thread's CPU a step, and for Tidal the functions of
its own (the worker library, the ledger, progress) with their CPU a step, and the rest of
its step loop's parts (`--top` lines). cProfile adds its own cost to every Python call, so
the Python-heavy parts weigh more here than they do unprofiled; compare the two runs'
totals, and read the table for where Tidal's own time goes. Run it unlocked: nothing
measured here goes into a result file."""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import DDP_BASELINE, LM_EXAMPLE, REPO
from bench.live import run_fixed_world
from bench.overhead import MODEL, WORLD

PROFILED = REPO / "bench" / "baselines" / "profiled.py"
# Tidal's own parts, by file (the worker library; the example's loss_fn and model are the script's).
TIDAL_FILES = (str(REPO / "train") + os.sep, str(REPO / "proto") + os.sep)

Costs = dict[tuple[str, int, str], tuple[float, float, float]]


def profile_run(kind: str, folder: Path, steps: int) -> Costs:
    """Every function's (calls, self CPU, cumulative CPU), summed over the run's workers."""
    profiles = folder / "profiles"
    profiles.mkdir(parents=True)
    os.environ["TIDAL_PROFILE_DIR"] = str(profiles)
    if kind == "tidal":
        run_fixed_world(folder, [sys.executable, str(PROFILED), str(LM_EXAMPLE), "--steps", str(steps), "--log-every",
                                 "1000", "--ledger-dir", str(folder / "ledger"), *MODEL], WORLD, "profile")
    else:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                        str(PROFILED), str(DDP_BASELINE), "--steps", str(steps), "--log-dir", str(folder / "log"),
                        *MODEL], check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       timeout=600)
    files = sorted(profiles.glob("profile-*.prof"))
    assert len(files) == WORLD, f"{kind}: {len(files)} profiles"
    stats = pstats.Stats(*map(str, files)).stats  # type: ignore[attr-defined]
    return {key: (calls, own, total) for key, (_, calls, own, total, _) in stats.items()}


def per_step(short: Costs, long: Costs, steps: int) -> Costs:
    """What `steps` more steps cost, per worker and step (calls, ms self, ms cumulative)."""
    scale = 1000 / (steps * WORLD)
    result: Costs = {}
    for key, (calls, own, total) in long.items():
        before = short.get(key, (0, 0.0, 0.0))
        if calls > before[0]:
            result[key] = ((calls - before[0]) / (steps * WORLD), (own - before[1]) * scale,
                           (total - before[2]) * scale)
    return result


def name(key: tuple[str, int, str]) -> str:
    path, line, function = key
    return f"{path.removeprefix(str(REPO) + os.sep) if path.startswith(str(REPO)) else Path(path).name}:{line}" \
           f"({function})" if path != "~" else function


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--short", type=int, default=100)
    options.add_argument("--long", type=int, default=400)
    options.add_argument("--top", type=int, default=25)
    args = options.parse_args()
    steps = args.long - args.short
    with tempfile.TemporaryDirectory(prefix="tidal-overhead-profile-") as scratch:
        for kind in ("ddp", "tidal"):
            costs = per_step(profile_run(kind, Path(scratch) / f"{kind}-short", args.short),
                             profile_run(kind, Path(scratch) / f"{kind}-long", args.long), steps)
            print(f"{kind}: the training thread's CPU a step {sum(c[1] for c in costs.values()):.2f} ms "
                  f"(profiled; {steps} steps' difference, per worker)")
            own = sorted(((key, c) for key, c in costs.items() if key[0].startswith(TIDAL_FILES)),
                         key=lambda kc: -kc[1][1])
            rows = list(own) if kind == "tidal" else []
            rows += sorted(((key, c) for key, c in costs.items() if not key[0].startswith(TIDAL_FILES)),
                           key=lambda kc: -kc[1][1])[:args.top]
            if kind == "tidal":
                print(f"  Tidal's own functions: {sum(c[1] for _, c in own):.3f} ms self a step")
            print(f"  {'ms self':>8} {'ms cum':>8} {'calls':>6}  function (a step, per worker)")
            for key, (calls, own_ms, total_ms) in rows:
                if own_ms >= 0.001:
                    print(f"  {own_ms:8.3f} {total_ms:8.3f} {calls:6.1f}  {name(key)}")


if __name__ == "__main__":
    main()
