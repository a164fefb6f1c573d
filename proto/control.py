"""The wire format of the channel between a launcher and its live-mode workers: JSON lines
over a Unix socket. Both ends import it from here (the launcher's server is
`tidal.launcher.control.LauncherChannel`, the worker's client `tidal.train.channel.WorkerChannel`);
the controller reads its exit code `EXIT_STATE_LOST`.

The launcher serves the socket in its private run folder (mode 0700, so only the job's
user reaches it) and names it in `TIDAL_CONTROL_SOCKET`. Each worker connects once and
says `hello`. Each message is a frozen dataclass below (`World`, `Stop`, `Hello`, ...),
written by `encode` and read by `decode`, the one codec, as one line:

launcher -> worker:
  {"op": "world", "generation": G, "rank": r, "world_size": n, "master_addr": h, "master_port": p,
   "joining": j, "target_step": t, "save": v, "at_step_boundary": b}
      the world of generation G. A running worker moves into it at the next step boundary
      its peers agree on (rank -1: leave after that step); an idle one joins it at once.
      With "at_step_boundary": false (a failure's next generation, sent at once) the
      generations before G are broken: a worker still in one abandons its step (its NCCL
      communicators are aborted from the channel's thread); missing reads as true.
      With "save": true (rank -1, the unit holds the job's last copy of the state), the
      worker writes its state to disk before it leaves; the next world resumes from it.
      The world's state must be at step t (the job's committed step) or later: when no
      rank holds it, each loads its newest checkpoint, or they refuse to train.
  {"op": "stop", "generation": G}
      abandon the step in flight, leave generation G's process group, wait for the next world.
  {"op": "coming", "generation": G}
      a change to generation G is decided and its world follows (once its joiners are up):
      until a world of G or later arrives, the ranks also vote at the end of each step, so
      that the change takes effect after the step in which its world arrives.

worker -> launcher:
  {"op": "hello", "local_rank": l, "pid": p}
  {"op": "formed", "generation": G, "step": s, "digest": d} in generation G's world, state verified
  {"op": "first_step", "generation": G, "step": s}          first step of generation G committed
  {"op": "stopped", "generation": G, "step": s}             out of the process group, idle
  {"op": "left", "generation": G, "step": s, "saved_to": p} left the job after step s; exits 0
                                                            (p: where it saved the state, or "")
  {"op": "finished", "generation": G, "step": s}            committed the job's last step s;
                                                            sent before tearing down and before
                                                            the script's code after train()
  {"op": "resumed", "generation": G, "step": s, "target_step": t, "detail": d}
                                                            no rank held step t: resumed from a
                                                            checkpoint at step s (s..t-1 redone)
  {"op": "state_lost", "generation": G, "target_step": t, "detail": d}
                                                            no rank held step t and there is no
                                                            checkpoint: refuses to train, exits
  {"op": "beat", "step": s, "samples": n, "waiting": w}    every BEAT_INTERVAL_S from a thread
                                                            of its own: alive, samples trained
                                                            so far, and whether blocked in a
                                                            collective
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MAX_LINE = 64 * 1024
BEAT_INTERVAL_S = 0.5
# A live worker that refuses to train because the job's state is lost (no rank holds the
# target step, no checkpoint) exits with this code, after saying `state_lost`; the
# controller fails the job on it, never the unit.
EXIT_STATE_LOST = 75


@dataclasses.dataclass(frozen=True)
class World:
    """One generation's world as a worker sees it."""

    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    # Joining a running world (its state comes from the members), as opposed to a world
    # formed afresh (a replica without state loads the newest checkpoint first).
    joining: bool = False
    # The job's committed step (its progress watermark) when the generation was decided.
    target_step: int = 0
    # Leaving (rank -1) as the last holder of the job's state: write it to disk first.
    save: bool = False
    # The world before it is healthy and changes after a step the ranks agree on. False:
    # it broke (a failure; the controller sent this generation at once), and a worker still
    # in it abandons the step in flight.
    at_step_boundary: bool = True
    # Out of this world (rank -1) but not out of the job: its replica of several nodes lost
    # one (or left) and waits for a node to take its place. After the agreed step the
    # worker leaves the old world and waits for the next one, keeping its state.
    set_aside: bool = False

    @property
    def leaves(self) -> bool:
        return self.rank < 0 and not self.set_aside



