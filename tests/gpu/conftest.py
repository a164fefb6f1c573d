"""The GPU tier: live mode on NCCL with CUDA tensors, one rank per GPU.

Every test here is marked `gpu(devices=N)` and needs N CUDA GPUs on this machine; with
fewer it does not run (tests/conftest.py says why). The units of a job all run on this
one machine, so each launcher is given its own GPUs in CUDA_VISIBLE_DEVICES, as Slurm
gives each node's job step its own: a worker then takes `cuda:LOCAL_RANK` among them
(`tidal.train.backend.worker_device`), and no two ranks of one NCCL communicator share a
GPU (which NCCL does not support).

Run on a machine of one GPU (an H100, torch 2.11) on 2026-11-26 and 2026-11-27: the one-GPU
tests ran there (tests/gpu/test_one_gpu.py says which passed); the tests of two or more GPUs
have not run anywhere. There the repository was installed from a wheel (`pip wheel .`) with
structlog, protobuf, grpcio and grpcio-health-checking carried as wheels. Without CUDA they import, collect and skip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from tests.integration.conftest import tidal_run  # noqa: F401  (the real-process harness, as a fixture here)


def gpus() -> list[int]:
    """The CUDA indices this test process sees (CUDA_VISIBLE_DEVICES applies)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def visible(*indices: int) -> dict[str, str]:
    """A launcher's environment giving its unit these GPUs (this process's indices), as Slurm's
    CUDA_VISIBLE_DEVICES for a node's job step."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [name.strip() for name in mask.split(",")] if mask else [str(i) for i in gpus()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(physical[i] for i in indices)}


def environment_alone() -> dict[str, str]:
    """This process's environment less what a launcher, torchrun or live mode sets (ranks,
    rendezvous, Tidal's variables, NCCL's settings): that of a process run alone."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("TIDAL_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "GROUP_", "TORCH_NCCL_"))}


def run_alone(command: list[str], gpu: int, timeout: float = 600) -> None:
    """`command` as a fixed world of one (no launcher, no torchrun) on GPU `gpu`: the reference."""
    subprocess.run(command, check=True, env={**environment_alone(), **visible(gpu)}, timeout=timeout,
                   stdout=subprocess.DEVNULL)


def assert_close_to(elastic: Path, fixed: Path, relative_to_scale: bool = False) -> None:
    """The parameters saved at `elastic` equal those at `fixed` (float64) to 1e-9."""
    got = torch.load(elastic, weights_only=True, map_location="cpu")["model"]
    for name, reference in torch.load(fixed, weights_only=True, map_location="cpu")["model"].items():
        scale = float(reference.abs().max()) if relative_to_scale else 1e-3
        torch.testing.assert_close(got[name], reference, rtol=1e-9, atol=1e-9 * scale, msg=name)
