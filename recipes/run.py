"""The recipe runner: what every worker of a recipe job runs.

    python -m tidal.recipes.run --config JSON      (what tidal submit --recipe runs)
    python -m tidal.recipes.run --recipe NAME [--set key=value ...]   (by hand; alone it is
                                                   the fixed single-process run)

It builds the model from its transformers config (random init from the recipe's seed, the
same in every worker, or `model.weights` from a local folder), shards each decoder layer and
the model with `HybridSharded` over the unit's workers, and trains it with `Elastic` on packed
sequences of the token file: a fixed global batch of `train.global_batch_tokens` tokens,
AdamW with linear warmup and a cosine decay to `optimizer.min_lr_ratio`, the gradient clipped
to `optimizer.max_grad_norm`. Under a Tidal launcher it is a live job; alone (or under
torchrun) it trains in a fixed world, which is the reference an elastic run must match.

The step's loss is the mean over its tokens. World rank 0 prints a line every
`train.log_every` steps and at the end writes `output.dir` (the full weights as
`model.safetensors` with `config.json`, and `summary.json`: steps, tokens, final loss)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from tidal.recipes import catalog
from tidal.recipes.tokens import PackedSequences, TokenFileError
from tidal.train import Elastic, HybridSharded, simulated
from tidal.train.backend import select_device, worker_device


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The learning rate of step `step` (0-based) over the peak: linear warmup over
    `warmup_steps` steps, then a cosine from 1 down to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def torch_dtype(name: str) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def build_model(recipe: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of the recipe, on the CPU, in `dtype` (float32 under bfloat16: the
    master weights; FSDP2 computes in bfloat16)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise SystemExit("recipes need transformers on every node: pip install 'tidal-elastic[recipes]'") from None
    model_section = recipe["model"]
    options: dict[str, Any] = {}
    if model_section.get("attn_implementation"):
        options["attn_implementation"] = model_section["attn_implementation"]
    if model_section.get("weights"):
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            model_section["weights"], local_files_only=True, dtype=dtype, **options)
    else:
        config = AutoConfig.for_model(model_section["type"], **catalog.model_config(recipe))
        torch.manual_seed(int(recipe["train"]["seed"]))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **options)
    if model_section.get("experts_implementation"):
        # transformers reads it from the config at each forward pass of the experts.
        config = getattr(model, "config")  # noqa: B009
        config._experts_implementation = model_section["experts_implementation"]
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 wraps one by one (transformers' decoder models keep them
    at model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise SystemExit(f"{type(model).__name__}: no model.layers to shard (not a transformers decoder model?)")
    return list(layers)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups: weight decay on matrices (and the stacked experts), none on norms,
    biases and other vectors."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def make_loss(sequence_length: int, aux_coefficient: float) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        batch = batch.to(device)
        output = model(input_ids=batch[:, :-1])
        logits = output.logits
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        # The sum over the batch's sequences of each one's mean token loss: Elastic divides
        # by the global batch, so the step's loss is the mean over its tokens.
        loss = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                        reduction="sum") / sequence_length
        aux = getattr(output, "aux_loss", None)
        if aux is not None and aux_coefficient:
            # The router's load-balancing loss is a statistic of the micro-batch, not a sum
            # over samples: with it a run is not the same at every world size.
            loss = loss + aux_coefficient * aux.to(loss.dtype) * batch.shape[0]
        return loss

    return loss_fn


def save_output(model: torch.nn.Module, folder: Path, summary: dict[str, Any], rank: int) -> None:
    """Every worker of the unit gathers the full tensors (FSDP2's collectives); world rank
    0 writes them."""
    full = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().contiguous()
            for name, value in model.state_dict().items()}
    if rank != 0:
        return
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(str(folder))
    save_file(full, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def train(recipe: dict[str, Any]) -> dict[str, Any]:
    train_section, optimizer_section, output = recipe["train"], recipe["optimizer"], recipe["output"]
    dtype_name = train_section["dtype"]
    master = torch.float32 if dtype_name == "bfloat16" else torch_dtype(dtype_name)
    length = int(recipe["data"]["sequence_length"])
    try:
        dataset = PackedSequences(recipe["data"]["tokens"], length)
    except TokenFileError as error:
        raise SystemExit(f"recipe {recipe['name']}: {error}") from None
    model = build_model(recipe, master)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and dataset.header.vocab_size > vocab:
        raise SystemExit(f"recipe {recipe['name']}: the token file's vocabulary ({dataset.header.vocab_size}) "
                         f"is larger than the model's ({vocab})")
    if torch.cuda.is_available():
        # This worker's GPU (LOCAL_RANK's among those it sees), made current first.
        model = model.to(select_device(worker_device(os.environ, "nccl")))
    strategy = HybridSharded(param_dtype=torch.bfloat16 if dtype_name == "bfloat16" else None)
    model = strategy.shard(model, modules=decoder_layers(model))
    steps = int(train_section["steps"])
    optimizer = torch.optim.AdamW(parameter_groups(model, float(optimizer_section["weight_decay"])),
                                  lr=float(optimizer_section["lr"]), betas=tuple(optimizer_section["betas"]),
                                  eps=float(optimizer_section["eps"]))
    warmup, min_ratio = int(optimizer_section["warmup_steps"]), float(optimizer_section["min_lr_ratio"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps=warmup, total_steps=steps, min_ratio=min_ratio))
    clip = optimizer_section.get("max_grad_norm")
    aux = float((recipe["model"].get("config") or {}).get("router_aux_loss_coef", 0.0) or 0.0)
    batch = catalog.global_batch(recipe)
    simulation = None
    if train_section.get("simulate"):
        wanted = train_section["simulate"]
        if wanted["accelerator"] not in simulated.ACCELERATORS:
            raise SystemExit(f"train.simulate.accelerator: {wanted['accelerator']!r} is not one of "
                             f"{', '.join(sorted(simulated.ACCELERATORS))}")
        simulation = simulated.Simulation(
            accelerator=simulated.ACCELERATORS[wanted["accelerator"]], parameters=float(wanted.get("parameters", 1e9)),
            tokens_per_sample=length, mfu=float(wanted.get("mfu", simulated.DEFAULT_MFU)))
    job = Elastic(model, optimizer, dataset, loss_fn=make_loss(length, aux), global_batch=batch,
                  micro_batch=int(train_section["micro_batch_sequences"]), lr_scheduler=scheduler,
                  seed=int(train_section["seed"]), strategy=strategy,
                  max_grad_norm=float(clip) if clip is not None else None,
                  checkpoint_dir=output.get("checkpoint_dir"),
                  checkpoint_every=int(output.get("checkpoint_every") or 0),
                  ledger_dir=output.get("ledger_dir"), simulation=simulation)
    log_every = int(train_section["log_every"])
    tokens_per_step = batch * length
    started = time.monotonic()
    last_loss = float("nan")
    for result in job.train(steps):
        last_loss = result.loss
        if result.rank == 0 and (result.step % log_every == 0 or result.step == steps):
            norm = f" grad_norm {result.grad_norm:.3f}" if result.grad_norm is not None else ""
            print(f"step {result.step}/{steps} loss {result.loss:.4f}{norm} lr {scheduler.get_last_lr()[0]:.3e} "
                  f"tokens {result.step * tokens_per_step} world {result.world_size} "
                  f"tokens/s {tokens_per_step / max(result.seconds, 1e-9):.0f}", flush=True)
    summary = {"recipe": recipe["name"], "model_type": recipe["model"]["type"], "size": recipe["model"].get("size"),
               "steps": job.step, "sequences": job.step * batch, "tokens": job.step * tokens_per_step,
               "global_batch_tokens": tokens_per_step, "final_loss": last_loss, "dtype": dtype_name,
               "seconds": round(time.monotonic() - started, 3)}
    if output.get("dir"):
        save_output(model, Path(output["dir"]), summary, job.rank)
    if job.rank == 0:
        print(f"recipe {recipe['name']}: {summary['steps']} steps, {summary['tokens']} tokens, "
              f"final loss {last_loss:.4f}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="the resolved recipe as JSON (what tidal submit --recipe passes)")
    source.add_argument("--recipe", help="a recipe's name or YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe: overrides")
    args = parser.parse_args(argv)
    try:
        if args.config is not None:
            recipe = json.loads(args.config)
            problems = catalog.check(recipe)
            if problems:
                raise catalog.RecipeError("; ".join(problems))
        else:
            recipe = catalog.resolve(args.recipe, args.set)
    except (catalog.RecipeError, ValueError) as error:
        print(f"tidal.recipes.run: {error}", file=sys.stderr)
        return 2
    train(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
