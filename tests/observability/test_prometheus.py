"""Real metrics: the exposition against the catalogue, every dashboard query and alert rule against Prometheus.

The module's Prometheus (tests/observability/conftest.py) scrapes a Single
and an Async parameter-server job every second and loads the alert rules
with every duration divided by 30 (a minute is 2 s). The replicas'
exposition was read once all of them trained; the dashboard queries run
while both jobs train; then each alert's condition is provoked in turn:
killed replicas (a restart storm), a job that never checkpoints (stale
checkpoint), a frozen worker that stalls its job (no progress).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
from catalogue import (
    catalogue, check_against_catalogue, dashboards, merged, queries, variable_queries,
)
from helpers.wait import wait_for
from live import FT, PS, SINGLE, replica_pids

pytestmark = pytest.mark.slow

BOARDS = dashboards()
CATALOGUE = catalogue()
# What Grafana would put in: a 1 s scrape interval gives a rate interval of 4 s; the range is the test's age.
VARIABLES = {"$__rate_interval": "5s", "$__range": "2m", "$namespace": "default", "$job": f"{SINGLE}|{PS}|{FT}"}


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def finite(result: list[dict]) -> list[dict]:
    return [s for s in result if math.isfinite(float(s["value"][1]))]


# The operator's own series come from a real operator reconciling jobs on the test cluster
# (tests/operator/test_operator_metrics.py); here every other query, the trainers'.
PANEL_QUERIES = [(name, title, expr) for name, board in BOARDS.items() for title, expr in queries(board)
                 if "kubetrain_operator_" not in expr]


@pytest.mark.parametrize(
    "board, title, expr", PANEL_QUERIES, ids=[f"{b}:{t}:{i}" for i, (b, t, _) in enumerate(PANEL_QUERIES)]
)
def test_dashboard_query_returns_data(observed, board, title, expr):
    promql = substitute(expr)
    result = wait_for(f"{board}: {title!r}: {promql} to return a number",
                      lambda: finite(observed.prometheus.query(promql)), timeout=30)
    assert result


@pytest.mark.parametrize("board", sorted(b for b in BOARDS if b != "operator"))  # its own: tests/operator
def test_dashboard_variables_list_the_running_jobs(observed, board):
    """`label_values(metric{...}, label)` as Grafana asks it: the namespaces and the jobs that run."""
    found = {}
    for name, definition in variable_queries(BOARDS[board]):
        inner = definition.removeprefix("label_values(").removesuffix(")")
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        series = observed.prometheus.query(f"group by ({label}) ({substitute(selector)})")
        found[name] = {s["metric"][label] for s in series}
    assert found["namespace"] == {"default"}
    assert found["job"] == {SINGLE, PS, FT}


def test_running_trainers_expose_exactly_the_catalogued_metrics(observed):
    """Single, parameter-server shard and workers (Async, TopK), fault-tolerant DDP groups and their
    Lighthouse, scraped while they trained."""
    assert set(observed.expositions) == {"obs-single/single-0", "obs-ps/ps-0", "obs-ps/worker-0", "obs-ps/worker-1",
                                         "obs-ft/ddp-0", "obs-ft/ddp-1", "obs-ft/lighthouse-0"}
    families = merged(list(observed.expositions.values()))
    check_against_catalogue("trainer", families)
    # The labelled families had samples: their extra label was checked, not just their name.
    for name in ("kubetrain_gradient_bytes_total", "kubetrain_network_bytes_total", "kubetrain_rpc_duration_seconds"):
        assert families[name][2], f"{name}: no sample while the PS job trained"
    for name, entry in CATALOGUE.items():
        if entry.side == "process":
            assert families[name][0] == entry.type, name


def firing_jobs(observed, alert: str) -> set[str]:
    return {a["labels"]["job"] for a in observed.prometheus.firing(alert)}


def test_restart_storm_fires_when_a_replica_keeps_dying(observed):
    """--fault killed single-0's first attempt; each later one is killed once Prometheus has seen it."""
    run, prometheus = observed.runs[SINGLE], observed.prometheus
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while SINGLE not in firing_jobs(observed, "KubetrainRestartStorm"):
        assert time.monotonic() < deadline, f"no restart storm after {len(seen)} processes of single-0"

        def new_process():
            values = {s["value"][1] for s in prometheus.query(f'process_start_time_seconds{{job="{SINGLE}"}}')}
            return values - seen

        seen |= wait_for("a new single-0 process to be scraped", new_process, timeout=60)
        if SINGLE in firing_jobs(observed, "KubetrainRestartStorm"):
            break
        for pid in replica_pids(run.run_dir, "single-0"):
            os.killpg(pid, signal.SIGKILL)
        time.sleep(1)
    restarts = json.loads((run.run_dir / "state.json").read_text())["restart_log"]
    assert len(restarts) >= 3 and restarts[0]["exit_code"] == 128 + signal.SIGKILL
    assert PS not in firing_jobs(observed, "KubetrainRestartStorm")


def test_checkpoint_stale_fires_for_a_job_that_trains_without_checkpoints(observed):
    """obs-ps checkpoints only at its (never reached) end; obs-single every 50 steps."""
    wait_for("KubetrainCheckpointStale for obs-ps", lambda: PS in firing_jobs(observed, "KubetrainCheckpointStale"),
             timeout=90)
    assert SINGLE not in firing_jobs(observed, "KubetrainCheckpointStale")


def test_no_progress_fires_when_a_frozen_worker_stalls_its_job(observed):
    """SIGSTOP worker-1 of the Async job: worker-0 runs maxStaleness steps ahead and then waits for it."""
    run = observed.runs[PS]
    assert PS not in firing_jobs(observed, "KubetrainJobNoProgress"), "fired before the job stalled"
    pid = run.pid("worker-1")
    os.killpg(pid, signal.SIGSTOP)
    try:
        wait_for("KubetrainJobNoProgress for obs-ps",
                 lambda: PS in firing_jobs(observed, "KubetrainJobNoProgress"), timeout=90)
        assert SINGLE not in firing_jobs(observed, "KubetrainJobNoProgress")
    finally:
        os.killpg(pid, signal.SIGCONT)
