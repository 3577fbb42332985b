"""The running operator's own /metrics, against the catalogue in docs/metrics.md."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics import scrape
from support import ROOT

pytestmark = pytest.mark.cluster


def catalogue():
    spec = importlib.util.spec_from_file_location("kt_catalogue", ROOT / "tests" / "observability" / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.catalogue()


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
