"""Every Prometheus metric a trainer process exports, defined once: name, unit, help, labels.

Names start with `kubetrain_`, carry base units (`_seconds`, `_bytes`),
counters end in `_total` (prometheus-client appends it), durations are
histograms. Every series carries the replica's labels (namespace, job, role,
replica); the few with one more label take it from a small fixed set
(stage: raw|compressed, direction: sent|received or upload|download, method: an RPC name, source: cache|store;
reason: one of REJECT_REASONS; name: one of at most MAX_REPORTED_METRICS
names a script reports).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)

from kubetrain.api.spec import MAX_REPORTED_METRICS

from .context import ReplicaContext
from .errors import ConfigError, TransientError

# No `*_created` series beside every counter and histogram: they double the
# series count and no dashboard or alert reads them.
disable_created_metrics()

LABELS = ("namespace", "job", "role", "replica")
PREFIX = "kubetrain_"

FAST_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SLOW_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STALENESS_STEPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# Why a parameter server did not apply a push (docs/parameter-server.md).
REJECT_REASONS = ("duplicate", "non_finite", "invalid")


class Labelled:
    """A metric with one label beyond the replica's: `.labels(stage="raw")` fills in the rest."""

    def __init__(self, metric: Any, base: Mapping[str, str]):
        self._metric = metric
        self._base = dict(base)

    def labels(self, **extra: str) -> Any:
        return self._metric.labels(**self._base, **extra)


def replica_labels(ctx_or_labels: ReplicaContext | Mapping[str, str]) -> dict[str, str]:
    """The labels every series of a replica carries: from its context, or given (exactly LABELS)."""
    if isinstance(ctx_or_labels, ReplicaContext):
        ctx = ctx_or_labels
        return {"namespace": ctx.namespace, "job": ctx.job_name, "role": ctx.role, "replica": ctx.replica}
    labels = dict(ctx_or_labels)
    if set(labels) != set(LABELS):
        raise ConfigError(f"metric labels must be exactly {', '.join(LABELS)}, got {', '.join(labels)}")
    return labels


def process_registry() -> CollectorRegistry:
    """A registry of its own with the process, platform and GC collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class Metric:
    """One entry of the catalogue: its kind, name (after `kubetrain_`), help text, extra label and buckets."""

    kind: type
    name: str
    doc: str
    extra: str | None = None
    """The one label beyond the replica's (from a small fixed set), if any."""
    buckets: tuple[float, ...] = ()
    """A histogram's buckets."""
    unmeasured: bool = False
    """A gauge that reads NaN until it is first set: a reader (the operator, a dashboard) must not take
    "no evaluation so far" for an accuracy of 0."""

    def create(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> Any:
        """The metric in `registry`, bound to the replica's labels (all but `extra`)."""
        names = LABELS + ((self.extra,) if self.extra else ())
        options: dict[str, Any] = {"buckets": self.buckets} if self.kind is Histogram else {}
        metric = self.kind(PREFIX + self.name, self.doc, names, registry=registry, **options)
        if self.extra:
            return Labelled(metric, labels)
        bound = metric.labels(**labels)
        if self.unmeasured:
            bound.set(float("nan"))
        return bound


def counter(name: str, doc: str, extra: str | None = None) -> Any:
    return Metric(Counter, name, doc, extra)


def gauge(name: str, doc: str, extra: str | None = None, unmeasured: bool = False) -> Any:
    return Metric(Gauge, name, doc, extra, unmeasured=unmeasured)


def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: str | None = None) -> Any:
    return Metric(Histogram, name, doc, extra, buckets)


