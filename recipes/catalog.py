"""Recipes: YAML files that train a public model in live mode with no code of the user's.

A recipe names a Hugging Face `transformers` model type, its sizes (a tiny one for a CPU,
the published ones), the data (a token file), the optimizer and schedule, and defaults for
the job's shape. `tidal recipes` lists them; `tidal submit --recipe NAME --set key=value`
resolves one here (on the submitting host: files are checked, paths made absolute), and
submits `python -m tidal.recipes.run --config JSON` with the resolved recipe, so every
worker trains exactly what was submitted.

Nothing here imports torch or transformers: the CLI resolves recipes without them."""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tidal.recipes.tokens import TokenFileError, read_header

# The recipes shipped with Tidal (this package's folder); $TIDAL_RECIPES_PATH adds folders
# (':'-separated) searched first.
BUILTIN_FOLDER = Path(__file__).parent
DTYPES = ("bfloat16", "float32", "float64")
# Keys of these sections take any name (a transformers config field, a size's fields).
FREE_SECTIONS = ("model.config", "model.sizes", "train.simulate")
SIMULATE_KEYS = ("accelerator", "parameters", "mfu")


class RecipeError(ValueError):
    """A recipe is missing, malformed, or an override does not fit it; the message says which."""


def search_folders(env: Mapping[str, str] = os.environ) -> list[Path]:
    extra = [Path(p) for p in env.get("TIDAL_RECIPES_PATH", "").split(":") if p]
    return [*extra, BUILTIN_FOLDER]


