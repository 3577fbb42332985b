"""The metric catalogue of docs/metrics.md as data, Prometheus's naming rules, and dashboard/rule readers."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"
DASHBOARDS = ROOT / "charts" / "kubetrain" / "dashboards"
ALERTS = ROOT / "charts" / "kubetrain" / "files" / "alerts.yaml"

SECTIONS = {"Trainer": "trainer", "Operator": "operator", "Process (prometheus-client's standard collectors)": "process"}
# Labels a kubetrain series may carry: the replica's, and small fixed enums.
# `name` is bounded by MAX_REPORTED_METRICS per process (kubetrain.report).
# lane: urgent|routine; verb: HTTP verbs; resource: the client's path templates (kube.resource_of), never names;
# source: cache|store (a dataset shard's).
BOUNDED_LABELS = {"namespace", "job", "role", "replica", "stage", "direction", "method", "mode", "state", "reason",
                  "name", "lane", "verb", "resource", "source"}
BASE_UNITS = {"seconds": "_seconds", "bytes": "_bytes"}
# Scaled or non-base units Prometheus's naming guide rules out.
NON_BASE = re.compile(r"_(milliseconds|microseconds|nanoseconds|ms|us|minutes|hours|days|kilobytes|megabytes|"
                      r"gigabytes|kb|mb|gb|kib|mib|gib|percent|bits)(_|$)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Entry:
    name: str  # as exposed: counters with _total, histograms by their base name
    type: str  # counter | gauge | histogram
    unit: str
    labels: tuple[str, ...]
    meaning: str
    side: str  # trainer | operator | process


def catalogue(path: Path = METRICS_DOC) -> dict[str, Entry]:
    """Every row of the catalogue tables, by metric name."""
    entries: dict[str, Entry] = {}
    side = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            side = SECTIONS.get(line[3:].strip())
            continue
        if side is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise AssertionError(f"{path}: catalogue row needs 5 cells, got {len(cells)}: {line}")
        name, type_, unit, labels, meaning = cells
        name = name.strip("`")
        if name in entries:
            raise AssertionError(f"{path}: {name} is listed twice")
        entries[name] = Entry(name, type_, unit, tuple(x.strip() for x in labels.split(",") if x.strip()),
                              meaning, side)
    return entries


def naming_problems(entry: Entry) -> list[str]:
    """Prometheus's naming rules as kubetrain applies them to its own metrics."""
    name, problems = entry.name, []
    if not name.startswith("kubetrain_"):
        problems.append(f"{name}: does not start with kubetrain_")
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        problems.append(f"{name}: not snake_case")
    if (entry.type == "counter") != name.endswith("_total"):
        problems.append(f"{name}: a {entry.type}; counters and only counters end in _total")
    stem = name.removesuffix("_total")
    if NON_BASE.search(stem):
        problems.append(f"{name}: uses a non-base unit")
    for unit, suffix in BASE_UNITS.items():
        if (entry.unit == unit) != stem.endswith(suffix):
            problems.append(f"{name}: unit {entry.unit!r} but the name {'lacks' if entry.unit == unit else 'has'} {suffix}")
    if entry.unit == "seconds" and "timestamp" not in name and entry.type != "histogram":
        problems.append(f"{name}: a duration must be a histogram, is a {entry.type}")
    if entry.type == "histogram" and name.endswith(HISTOGRAM_SUFFIXES):
        problems.append(f"{name}: a histogram's name must not end in {HISTOGRAM_SUFFIXES}")
    unbounded = set(entry.labels) - BOUNDED_LABELS
    if unbounded:
        problems.append(f"{name}: labels outside the bounded set: {sorted(unbounded)}")
    if not entry.meaning:
        problems.append(f"{name}: no meaning")
    return problems


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict) -> list[dict]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    out = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(p["title"], t["expr"]) for p in panels(board) for t in p["targets"]]


def variable_queries(board: dict) -> list[tuple[str, str]]:
    return [(v["name"], v["definition"]) for v in board["templating"]["list"] if v["type"] == "query"]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


METRIC_TOKEN = re.compile(r"\b((?:kubetrain|process|python)_[a-z0-9_]+)\b")


def metric_names(expr: str, known: dict[str, Entry]) -> set[str]:
    """Catalogue names an expression refers to (a histogram's _bucket/_sum/_count map to its name)."""
    names = set()
    for token in METRIC_TOKEN.findall(expr):
        for suffix in HISTOGRAM_SUFFIXES:
            base = token.removesuffix(suffix)
            if base != token and known.get(base, None) and known[base].type == "histogram":
                token = base
        names.add(token)
    return names


SELECTOR = re.compile(r"\b((?:kubetrain|process)_[a-z0-9_]+)(\{[^}]*\})?")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, matchers) of every vector selector; matchers '' when there are none."""
    return [(m.group(1), m.group(2) or "") for m in SELECTOR.finditer(expr)]


def exposed(text: str) -> dict[str, tuple[str, str, set[tuple[str, ...]]]]:
    """name (counters with _total) -> (type, help, the label sets of its samples, `le` left out).

    The `<name>_created` samples prometheus-client adds to counters and
    histograms parse as families of their own: they belong to their metric.
    """
    families = list(text_string_to_metric_families(text))
    with_created = {f.name for f in families if f.type in ("counter", "histogram")}
    out = {}
    for family in families:
        if family.name.endswith("_created") and family.name.removesuffix("_created") in with_created:
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {tuple(sorted(k for k in s.labels if k != "le")) for s in family.samples}
        out[name] = (family.type, family.documentation, labels)
    return out


def merged(texts: list[str]) -> dict[str, tuple[str, str, set[tuple[str, ...]]]]:
    out: dict[str, tuple[str, str, set[tuple[str, ...]]]] = {}
    for text in texts:
        for name, (type_, help_, labels) in exposed(text).items():
            if name in out:
                assert out[name][0] == type_, f"{name}: a {type_} here, a {out[name][0]} elsewhere"
                labels = labels | out[name][2]
            out[name] = (type_, help_, labels)
    return out


def check_against_catalogue(side: str, families: dict) -> None:
    """The exposed kubetrain_ families of one side are exactly the catalogue's, with its types and labels."""
    mine = {n: e for n, e in catalogue().items() if e.side == side}
    ours = {n: f for n, f in families.items() if n.startswith("kubetrain_")}
    assert set(ours) - set(mine) == set(), f"exposed but not in docs/metrics.md: {sorted(set(ours) - set(mine))}"
    assert set(mine) - set(ours) == set(), f"in docs/metrics.md but not exposed: {sorted(set(mine) - set(ours))}"
    for name, (type_, help_, label_sets) in ours.items():
        entry = mine[name]
        assert type_ == entry.type, f"{name}: exposed as a {type_}, catalogued as a {entry.type}"
        assert help_.strip(), f"{name}: no help text"
        for labels in label_sets:
            assert set(labels) == set(entry.labels), f"{name}: exposed labels {labels}, catalogued {entry.labels}"
