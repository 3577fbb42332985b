"""Serve the operator's real metric registry, exercised the way the kopf handlers do, for Prometheus to scrape.

`python operator_metrics.py PORT`. The operator itself needs a Kubernetes API
to reconcile against; this process records what its handlers record for a few
jobs' lives (created, restarted, succeeded, failed, the state gauge, one
reconcile duration every 100 ms, the occasional error), through the same
metric objects, and serves them with the operator's own `serve`.
"""

from __future__ import annotations

import sys
import time

from kubetrain_operator.controller import metrics


def main(port: int) -> None:
    metrics.serve(port)
    for mode in ("Single", "ParameterServer"):
        metrics.JOBS_CREATED.labels("default", mode).inc()
    metrics.REPLICA_RESTARTS.labels("default", "ParameterServer", "Error").inc()
    metrics.JOBS_SUCCEEDED.labels("default", "Single").inc()
    metrics.JOBS_FAILED.labels("default", "ParameterServer").inc(0)
    metrics.JOBS_BY_STATE.labels("default", "Running").set(1)
    metrics.JOBS_BY_STATE.labels("default", "Succeeded").set(1)
    metrics.JOBS_WAITING.labels("default", "Unschedulable").set(1)
    rounds = 0
    while True:
        started = time.monotonic()
        time.sleep(0.01)  # the I/O of one round
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        rounds += 1
        if rounds % 50 == 0:
            metrics.RECONCILE_ERRORS.inc()
        time.sleep(0.09)


if __name__ == "__main__":
    main(int(sys.argv[1]))
