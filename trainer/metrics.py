"""Every Prometheus metric a trainer process exports, defined once: name, unit, help, labels.

Names start with `kubetrain_`, carry base units (`_seconds`, `_bytes`),
counters end in `_total` (prometheus-client appends it), durations are
histograms. Every series carries the replica's labels (namespace, job, role,
replica); the few with one more label take it from a small fixed set
(stage: raw|compressed, direction: sent|received, method: an RPC name;
reason: one of REJECT_REASONS; name: one of at most MAX_REPORTED_METRICS
names a script reports).
"""

from __future__ import annotations

from collections.abc import Mapping
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

from kubetrain_operator.api.spec import MAX_REPORTED_METRICS

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


class TrainerMetrics:
    """The metrics of one replica, in their own registry (with the process collectors)."""

    def __init__(self, ctx_or_labels: ReplicaContext | Mapping[str, str], registry: CollectorRegistry | None = None):
        if isinstance(ctx_or_labels, ReplicaContext):
            ctx = ctx_or_labels
            labels = {"namespace": ctx.namespace, "job": ctx.job_name, "role": ctx.role, "replica": ctx.replica}
        else:
            labels = dict(ctx_or_labels)
            if set(labels) != set(LABELS):
                raise ConfigError(f"metric labels must be exactly {', '.join(LABELS)}, got {', '.join(labels)}")
        self.labels = labels
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        self._server: Any = None

        # Progress
        self.steps_total = self._counter("steps", "Optimizer steps this replica has run.")
        self.samples_total = self._counter("samples", "Training samples this replica has processed.")
        self.step_duration_seconds = self._histogram(
            "step_duration_seconds", "Wall time of one training step.", FAST_SECONDS
        )
        self.training_step = self._gauge("training_step", "The step the job has reached, as this replica sees it.")
        self.total_steps = self._gauge("total_steps", "Steps the job runs in all.")
        self.samples_per_second = self._gauge("samples_per_second", "Recent training throughput of this replica.")
        self.steps_per_second = self._gauge("steps_per_second", "Recent optimizer steps per second of this replica.")
        self.reported_metric = self._gauge(
            "reported_metric",
            "A value a training script reported with kubetrain.report(step, name=value), by name "
            f"(at most {MAX_REPORTED_METRICS} names per process).",
            "name",
        )
        self.loss = self._gauge("loss", "Training loss of the most recent step.")
        self.eval_accuracy = self._gauge("eval_accuracy", "Accuracy on the eval split at the last evaluation (0..1).")
        self.eval_loss = self._gauge("eval_loss", "Mean loss (spec.training.loss) on the eval split at the last evaluation.")
        self.process_starts_total = self._counter(
            "process_starts", "Starts of this replica's process; more than one series reset means restarts."
        )
        # Communication
        self.gradient_bytes_total = self._counter(
            "gradient_bytes", "Gradient bytes before (raw) and after (compressed) compression.", "stage"
        )
        self.network_bytes_total = self._counter(
            "network_bytes", "Payload bytes this replica sent or received.", "direction"
        )
        self.staleness_steps = self._histogram(
            "staleness_steps", "Async: steps the parameters moved between a worker's read and its push.",
            STALENESS_STEPS,
        )
        self.sync_dropped_workers_total = self._counter(
            "sync_dropped_workers", "Sync: workers dropped from a step after syncTimeoutSeconds of silence."
        )
        self.rpc_duration_seconds = self._histogram(
            "rpc_duration_seconds", "Wall time of one parameter-server RPC, retries included.", FAST_SECONDS, "method"
        )
        self.rpc_retries_total = self._counter("rpc_retries", "RPC attempts that failed and were retried.", "method")
        # What a parameter server refuses, and what a worker skips
        self.ps_rejected_pushes_total = self._counter(
            "ps_rejected_pushes",
            "Pushes a parameter server did not apply: duplicate (acknowledged), non_finite or invalid (refused).",
            "reason",
        )
        self.ps_cancelled_streams_total = self._counter(
            "ps_cancelled_streams", "Streams a parameter server cancelled because their client stalled."
        )
        self.ps_workers = self._gauge(
            "ps_workers", "The workers of the set a parameter server serves now (an elastic job's size)."
        )
        self.ps_resizes_total = self._counter(
            "ps_resizes", "Live resizes of the job's workers that ps-0 made (elastic jobs)."
        )
        self.ps_standby_workers = self._gauge(
            "ps_standby_workers", "Standby workers waiting at ps-0 for a worker's place."
        )
        self.ps_takeovers_total = self._counter(
            "ps_takeovers", "Worker places ps-0 handed to a standby worker after the process holding it ended."
        )
        self.ps_data_connections = self._gauge(
            "ps_data_connections", "Connections a parameter server's data plane serves now (Pull and Push)."
        )
        self.ps_data_refused_connections_total = self._counter(
            "ps_data_refused_connections",
            "Connections a parameter server's data plane closed unserved: past max_connections (limit), "
            "past its address's connections before HELLO (peer), a failed TLS handshake (handshake), "
            "not its protocol (protocol), or no handshake and HELLO within the deadline (deadline).",
            "reason",
        )
        self.non_finite_steps_total = self._counter(
            "non_finite_steps", "Steps a worker skipped because its gradients held NaN or Inf."
        )
        # Fault-tolerant DDP (spec.ddp.faultTolerance): the replica groups' quorum, steps, heals
        self.ft_quorum_participants = self._gauge(
            "ft_quorum_participants", "Replica groups taking part in this rank's current step (its quorum).")
        self.ft_committed_steps_total = self._counter(
            "ft_committed_steps", "Steps this rank's replica group committed (the optimizer stepped).")
        self.ft_discarded_steps_total = self._counter(
            "ft_discarded_steps",
            "Steps this rank's replica group discarded: a peer failed in the step's gradient average, or fewer "
            "than minReplicas groups took part.")
        self.ft_heals_total = self._counter(
            "ft_heals", "Times this rank's replica group copied the model and optimizer from a live group (a heal).")
        self.ft_heal_duration_seconds = self._histogram(
            "ft_heal_duration_seconds",
            "Time from the start of the quorum that found this group behind to the peer's state applied.",
            SLOW_SECONDS,
        )
        # Checkpoints
        self.checkpoint_duration_seconds = self._histogram(
            "checkpoint_duration_seconds", "Time to make one checkpoint durable.", SLOW_SECONDS
        )
        self.checkpoint_stall_seconds = self._histogram(
            "checkpoint_stall_seconds",
            "Time the training loop waited in one checkpoint save (copy into memory, and any wait for the write before).",
            FAST_SECONDS,
        )
        self.checkpoint_size_bytes = self._gauge("checkpoint_size_bytes", "Size of the last checkpoint file.")
        self.checkpoint_last_success_timestamp_seconds = self._gauge(
            "checkpoint_last_success_timestamp_seconds", "Unix time the last checkpoint became durable."
        )
        self.last_checkpoint_step = self._gauge("last_checkpoint_step", "Step of the last durable checkpoint.")
        # Not measured yet is NaN, not 0: a reader (the operator, a dashboard) must
        # not take "no evaluation so far" for an accuracy of 0.
        for unmeasured in (self.loss, self.eval_accuracy, self.eval_loss, self.samples_per_second,
                           self.steps_per_second, self.ft_quorum_participants):
            unmeasured.set(float("nan"))

    def _bind(self, metric: Any, extra: str | None) -> Any:
        return Labelled(metric, self.labels) if extra else metric.labels(**self.labels)

    def _counter(self, name: str, doc: str, extra: str | None = None) -> Any:
        names = LABELS + ((extra,) if extra else ())
        return self._bind(Counter(PREFIX + name, doc, names, registry=self.registry), extra)

    def _gauge(self, name: str, doc: str, extra: str | None = None) -> Any:
        names = LABELS + ((extra,) if extra else ())
        return self._bind(Gauge(PREFIX + name, doc, names, registry=self.registry), extra)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], extra: str | None = None) -> Any:
        names = LABELS + ((extra,) if extra else ())
        return self._bind(Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry), extra)

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
