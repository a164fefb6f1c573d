"""What the Grafana dashboard (deploy/grafana/tidal.json) queries, and what a controller's
/metrics exports, as metric names comparable with each other."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tidal.json"
# The metric names in a PromQL expression: every word with the controller's prefix
# (its metrics all start with tidal_; the board's labels and functions do not).
_METRIC = re.compile(r"\b(tidal_[a-z0-9_]+)\b")
# A Grafana template variable in a query: $name, ${name} or ${name:format}, [[name]].
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "untyped": ("",)}


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def panel_queries(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    """Each panel's title and its PromQL expressions."""
    return {each["title"]: [target["expr"] for target in each.get("targets", [])] for each in dashboard["panels"]}


def queried_metrics(dashboard: dict[str, Any]) -> set[str]:
    names = {name for exprs in panel_queries(dashboard).values() for expr in exprs for name in _METRIC.findall(expr)}
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        names.update(_METRIC.findall(text))
    return names


def exported_metrics(exposition: str) -> set[str]:
    """Every sample name an exposition (the text of /metrics) can carry, by its families'
    types: a labelled counter with no child yet still says its family and type."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(f"{family.name}{suffix}" for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def with_variables(expression: str, values: dict[str, str]) -> str:
    """`expression` with each Grafana variable ($job, $__rate_interval, …) replaced by its
    value in `values`; KeyError naming a variable that has none."""
    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise KeyError(f"no value for Grafana's ${name} in {expression!r}")
        return values[name]

    return _VARIABLE.sub(value, expression)


def label_values_query(variable: dict[str, Any]) -> tuple[str, str]:
    """(metric, label) of a query variable defined as `label_values(metric, label)`."""
    query = variable["query"]
    text = query.get("query", "") if isinstance(query, dict) else str(query)
    match = _LABEL_VALUES.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"variable {variable['name']!r} is not label_values(metric, label): {text!r}")
    return match.group(1), match.group(2)
