"""Prometheus, on loopback, finds the job's pods through kubernetes_sd_configs and scrapes them.

Debian's Prometheus (2.42.0+ds) is built without Kubernetes service discovery
("field kubernetes_sd_configs not found in type config.ScrapeConfig"), so this
test runs Prometheus v3.16.0 built by `hack/cluster build` from its pinned Go
module (hack/tools/prometheus), beside the cluster's other binaries. The
scrape jobs are the ones the chart ships for a Prometheus without the Operator
(charts/kubetrain/files/scrape-configs.yaml), pointed at the test cluster's
API server with its kubeconfig. The training dashboard's main panels must
return data for a running ParameterServer job.
"""

from __future__ import annotations

import math

import pytest
import yaml
from catalogue import dashboards, queries
from e2elib import NAMESPACE, apply, example, figure
from helpers.prometheus import start_prometheus
from helpers.wait import wait_for
from support import ROOT

pytestmark = pytest.mark.e2e

SCRAPE_CONFIGS = ROOT / "charts" / "kubetrain" / "files" / "scrape-configs.yaml"
JOB = "prom-ps"
MAIN_PANELS = ("Progress", "Steps per second", "Throughput", "Loss", "Restarts", "Last checkpoint step", "CPU")
VARIABLES = {"$__rate_interval": "10s", "$__range": "2m", "$namespace": NAMESPACE, "$job": JOB}


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


@pytest.fixture(scope="module")
def prometheus(e2e, tmp_path_factory):
    binary = e2e.cluster.bin_dir / "prometheus"
    assert binary.is_file(), f"{binary} is missing: `hack/cluster build` builds it"
    root = tmp_path_factory.mktemp("prometheus")
    jobs = yaml.safe_load(SCRAPE_CONFIGS.read_text())
    for job in jobs:
        for sd in job["kubernetes_sd_configs"]:
            sd |= {"kubeconfig_file": str(e2e.cluster.kubeconfig), "namespaces": {"names": [NAMESPACE]}}
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        # 2 s: a trainer's /metrics answered in more than 1 s while the suite loaded both cores, and a
        # short job (the notebook's) then had no sample at all.
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    }))
    prom = start_prometheus(binary, config, root)
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def training(e2e, prometheus):
    """A ParameterServer job that trains until the module is done, discovered and scraped."""
    doc = example("parameter-server.yaml", 1)
    doc["metadata"]["name"] = JOB
    training = doc["spec"]["training"]
    del training["epochs"]
    training["maxSteps"] = 10**7
    doc["spec"]["checkpoint"]["intervalSteps"] = 500
    apply(e2e, doc)
    replicas = {"ps-0", "worker-0", "worker-1"}

    def scraped():
        seen = prometheus.query(f'count_over_time(kubetrain_training_step{{namespace="{NAMESPACE}",job="{JOB}"}}[30s]) > 3')
        return {s["metric"]["replica"] for s in seen} >= replicas

    try:
        wait_for(f"Prometheus to discover and scrape {JOB}'s pods: {prometheus.log_tail()}", scraped, timeout=240)
        yield prometheus
    finally:
        e2e.kubectl("delete", "trainingjob", JOB, "--wait=false")


def test_pods_are_discovered_through_the_api_server_with_their_replica_labels(training):
    targets = training.api("targets", state="active")["activeTargets"]
    trainers = [t for t in targets if t["labels"]["job"] == JOB]
    assert {t["labels"]["replica"] for t in trainers} == {"ps-0", "worker-0", "worker-1"}, trainers
    assert all(t["health"] == "up" and t["discoveredLabels"]["__meta_kubernetes_namespace"] == NAMESPACE
               for t in trainers), trainers
    # The process collectors' series carry the replica labels, from the relabelling.
    starts = training.query(f'process_start_time_seconds{{namespace="{NAMESPACE}",job="{JOB}"}}')
    assert {s["metric"]["replica"] for s in starts} == {"ps-0", "worker-0", "worker-1"}, starts
    operator = training.query('up{job="kubetrain-operator"} == 1')
    assert operator, [t["labels"] for t in targets]
    assert training.query(f'kubetrain_operator_jobs{{namespace="{NAMESPACE}"}}'), "the operator's metrics"
    figure(f"prometheus: {len(trainers)} trainer pods of {JOB} and the operator found by kubernetes_sd_configs")


# A parameter-server job evaluates once, at its end: its eval series stay NaN while it trains.
PANELS = [(title, expr) for title, expr in queries(dashboards()["training"])
          if title in MAIN_PANELS and "kubetrain_eval_" not in expr]


@pytest.mark.parametrize("title, expr", PANELS, ids=[f"{t}:{i}" for i, (t, _) in enumerate(PANELS)])
def test_training_dashboard_main_panel_returns_data(training, title, expr):
    promql = substitute(expr)
    result = wait_for(f"{title!r}: {promql} to return a number", lambda: [
        s for s in training.query(promql) if math.isfinite(float(s["value"][1]))], timeout=60)
    assert all(s["metric"].get("job", JOB) == JOB for s in result), result


def test_every_main_panel_is_covered():
    assert {title for title, _ in PANELS} == set(MAIN_PANELS)
