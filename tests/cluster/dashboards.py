"""The PromQL of the Grafana dashboards (dashboards/*.json), with Grafana's variables filled in, to run against a
real Prometheus.

panel_queries(path, namespace=..., job=...) gives (panel title, query) for every target of every panel, rows'
panels included; annotation_queries the same for the annotations' targets (filtered: `> 0`, so they return series
only around an event; unfiltered() drops the filter). variable_queries turns the template variables' label_values(...)
into PromQL that returns one series per value. A variable the caller does not give and that has no default here
raises KeyError, so a dashboard that starts using a new variable fails loudly instead of sending `$x`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
RLHF_JOB, OPERATOR = DASHBOARDS / "rlhf-job.json", DASHBOARDS / "operator.json"

# Grafana's built-in variables, as they work with the tests' Prometheus (1 s scrape interval): $__rate_interval is
# at least 4 scrape intervals; a longer window only smooths. $__range is the dashboard's time range.
BUILTINS = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m"}

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*?)\s*,\s*)?(\w+)\s*\)\s*$")
_FILTER = re.compile(r"\s*(>|>=|!=)\s*0\s*$")


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def substitute(expr: str, **variables: str) -> str:
    """expr with $var, ${var}, ${var:format} and [[var]] replaced (the caller's values first, then BUILTINS)."""
    values = {**BUILTINS, **variables}

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for the dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' (collapsed) panels included, the rows themselves too."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panels(panel))
    return out


def panel_queries(path: Path, **variables: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, in the dashboard's order."""
    return [(panel.get("title", ""), substitute(target["expr"], **variables))
            for panel in panels(load(path)) for target in panel.get("targets", []) if target.get("expr")]


def annotation_queries(path: Path, **variables: str) -> list[tuple[str, str]]:
    """(annotation name, PromQL) of the dashboard's Prometheus annotations; they may be filtered (`> 0`). The query
    is the annotation's target.expr, as Grafana's Prometheus data source keeps it (a missing one raises KeyError)."""
    return [(a.get("name", ""), substitute(a["target"]["expr"], **variables))
            for a in load(path).get("annotations", {}).get("list", [])
            if (a.get("datasource") or {}).get("type") == "prometheus"]


def unfiltered(expr: str) -> str:
    """An annotation query without its trailing `> 0`: it returns series before any event too."""
    return _FILTER.sub("", expr)


def variable_queries(path: Path, **variables: str) -> list[tuple[str, str]]:
    """(variable name, PromQL) for each label_values(...) variable: `group by (label) (selector)`, one series per
    value the variable offers (label_values(label) alone: `group by (label) ({label!=""})`)."""
    out = []
    for var in load(path).get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        m = _LABEL_VALUES.match(query)
        if m is None:
            raise ValueError(f"variable {var.get('name')}: not a label_values() query: {query!r}")
        selector, label = m.group(1) or f'{{{m.group(2)}!=""}}', m.group(2)
        out.append((var["name"], substitute(f"group by ({label}) ({selector})", **variables)))
    return out
