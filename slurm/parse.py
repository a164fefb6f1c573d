"""Pure parsers from what Slurm prints to Tidal's models. Tested on recorded real output
(tests/data/slurm-*/, and the slurmrestd recordings of 23.11-25.11 in shared/slurm-json/),
never on hand-written JSON.

Two families of JSON schema are understood:

- openapi v0.0.37/v0.0.38 (Slurm 21.08-22.05): `job_state` is a string that names a flag
  instead of the base state while a flag is set; node `state` is a lower-case base state
  with a separate `state_flags` list; numbers are plain integers.
- data_parser v0.0.40-v0.0.45 (Slurm 23.11 and later: 23.11 prints v0.0.40, 24.05 v0.0.41,
  24.11 v0.0.42, 25.05 v0.0.43, 25.11 v0.0.44, 26.05 v0.0.45; the CLI client pins the
  newest one the release knows): states are lists, base first (`["PENDING",
  "COMPLETING"]`); a number that can be unset is `{"set": bool, "infinite": bool,
  "number": int}`. The fields Tidal reads are the same in all six.

Slurm 23.02's v0.0.39 and anything newer than v0.0.45 are refused with SlurmParseError.
Within a supported schema a newer release's state or flag word that Tidal does not know
is ignored, and a field a newer schema dropped reads as empty (no name, no nodes, state
UNKNOWN); only a job without `job_id` or a node without `name` is not a record. Anything
that is not a Slurm document raises SlurmParseError.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from tidal.slurm.errors import SlurmParseError, SlurmReportedError
from tidal.slurm.hostlist import expand
from tidal.slurm.models import (
    Gres,
    Job,
    JobFlag,
    JobState,
    Node,
    NodeFlag,
    NodeState,
    Partition,
    PreemptMode,
    SlurmVersion,
)

T = TypeVar("T")
_JOB_STATES = {s.value for s in JobState}
_JOB_FLAGS = {f.value for f in JobFlag}
_NODE_STATES = {s.value for s in NodeState}
_NODE_FLAGS = {f.value for f in NodeFlag}
# Slurm's printed names that differ from the flag's enum name.
_NODE_FLAG_ALIASES = {"MAINT": "MAINTENANCE", "NO_RESPOND": "NOT_RESPONDING",
                      "REBOOT": "REBOOT_REQUESTED", "POWER": "POWERED_DOWN", "RESV": "RESERVED",
                      "INVAL": "INVALID", "PERFCTRS": "EXTERNAL"}
# Compound names `sinfo` and slurm_node_state_string() print for base+flag combinations.
_NODE_COMPOUND = {"DRAINED": ("IDLE", "DRAIN"), "DRAINING": ("ALLOCATED", "DRAIN"),
                  "ALLOCATED+DRAIN": ("ALLOCATED", "DRAIN"), "MIXED+DRAIN": ("MIXED", "DRAIN")}


def parse_version(text: str) -> SlurmVersion:
    """`slurm-wlm 22.05.8` or `slurm 24.11.5` → SlurmVersion(22, 5, 8)."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise SlurmParseError(f"no Slurm version in {text.strip()!r}")
    return SlurmVersion(int(match[1]), int(match[2]), int(match[3]))


#: The JSON schemas Tidal reads, by their v0.0.N number.
OPENAPI_SCHEMAS = frozenset({37, 38})
DATA_PARSER_SCHEMAS = frozenset(range(40, 46))
_SUPPORTED_TEXT = "v0.0.37-38 (Slurm 21.08-22.05) and v0.0.40-45 (Slurm 23.11-26.05)"


