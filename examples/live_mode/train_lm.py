"""A small transformer language model on generated text, trained with Tidal's live
elasticity (`tidal.train`).

The text is made here from a tiny seeded grammar (nothing to download), cut into windows
of `--context` + 1 characters; a sample's loss is its mean next-character cross-entropy,
and the library keeps the global batch fixed, so the run computes the same thing at any
world size. Run it alone for a fixed world of one, under torchrun for a fixed world, or
submit it to Tidal in live mode to let it grow, shrink and survive failures in-process.

`--strategy dp` (the default) makes every worker a whole replica, its gradients reduced in
buckets during the backward pass; `--strategy hsdp` shards each replica with FSDP2 over the
workers of a unit (`tidal submit --procs-per-node 2 ...`) and replicates it across units.

`--simulate-accelerator h100` (with `--simulated-params`, `--simulated-tokens-per-sample`,
...) makes each worker also spend the time an H100 would take for a model of that size,
and each step's reduction the time of its all-reduce, in sleeps that use no CPU: N
replicas on a few cores then train N times as fast, as N nodes would
(`tidal.train.simulated` states the model)."""

from __future__ import annotations

import argparse
import math
import os
import random

import torch
from torch import nn
from torch.nn import functional

from tidal.train import DataParallel, Elastic, HybridSharded, Strategy, simulated
from tidal.train.backend import select_device, worker_device

SUBJECTS = ["the cat", "a dog", "the old fox", "my friend", "the small bird", "a tired horse", "the river"]
VERBS = ["sees", "follows", "jumps over", "likes", "waits for", "runs past", "sings to"]
OBJECTS = ["the moon", "a red ball", "the green hill", "an open door", "the quiet town", "a cold lake"]
ENDINGS = [".", " today.", " at night.", " again.", " slowly."]


def generate_text(characters: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences: list[str] = []
    length = 0
    while length < characters:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)} "
        sentences.append(sentence)
        length += len(sentence)
    return "".join(sentences)[:characters]


class CharWindows(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i: characters [i*context, i*context + context + 1) as vocabulary ids."""

    def __init__(self, text: str, context: int) -> None:
        self.vocabulary = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocabulary)}
        self.ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
        self.context = context

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.context

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.context
        return self.ids[start:start + self.context + 1]


class TinyTransformer(nn.Module):
    causal: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, vocabulary: int, context: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))


def lr_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup: int = 20) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup` steps, then a cosine decay to 0 at `steps`."""
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def sample(model: TinyTransformer, dataset: CharWindows, prompt: str, characters: int) -> str:
    model.eval()
    lookup = {c: i for i, c in enumerate(dataset.vocabulary)}
    tokens = [lookup[c] for c in prompt if c in lookup]
    device = next(model.parameters()).device
    for _ in range(characters):
        window = torch.tensor([tokens[-dataset.context:]], device=device)
        tokens.append(int(model(window)[0, -1].argmax()))
    return "".join(dataset.vocabulary[t] for t in tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--characters", type=int, default=200_000, help="size of the generated text")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip the gradients' global 2-norm to this (under hsdp, a collective of the unit)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--ledger-dir", default=None)
    parser.add_argument("--out", default=None, help="rank 0 saves the final parameters (full tensors) here")
    parser.add_argument("--strategy", choices=("dp", "hsdp"), default="dp",
                        help="dp: every worker a whole replica; hsdp: FSDP2 over a unit's workers")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="dp: gradient bucket size")
    parser.add_argument("--no-overlap", action="store_true", help="dp: reduce gradients after the backward pass")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: this worker's GPU (LOCAL_RANK's among those it sees), NCCL between workers")
    simulated.add_arguments(parser)
    args = parser.parse_args()
    simulation = simulated.from_arguments(args)

    # Chosen and made current before anything touches CUDA.
    device = select_device(worker_device(os.environ, "nccl")) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(args.seed)
    dataset = CharWindows(generate_text(args.characters, args.seed), args.context)
    model = TinyTransformer(len(dataset.vocabulary), args.context, args.width, heads=4, layers=args.layers)
    model = model.to(getattr(torch, args.dtype)).to(device)
    strategy: Strategy
    if args.strategy == "hsdp":
        # The change a script makes for HSDP: shard the blocks and the model before the optimizer.
        strategy = HybridSharded()
        model = strategy.shard(model, modules=list(model.blocks.layers),
                               backend="nccl" if device.type == "cuda" else "gloo")
    else:
        strategy = DataParallel(bucket_mb=args.bucket_mb, overlap=not args.no_overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = lr_schedule(optimizer, args.steps)

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        # Each sample's loss is its mean per-character loss; the batch's is their sum.
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                        reduction="sum") / args.context

    job = Elastic(model, optimizer, dataset, loss_fn=loss_fn, global_batch=args.global_batch,
                  micro_batch=args.micro_batch, lr_scheduler=scheduler, seed=args.seed,
                  checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                  ledger_dir=args.ledger_dir, strategy=strategy, simulation=simulation,
                  max_grad_norm=args.max_grad_norm)
    for result in job.train(args.steps):
        if result.rank == 0 and (result.step % args.log_every == 0 or result.step == args.steps):
            print(f"step {result.step} loss {result.loss:.4f} world {result.world_size} generation {result.generation} "
                  f"step_time {result.seconds * 1000:.0f} ms"
                  + (f" grad_norm {result.grad_norm:.4f}" if result.grad_norm is not None else ""), flush=True)
    sharded = args.strategy == "hsdp"
    # Under HSDP every worker of a unit takes part in a forward pass and in gathering the
    # full tensors (FSDP's collectives within the unit); rank 0 prints and writes.
    if job.rank == 0 or sharded:
        text = sample(model, dataset, "the cat ", 60)
        full = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).cpu()
                for name, value in model.state_dict().items()}
        if job.rank == 0:
            print("sample:", repr(text), flush=True)
            if args.out:
                torch.save({"model": full, "step": job.step}, args.out)


if __name__ == "__main__":
    main()
