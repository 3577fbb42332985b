"""The running operator's own /metrics, against the catalogue in docs/metrics.md."""

from __future__ import annotations

import importlib.util
import math
import sys
import uuid

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics import scrape
from helpers.process import require_program
from helpers.prometheus import start_prometheus
from helpers.wait import wait_for
from support import ROOT
from test_lifecycle import manifest, running_pods

pytestmark = pytest.mark.cluster


def _catalogue_module():
    spec = importlib.util.spec_from_file_location("kt_catalogue", ROOT / "tests" / "observability" / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CATALOGUE_MODULE = _catalogue_module()
dashboards, queries = CATALOGUE_MODULE.dashboards, CATALOGUE_MODULE.queries


def catalogue():
    return CATALOGUE_MODULE.catalogue()


def test_the_running_operator_exposes_its_catalogued_metrics(operator):
    operator.apply({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "metrics-probe"},
                    "spec": {"mode": "Single"}})
    operator.wait("the job reconciled", lambda: operator.job_status("metrics-probe").get("state"))
    text = scrape(f"127.0.0.1:{operator.metrics_port}")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    entries = {name: e for name, e in catalogue().items() if e.side == "operator"}
    assert entries, "docs/metrics.md has no operator section"
    for name, entry in entries.items():
        family = name.removesuffix("_total") if entry.type == "counter" else name
        assert family in families, f"{name} is catalogued but the operator does not expose it"
        assert families[family].type == entry.type, f"{name}: exposed as {families[family].type}, catalogued as {entry.type}"
    exposed = {n for n in families if n.startswith("kubetrain_")}
    catalogued = {n.removesuffix("_total") if e.type == "counter" else n for n, e in entries.items()}
    assert exposed <= catalogued, f"not in the catalogue: {sorted(exposed - catalogued)}"
    reconciles = next(s for s in families["kubetrain_operator_reconcile_duration_seconds"].samples if s.name.endswith("_count"))
    assert reconciles.value > 0


def test_the_operator_dashboards_panels_return_data_from_the_running_operator(operator, tmp_path):
    """Every panel of charts/kubetrain/dashboards/operator.json over the operator's own metrics, queried from a
    real Prometheus scraping the real operator while it reconciles jobs that start, restart, succeed and fail
    (kwok's pods, their ends written as a kubelet would). The board's one trainer panel (the trainers'
    process_start_time_seconds) is checked against running trainers in tests/observability."""
    prometheus = require_program("prometheus", "apt-get install -y --no-install-recommends prometheus (hack/deps)")
    config = tmp_path / "prometheus.yml"
    # honor_labels: the operator's `namespace` label is the job's, not the scrape target's.
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kubetrain-operator", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}]}],
    }))
    prom = start_prometheus(prometheus, config, tmp_path)
    try:
        lives = {"ok": [("Succeeded", 0)], "bad": [("Failed", 2)], "again": [("Failed", 137), ("Succeeded", 0)]}
        names = {life: manifest("Single", f"dash-{life}-{uuid.uuid4().hex[:4]}") for life in lives}
        for doc in names.values():
            operator.apply(doc)
        # A job's end and restart series exist at 0 from its first round (metrics.start_counting), and
        # Prometheus has seen them before anything ends: else increase() would miss each first one.
        ns = operator.namespace
        # (0 for a fresh operator; the session's operator may have counted other tests' jobs already.)
        wait_for("the series of the jobs' ends and restarts", lambda: len(prom.query(
            f'kubetrain_operator_replica_restarts_total{{namespace="{ns}",mode="Single",reason="Killed"}} or '
            f'kubetrain_operator_jobs_failed_total{{namespace="{ns}",mode="Single"}}')) == 2, timeout=60,
                 explain=lambda: f"{prom.targets()}\n{prom.log_tail()}")
        for life, ends in lives.items():
            name = names[life]["metadata"]["name"]
            for phase, code in ends:
                [pod] = running_pods(operator, name, 1)
                operator.set_pod_status(pod, phase, exit_code=code)
                if phase == "Failed" and code == 137:  # replaced: wait for the new pod before its own end
                    operator.wait(f"{name}'s restart", lambda: operator.job_status(name).get("restarts") == 1)
            final = "Succeeded" if ends[-1][0] == "Succeeded" else "Failed"
            operator.wait(f"{name} {final}", lambda: operator.job_status(name).get("state") == final, timeout=90)

        variables = {"$__rate_interval": "1m", "$__range": "10m", "$namespace": operator.namespace}
        checked = []
        for title, expr in queries(dashboards()["operator"]):
            if "kubetrain_operator_" not in expr:
                continue
            for name, value in variables.items():
                expr = expr.replace(name, value)
            # What each panel must show once Prometheus has the jobs' lives (it may lag them by a scrape).
            wanted = {"Jobs by state": lambda r: {s["metric"]["state"] for s in r} >= {"Succeeded", "Failed"},
                      "Replica restarts": lambda r: any(float(s["value"][1]) >= 1 for s in r)}.get(title, bool)
            last: list = []

            def answer(expr=expr):
                last[:] = [s for s in prom.query(expr) if math.isfinite(float(s["value"][1]))]
                return wanted(last)

            wait_for(f"operator board: {title!r}: {expr} to return what it must", answer, timeout=60,
                     explain=lambda: repr([(s["metric"], s["value"][1]) for s in last]))
            checked.append(title)
        assert len(checked) >= 8, checked
        # The board's namespace variable, as Grafana asks it, lists the operator's namespaces.
        [(_, definition)] = [(n, d) for n, d in CATALOGUE_MODULE.variable_queries(dashboards()["operator"])
                             if n == "namespace"]
        selector, label = definition.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
        listed = {s["metric"][label.strip()] for s in prom.query(f"group by ({label.strip()}) ({selector})")}
        assert ns in listed, (definition, listed)
        # The exposition after those lives: the catalogue's names, types and labels (every family that
        # has samples by now; the waiting gauge has none without a waiting job).
        families = CATALOGUE_MODULE.exposed(scrape(f"127.0.0.1:{operator.metrics_port}"))
        CATALOGUE_MODULE.check_against_catalogue("operator", families)
        for name in ("kubetrain_operator_jobs_created_total", "kubetrain_operator_jobs_succeeded_total",
                     "kubetrain_operator_jobs_failed_total", "kubetrain_operator_replica_restarts_total",
                     "kubetrain_operator_jobs"):
            assert families[name][2], f"{name}: no sample to check the labels of"
    finally:
        prom.stop()
