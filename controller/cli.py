"""The `tidal` command.

The job commands (submit, status, events, resize, drain, cancel) talk to the controller's
admin API: over its Unix socket by default (`--socket`, `$TIDAL_CONTROLLER_SOCKET`), where
the controller knows the caller by uid, or over TCP with `--controller HOST:PORT` and the
admin token. `tidal nodes` reads Slurm directly; `tidal recipes` and `tidal data tokenize`
work on files only (no controller).

Exit codes: 0 done; 1 the controller answered with an error; 2 usage, or a job spec the
controller refused; 3 Slurm did not answer; 4 the controller cannot be reached; 5 no such
job or unit; 6 not allowed (not the job's owner, or a wrong token).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

import grpc
from google.protobuf import json_format

from tidal.controller import plot
from tidal.controller.client import DEFAULT_SOCKET, AdminClient
from tidal.controller.submission import INT32_MAX, SubmitUsageError, parse_submit
from tidal.proto import admin_pb2, common_pb2
from tidal.slurm import Node, SlurmError, default_client

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SLURM_UNAVAILABLE = 3
EXIT_UNREACHABLE = 4
EXIT_NOT_FOUND = 5
EXIT_DENIED = 6
# Its output's reader went before it was written (a pipe into `head`).
EXIT_BROKEN_PIPE = 128 + 13

_EXIT_BY_STATUS = {
    grpc.StatusCode.UNAVAILABLE: EXIT_UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_UNREACHABLE,
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_DENIED,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_DENIED,
    # The controller answers FAILED_PRECONDITION when Slurm did not answer it.
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_SLURM_UNAVAILABLE,
}


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _node_row(node: Node, tidal: str) -> list[str]:
    flags = ",".join(sorted(f.value for f in node.flags)) or "-"
    gres = ",".join(f"{g.name}{':' + g.type if g.type else ''}:{g.count}" for g in node.gres) or "-"
    usable = "yes" if node.is_idle_and_usable else "no"
    return [node.name, node.state.value, flags, ",".join(node.partitions), str(node.cpus), gres,
            usable, tidal or "-", node.reason or "-"]


def _node_dict(node: Node, tidal: tuple[str, str] | None) -> dict[str, object]:
    return {"name": node.name, "state": node.state.value, "flags": sorted(f.value for f in node.flags),
            "partitions": list(node.partitions), "cpus": node.cpus,
            "gres": [{"name": g.name, "type": g.type, "count": g.count} for g in node.gres],
            "features": list(node.features), "idle_and_usable": node.is_idle_and_usable,
            "reason": node.reason,
            "tidal": {"job_id": tidal[0], "unit_id": tidal[1]} if tidal else None}


def _tidal_units_by_node(args: argparse.Namespace) -> tuple[dict[str, tuple[str, str]], str]:
    """Which Tidal job and unit runs on each node, as the controller says; with a note
    instead when the controller does not answer (Slurm's view is shown all the same)."""
    try:
        with _client(args) as client:
            nodes = client.nodes().nodes
    except (grpc.RpcError, OSError) as error:
        details = error.details() if isinstance(error, grpc.RpcError) and hasattr(error, "details") else str(error)
        return {}, f"the controller at {_where(args)} did not answer ({details}): Tidal's units are not shown"
    return {n.name: (n.job_id, n.unit_id) for n in nodes if n.job_id}, ""


def command_nodes(args: argparse.Namespace) -> int:
    client = default_client(timeout_s=args.timeout)
    try:
        nodes = sorted(client.list_nodes(), key=lambda n: n.name)
        version = client.version()
    except SlurmError as error:
        print(f"tidal nodes: Slurm did not answer: {error}", file=sys.stderr)
        return EXIT_SLURM_UNAVAILABLE
    used, note = _tidal_units_by_node(args)
    if args.json:
        print(json.dumps({"slurm_version": str(version), "tidal_units_known": not note,
                          "nodes": [_node_dict(n, used.get(n.name)) for n in nodes]}, indent=2))
        return EXIT_OK
    headers = ["NODE", "STATE", "FLAGS", "PARTITIONS", "CPUS", "GRES", "GROW-ONTO", "TIDAL (JOB/UNIT)", "REASON"]
    rows = [_node_row(n, "/".join(used[n.name]) if n.name in used else "") for n in nodes]
    print(_format_table(headers, rows))
    usable = sum(n.is_idle_and_usable for n in nodes)
    print(f"\n{len(nodes)} nodes, {usable} idle and usable, {len(used)} running Tidal units (Slurm {version})")
    if note:
        print(note, file=sys.stderr)
    return EXIT_OK


def command_version(args: argparse.Namespace) -> int:
    try:
        print(package_version("tidal-elastic"))
    except PackageNotFoundError:
        print("unknown (not installed)")
    return EXIT_OK


# The job commands.


def _client(args: argparse.Namespace) -> AdminClient:
    if args.controller:
        token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("TIDAL_ADMIN_TOKEN")
        return AdminClient(address=args.controller, token=token, tls_ca=Path(args.tls_ca) if args.tls_ca else None,
                           timeout_s=args.timeout)
    return AdminClient(unix_socket=Path(args.socket), timeout_s=args.timeout)


def _where(args: argparse.Namespace) -> str:
    return args.controller or f"unix:{args.socket}"


def _state(value: int) -> str:
    return admin_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def _unit_state(value: int) -> str:
    return admin_pb2.UnitState.Name(value).removeprefix("UNIT_STATE_").lower()


def _mode(value: int) -> str:
    return common_pb2.JobMode.Name(value).removeprefix("JOB_MODE_").lower()


def _age(timestamp_ns: int, now: float) -> str:
    if not timestamp_ns:
        return "-"
    seconds = max(0.0, now - timestamp_ns / 1e9)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _as_dict(message: object) -> dict[str, object]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[arg-type]


def sbatch_arguments(argv: Sequence[str]) -> tuple[list[str], bool, bool]:
    """sbatch's own spellings that `tidal submit` lacks, for `tidal-sbatch`: `--wrap CMD`
    becomes the command `bash -c CMD`, and `--parsable` asks for the bare job id. (The
    arguments, whether `--parsable` was given, whether `--wrap` was.)"""
    rest: list[str] = []
    wrap: str | None = None
    parsable = False
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--parsable":
            parsable = True
        elif token == "--wrap" and index + 1 < len(argv):
            wrap = argv[index + 1]
            index += 1
        elif token.startswith("--wrap="):
            wrap = token.split("=", 1)[1]
        else:
            rest.append(token)
        index += 1
    if wrap is not None:
        rest += ["--", "bash", "-c", wrap]
    return rest, parsable, wrap is not None


def not_a_batch_script(argument: str, cwd: Path) -> str:
    """Why `tidal sbatch ARGUMENT` is refused, in sbatch's words: ARGUMENT is no file
    here, or not a batch script (no `#!` line, no #SBATCH or #TIDAL line)."""
    path = cwd / argument
    if not path.is_file():
        return f"unable to open file {argument} (a batch script, as sbatch takes; a command: --wrap, or tidal submit)"
    return (f"{argument} does not look like a batch script: its first line must start with #! followed by the "
            "path to an interpreter (a command: --wrap, or tidal submit)")


def command_submit(args: argparse.Namespace) -> int:
    parsable = wrapped = False
    if args.command == "sbatch":
        args.rest, parsable, wrapped = sbatch_arguments(args.rest)
    try:
        submission = parse_submit(args.rest, cwd=Path.cwd())
    except SubmitUsageError as error:
        print(f"tidal {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "sbatch" and not wrapped and submission.script is None:
        # sbatch's drop-in takes a batch script, as sbatch does, not a command.
        print(f"tidal sbatch: {not_a_batch_script(submission.spec.command[0], Path.cwd())}", file=sys.stderr)
        return EXIT_USAGE
    for warning in submission.warnings:
        print(f"tidal {args.command}: warning: {warning}", file=sys.stderr)
    with _client(args) as client:
        response = client.submit(submission.spec)
    if parsable:
        print(response.job.job_id)
        return EXIT_OK
    if args.command == "sbatch" and not args.json:
        print(f"Submitted elastic job {response.job.job_id}")
        return EXIT_OK
    if args.json:
        print(json.dumps({"job": _as_dict(response.job), "secret_path": response.secret_path}, indent=2))
        return EXIT_OK
    spec = response.job.spec
    print(f"submitted {response.job.job_id} ({_mode(spec.mode)} mode, replicas {spec.min_replicas}.."
          f"{spec.max_replicas}, {spec.procs_per_node} process(es) per node)")
    print(f"secret: {response.secret_path} (readable by you only)")
    return EXIT_OK


def _job_row(job: admin_pb2.Job, now: float) -> list[str]:
    spec = job.spec
    last = job.last_event
    last_text = f"{last.kind} {_age(last.time.ToNanoseconds(), now)}" if last.kind else "-"
    return [job.job_id, _state(job.state), _mode(spec.mode), f"{job.replicas}/{spec.min_replicas}/{spec.max_replicas}",
            str(job.world_size), str(job.generation), str(job.step),
            f"{job.samples_per_second:.1f}" if job.samples_per_second else "-",
            f"{job.goodput:.0%}" if job.goodput else "-", last_text]


def command_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = [client.job(args.job)] if args.job else client.jobs(include_finished=args.all)
    if args.json:
        print(json.dumps([_as_dict(job) for job in jobs], indent=2))
        return EXIT_OK
    now = time.time()
    headers = ["JOB", "STATE", "MODE", "REPLICAS(now/min/max)", "WORLD", "GEN", "STEP", "SAMPLES/S", "GOODPUT",
               "LAST EVENT"]
    if not jobs:
        print("no jobs" + ("" if args.all else " running (--all shows ended ones too)"))
        return EXIT_OK
    print(_format_table(headers, [_job_row(job, now) for job in jobs]))
    if args.job:
        job = jobs[0]
        slots = any(u.replica > 0 for u in job.units)
        rows = [[u.unit_id, _unit_state(u.state), str(u.slurm_job_id or "-"), ",".join(u.nodes) or "-",
                 *([f"{u.replica}/{u.node_index}" if u.replica > 0 else "-"] if slots else []),
                 str(u.group_rank) if u.group_rank >= 0 else "-", _compute(u),
                 _age(u.last_heartbeat.ToNanoseconds(), now)]
                for u in job.units]
        if rows:
            print()
            print(_format_table(["UNIT", "STATE", "SLURM JOB", "NODES", *(["REPLICA/NODE"] if slots else []),
                                 "GROUP RANK", "COMPUTE", "LAST HEARTBEAT"], rows))
        if job.last_event.reason:
            print(f"\nlast event: {job.last_event.kind}: {job.last_event.reason}")
    return EXIT_OK


def _compute(unit: admin_pb2.Unit) -> str:
    """The unit's slowest worker's compute per sample against its peers' (live mode), and
    STRAGGLER while one of its workers is one."""
    if unit.compute_ratio <= 0:
        return "-"
    return f"{unit.compute_ratio:.2f}x" + (" STRAGGLER" if unit.straggler else "")


def _event_line(event: admin_pb2.Event) -> str:
    """One line per event; a field of several lines (a worker's traceback) follows it,
    indented."""
    at = datetime.datetime.fromtimestamp(event.time.ToNanoseconds() / 1e9).strftime("%H:%M:%S.%f")[:-3]
    items = sorted(event.fields.items())
    fields = " ".join(f"{k}={v}" for k, v in items if "\n" not in v)
    line = f"{at}  {event.generation:>3}  {event.kind:<22} {event.unit_id or '-':<10} {event.reason}  {fields}".rstrip()
    for key, value in items:
        if "\n" in value:
            line += f"\n    {key}:\n" + "\n".join(f"      {text}" for text in value.splitlines())
    return line


def command_events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.job(args.job)  # NOT_FOUND for an unknown job, even with no events
        events = client.events(args.job, after_sequence=args.after)
        for event in events:
            print(json.dumps(_as_dict(event)) if args.json else _event_line(event), flush=True)
        if args.follow:
            last = events[-1].sequence if events else args.after
            try:
                for event in client.watch_events(args.job, after_sequence=last):
                    print(json.dumps(_as_dict(event)) if args.json else _event_line(event), flush=True)
            except KeyboardInterrupt:
                return EXIT_OK
    return EXIT_OK


def command_plot(args: argparse.Namespace) -> int:
    output = Path(args.output or f"tidal-{args.job}.png")
    with _client(args) as client:
        history = client.history(args.job)
        job = client.job(args.job)
    if not history.samples and not history.events:
        print(f"tidal plot: job {args.job} has no history yet (the controller samples it from heartbeats)",
              file=sys.stderr)
        return EXIT_ERROR
    drawn = plot.series(history)
    title = (f"{job.job_id} ({job.spec.name}): {_state(job.state)}, step {job.step}" if job.spec.name
             else f"{job.job_id}: {_state(job.state)}, step {job.step}")
    try:
        plot.render(drawn, output, title=title)
    except plot.PlotUnavailable as error:
        print(f"tidal plot: {error}", file=sys.stderr)
        return EXIT_USAGE
    kinds = sorted({mark.kind for mark in drawn.marks})
    print(f"{output} ({len(history.samples)} samples, {len(drawn.marks)} marks"
          + (f": {', '.join(kinds)}" if kinds else "") + ")")
    return EXIT_OK


def command_recipes(args: argparse.Namespace) -> int:
    from tidal.recipes import catalog

    if args.name is None:
        if args.set:
            print("tidal recipes: --set needs a recipe NAME", file=sys.stderr)
            return EXIT_USAGE
        found = catalog.available()
        print(_format_table(["RECIPE", "MODEL TYPE", "SIZES (DEFAULT FIRST)", "DESCRIPTION"],
                            catalog.summary_rows(found.items())))
        print("\ntidal recipes NAME shows one; tidal submit --recipe NAME --set data.tokens=FILE [--set KEY=VALUE...] "
              "trains it")
        return EXIT_OK
    try:
        if args.set:
            recipe = catalog.resolve(args.name, args.set, checked=False)
            print(json.dumps(recipe, indent=2))
            problems = catalog.check(recipe)
            if problems:
                print("tidal submit would refuse it: " + "; ".join(problems), file=sys.stderr)
                return EXIT_USAGE
        else:
            recipe = catalog.load(args.name)
            print(f"# {recipe['source']}")
            print(Path(recipe["source"]).read_text(), end="")
    except catalog.RecipeError as error:
        print(f"tidal recipes: {error}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def command_tokenize(args: argparse.Namespace) -> int:
    from tidal.recipes.tokens import TokenFileError, tokenize

    started = time.monotonic()
    try:
        written = tokenize(args.inputs, args.output, tokenizer=args.tokenizer, eos_id=args.eos_id, field=args.field)
    except (TokenFileError, OSError, UnicodeDecodeError) as error:
        print(f"tidal data tokenize: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, TokenFileError) else EXIT_ERROR
    header = written.header
    kind = header.tokenizer.get("kind")
    print(f"{written.path}: {header.tokens} tokens ({header.dtype}), {header.documents} documents, vocabulary "
          f"{header.vocab_size}, end-of-document id {header.eos_id}, tokenizer {kind} "
          f"({time.monotonic() - started:.1f} s)")
    return EXIT_OK


def command_resize(args: argparse.Namespace) -> int:
    if not args.min and not args.max:
        print("tidal resize: give --min and/or --max", file=sys.stderr)
        return EXIT_USAGE
    for option, value in (("--min", args.min), ("--max", args.max)):
        if value is not None and not 1 <= value <= INT32_MAX:
            print(f"tidal resize: {option} must be within 1..{INT32_MAX}, got {value}", file=sys.stderr)
            return EXIT_USAGE
    with _client(args) as client:
        job = client.resize(args.job, min_replicas=args.min or 0, max_replicas=args.max or 0)
    print(f"{job.job_id}: replicas {job.spec.min_replicas}..{job.spec.max_replicas}")
    return EXIT_OK


def command_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        units = client.drain(args.target)
    print(f"draining {', '.join(units)}" if units else f"{args.target}: nothing to drain")
    return EXIT_OK


def command_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job)
    print(f"{job.job_id}: {_state(job.state)}")
    return EXIT_OK


def _run_admin(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a job command; a gRPC error becomes a one-line message and its exit code."""
    try:
        return handler(args)
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        status = _EXIT_BY_STATUS.get(code, EXIT_ERROR)
        if status == EXIT_UNREACHABLE:
            print(f"tidal {args.command}: cannot reach the controller at {_where(args)} ({details}). "
                  "Is tidal-controller running? (--socket or --controller)", file=sys.stderr)
        else:
            print(f"tidal {args.command}: {details}", file=sys.stderr)
        return status
    except BrokenPipeError:
        raise
    except UnicodeEncodeError as error:
        # An argument, a file's name or the folder that is not UTF-8 (Linux allows any
        # bytes; Python keeps them as surrogates): the controller's messages hold text only.
        print(f"tidal {args.command}: {os.fsencode(error.object)!r} is not UTF-8, which the controller's messages "
              "need", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"tidal {args.command}: {error}", file=sys.stderr)
        return EXIT_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="Elastic, checkpointless PyTorch training on Slurm.")
    env = os.environ.get
    parser.add_argument("--socket", default=env("TIDAL_CONTROLLER_SOCKET", str(DEFAULT_SOCKET)),
                        help="the controller's Unix socket ($TIDAL_CONTROLLER_SOCKET; default %(default)s)")
    parser.add_argument("--controller", default=env("TIDAL_CONTROLLER_ADDRESS"),
                        help="HOST:PORT of the controller over TCP instead ($TIDAL_CONTROLLER_ADDRESS)")
    parser.add_argument("--token-file", default=env("TIDAL_ADMIN_TOKEN_FILE"),
                        help="admin token for --controller ($TIDAL_ADMIN_TOKEN_FILE, or $TIDAL_ADMIN_TOKEN)")
    parser.add_argument("--tls-ca", default=env("TIDAL_TLS_CA"), help="CA certificate for a TLS controller")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    submit = sub.add_parser(
        "submit", help="submit an elastic job", usage="tidal submit [--min-replicas N] [--max-replicas M] "
        "[--nodes-per-replica K] [--procs-per-node P] [--global-batch B] [--mode live|restart] [--name NAME] "
        "[--env K=V] [--replica-step S | --allowed-replicas 1,2,4] [--yield-to-pending] [--weight W] [--json] "
        "[sbatch options...] SCRIPT_OR_COMMAND [ARGS...]",
        description="Options before the script or command: Tidal's own, and sbatch's (kept for every unit). "
        "A batch script's #SBATCH and #TIDAL lines are read too; the command line wins.")
    submit.add_argument("--json", action="store_true", help="machine-readable output")
    submit.add_argument("rest", nargs=argparse.REMAINDER)
    submit.set_defaults(handler=command_submit, admin=True)
    sbatch = sub.add_parser("sbatch", help="sbatch's command line, submitted through Tidal (what tidal-sbatch runs)",
                            usage="tidal sbatch [--parsable] [--wrap CMD] [tidal and sbatch options...] "
                            "[SCRIPT [ARGS...]]")
    sbatch.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    sbatch.add_argument("rest", nargs=argparse.REMAINDER)
    sbatch.set_defaults(handler=command_submit, admin=True)
    status = sub.add_parser("status", help="jobs at a glance, or one job and its units")
    status.add_argument("job", nargs="?")
    status.add_argument("--all", action="store_true", help="also jobs that have ended")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=command_status, admin=True)
    events = sub.add_parser("events", help="a job's timeline")
    events.add_argument("job")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--after", type=int, default=0, help="only events after this sequence number")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.set_defaults(handler=command_events, admin=True)
    plotting = sub.add_parser("plot", help="a picture of a job: world size, samples/s and loss over time, with "
                                           "grows, preemptions, failures and recoveries marked")
    plotting.add_argument("job")
    plotting.add_argument("-o", "--output", help="PNG, SVG or PDF, by the name's ending (default tidal-JOB.png)")
    plotting.set_defaults(handler=command_plot, admin=True)
    resize = sub.add_parser("resize", help="change a job's replica bounds")
    resize.add_argument("job")
    resize.add_argument("--min", type=int)
    resize.add_argument("--max", type=int)
    resize.set_defaults(handler=command_resize, admin=True)
    drain = sub.add_parser("drain", help="take a unit (or every unit of a job) out gracefully")
    drain.add_argument("target", metavar="JOB|JOB/UNIT|UNIT",
                       help="a job (every unit), one of its units (JOB/u2), or a unit id that one job has")
    drain.set_defaults(handler=command_drain, admin=True)
    cancel = sub.add_parser("cancel", help="end a job")
    cancel.add_argument("job")
    cancel.set_defaults(handler=command_cancel, admin=True)
    nodes = sub.add_parser("nodes", help="what Slurm shows of its nodes, and which Tidal could grow onto")
    nodes.add_argument("--json", action="store_true", help="machine-readable output")
    nodes.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for Slurm (default 10)")
    nodes.set_defaults(handler=command_nodes)
    recipes = sub.add_parser("recipes", help="the recipes tidal submit --recipe NAME trains (public models, no code)")
    recipes.add_argument("name", nargs="?", help="print this recipe's YAML (with --set: resolved, as submitted)")
    recipes.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="with NAME: an override, checked as submit checks it")
    recipes.set_defaults(handler=command_recipes)
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    tokenize = data_sub.add_parser(
        "tokenize", help="text files to a token file (memory-mapped ids) for recipes",
        description="Each .jsonl line (its --field) or each other file is one document; documents are written "
        "one after another, each ended by the end-of-sequence id. Without --tokenizer, one token per UTF-8 byte.")
    tokenize.add_argument("inputs", nargs="+", metavar="TEXT", help=".txt (one document a file) or .jsonl files")
    tokenize.add_argument("-o", "--output", required=True, help="the token file (its header goes to OUTPUT.json)")
    tokenize.add_argument("--tokenizer", help="a local folder holding a Hugging Face tokenizer (never downloaded)")
    tokenize.add_argument("--eos-id", type=int, help="the end-of-document id (default: the tokenizer's; bytes: 256)")
    tokenize.add_argument("--field", default="text", help=".jsonl: the field holding the text (default text)")
    tokenize.set_defaults(handler=command_tokenize)
    version = sub.add_parser("version", help="print Tidal's version")
    version.set_defaults(handler=command_version)
    return parser


GLOBAL_OPTIONS_WITH_VALUE = frozenset({"--socket", "--controller", "--token-file", "--tls-ca", "--timeout"})


def _command_index(argv: Sequence[str]) -> int | None:
    """Where the subcommand is in `argv`, skipping the global options and their values."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in GLOBAL_OPTIONS_WITH_VALUE:
            index += 2
        elif token.startswith("-"):
            index += 1
        else:
            return index
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    at = _command_index(argv)
    if at is not None and argv[at] in ("submit", "sbatch"):
        # Everything after `submit` is Tidal's options, sbatch's and the command, which
        # argparse cannot tell apart: parse_submit does. `--json` and `--help` come first.
        rest = argv[at + 1:]
        leading = []
        while rest and rest[0] in ("--json", "-h", "--help"):
            leading.append(rest.pop(0))
        args = parser.parse_args([*argv[:at + 1], *leading])
        args.rest = rest
    else:
        args = parser.parse_args(argv)
    try:
        status = _run_admin(args.handler, args) if getattr(args, "admin", False) else int(args.handler(args))
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader went (`tidal status | head -1`): stop quietly, as a program the
        # SIGPIPE ends does (128 + 13), with nothing more written to the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