def load_document(text: str, key: str) -> tuple[str, list[Mapping[str, Any]]]:
    """Parse a Slurm JSON document; return (schema, records under `key`). A document of a
    schema Tidal does not read is refused by its schema before anything else is looked at."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:  # (RecursionError: nested past Python's limit)
        raise SlurmParseError(f"Slurm printed no valid JSON: {error}") from None
    named = named_schema(document) if isinstance(document, dict) else None
    if named is not None:
        supported_schema(named)
    if not isinstance(document, dict) or not isinstance(document.get(key), list):
        raise SlurmParseError(f"Slurm's JSON has no '{key}' list")
    listed = document.get("errors") or []
    if not isinstance(listed, list):
        raise SlurmParseError(f"Slurm's JSON has an 'errors' that is not a list: {listed!r}"[:300])
    errors = [e for e in listed if e]
    if errors:
        details = "; ".join(str(e.get("description") or e.get("error") or e) if isinstance(e, dict) else str(e)
                            for e in errors)
        raise SlurmReportedError(f"Slurm reported errors instead of '{key}': {details}")
    return schema_of(document), document[key]


def named_schema(document: Mapping[str, Any]) -> int | None:
    """N of the `v0.0.N` the document's meta block names (`meta.plugin`; 23.02's v0.0.39
    says `meta.plugins`), or None when it names none."""
    meta = document.get("meta")
    if not isinstance(meta, Mapping):
        return None
    for plugin in (meta.get("plugin"), meta.get("plugins")):
        if not isinstance(plugin, Mapping):
            continue
        for candidate in (plugin.get("data_parser"), plugin.get("type")):
            match = re.search(r"v0\.0\.(\d+)", str(candidate or ""))
            if match:
                return int(match[1])
    return None


def supported_schema(version: int) -> str:
    """'v0.0.N' when Tidal reads schema v0.0.N; SlurmParseError naming what it reads otherwise."""
    if version in OPENAPI_SCHEMAS or version in DATA_PARSER_SCHEMAS:
        return f"v0.0.{version}"
    release = " (Slurm 23.02's)" if version == 39 else ""
    raise SlurmParseError(f"unsupported Slurm JSON schema v0.0.{version}{release}; "
                          f"Tidal reads {_SUPPORTED_TEXT}")


def schema_of(document: Mapping[str, Any]) -> str:
    """'v0.0.38', 'v0.0.40'…'v0.0.45': the supported schema the document's meta block names."""
    version = named_schema(document)
    if version is None:
        raise SlurmParseError("Slurm's JSON names no schema version in meta.plugin")
    return supported_schema(version)


def number(value: Any) -> int | None:
    """A plain integer (v0.0.38) or {"set","infinite","number"} (v0.0.40+) → int or None
    when unset or infinite."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise SlurmParseError(f"not a finite number: {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        return number(value.get("number", 0))
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise SlurmParseError(f"not a number: {value!r}")


def timestamp(value: Any) -> datetime | None:
    """Seconds since the epoch → aware UTC datetime; 0, unset or infinite → None."""
    seconds = number(value)
    if not seconds or seconds < 0 or seconds >= 2**32 - 2:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC)


def parse_gres(text: str | None) -> tuple[Gres, ...]:
    """`gpu:a100:4(S:0-1),nic:1` → (Gres("gpu","a100",4), Gres("nic",None,1))."""
    if not text or text in ("(null)", "N/A"):
        return ()
    result: list[Gres] = []
    for item in re.split(r",(?![^()]*\))", text):
        item = re.sub(r"\(.*\)$", "", item.strip())
        if not item:
            continue
        parts = item.split(":")
        name = parts[0]
        kind: str | None = None
        count = 1
        if len(parts) == 2:
            if parts[1].isdigit():
                count = int(parts[1])
            else:
                kind = parts[1]
        elif len(parts) >= 3:
            kind = parts[1]
            count = int(parts[2]) if parts[2].isdigit() else 1
        result.append(Gres(name, kind, count))
    return tuple(result)


def job_state_from_names(names: Iterable[str]) -> tuple[JobState, frozenset[JobFlag]]:
    """A list of state words (v0.0.40+) or one word (v0.0.38, pyslurm) → base and flags.
    Words this version of Tidal does not know are ignored rather than fatal, so a newer
    Slurm's new flag does not stop the poller."""
    base = JobState.UNKNOWN
    flags: set[JobFlag] = set()
    for raw in names:
        word = str(raw).strip().upper()
        if word in _JOB_STATES and base is JobState.UNKNOWN:
            base = JobState(word)
        elif word in _JOB_FLAGS:
            flags.add(JobFlag(word))
    return base, frozenset(flags)


def node_state_from_names(names: Iterable[str]) -> tuple[NodeState, frozenset[NodeFlag]]:
    """State words in any of Slurm's spellings (`idle`, `IDLE+DRAIN`, `["IDLE","DRAIN"]`,
    `drained`, `down*`) → base and flags."""
    base = NodeState.UNKNOWN
    flags: set[NodeFlag] = set()
    words: list[str] = []
    for raw in names:
        text = str(raw).strip().upper()
        if text.endswith("*"):  # sinfo's mark for a node not responding
            text = text[:-1]
            words.append("NOT_RESPONDING")
        if text in _NODE_COMPOUND:
            words.extend(_NODE_COMPOUND[text])
        else:
            words.extend(w for w in text.split("+") if w)
    for word in words:
        if word in _NODE_STATES and base is NodeState.UNKNOWN:
            base = NodeState(word)
            continue
        word = _NODE_FLAG_ALIASES.get(word, word)
        if word in _NODE_FLAGS:
            flags.add(NodeFlag(word))
    return base, frozenset(flags)


