"""Lint of the Grafana dashboards and the alert rules against the metric catalogue."""

from __future__ import annotations

import re
import subprocess

import pytest
from helpers.process import require_program
from catalogue import ALERTS, alert_rules, catalogue, dashboards, metric_names, panels, queries, selectors, variable_queries

CATALOGUE = catalogue()
BOARDS = dashboards()
RANGE = re.compile(r"\[([^\]]*)\]")


def test_both_dashboards_exist():
    assert set(BOARDS) == {"training", "operator"}


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_has_datasource_namespace_and_job_variables(name):
    board = BOARDS[name]
    assert 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for var in ("namespace", "job"):
        assert variables[var]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[var]["multi"] and variables[var]["includeAll"]
    assert '$namespace' in variables["job"]["definition"], "the job list must follow the namespace"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_panel_has_a_unit_and_queries_the_datasource_variable(name):
    for panel in panels(BOARDS[name]):
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{name}: panel {panel['title']!r} has no unit"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"{name}: panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_metric_a_dashboard_names_is_in_the_catalogue(name):
    board = BOARDS[name]
    for title, expr in queries(board) + variable_queries(board):
        unknown = metric_names(expr, CATALOGUE) - set(CATALOGUE)
        assert not unknown, f"{name}: {title!r} names metrics missing from docs/metrics.md: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_selectors_filter_by_the_namespace_and_job_variables(name):
    """Each selector filters by every variable whose label its metric carries."""
    uses_job = False
    for title, expr in queries(BOARDS[name]):
        for metric, matchers in selectors(expr):
            base = next((m for m in metric_names(metric, CATALOGUE)), metric)
            labels = CATALOGUE[base].labels
            if "namespace" in labels:
                assert 'namespace=~"$namespace"' in matchers, f"{name}: {title!r}: {metric}{matchers}"
            if "job" in labels:
                assert 'job=~"$job"' in matchers, f"{name}: {title!r}: {metric}{matchers}"
                uses_job = True
    assert uses_job, f"{name}: no panel uses the job variable"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_rates_use_rate_interval_and_ranges_use_grafana_variables(name):
    for title, expr in queries(BOARDS[name]):
        for call in re.finditer(r"\b(i?rate)\(", expr):
            window = RANGE.search(expr, call.end())
            assert window and window.group(1) == "$__rate_interval", f"{name}: {title!r}: {expr}"
        for window in RANGE.findall(expr):
            assert window in ("$__rate_interval", "$__range"), f"{name}: {title!r}: fixed range [{window}]"


@pytest.mark.parametrize(
    "name, wanted",
    [
        ("training", ["throughput", "loss", "accuracy", "step time", "gradient bytes", "compression ratio",
                      "staleness", "checkpoint age", "restarts"]),
        ("operator", ["jobs by state", "reconcile latency", "restarts"]),
    ],
)
def test_dashboard_shows_what_the_issue_asks_for(name, wanted):
    titles = " | ".join(p["title"].lower() for p in panels(BOARDS[name]))
    missing = [w for w in wanted if w not in titles]
    assert not missing, f"{name}: no panel for {missing}; panels: {titles}"


def test_alerts_cover_no_progress_restart_storm_and_stale_checkpoint():
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(rules) == {"KubetrainJobNoProgress", "KubetrainRestartStorm", "KubetrainCheckpointStale"}
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        unknown = metric_names(rule["expr"], CATALOGUE) - set(CATALOGUE)
        assert not unknown, f"{name} names metrics missing from docs/metrics.md: {sorted(unknown)}"


def test_promtool_accepts_the_alert_rules():
    promtool = require_program("promtool", "apt-get install -y --no-install-recommends prometheus (hack/deps)")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 3 rules found" in done.stdout
