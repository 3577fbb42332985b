"""The metric catalogue (docs/metrics.md) and Prometheus's naming rules; the real exposition is checked in test_prometheus.py."""

from __future__ import annotations

import pytest
from catalogue import Entry, catalogue, naming_problems

CATALOGUE = catalogue()


def test_catalogue_follows_prometheus_naming_rules():
    problems = [p for e in CATALOGUE.values() if e.side != "process" for p in naming_problems(e)]
    assert problems == []
    assert {e.side for e in CATALOGUE.values()} == {"trainer", "operator", "process"}


REPLICA = ("namespace", "job", "role", "replica")


@pytest.mark.parametrize(
    "name, type_, unit, labels, problem",
    [
        ("kubetrain_steps", "counter", "steps", REPLICA, "end in _total"),
        ("kubetrain_loss_total", "gauge", "1", REPLICA, "end in _total"),
        ("kubetrain_step_duration_seconds", "gauge", "seconds", REPLICA, "must be a histogram"),
        ("kubetrain_step_duration_milliseconds", "histogram", "milliseconds", REPLICA, "non-base unit"),
        ("kubetrain_checkpoint_size", "gauge", "bytes", REPLICA, "lacks _bytes"),
        ("kubetrain_checkpoint_bytes", "gauge", "steps", REPLICA, "has _bytes"),
        ("steps_total", "counter", "steps", REPLICA, "kubetrain_"),
        ("kubetrain_rpc_retries_total", "counter", "retries", REPLICA + ("pod_ip",), "bounded"),
        ("kubetrain_step_duration_seconds_count", "histogram", "seconds", REPLICA, "must not end"),
    ],
)
def test_naming_rules_catch_a_bad_metric(name, type_, unit, labels, problem):
    problems = naming_problems(Entry(name, type_, unit, labels, "a meaning", "trainer"))
    assert any(problem in p for p in problems), problems