def state_words(value: Any) -> list[str]:
    """A state as printed: one word (v0.0.38), a list of words (v0.0.40+), or absent."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [str(word) for word in value]
    raise TypeError(f"a state is a word or a list of words, not {value!r}")


def _text(record: Mapping[str, Any], key: str) -> str:
    """A text field; absent or null (a field a newer schema dropped) reads as ""."""
    value = record.get(key)
    return "" if value is None else str(value)


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return [str(v) for v in value]


def _records(text: str, key: str, build: Callable[[Mapping[str, Any]], T]) -> list[T]:
    schema, records = load_document(text, key)
    try:
        return [build(record) for record in records]
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
        # (AttributeError: a record that is not an object; OverflowError: a number past
        # what a float holds, read as infinity.)
        raise SlurmParseError(f"unexpected {key} record in {schema}: {error!r}"[:500]) from None


def parse_jobs(text: str) -> list[Job]:
    """`squeue --json` (any supported schema) → jobs."""
    return _records(text, "jobs", _job)


def _job(record: Mapping[str, Any]) -> Job:
    state, flags = job_state_from_names(state_words(record.get("job_state")))
    nodes_field = record.get("nodes") or ""
    return Job(
        job_id=int(record["job_id"]),
        name=_text(record, "name"),
        user=_text(record, "user_name"),
        state=state,
        flags=flags,
        partition=_text(record, "partition"),
        nodes=expand(nodes_field if isinstance(nodes_field, str) else ""),
        node_count=number(record.get("node_count")) or 0,
        priority=number(record.get("priority")) or 0,
        submit_time=timestamp(record.get("submit_time")),
        start_time=timestamp(record.get("start_time")),
        end_time=timestamp(record.get("end_time")),
        preempt_time=timestamp(record.get("preempt_time")),
        requeue_count=number(record.get("restart_cnt")) or 0,
        reason=_text(record, "state_reason"),
        comment=_text(record, "comment"),
    )


def parse_nodes(text: str) -> list[Node]:
    """`sinfo --json` (22.05) or `scontrol show nodes --json` (23.11+) → nodes."""
    return _records(text, "nodes", _node)


def _node(record: Mapping[str, Any]) -> Node:
    # v0.0.38 keeps the flags apart, in `state_flags`.
    state, flags = node_state_from_names(state_words(record.get("state")) + state_words(record.get("state_flags")))
    return Node(
        name=str(record["name"]),
        state=state,
        flags=flags,
        partitions=tuple(_as_list(record.get("partitions"))),
        cpus=number(record.get("cpus")) or 0,
        gres=parse_gres(record.get("gres")),
        features=tuple(_as_list(record.get("features"))),
        reason=_text(record, "reason"),
        address=_text(record, "address"),
    )


def parse_partitions_oneliner(text: str) -> list[Partition]:
    """`scontrol show partition --oneliner` → partitions. The text form is read on every
    Slurm version: 24.11's partition JSON carries no PreemptMode."""
    partitions: list[Partition] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        if "PartitionName" not in fields:
            raise SlurmParseError(f"not a partition line: {line[:80]!r}")
        modes = frozenset(PreemptMode(m) for m in fields.get("PreemptMode", "OFF").split(",")
                          if m in PreemptMode.__members__)
        try:
            partitions.append(Partition(
                name=fields["PartitionName"],
                nodes=expand(fields.get("Nodes", "")),
                priority_tier=int(fields.get("PriorityTier", "1")),
                preempt_mode=modes,
                grace_time_s=int(fields.get("GraceTime", "0")),
                is_default=fields.get("Default", "NO") == "YES",
                is_up=fields.get("State", "UP") == "UP",
            ))
        except ValueError as error:
            raise SlurmParseError(f"bad partition line {line[:80]!r}: {error}") from None
    return partitions


#: Slurm's job ids are 32-bit and never 0 (`uint32_t job_id` in slurm.h).
_JOB_IDS = range(1, 2**32)


def parse_sbatch_parsable(text: str) -> int:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`. Anything else, digits that are
    not ASCII or an id Slurm never gives (0, past 32 bits) included, is SlurmParseError."""
    first = text.strip().split(";")[0]
    if not re.fullmatch(r"[0-9]+", first) or int(first) not in _JOB_IDS:
        raise SlurmParseError(f"sbatch printed no job id: {text.strip()[:80]!r}")
    return int(first)