@dataclasses.dataclass(frozen=True)
class Stop:
    """Abandon the step in flight, leave that generation's group, wait for the next."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Coming:
    """A change to `generation` is decided; its world follows once its joiners are up."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Hello:
    local_rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class Formed:
    """In that generation's world at `step`, its state verified (`digest`). `replica_workers`:
    the workers one replica of the model spans (DataParallel 1, HybridSharded its shard
    group's size; 0: not said)."""

    generation: int
    step: int
    digest: str = ""
    replica_workers: int = 0


@dataclasses.dataclass(frozen=True)
class FirstStep:
    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Stopped:
    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Left:
    generation: int
    step: int
    # Where this worker wrote the state before leaving (its shard of it), or "".
    saved_to: str = ""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Committed the job's last step `step`: training is over for this worker."""

    generation: int
    step: int


@dataclasses.dataclass(frozen=True)
class Resumed:
    """No rank held `target_step`; resumed from a checkpoint at `step`."""

    generation: int
    step: int
    target_step: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class StateLost:
    """No rank held `target_step` and there was no checkpoint: refuses to train."""

    generation: int
    target_step: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Beat:
    """Alive; samples trained so far; whether blocked in a collective; the loss of the
    last committed step (None before the first); and this rank's own compute in generation
    `compute_generation` so far: seconds in its forward and backward passes (before it
    waits for its peers) over `compute_samples` samples in `compute_steps` steps, its first
    step in the generation left out (straggler detection, `tidal.controller.core.stragglers`)."""

    step: int
    samples: int = 0
    waiting: bool = False
    loss: float | None = None
    compute_generation: int = 0
    compute_seconds: float = 0.0
    compute_samples: int = 0
    compute_steps: int = 0


LauncherToWorker = World | Stop | Coming
WorkerToLauncher = Hello | Formed | FirstStep | Stopped | Left | Finished | Resumed | StateLost | Beat
Message = LauncherToWorker | WorkerToLauncher

# The one codec: each message type and its "op" on the wire.
_OPS: dict[str, type[Any]] = {"world": World, "stop": Stop, "coming": Coming, "hello": Hello, "formed": Formed,
                              "first_step": FirstStep, "stopped": Stopped, "left": Left, "finished": Finished,
                              "resumed": Resumed, "state_lost": StateLost, "beat": Beat}
_OP_OF = {kind: op for op, kind in _OPS.items()}
# Field types, for checking what a peer sent (annotations are strings under `annotations`).
_TYPES: dict[str, type[Any]] = {"int": int, "str": str, "bool": bool, "float": float}
# (type, whether None is allowed), by field, by message kind.
_FIELD_TYPES = {kind: {f.name: (_TYPES[str(f.type).removesuffix(" | None")], str(f.type).endswith(" | None"))
                       for f in dataclasses.fields(kind)}
                for kind in _OPS.values()}
MAX_DETAIL = 2000


def encode(message: Message) -> bytes:
    """One JSON line: {"op": ..., **fields}."""
    body = dataclasses.asdict(message)
    return (json.dumps({"op": _OP_OF[type(message)], **body}) + "\n").encode()


def decode(line: bytes) -> Message | None:
    """The message on one line, or None (logged) for a line that is not one (not JSON, an
    unknown op, a field missing or of the wrong type): garbage never ends a channel.
    Unknown fields are ignored, so a newer peer's additions do not break an older one."""
    try:
        raw = json.loads(line)
        kind = _OPS[raw["op"]]
        fields: dict[str, Any] = {}
        for name, (expected, optional) in _FIELD_TYPES[kind].items():
            if name not in raw:
                continue
            value = raw[name]
            if value is None and optional:
                fields[name] = None
                continue
            if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} is not an integer")
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if expected is float and isinstance(value, float) and not math.isfinite(value):
                # (A beat is liveness: a loss that is not a number is dropped, not the beat.)
                if not optional:
                    raise ValueError(f"{name} is not a finite number")
                fields[name] = None
                continue
            if not isinstance(value, expected):
                raise TypeError(f"{name} is not a {expected.__name__}")
            fields[name] = value[:MAX_DETAIL] if isinstance(value, str) else value
        message: Message = kind(**fields)
        return message
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as error:
        # (RecursionError: JSON nested deeper than the parser goes.)
        import structlog  # (here, not at the top: the controller's pure core imports this module)

        structlog.get_logger("tidal.proto.control").warning("control_message_garbled", line=line[:200],
                                                            error=str(error))
        return None
