"""One end of a state transfer over NCCL, for tests/gpu/test_one_gpu.py: rank 0 (GPU 0)
trains a few steps and sends its state, rank 1 (GPU 1) receives it into a fresh model and
optimizer. Each writes its device, role, bytes and digest (rank 1 also the digest of a CPU
copy of what it received) as JSON to the path it is given.

    python tests/gpu/transfer_pair.py RANK STORE_PORT OUT.json

The group is made as a live-mode generation's: `tidal.train.backend.new_group` under the
live NCCL environment (blocking waits). NOT RUN ON A GPU YET (needs two)."""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.train.backend import NCCL, Mode, apply_environment, close_groups, new_group, select_device, worker_device
from tidal.train.state import Counters, TrainingParts, capture, digest
from tidal.train.transfer import receive_state, send_state


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    os.environ["LOCAL_RANK"] = str(rank)
    apply_environment(os.environ, Mode.LIVE)
    device = select_device(worker_device(os.environ, NCCL))
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    group = new_group(NCCL, dist.PrefixStore("transfer", store), rank, 2, timeout)
    torch.manual_seed(rank)  # the receiver starts from other weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)).double().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    parts = TrainingParts(model=model, optimizer=optimizer)
    counters = Counters()
    if rank == 0:
        for _ in range(3):
            model(torch.randn(4, 16, dtype=torch.float64, device=device)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        counters.step = 3
        # Small buckets: large tensors travel in slices, small ones through the staging buffer.
        stats = send_state(group, parts, counters, me=0, sources=[0], receivers=[1], bucket_bytes=4096)
    else:
        stats = receive_state(group, parts, counters, me=1, sources=[0], bucket_bytes=4096)
    result = {"device": str(device), "role": "source" if rank == 0 else "receiver", "bytes": stats.bytes,
              "digest": digest(capture(parts, counters))}
    if rank == 1:
        cpu_model = copy.deepcopy(model).cpu()
        cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=0.01)
        cpu_optimizer.load_state_dict(optimizer.state_dict())
        result["cpu_digest"] = digest(capture(TrainingParts(model=cpu_model, optimizer=cpu_optimizer), counters))
    out.write_text(json.dumps(result))
    close_groups([group], broken=False)


if __name__ == "__main__":
    main()
