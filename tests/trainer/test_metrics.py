"""The trainer's exposition follows Prometheus naming rules and is served over HTTP."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics import scrape
from helpers.net import free_port
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.metrics import TrainerMetrics

LABELS = {"namespace": "default", "job": "digits", "role": "worker", "replica": "worker-1"}
ALLOWED_LABELS = {"namespace", "job", "role", "replica", "stage", "direction", "method", "name", "source", "le"}
NAME = re.compile(r"kubetrain_[a-z][a-z0-9_]*")
# Unit words that must appear as the suffix (before _total), never in the middle or in another form.
UNIT_SUFFIXES = ("_seconds", "_bytes")
WRONG_UNITS = re.compile(r"_(milliseconds|ms|millis|kilobytes|kb|mb|megabytes|minutes|hours)(_|$)")

CONTRACT = {
    "kubetrain_steps": "counter",
    "kubetrain_ps_rejected_pushes": "counter",
    "kubetrain_ps_cancelled_streams": "counter",
    "kubetrain_ps_workers": "gauge",
    "kubetrain_ps_resizes": "counter",
    "kubetrain_ps_standby_workers": "gauge",
    "kubetrain_ps_takeovers": "counter",
    "kubetrain_ps_data_connections": "gauge",
    "kubetrain_ps_data_refused_connections": "counter",
    "kubetrain_non_finite_steps": "counter",
    "kubetrain_samples": "counter",
    "kubetrain_step_duration_seconds": "histogram",
    "kubetrain_loss": "gauge",
    "kubetrain_eval_accuracy": "gauge",
    "kubetrain_eval_loss": "gauge",
    "kubetrain_eval_perplexity": "gauge",
    "kubetrain_gradient_bytes": "counter",
    "kubetrain_network_bytes": "counter",
    "kubetrain_staleness_steps": "histogram",
    "kubetrain_sync_dropped_workers": "counter",
    "kubetrain_rpc_duration_seconds": "histogram",
    "kubetrain_rpc_retries": "counter",
    "kubetrain_checkpoint_duration_seconds": "histogram",
    "kubetrain_checkpoint_stall_seconds": "histogram",
    "kubetrain_checkpoint_size_bytes": "gauge",
    "kubetrain_checkpoint_last_success_timestamp_seconds": "gauge",
    "kubetrain_last_checkpoint_step": "gauge",
    "kubetrain_training_step": "gauge",
    "kubetrain_total_steps": "gauge",
    "kubetrain_samples_per_second": "gauge",
    "kubetrain_steps_per_second": "gauge",
    "kubetrain_reported_metric": "gauge",
    "kubetrain_process_starts": "counter",
    "kubetrain_ft_quorum_participants": "gauge",
    "kubetrain_ft_committed_steps": "counter",
    "kubetrain_ft_discarded_steps": "counter",
    "kubetrain_ft_heals": "counter",
    "kubetrain_ft_heal_duration_seconds": "histogram",
    "kubetrain_checkpoint_upload_seconds": "histogram",
    "kubetrain_checkpoints_set_aside": "counter",
    "kubetrain_object_store_bytes": "counter",
    "kubetrain_object_store_retries": "counter",
    "kubetrain_data_shard_reads": "counter",
}


def touched() -> TrainerMetrics:
    """Metrics with one observation each, so every family (and its labelled series) is exposed."""
    m = TrainerMetrics(LABELS)
    m.steps_total.inc()
    m.gradient_bytes_total.labels(stage="raw").inc(100)
    m.network_bytes_total.labels(direction="sent").inc(10)
    m.rpc_duration_seconds.labels(method="PushPull").observe(0.01)
    m.rpc_retries_total.labels(method="PushPull").inc()
    m.staleness_steps.observe(2)
    m.reported_metric.labels(name="accuracy").set(0.5)
    m.object_store_bytes_total.labels(direction="upload").inc(10)
    m.data_shard_reads_total.labels(source="cache").inc()
    return m


def kubetrain_families(m: TrainerMetrics) -> dict:
    families = text_string_to_metric_families(m.exposition().decode())
    # prometheus-client adds a *_created gauge per counter and histogram: not ours to name.
    return {f.name: f for f in families if f.name.startswith("kubetrain_") and not f.name.endswith("_created")}


def test_every_contract_metric_is_exposed_with_its_type() -> None:
    families = kubetrain_families(touched())
    assert {name: f.type for name, f in families.items()} == CONTRACT


def test_exposed_names_follow_prometheus_naming_rules() -> None:
    for name, family in kubetrain_families(touched()).items():
        assert NAME.fullmatch(name), name
        assert family.documentation, f"{name} has no help text"
        assert not WRONG_UNITS.search(name), f"{name}: use base units (seconds, bytes)"
        if "duration" in name:
            assert name.endswith("_seconds") and family.type == "histogram", name
        for unit in UNIT_SUFFIXES:
            if unit[1:] in name.split("_"):
                assert name.endswith(unit), f"{name}: the unit {unit} goes last"
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
            assert set(sample.labels) <= ALLOWED_LABELS, sample.labels
            assert {k: sample.labels[k] for k in LABELS} == LABELS


def test_labels_must_be_exactly_the_replica_labels() -> None:
    with pytest.raises(ConfigError, match="metric labels must be exactly namespace, job, role, replica"):
        TrainerMetrics({"job": "x", "pod": "y"})


def test_serve_exposes_metrics_over_http_and_port_zero_turns_it_off() -> None:
    m = touched()
    assert m.serve(0, "127.0.0.1") == 0
    port = m.serve(free_port(), "127.0.0.1")
    try:
        # Bound to the listen address it was given (loopback for a local run), not every interface.
        assert m._server.server_address[0] == "127.0.0.1"
        body = scrape(f"127.0.0.1:{port}", timeout=5)
    finally:
        m.close()
    assert 'kubetrain_steps_total{job="digits",namespace="default",replica="worker-1",role="worker"} 1.0' in body


def test_loss_and_eval_read_nan_until_measured_then_their_value() -> None:
    metrics = TrainerMetrics(LABELS)

    def value(name: str) -> float:
        return kubetrain_families(metrics)[name].samples[0].value

    assert all(math.isnan(value(n)) for n in ("kubetrain_loss", "kubetrain_eval_accuracy", "kubetrain_eval_loss"))
    metrics.eval_accuracy.set(0.25)
    assert value("kubetrain_eval_accuracy") == 0.25