class TrainerMetrics:
    """The metrics of one replica, in their own registry (with the process collectors).

    The class attributes are the catalogue (a `Metric` each, in exposition
    order); an instance holds each one created in its registry under the same
    name, bound to the replica's labels: `metrics.steps_total.inc()`.
    """

    # Progress
    steps_total = counter("steps", "Optimizer steps this replica has run.")
    samples_total = counter("samples", "Training samples this replica has processed.")
    step_duration_seconds = histogram("step_duration_seconds", "Wall time of one training step.", FAST_SECONDS)
    training_step = gauge("training_step", "The step the job has reached, as this replica sees it.")
    total_steps = gauge("total_steps", "Steps the job runs in all.")
    samples_per_second = gauge("samples_per_second", "Recent training throughput of this replica.", unmeasured=True)
    steps_per_second = gauge("steps_per_second", "Recent optimizer steps per second of this replica.",
                             unmeasured=True)
    reported_metric = gauge(
        "reported_metric",
        "A value a training script reported with kubetrain.report(step, name=value), by name "
        f"(at most {MAX_REPORTED_METRICS} names per process).",
        "name",
    )
    loss = gauge("loss", "Training loss of the most recent step.", unmeasured=True)
    eval_accuracy = gauge("eval_accuracy", "Accuracy on the eval split at the last evaluation (0..1).",
                          unmeasured=True)
    eval_loss = gauge("eval_loss", "Mean loss (spec.training.loss) on the eval split at the last evaluation.",
                      unmeasured=True)
    eval_perplexity = gauge("eval_perplexity", "model causal-lm: exp(eval_loss), the perplexity on the eval split "
                            "at the last evaluation.", unmeasured=True)
    process_starts_total = counter(
        "process_starts", "Starts of this replica's process; more than one series reset means restarts."
    )
    # Communication
    gradient_bytes_total = counter(
        "gradient_bytes", "Gradient bytes before (raw) and after (compressed) compression.", "stage"
    )
    network_bytes_total = counter("network_bytes", "Payload bytes this replica sent or received.", "direction")
    staleness_steps = histogram(
        "staleness_steps", "Async: steps the parameters moved between a worker's read and its push.",
        STALENESS_STEPS,
    )
    sync_dropped_workers_total = counter(
        "sync_dropped_workers", "Sync: workers dropped from a step after syncTimeoutSeconds of silence."
    )
    rpc_duration_seconds = histogram(
        "rpc_duration_seconds", "Wall time of one parameter-server RPC, retries included.", FAST_SECONDS, "method"
    )
    rpc_retries_total = counter("rpc_retries", "RPC attempts that failed and were retried.", "method")
    # What a parameter server refuses, and what a worker skips
    ps_rejected_pushes_total = counter(
        "ps_rejected_pushes",
        "Pushes a parameter server did not apply: duplicate (acknowledged), non_finite or invalid (refused).",
        "reason",
    )
    ps_cancelled_streams_total = counter(
        "ps_cancelled_streams", "Streams a parameter server cancelled because their client stalled."
    )
    ps_workers = gauge("ps_workers", "The workers of the set a parameter server serves now (an elastic job's size).")
    ps_resizes_total = counter("ps_resizes", "Live resizes of the job's workers that ps-0 made (elastic jobs).")
    ps_standby_workers = gauge("ps_standby_workers", "Standby workers waiting at ps-0 for a worker's place.")
    ps_takeovers_total = counter(
        "ps_takeovers", "Worker places ps-0 handed to a standby worker after the process holding it ended."
    )
    ps_data_connections = gauge(
        "ps_data_connections", "Connections a parameter server's data plane serves now (Pull and Push)."
    )
    ps_data_refused_connections_total = counter(
        "ps_data_refused_connections",
        "Connections a parameter server's data plane closed unserved: past max_connections (limit), "
        "past its address's connections before HELLO (peer), a failed TLS handshake (handshake), "
        "not its protocol (protocol), or no handshake and HELLO within the deadline (deadline).",
        "reason",
    )
    non_finite_steps_total = counter(
        "non_finite_steps", "Steps a worker skipped because its gradients held NaN or Inf."
    )
    # Fault-tolerant DDP (spec.ddp.faultTolerance): the replica groups' quorum, steps, heals
    ft_quorum_participants = gauge(
        "ft_quorum_participants", "Replica groups taking part in this rank's current step (its quorum).",
        unmeasured=True)
    ft_committed_steps_total = counter(
        "ft_committed_steps", "Steps this rank's replica group committed (the optimizer stepped).")
    ft_discarded_steps_total = counter(
        "ft_discarded_steps",
        "Steps this rank's replica group discarded: a peer failed in the step's gradient average, or fewer "
        "than minReplicas groups took part.")
    ft_heals_total = counter(
        "ft_heals", "Times this rank's replica group copied the model and optimizer from a live group (a heal).")
    ft_heal_duration_seconds = histogram(
        "ft_heal_duration_seconds",
        "Time from the start of the quorum that found this group behind to the peer's state applied.",
        SLOW_SECONDS,
    )
    # Checkpoints
    checkpoint_duration_seconds = histogram(
        "checkpoint_duration_seconds", "Time to make one checkpoint durable.", SLOW_SECONDS
    )
    checkpoint_stall_seconds = histogram(
        "checkpoint_stall_seconds",
        "Time the training loop waited in one checkpoint save (copy into memory, and any wait for the write before).",
        FAST_SECONDS,
    )
    checkpoint_size_bytes = gauge("checkpoint_size_bytes", "Size of the last checkpoint file.")
    checkpoint_last_success_timestamp_seconds = gauge(
        "checkpoint_last_success_timestamp_seconds", "Unix time the last checkpoint became durable."
    )
    last_checkpoint_step = gauge("last_checkpoint_step", "Step of the last durable checkpoint.")
    checkpoint_upload_seconds = histogram(
        "checkpoint_upload_seconds",
        "Time to upload one checkpoint to object storage and commit it (spec.checkpoint.storage.uri), after its "
        "local write.", SLOW_SECONDS,
    )
    checkpoints_set_aside_total = counter(
        "checkpoints_set_aside",
        "Checkpoints a restore of this process found damaged (a file or object missing, short or changed, a "
        "header or metadata that does not parse) and set aside, kept, to resume from the one before.")
    # Object storage (data, checkpoints, exports)
    object_store_bytes_total = counter(
        "object_store_bytes", "Bytes this replica uploaded to or downloaded from object storage.", "direction")
    object_store_retries_total = counter(
        "object_store_retries", "Requests to object storage that failed and were retried (a slow or failing store).")
    data_shard_reads_total = counter(
        "data_shard_reads",
        "Dataset shards this replica opened: from its local cache (cache) or fetched from the store (store).",
        "source",
    )

    def __init__(self, ctx_or_labels: ReplicaContext | Mapping[str, str], registry: CollectorRegistry | None = None):
        self.labels = replica_labels(ctx_or_labels)
        self.registry = registry if registry is not None else process_registry()
        self._server: Any = None
        for attr, metric in vars(TrainerMetrics).items():
            if isinstance(metric, Metric):
                setattr(self, attr, metric.create(self.registry, self.labels))

    def serve(self, port: int, addr: str) -> int:
        """Serve /metrics on `addr`:`port` (the replica's listen address); 0 turns it off. Returns the port."""
        if port == 0:
            return 0
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:
            # Locally a port may still be held by the previous attempt of this replica.
            raise TransientError(f"metrics port {port}: cannot listen: {err.strerror or err}") from None
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)


def attach_metrics(store: Any, metrics: TrainerMetrics) -> None:
    """Count an ObjectStore's traffic and retries (kubetrain/trainer/objstore.py) in `metrics`."""
    store.on_upload = metrics.object_store_bytes_total.labels(direction="upload").inc
    store.on_download = metrics.object_store_bytes_total.labels(direction="download").inc
    store.on_retry = metrics.object_store_retries_total.inc
