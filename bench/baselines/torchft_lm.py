"""The torchft baseline: the example language model of bench/baselines/ddp_lm.py, as a
torchft user writes it: one replica group per process (world size 1 in the group), a
`torchft.Manager` that meets the others at a lighthouse, torchft's DDP wrapper (or its
pure-Python one, `--wrapper pure`) and optimizer wrapper, gloo (`torchft.ProcessGroupGloo`). Each replica group trains
`--global-batch / --replicas` samples a step (torchft keeps the per-replica batch: a
group lost makes the global batch smaller, unlike Tidal). Appends one JSON line per
step to --log-dir: step, time, whether it committed, the participants of its quorum.

Needs torchft (`pip install torchft==0.2.0`, which carries the `torchft_lighthouse`
binary); bench/recovery.py starts the lighthouse and the groups."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore

# Run as a script: its own folder (ddp_lm) is on the path; the example's too (for ddp_lm).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "live_mode"))
from ddp_lm import add_lm_options, build_lm, lm_loss, simulated_device  # type: ignore[import-not-found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
    parser.add_argument("--replicas", type=int, default=4, help="the job's replica groups when none is lost")
    parser.add_argument("--lighthouse", required=True, help="http://host:port")
    parser.add_argument("--store-port", type=int, required=True, help="this group's own TCPStore port")
    add_lm_options(parser)
    parser.add_argument("--timeout", type=float, default=60.0, help="torchft's collective timeout (s)")
    parser.add_argument("--wrapper", choices=("ddp", "pure"), default="ddp",
                        help="torchft's DistributedDataParallel (its recommended wrapper) or its "
                             "PureDistributedDataParallel (an all-reduce per gradient from a hook)")
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()

    # Imported here: the rest of bench/ (and the tests) run without torchft installed.
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.ddp import PureDistributedDataParallel

    dataset, model, inner, scheduler = build_lm(args)
    device = simulated_device(args)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": inner.state_dict(), "scheduler": scheduler.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    # The group's own store (world size 1: this process is its rank 0), on loopback.
    store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"bench_{args.replica}", lighthouse_addr=args.lighthouse,
                      store_addr="127.0.0.1", store_port=args.store_port, rank=0, world_size=1,
                      hostname="127.0.0.1", timeout=timeout)
    wrapped = DistributedDataParallel(manager, model) if args.wrapper == "ddp" else None
    ddp: torch.nn.Module = wrapped if wrapped is not None else PureDistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    share = args.global_batch // args.replicas
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"torchft-{args.replica}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    while manager.current_step() < args.steps:
        step = manager.current_step()
        start = (step * args.global_batch + args.replica * share) % len(order)
        indices = [int(order[(start + i) % len(order)]) for i in range(share)]
        chunks = [indices[i:i + args.micro_batch] for i in range(0, len(indices), args.micro_batch)]
        optimizer.zero_grad(set_to_none=True)  # starts the quorum (async)
        for number, chunk in enumerate(chunks):
            started = time.monotonic()
            batch = torch.stack([dataset[i] for i in chunk])
            last = number == len(chunks) - 1
            # (The pure wrapper all-reduces every micro-batch; the bench's share is one.)
            context = wrapped.no_sync() if not last and wrapped is not None else contextlib.nullcontext()
            with context:
                (lm_loss(ddp, batch, args.context) / share).backward()
            if device is not None:
                device.finish_micro_batch(len(chunk), started)
        if device is not None:
            device.reduce(max(1, manager.num_participants()))
        committed = manager.should_commit()
        if committed:
            inner.step()
            scheduler.step()
        log.write(json.dumps({"step": manager.current_step(), "time": time.time(), "replica": args.replica,
                              "committed": committed, "world_size": manager.num_participants(),
                              "cpu_s": time.process_time()}) + "\n")
    store.set("done", "1")


if __name__ == "__main__":
    main()
