"""The operator's own Prometheus metrics, every one defined here once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

# No `*_created` series beside every counter and histogram: they double the
# series count and no dashboard or alert reads them.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS_CREATED = Counter(
    "kubetrain_operator_jobs_created_total", "TrainingJobs the operator started managing.",
    ["namespace", "mode"], registry=REGISTRY,
)  # fmt: skip
JOBS_SUCCEEDED = Counter(
    "kubetrain_operator_jobs_succeeded_total", "TrainingJobs that succeeded.", ["namespace", "mode"], registry=REGISTRY
)
JOBS_FAILED = Counter(
    "kubetrain_operator_jobs_failed_total", "TrainingJobs that failed.", ["namespace", "mode"], registry=REGISTRY
)
REPLICA_RESTARTS = Counter(
    "kubetrain_operator_replica_restarts_total", "Replicas the operator restarted, by reason.",
    ["namespace", "mode", "reason"], registry=REGISTRY,
)  # fmt: skip
# The restart reasons the engine gives (engine/policy.py Failure.restart_reason; open-ended in principle,
# these cover every one it names). Their series start at 0 with a namespace's jobs: `start_counting`.
RESTART_REASONS = ("Error", "Killed", "Signaled", "TransientError", "Evicted", "Deleted", "Hung", "NodeLost")
JOBS_BY_STATE = Gauge(
    "kubetrain_operator_jobs", "TrainingJobs the operator manages, by state.", ["namespace", "state"], registry=REGISTRY
)
JOBS_WAITING = Gauge(
    "kubetrain_operator_jobs_waiting",
    "TrainingJobs whose replicas wait, by why: Unschedulable (no node fits), ImagePullFailed, VolumePending.",
    ["namespace", "reason"], registry=REGISTRY,
)  # fmt: skip
RECONCILE_SECONDS = Histogram(
    "kubetrain_operator_reconcile_duration_seconds", "Wall time of one reconciliation, I/O included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=REGISTRY,
)  # fmt: skip
RECONCILE_ERRORS = Counter(
    "kubetrain_operator_reconcile_errors_total", "Reconciliations that failed and will be retried.", registry=REGISTRY
)

WORKQUEUE_DEPTH = Gauge(
    "kubetrain_operator_workqueue_depth",
    "Jobs ready to be reconciled and waiting for a worker, by lane: urgent (a replica to replace) or routine.",
    ["lane"], registry=REGISTRY,
)  # fmt: skip
WORKQUEUE_WAIT_SECONDS = Histogram(
    "kubetrain_operator_workqueue_wait_seconds",
    "How long a job waited ready in the work queue before a worker took it, by lane.",
    ["lane"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0), registry=REGISTRY,
)  # fmt: skip
API_REQUESTS = Counter(
    "kubetrain_operator_api_requests_total",
    "Requests the operator's reconciliations made to the Kubernetes API, by HTTP verb and resource "
    "(kopf's watches not counted).",
    ["verb", "resource"], registry=REGISTRY,
)  # fmt: skip
LEADER = Gauge(
    "kubetrain_operator_leader",
    "1 while this operator acts (it holds the leader Lease, or runs without leader election), 0 while it stands by.",
    registry=REGISTRY,
)


def serve(port: int) -> None:
    if port:
        start_http_server(port, addr="0.0.0.0", registry=REGISTRY)


def start_counting(namespace: str, mode: str) -> None:
    """Make the job-end and restart series of (namespace, mode) exist at 0, before anything is counted.

    Prometheus's increase() and rate() see a counter's first sample as its
    start: a series that first appears at 1 (the first job of a namespace to
    fail, its first restart) shows an increase of 0, and the dashboard's
    "Jobs finished" and "Replica restarts" panels stayed empty for it (found by
    tests/operator/test_operator_metrics.py against a real operator). Called
    when a job is first counted, seconds before it can end or restart. At most
    2 + len(RESTART_REASONS) series per namespace and mode.
    """
    JOBS_SUCCEEDED.labels(namespace, mode)
    JOBS_FAILED.labels(namespace, mode)
    for reason in RESTART_REASONS:
        REPLICA_RESTARTS.labels(namespace, mode, reason)
