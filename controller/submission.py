"""What `tidal submit` turns into a JobSpec: Tidal's own options, sbatch's options (kept
for every unit the job submits), and `#SBATCH` / `#TIDAL` lines of a batch script, so an
existing sbatch script becomes elastic by adding `#TIDAL --max-replicas 8`.

Precedence follows sbatch: the script's lines first, the command line over them. Options
sbatch does not know are not guessed at here: Slurm itself refuses them when a unit is
submitted; what Tidal cannot parse at all is a usage error naming the option."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tidal.proto import admin_pb2, common_pb2


class SubmitUsageError(ValueError):
    """The submit line (or a #TIDAL line) is malformed; the message names the option."""


# sbatch's short options that take a value (`-p debug` or `-pdebug`).
SBATCH_SHORT_WITH_VALUE = frozenset("AabcCdDeFGiJLMmnNopqStwx")
# sbatch's long options that take no value; every other long option takes one.
SBATCH_LONG_FLAGS = frozenset({
    "exclusive", "hold", "requeue", "no-requeue", "wait", "parsable", "test-only", "overcommit", "oversubscribe",
    "contiguous", "spread-job", "use-min-nodes", "ignore-pbs", "quiet", "verbose", "immediate", "no-kill",
    "get-user-env", "reboot", "kill-on-invalid-dep", "export-file",
})


@dataclasses.dataclass
class Submission:
    spec: admin_pb2.JobSpec
    # Where the options came from, for messages ("#TIDAL line 3", "command line").
    script: Path | None = None
    # What looks wrong but may be right on the nodes (a command not found here), for the
    # CLI to print: the job is submitted all the same.
    warnings: tuple[str, ...] = ()


# The largest values the JobSpec's fields hold (int32; global_batch is int64).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _positive_int(option: str, value: str, largest: int = INT32_MAX) -> int:
    try:
        number = int(value)
    except ValueError:
        raise SubmitUsageError(f"{option}: {value!r} is not a whole number") from None
    if number < 1:
        raise SubmitUsageError(f"{option}: must be positive, got {number}")
    if number > largest:
        raise SubmitUsageError(f"{option}: must be at most {largest}, got {number}")
    return number


def _apply_tidal_option(spec: admin_pb2.JobSpec, option: str, value: str | None) -> None:
    def need() -> str:
        if value is None:
            raise SubmitUsageError(f"{option} needs a value")
        return value

    match option:
        case "--min-replicas":
            spec.min_replicas = _positive_int(option, need())
        case "--max-replicas":
            spec.max_replicas = _positive_int(option, need())
        case "--nodes-per-replica":
            spec.nodes_per_replica = _positive_int(option, need())
        case "--procs-per-node":
            spec.procs_per_node = _positive_int(option, need())
        case "--global-batch":
            spec.global_batch = _positive_int(option, need(), INT64_MAX)
        case "--weight":
            spec.weight = _positive_int(option, need())
        case "--replica-step":
            spec.replica_step = _positive_int(option, need())
        case "--allowed-replicas":
            del spec.allowed_replicas[:]
            spec.allowed_replicas.extend(_positive_int(option, part) for part in need().split(",") if part)
        case "--mode":
            modes = {"live": common_pb2.JOB_MODE_LIVE, "restart": common_pb2.JOB_MODE_RESTART}
            if need() not in modes:
                raise SubmitUsageError(f"--mode: {value!r} is not one of live, restart")
            spec.mode = modes[need()]
        case "--name":
            spec.name = need()
        case "--env":
            key, sep, text = need().partition("=")
            if not sep or not key:
                raise SubmitUsageError(f"--env: {value!r} is not KEY=VALUE")
            spec.environment[key] = text
        case "--yield-to-pending":
            if value is not None:
                raise SubmitUsageError("--yield-to-pending takes no value")
            spec.yield_to_pending = True
        case _:
            raise SubmitUsageError(f"{option}: not an option of tidal submit")


TIDAL_OPTIONS = frozenset({"--min-replicas", "--max-replicas", "--nodes-per-replica", "--procs-per-node",
                           "--global-batch", "--replica-step", "--allowed-replicas", "--mode", "--name", "--env",
                           "--yield-to-pending", "--weight", "--recipe", "--set"})
# Options that name a recipe and override its keys (tidal.recipes.catalog): the command line only.
RECIPE_OPTIONS = frozenset({"--recipe", "--set"})
TIDAL_FLAGS = frozenset({"--yield-to-pending"})


def _split_options(tokens: Sequence[str], *, where: str,
                   allow_command: bool) -> tuple[list[tuple[str, str | None]], list[str], list[str]]:
    """(Tidal options, sbatch options as tokens, the command) from `tokens`: options come
    first; the first token that is not one starts the command."""
    tidal: list[tuple[str, str | None]] = []
    sbatch: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--":
            index += 1
            break
        if not token.startswith("-") or token == "-":
            break
        if token.startswith("--"):
            name, sep, value = token.partition("=")
            if name in TIDAL_FLAGS:
                tidal.append((name, value if sep else None))
            elif name in TIDAL_OPTIONS:
                if not sep:
                    if index + 1 >= len(tokens):
                        raise SubmitUsageError(f"{name} needs a value ({where})")
                    index += 1
                    value = tokens[index]
                tidal.append((name, value))
            elif sep or name[2:] in SBATCH_LONG_FLAGS:
                sbatch.append(token)
            else:
                if index + 1 >= len(tokens):
                    raise SubmitUsageError(f"{name} needs a value ({where})")
                index += 1
                sbatch.append(f"{name}={tokens[index]}")
        else:
            letter = token[1:2]
            if letter in SBATCH_SHORT_WITH_VALUE:
                if len(token) > 2:
                    sbatch += [token[:2], token[2:]]
                else:
                    if index + 1 >= len(tokens):
                        raise SubmitUsageError(f"{token} needs a value ({where})")
                    index += 1
                    sbatch += [token, tokens[index]]
            else:
                sbatch.append(token)
        index += 1
    command = list(tokens[index:])
    if command and not allow_command:
        raise SubmitUsageError(f"{where}: unexpected {command[0]!r} (only options belong here)")
    return tidal, sbatch, command


def script_directives(text: str) -> tuple[list[list[str]], list[list[str]]]:
    """(#SBATCH lines, #TIDAL lines), each split like a shell would, from the top of a batch
    script: like sbatch, reading stops at the first line that is neither blank nor a
    comment."""
    sbatch: list[list[str]] = []
    tidal: list[list[str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if number == 1 and stripped.startswith("#!"):
            continue
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break
        for prefix, found in (("#SBATCH", sbatch), ("#TIDAL", tidal)):
            if stripped.startswith(prefix + " ") or stripped == prefix:
                try:
                    found.append(shlex.split(stripped[len(prefix):], comments=True))
                except ValueError as error:
                    raise SubmitUsageError(f"line {number}: {error}: {stripped}") from None
    return sbatch, tidal


def sbatch_value(options: Sequence[str], short: str | None, long: str) -> str | None:
    """The last value given to an sbatch option in `options` (a list of tokens: `-C x`,
    `-Cx`, `--constraint=x` or `--constraint x`), as sbatch takes the last one."""
    value = None
    for index, token in enumerate(options):
        following = options[index + 1] if index + 1 < len(options) else None
        if short is not None and token == short and following is not None:
            value = following
        elif short is not None and token.startswith(short) and len(token) > len(short) and token[1] != "-":
            value = token[len(short):]
        elif token.startswith(f"--{long}="):
            value = token.split("=", 1)[1]
        elif token == f"--{long}" and following is not None:
            value = following
    return value


def parse_submit(argv: Sequence[str], *, cwd: Path,
                 read_text: Callable[[Path], str] = lambda p: p.read_text()) -> Submission:
    """A JobSpec (not yet checked by the controller's `normalized_spec`) from `tidal
    submit`'s arguments."""
    tidal, sbatch, command = _split_options(argv, where="command line", allow_command=True)
    recipe_options = [(option, value) for option, value in tidal if option in RECIPE_OPTIONS]
    tidal = [(option, value) for option, value in tidal if option not in RECIPE_OPTIONS]
    if recipe_options:
        return _recipe_submission(recipe_options, tidal, sbatch, command, cwd)
    if not command:
        raise SubmitUsageError("no script or command to run (tidal submit [options] SCRIPT_OR_COMMAND [ARGS...])")
    spec = admin_pb2.JobSpec(working_dir=str(cwd))
    script: Path | None = None
    candidate = Path(command[0]) if os.sep in command[0] or Path(cwd, command[0]).is_file() else None
    if candidate is not None:
        path = candidate if candidate.is_absolute() else cwd / candidate
        try:
            text = read_text(path)
        except (OSError, UnicodeDecodeError):
            text = ""
        if text.startswith("#!") or "#SBATCH" in text or "#TIDAL" in text:
            script = path
            script_sbatch, script_tidal = script_directives(text)
            for tokens in script_tidal:
                found, extra_sbatch, _ = _split_options(tokens, where=f"#TIDAL line in {path}",
                                                           allow_command=False)
                if extra_sbatch:
                    raise SubmitUsageError(f"#TIDAL line in {path}: {extra_sbatch[0]} is not a Tidal option "
                                           "(sbatch options go on #SBATCH lines)")
                for option, value in found:
                    _apply_tidal_option(spec, option, value)
            from_script: list[str] = []
            for tokens in script_sbatch:
                _, extra, _ = _split_options(tokens, where=f"#SBATCH line in {path}", allow_command=False)
                from_script += extra
            sbatch = from_script + sbatch
            command = [str(path), *command[1:]] if os.access(path, os.X_OK) else ["bash", str(path), *command[1:]]
    for option, value in tidal:
        _apply_tidal_option(spec, option, value)
    spec.command.extend(command)
    _apply_sbatch_options(spec, sbatch, cwd)
    spec.name = spec.name or _default_name(script, command)
    warnings = () if script is not None else _command_warnings(command[0], cwd, Path(spec.working_dir))
    return Submission(spec=spec, script=script, warnings=warnings)


def _command_warnings(program: str, cwd: Path, working_dir: Path) -> tuple[str, ...]:
    """A command given by its path (it has a `/`) that is not here, or not executable, in
    the folder its units run in (`working_dir`) or this one: it fails on the nodes unless it
    is there (a node's own disk), with exit 127, and the job fails after
    crash_loop_generations. Only a warning: the nodes may see what this machine does not.
    A bare name is looked up on the nodes' PATH, not checked."""
    if os.sep not in program:
        return ()
    found = [path for path in dict.fromkeys((working_dir / program, cwd / program)) if path.exists()]
    if not found:
        return (f"{program}: no such file here (nor in {working_dir}); its units will fail to start it "
                "unless it exists on the nodes",)
    if not any(path.is_file() and os.access(path, os.X_OK) for path in found):
        return (f"{program} is not an executable file; its units will fail to start it "
                f"(chmod +x it, or name its interpreter: ... bash {program})",)
    return ()


def _apply_sbatch_options(spec: admin_pb2.JobSpec, sbatch: Sequence[str], cwd: Path) -> None:
    """sbatch's options, kept for every unit; the partition, working folder and (unless
    --name gave one) the job's name that they set."""
    spec.sbatch_options.extend(sbatch)
    partition = sbatch_value(sbatch, "-p", "partition")
    if partition:
        spec.partition = partition
    directory = sbatch_value(sbatch, "-D", "chdir")
    if directory:
        spec.working_dir = str(cwd / directory)
    if not spec.name:
        spec.name = sbatch_value(sbatch, "-J", "job-name") or ""


def _recipe_submission(recipe_options: Sequence[tuple[str, str | None]], tidal: Sequence[tuple[str, str | None]],
                       sbatch: Sequence[str], command: Sequence[str], cwd: Path) -> Submission:
    """`tidal submit --recipe NAME [--set KEY=VALUE ...]`: the recipe resolved here (files
    checked, paths absolute), its job section as defaults under the command line's
    options, and the recipe runner as the command, in live mode."""
    from tidal.recipes import catalog

    names = [value for option, value in recipe_options if option == "--recipe"]
    if len(names) != 1 or not names[0]:
        raise SubmitUsageError("--set needs one --recipe NAME (tidal recipes lists them)" if not names
                               else "give --recipe once")
    if command:
        raise SubmitUsageError(f"--recipe runs the recipe: no script or command after it (got {command[0]!r})")
    overrides = [value or "" for option, value in recipe_options if option == "--set"]
    spec = admin_pb2.JobSpec(working_dir=str(cwd), mode=common_pb2.JOB_MODE_LIVE)
    try:
        recipe = catalog.resolve(names[0], overrides, cwd=cwd)
        defaults = catalog.job_defaults(recipe)
    except catalog.RecipeError as error:
        raise SubmitUsageError(str(error)) from None
    for key, number in defaults.items():
        setattr(spec, key, number)
    for option, value in tidal:
        _apply_tidal_option(spec, option, value)
    if spec.mode != common_pb2.JOB_MODE_LIVE:
        raise SubmitUsageError("--recipe trains in live mode (leave --mode out)")
    spec.global_batch = catalog.global_batch(recipe)
    spec.command.extend(catalog.command(recipe, sys.executable))
    _apply_sbatch_options(spec, sbatch, cwd)
    size = recipe["model"].get("size") if not recipe["model"].get("weights") else "weights"
    spec.name = spec.name or f"{recipe['name']}-{size}"
    return Submission(spec=spec)


def _default_name(script: Path | None, command: Sequence[str]) -> str:
    interpreted = Path(command[0]).name.startswith(("python", "bash", "sh")) and len(command) > 1
    base = script.stem if script is not None else Path(command[1] if interpreted else command[0]).stem
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in base).strip("-._")
    return (cleaned or "job")[:64]
