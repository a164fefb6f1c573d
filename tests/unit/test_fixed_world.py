"""Scripts that train through `Elastic` in a fixed world of real processes, as torchrun runs
them: every rank a process of its own, meeting at an agent store this test serves on
127.0.0.1 (TORCHELASTIC_USE_AGENT_STORE, torchrun's), over gloo."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from tests.unit.test_elastic_library import _train

SCRIPT = """
import json, sys, time
import torch
from torch.utils.data import TensorDataset
from tidal.train import Elastic

calls, out = [int(n) for n in sys.argv[1].split(",")], sys.argv[2]
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
inputs = torch.randn(50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1], reduction="sum")


job = Elastic(model, optimizer, dataset, loss_fn=loss_fn, global_batch=12, micro_batch=4, seed=5, timeout_s=10)
steps = []
for call in calls:
    steps.append([result.step for result in job.train(call)])
    if job.rank == 0:
        time.sleep(0.2)  # rank 0 evaluates the model, or saves it, between the calls
with open(out, "w") as handle:
    json.dump({"steps": steps, "parameters": [p.detach().flatten().tolist() for p in model.parameters()]}, handle)
"""


def run_fixed_world(tmp_path: Path, world_size: int, calls: str) -> list[dict]:
    """Run SCRIPT (train(n) for each n of `calls`) in `world_size` processes; each rank's output."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    workers = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        workers.append(subprocess.Popen([sys.executable, "-c", SCRIPT, calls, str(tmp_path / f"rank-{rank}.json")],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for worker in workers:
            output, _ = worker.communicate(timeout=60)
            outputs.append(output)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    codes = [worker.returncode for worker in workers]
    assert codes == [0] * world_size, "\n".join(f"rank {r} ({c}): {o[-2000:]}" for r, (c, o) in
                                                enumerate(zip(codes, outputs, strict=True)))
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world_size)]


def test_a_script_that_calls_train_again_meets_its_peers_again_and_computes_what_one_call_does(
        tmp_path: Path) -> None:
    """`train(1)`, rank 0 evaluating the model, `train(2)`, and so on. Each call's world met
    under the store keys of the first's, so a rank there first could read its peer's previous
    (closed) address: "Gloo connectFullMesh failed ... Connection refused", and the peer then
    waited for it until its timeout (seen on most runs of these four calls)."""
    once = _train(4)
    for rank in run_fixed_world(tmp_path, 2, "1,2,3,4"):
        assert rank["steps"] == [[1], [2], [3], [4]]
        for got, expected in zip(rank["parameters"], once.parts.model.parameters(), strict=True):
            assert max(abs(x - y) for x, y in zip(got, expected.detach().flatten().tolist(), strict=True)) < 1e-12
