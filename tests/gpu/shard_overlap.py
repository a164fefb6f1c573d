"""One process of tests/gpu/test_one_gpu.py: the collectives FSDP2 issues on a live worker's
shard group (a `ShardGroup` over NCCL, one rank, live mode's NCCL settings), called through
torch.distributed's API as FSDP2 calls them (async_op=False) and as a caller that waits on
the work (async_op=True, then wait()), and the commit vote's last all-reduce waited as
`tidal.train.groups.start_world_allreduce` returns it, while the GPU still has about 3 s of
earlier work.
Prints, as JSON, how long the host took to return from each.

    python tests/gpu/shard_overlap.py {shard|blocking} OUT.json

`shard`: the group as live mode makes it (`host_waits=False`); `blocking`: the same group
made with live mode's blocking waits, for contrast. NOT PART OF make test (needs a GPU)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tidal.train import backend as backends
from tidal.train import shard_group
from tidal.train.backend import NCCL, Mode, apply_environment, select_device, worker_device
from tidal.train.groups import HostWaited

BUSY_S = 3.0


def main(kind: str, out: Path) -> None:
    os.environ["LOCAL_RANK"] = "0"
    apply_environment(os.environ, Mode.LIVE)
    device = select_device(worker_device(os.environ, NCCL))
    if kind == "blocking":
        made = backends.new_group

        def blocking(*args: Any, host_waits: bool = True, **kwargs: Any) -> Any:
            return made(*args, host_waits=True, **kwargs)

        backends.new_group = blocking  # type: ignore[assignment]
    group = shard_group.install(0, 1)
    timeout = datetime.timedelta(seconds=60)
    group.connect(NCCL, dist.PrefixStore("generation/1", dist.HashStore()), generation=1, connect_timeout=timeout,
                  timeout=timeout)
    shard = torch.ones(1 << 20, device=device)
    full = torch.empty(1 << 20, device=device)
    vote = torch.ones(5, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(full, shard)  # the communicator connects
    torch.cuda.synchronize(device)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    torch.cuda.synchronize(device)
    cycles_per_s = 200_000_000 / (start.elapsed_time(end) / 1000)

    def host_seconds(issue: Callable[[], Any]) -> float:
        """How long the host takes to return from `issue()` while the GPU still has BUSY_S of work."""
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(BUSY_S * cycles_per_s))
        began = time.monotonic()
        issue()
        seconds = time.monotonic() - began
        torch.cuda.synchronize(device)
        return seconds

    def waited(work: Any) -> None:
        work.wait()

    timings = {
        # As FSDP2 issues them (async_op=False).
        "all_gather_s": host_seconds(lambda: dist.all_gather_into_tensor(full, shard)),
        "reduce_scatter_s": host_seconds(lambda: dist.reduce_scatter_tensor(shard, full)),
        # As a caller that waits on the work (async_op=True, then wait()).
        "all_gather_wait_s": host_seconds(lambda: waited(dist.all_gather_into_tensor(full, shard, async_op=True))),
        "reduce_scatter_wait_s": host_seconds(lambda: waited(dist.reduce_scatter_tensor(shard, full, async_op=True))),
        # The commit vote's last level under HybridSharded: an all-reduce on the shard group
        # waited as `start_world_allreduce` returns it (HostWaited: the stream synchronized).
        "vote_wait_s": host_seconds(lambda: waited(HostWaited(group.allreduce([vote]), vote))),
    }
    out.write_text(json.dumps({"kind": kind, "busy_s": BUSY_S, **timings}))
    group.disconnect(broken=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
