"""The baseline: the example language model in a plain torch.distributed script, as a
user would write it without Tidal: DDP, gradient accumulation with no_sync, a fixed global
batch split over the ranks, the example's learning-rate schedule, and (optionally) a
checkpoint every N steps that a restarted run resumes from. Run it under torchrun; every
rank appends one JSON line per completed step to --log-dir (step, time, world size, the
torchrun restart count).

Used by bench/overhead.py (no checkpoint, fixed world) and bench/recovery.py (torchrun
--nnodes 3:4 --max-restarts, resuming from its own checkpoint)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from tidal.train import simulated

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "live_mode"))
from train_lm import CharWindows, TinyTransformer, generate_text, lr_schedule


def add_lm_options(parser: argparse.ArgumentParser) -> None:
    """The example language model's options, shared with torchft_lm.py."""
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--characters", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    simulated.add_arguments(parser)


def simulated_device(args: argparse.Namespace) -> simulated.SimulatedDevice | None:
    """The simulated accelerator the --simulate-* flags ask for (each micro-batch's device
    time and each step's all-reduce time slept, as the live-mode example does), or None."""
    simulation = simulated.from_arguments(args)
    return simulated.SimulatedDevice(simulation) if simulation is not None else None


def build_lm(args: argparse.Namespace) -> tuple[CharWindows, TinyTransformer, torch.optim.AdamW,
                                                torch.optim.lr_scheduler.LambdaLR]:
    """The dataset, model, optimizer and learning-rate schedule every baseline trains, seeded
    alike and as the example trains them (its schedule stepped after each optimizer step)."""
    torch.manual_seed(args.seed)
    dataset = CharWindows(generate_text(args.characters, args.seed), args.context)
    model = TinyTransformer(len(dataset.vocabulary), args.context, args.width, heads=4, layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return dataset, model, optimizer, lr_schedule(optimizer, args.steps)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, context: int) -> torch.Tensor:
    """The summed next-character loss of `batch`, per position of the context."""
    logits = model(batch[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                    reduction="sum") / context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_lm_options(parser)
    parser.add_argument("--checkpoint", default=None, help="save here every --checkpoint-every steps; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset, model, optimizer, scheduler = build_lm(args)
    device = simulated_device(args)
    step = 0
    if args.checkpoint and Path(args.checkpoint).exists():
        saved = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step = int(saved["step"])
    ddp = DistributedDataParallel(model)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"ddp-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    share = args.global_batch // world + (1 if rank < args.global_batch % world else 0)
    first = sum(args.global_batch // world + (1 if r < args.global_batch % world else 0) for r in range(rank))
    while step < args.steps:
        start = step * args.global_batch % len(order)
        indices = [int(order[(start + first + i) % len(order)]) for i in range(share)]
        chunks = [indices[i:i + args.micro_batch] for i in range(0, len(indices), args.micro_batch)]
        optimizer.zero_grad(set_to_none=True)
        for number, chunk in enumerate(chunks):
            started = time.monotonic()
            batch = torch.stack([dataset[i] for i in chunk])
            last = number == len(chunks) - 1
            context = ddp.no_sync() if not last else torch.enable_grad()
            with context:
                loss = lm_loss(ddp, batch, args.context)
                # DDP averages over ranks; scale so the result is the mean over the global batch.
                (loss * world / args.global_batch).backward()
            if device is not None:
                device.finish_micro_batch(len(chunk), started)
        if device is not None:
            device.reduce(world)
        optimizer.step()
        scheduler.step()
        step += 1
        log.write(json.dumps({"step": step, "time": time.time(), "rank": rank, "world_size": world,
                              "restart": restart, "cpu_s": time.process_time()}) + "\n")
        if args.checkpoint and rank == 0 and step % args.checkpoint_every == 0:
            temporary = Path(args.checkpoint + ".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step}, temporary)
            os.replace(temporary, args.checkpoint)
    # DDP holds the group in reference cycles: collect it before the destroy, or the gloo
    # group is freed during the interpreter's finalization, where a rank can abort.
    del ddp
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