def available(env: Mapping[str, str] = os.environ) -> dict[str, Path]:
    """Recipe name → its file, the first found along the search folders."""
    found: dict[str, Path] = {}
    for folder in search_folders(env):
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def load(name_or_path: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The recipe named `name_or_path` (or the YAML file at that path), as written."""
    recipes = available(env)
    path = Path(name_or_path)
    if name_or_path in recipes:
        path = recipes[name_or_path]
    elif not (path.suffix in (".yaml", ".yml") and path.is_file()):
        known = ", ".join(sorted(recipes)) or "none"
        raise RecipeError(f"no recipe {name_or_path!r} (recipes: {known}; or give a .yaml file's path)")
    try:
        recipe = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise RecipeError(f"{path}: {error}") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping")
    recipe.setdefault("name", path.stem)
    recipe["source"] = str(path.absolute())
    return recipe


def parse_value(text: str) -> Any:
    """A `--set` value as YAML reads it (numbers, true/false, null, [lists], {maps}), with
    exponent floats such as 3e-4 (which YAML 1.1 leaves a string) read as numbers."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_override(recipe: dict[str, Any], assignment: str) -> None:
    """Apply `key.path=value` to `recipe` in place. The key must be one the recipe has,
    except below model.config and model.sizes; the value must have the type of the one it
    replaces (a whole number where a float stood is taken as a float)."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set {assignment!r}: not KEY=VALUE (say --set train.steps=500)")
    value = parse_value(text)
    parts = key.split(".")
    node: Any = recipe
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[:depth + 1])
        if not isinstance(node, dict) or part not in node:
            if isinstance(node, dict) and _free(".".join(parts[:depth])):
                node = node.setdefault(part, {})
                continue
            raise RecipeError(f"--set {key}: the recipe has no {here!r}{_choices(node)}")
        if node[part] is None and _free(here):
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if not isinstance(node, dict):
        raise RecipeError(f"--set {key}: {'.'.join(parts[:-1])!r} is not a section")
    if last not in node:
        if not _free(".".join(parts[:-1])):
            raise RecipeError(f"--set {key}: the recipe has no {key!r}{_choices(node)}")
        node[last] = value
        return
    node[last] = _typed(key, node[last], value)


def _free(section: str) -> bool:
    return any(section == free or section.startswith(free + ".") for free in FREE_SECTIONS)


def _choices(node: Any) -> str:
    if isinstance(node, dict) and node:
        return f" (it has: {', '.join(sorted(str(k) for k in node))})"
    return ""


def _typed(key: str, old: Any, new: Any) -> Any:
    if old is None or new is None:
        return new
    if isinstance(old, bool) or isinstance(new, bool):
        if isinstance(old, bool) and isinstance(new, bool):
            return new
        raise RecipeError(f"--set {key}: {new!r} is not true or false")
    if isinstance(old, float) and isinstance(new, int):
        return float(new)
    if isinstance(old, int) and isinstance(new, float) and new.is_integer():
        return int(new)
    if type(old) is not type(new):
        raise RecipeError(f"--set {key}: {new!r} is not of the type of the recipe's value ({type(old).__name__}: "
                          f"{old!r})")
    return new


def resolve(name_or_path: str, overrides: Sequence[str] = (), *, cwd: Path | None = None,
            env: Mapping[str, str] = os.environ, checked: bool = True) -> dict[str, Any]:
    """The recipe with `overrides` applied, paths absolute (relative to `cwd`) and, when
    `checked`, checked (files included): RecipeError names every problem."""
    recipe = copy.deepcopy(load(name_or_path, env))
    for assignment in overrides:
        apply_override(recipe, assignment)
    base = cwd or Path.cwd()
    for section, key in (("data", "tokens"), ("model", "weights"), ("output", "dir"), ("output", "checkpoint_dir"),
                         ("output", "ledger_dir")):
        value = (recipe.get(section) or {}).get(key)
        if isinstance(value, str) and value:
            recipe[section][key] = str((base / Path(value).expanduser()).absolute())
    problems = check(recipe) if checked else []
    if problems:
        raise RecipeError(f"recipe {recipe.get('name')}: " + "; ".join(problems))
    return recipe


def model_config(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers config fields: the chosen size's, then model.config over them."""
    model = recipe["model"]
    sizes = model.get("sizes") or {}
    fields = dict(sizes.get(model.get("size"), {}) or {})
    fields.update(model.get("config") or {})
    return fields


def global_batch(recipe: Mapping[str, Any]) -> int:
    """Sequences a step trains on: the global batch in tokens over the sequence length."""
    return int(recipe["train"]["global_batch_tokens"]) // int(recipe["data"]["sequence_length"])


def check(recipe: Mapping[str, Any]) -> list[str]:
    """Every problem of a resolved recipe, as sentences (empty: it can run)."""
    problems: list[str] = []
    sections = ("model", "data", "train", "optimizer", "job", "output")
    for section in sections:
        if not isinstance(recipe.get(section), dict):
            problems.append(f"no {section!r} section")
    if problems:
        return problems
    model, data, train, optimizer = recipe["model"], recipe["data"], recipe["train"], recipe["optimizer"]
    if not isinstance(model.get("type"), str) or not model["type"]:
        problems.append("model.type: a transformers model type (llama, gpt_oss, ...)")
    if not model.get("weights") and model.get("size") not in (model.get("sizes") or {}):
        problems.append(f"model.size: {model.get('size')!r} is not one of {sorted(model.get('sizes') or {})}")
    fields = model_config(recipe)

    def positive_int(where: str, value: Any) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{where}: must be a positive whole number, got {value!r}")
            return None
        return value

    length = positive_int("data.sequence_length", data.get("sequence_length"))
    tokens = positive_int("train.global_batch_tokens", train.get("global_batch_tokens"))
    positive_int("train.steps", train.get("steps"))
    positive_int("train.micro_batch_sequences", train.get("micro_batch_sequences"))
    positive_int("train.log_every", train.get("log_every"))
    if length and tokens and tokens % length:
        problems.append(f"train.global_batch_tokens: {tokens} is not a multiple of data.sequence_length {length}")
    if length and isinstance(fields.get("max_position_embeddings"), int) and length > fields["max_position_embeddings"]:
        problems.append(f"data.sequence_length: {length} is past the model's max_position_embeddings "
                        f"{fields['max_position_embeddings']}")
    if train.get("dtype") not in DTYPES:
        problems.append(f"train.dtype: {train.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(train.get("seed"), int):
        problems.append(f"train.seed: a whole number, got {train.get('seed')!r}")
    lr = optimizer.get("lr")
    if not isinstance(lr, (int, float)) or not lr > 0 or not math.isfinite(lr):
        problems.append(f"optimizer.lr: must be positive, got {lr!r}")
    warmup = optimizer.get("warmup_steps")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        problems.append(f"optimizer.warmup_steps: a whole number ≥ 0, got {warmup!r}")
    ratio = optimizer.get("min_lr_ratio")
    if not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        problems.append(f"optimizer.min_lr_ratio: between 0 and 1, got {ratio!r}")
    clip = optimizer.get("max_grad_norm")
    if clip is not None and (not isinstance(clip, (int, float)) or not clip > 0):
        problems.append(f"optimizer.max_grad_norm: positive or null, got {clip!r}")
    betas = optimizer.get("betas")
    if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1
                                                                for b in betas)):
        problems.append(f"optimizer.betas: two numbers in [0, 1), got {betas!r}")
    for key in ("eps", "weight_decay"):
        if not isinstance(optimizer.get(key), (int, float)) or optimizer[key] < 0:
            problems.append(f"optimizer.{key}: a number ≥ 0, got {optimizer.get(key)!r}")
    simulate = train.get("simulate")
    if simulate is not None:
        if not isinstance(simulate, dict) or not isinstance(simulate.get("accelerator"), str):
            problems.append(f"train.simulate: null, or {{accelerator: h100, parameters: 8.0e9, mfu: 0.4}}; got "
                            f"{simulate!r}")
        else:
            unknown = sorted(set(simulate) - set(SIMULATE_KEYS))
            if unknown:
                problems.append(f"train.simulate: {', '.join(unknown)} not among {', '.join(SIMULATE_KEYS)}")
    every = recipe["output"].get("checkpoint_every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        problems.append(f"output.checkpoint_every: a whole number ≥ 0, got {every!r}")
    if not data.get("tokens"):
        problems.append("data.tokens: give the token file (tidal data tokenize TEXT -o FILE; "
                        "then --set data.tokens=FILE)")
    else:
        problems += _check_tokens(str(data["tokens"]), fields, length)
    weights = model.get("weights")
    if weights and not Path(weights).is_dir():
        problems.append(f"model.weights: {weights} is not a folder (a model saved with save_pretrained; "
                        "weights are never downloaded)")
    return problems


def _check_tokens(path: str, fields: Mapping[str, Any], length: int | None) -> list[str]:
    try:
        header = read_header(path)
    except TokenFileError as error:
        return [f"data.tokens: {error}"]
    problems = []
    model_vocab = fields.get("vocab_size")
    if isinstance(model_vocab, int) and header.vocab_size > model_vocab:
        problems.append(f"data.tokens: its vocabulary ({header.vocab_size}) is larger than the model's vocab_size "
                        f"({model_vocab}): --set model.config.vocab_size={header.vocab_size}")
    if length and header.tokens - 1 < length:
        problems.append(f"data.tokens: {header.tokens} tokens hold no sequence of {length} + 1")
    return problems


def job_defaults(recipe: Mapping[str, Any]) -> dict[str, int]:
    """The recipe's job section: tidal submit's options it sets (the command line wins)."""
    job = recipe.get("job") or {}
    allowed = ("min_replicas", "max_replicas", "procs_per_node", "nodes_per_replica")
    unknown = sorted(set(job) - set(allowed))
    if unknown:
        raise RecipeError(f"job: {', '.join(unknown)} not among {', '.join(allowed)}")
    return {key: int(job[key]) for key in allowed if job.get(key) is not None}


def command(recipe: Mapping[str, Any], python: str) -> list[str]:
    """The workers' command: the recipe runner with the resolved recipe."""
    return [python, "-m", "tidal.recipes.run", "--config", json.dumps(recipe, separators=(",", ":"))]


def summary_rows(recipes: Iterable[tuple[str, Path]]) -> list[list[str]]:
    """`tidal recipes`' table: name, model type, sizes (the default first), description."""
    rows = []
    for name, path in recipes:
        try:
            recipe = load(str(path))
        except RecipeError as error:
            rows.append([name, "?", "?", f"unreadable: {error}"])
            continue
        model = recipe.get("model") or {}
        sizes = list(model.get("sizes") or {})
        default = model.get("size")
        ordered = [default, *(s for s in sizes if s != default)] if default in sizes else sizes
        rows.append([name, str(model.get("type", "?")), ", ".join(str(s) for s in ordered),
                     str(recipe.get("description", ""))])
    return rows
