"""One process of tests/unit/test_shard_group.py: a shard rank of a replica of two whose
FSDP2 group is a `ShardGroup`. Roles: `first` (rank 0, for the whole run), `lost` (rank 1,
trains 3 steps, writes its shard and exits as a lost node would), `replacement` (a new
process that takes rank 1's place with the lost shard). Prints the largest relative
difference from a one-process run."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from tidal.train import shard_group

STEPS = 6
LOST_AFTER = 3


def model_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=generator, dtype=torch.float64),
                torch.randn(4, 4, generator=generator, dtype=torch.float64)) for _ in range(STEPS)]
    return model, batches


def one_process() -> dict[str, torch.Tensor]:
    model, batches = model_and_batches()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, targets in batches:
        optimizer.zero_grad()
        ((model(inputs) - targets) ** 2).sum().backward()
        optimizer.step()
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def main(role: str, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = 0 if role == "first" else 1
    group = shard_group.install(rank, 2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    assert mesh.get_group() is group
    model, batches = model_and_batches()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    store = dist.TCPStore("127.0.0.1", port, is_master=role == "first", wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    timeout = datetime.timedelta(seconds=60)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        optimizer.zero_grad()
        ((model(inputs.chunk(2)[rank]) - targets.chunk(2)[rank]) ** 2).sum().backward()
        optimizer.step()

    if role == "replacement":
        saved = torch.load(f"{folder}/lost.pt", weights_only=False)
        for name, tensor in model.state_dict().items():
            tensor.to_local().copy_(saved["model"][name])
        optimizer.load_state_dict(saved["optimizer"])
        start = LOST_AFTER
        group.connect("gloo", dist.PrefixStore("gen/2", store), generation=2, connect_timeout=timeout, timeout=timeout)
    else:
        start = 0
        group.connect("gloo", dist.PrefixStore("gen/1", store), generation=1, connect_timeout=timeout, timeout=timeout)
    for index in range(start, STEPS):
        if index == LOST_AFTER and role == "lost":
            shards = {name: tensor.to_local().clone() for name, tensor in model.state_dict().items()}
            torch.save({"model": shards, "optimizer": optimizer.state_dict()}, f"{folder}/lost.pt")
            return
        if index == LOST_AFTER and role == "first":
            # The peer is gone: this generation broke; the next one connects the replacement.
            group.disconnect(broken=True)
            try:
                step(*batches[index])
            except shard_group.NotConnected:
                print("not connected between generations", flush=True)
            group.connect("gloo", dist.PrefixStore("gen/2", store), generation=2, connect_timeout=timeout,
                          timeout=timeout)
        step(*batches[index])
    full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if rank == 0:
        reference = one_process()
        worst = max(float((full[name] - reference[name]).abs().max() / reference[name].abs().max())
                    for name in reference)
        print(f"max relative difference {worst:.3e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
