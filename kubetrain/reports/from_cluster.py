"""A cluster job as a report's run: its status (the summary's figures) and its series read from Prometheus.

The figures are the job's status, the same numbers `kubectl get tj -o yaml`
shows: steps, final loss, eval accuracy, samples per second, restarts, wall
time. The curves come from range queries of the catalogue's metrics
(docs/metrics.md) over the job's run, by its `namespace` and `job` labels:
the chief's `kubetrain_training_step` and `kubetrain_loss` become the `train`
events a local run writes, `kubetrain_eval_accuracy` its `eval` events,
every replica's `kubetrain_samples_total` the throughput, and a replica whose
`process_start_time_seconds` changes restarted there. The report built from
them is the same as a local run's (report.py).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from kubetrain.shared.timestamps import parse_iso

from kubetrain.engine.plan import chief
from kubetrain.drivers.local.summary import SUMMARY_KEYS
from .runs import Recovery, ReportError, RunData

MAX_POINTS = 5000
"""Samples per series of one range query: the step is the run's length over this (at least 1 s, the tests'
scrape interval). Prometheus refuses more than 11,000 points a series; 5,000 draw every wiggle a plot of
11 inches can show."""
QUERY_TIMEOUT = 30.0
"""Seconds to wait for Prometheus to answer one range query (a few series over hours: milliseconds)."""


class Prometheus:
    """Range queries of one Prometheus server's HTTP API."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step:.3f}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{params}", timeout=QUERY_TIMEOUT) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise ReportError(f"Prometheus at {self.url}: {query}: {err.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ReportError(f"Prometheus at {self.url} cannot be read: {err}") from None
        if body.get("status") != "success":
            raise ReportError(f"Prometheus at {self.url}: {query}: {body.get('error', body)}")
        return body["data"]["result"]


def _series(prom: Prometheus, metric: str, labels: str, start: float, end: float, step: float,
            ) -> dict[str, list[tuple[float, float]]]:
    """replica -> [(unix time, value)] of `metric`, finite values only (an unset gauge reads NaN)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in prom.range(f"{metric}{{{labels}}}", start, end, step):
        replica = s["metric"].get("replica", "")
        out[replica] += [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))]
    for points in out.values():
        points.sort()
    return dict(out)


def _at(points: list[tuple[float, float]], t: float) -> float | None:
    """The value of a series at time t (its latest sample at or before t)."""
    value = None
    for when, v in points:
        if when > t:
            break
        value = v
    return value


def counter_total(points: list[tuple[float, float]]) -> float:
    """What a counter counted over the series, across resets (a restarted process counts from 0 again)."""
    total, last = 0.0, None
    for _, v in points:
        total += v if last is None or v < last else v - last
        last = v
    return total


class JobSeries:
    """Range queries of one job's series (its `namespace` and `job` labels) over its run, by replica."""

    def __init__(self, prom: Prometheus, namespace: str, name: str, start: float, end: float):
        # A few more scrapes after the end: the last samples of the processes' final steps.
        self.step = max(1.0, (end - start) / MAX_POINTS)
        self.prom = prom
        self.labels = f'namespace="{namespace}",job="{name}"'
        self.start, self.until = start, end + 10 * self.step

    def get(self, metric: str, extra: str = "") -> dict[str, list[tuple[float, float]]]:
        labels = f"{self.labels},{extra}" if extra else self.labels
        return _series(self.prom, metric, labels, self.start, self.until, self.step)


def cluster_run(backend: Any, name: str, url: str, label: str | None = None) -> RunData:
    """A cluster TrainingJob (through the client's cluster backend) as a report's run; ReportError on a job
    that has not run or a Prometheus that cannot be read."""
    job = backend.spec(name)
    status = backend.get(name)
    start = parse_iso(status.start_time)
    if start is None:
        raise ReportError(f"tj/{name}: has not started (no status.startTime)")
    end = max(parse_iso(status.completion_time) or time.time(), start + 1)
    query = JobSeries(Prometheus(url), job.metadata.namespace, name, start, end)
    steps = query.get("kubetrain_training_step")
    if not steps:
        raise ReportError(f"tj/{name}: Prometheus at {url} holds no kubetrain_training_step series of the job "
                          f"({query.labels}) between its start and its end: does it scrape the job's pods?")
    head = chief(job)
    events = _events(steps, query.get("kubetrain_loss"), query.get("kubetrain_samples_total"),
                     query.get("kubetrain_eval_accuracy"))
    totals, results = _traffic(query)
    summary = _summary(name, job, status, end - start, query.get("kubetrain_eval_loss").get(head), totals, results)
    recoveries = _recoveries(backend, name, query.get("process_start_time_seconds"), steps, head)
    return RunData(path=Path(f"tj/{name}"), label=label or name, job=job, summary=summary, results=results,
                   events=events, recoveries=recoveries, start_time=start)


def _events(steps: dict[str, list[tuple[float, float]]], losses: dict[str, list[tuple[float, float]]],
            samples: dict[str, list[tuple[float, float]]],
            accuracy: dict[str, list[tuple[float, float]]]) -> dict[str, list[dict[str, Any]]]:
    """The `train` and `eval` events a local run writes, per replica, from its series."""
    events: dict[str, list[dict[str, Any]]] = {}
    for replica, points in steps.items():
        out: list[dict[str, Any]] = []
        last_step = None
        for t, value in points:
            if value == last_step:
                continue  # a scrape between two steps
            last_step = value
            event: dict[str, Any] = {"time": t, "event": "train", "step": int(value)}
            loss = _at(losses.get(replica, []), t)
            if loss is not None:
                event["loss"] = loss
            count = _at(samples.get(replica, []), t)
            if count is not None:
                event["samples"] = int(count)
            out.append(event)
        last_accuracy = None
        for t, value in accuracy.get(replica, []):
            if value != last_accuracy and value > 0:  # 0: not evaluated yet (docs/metrics.md)
                last_accuracy = value
                out.append({"time": t, "event": "eval", "step": int(_at(points, t) or 0), "eval_accuracy": value})
        events[replica] = sorted(out, key=lambda e: e["time"])
    return events


def _traffic(query: JobSeries) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(network bytes sent and received by the whole job, each replica's raw and compressed gradient bytes)."""
    totals = {what: sum(counter_total(p) for p in query.get(
        "kubetrain_network_bytes_total", f'direction="{what}"').values()) for what in ("sent", "received")}
    gradients = {stage: query.get("kubetrain_gradient_bytes_total", f'stage="{stage}"')
                 for stage in ("raw", "compressed")}
    results = {r: {"raw_gradient_bytes": counter_total(gradients["raw"].get(r, [])),
                   "compressed_gradient_bytes": counter_total(gradients["compressed"].get(r, []))}
               for r in set(gradients["raw"]) | set(gradients["compressed"])}
    return totals, results


def _summary(name: str, job: Any, status: Any, seconds: float, head_eval_loss: list[tuple[float, float]] | None,
             totals: dict[str, float], results: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The summary.json figures a local run writes, from the job's status and its traffic."""
    raw = sum(r["raw_gradient_bytes"] for r in results.values())
    compressed = sum(r["compressed_gradient_bytes"] for r in results.values())
    progress = status.progress
    summary: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)
    summary.update({
        "name": name,
        "mode": job.spec.mode,
        "state": status.state,
        "steps": progress.step if progress is not None else None,
        "eval_accuracy": progress.eval_accuracy if progress is not None else None,
        "eval_loss": head_eval_loss[-1][1] if head_eval_loss else None,
        "final_train_loss": progress.loss if progress is not None else None,
        "samples_per_second": progress.samples_per_second if progress is not None else None,
        "wall_seconds": round(seconds, 3) if status.completion_time else None,
        "restarts": status.restarts,
        "bytes_sent": int(totals["sent"]),
        "bytes_received": int(totals["received"]),
        "compression_ratio": round(raw / compressed, 4) if compressed else 1.0,
    })
    if progress is not None and progress.metrics:
        summary["metrics"] = dict(progress.metrics)
    return summary


def _recoveries(backend: Any, name: str, starts: dict[str, list[tuple[float, float]]],
                steps: dict[str, list[tuple[float, float]]], head: str) -> list[Recovery]:
    """A replica restarted where its process_start_time_seconds changed: the new process's start is when its
    failure was acted on (a pod is replaced within a second or two of its end), its first step after that when
    it trained again. The reason is the job's Event that names the replica, in order."""
    reasons: dict[str, list[str]] = defaultdict(list)
    for e in backend.events(name):
        if e.type == "Warning" and e.message.split(" ", 1)[0] in starts:
            reasons[e.message.split(" ", 1)[0]] += [e.reason] * max(1, e.count)
    out = []
    for replica, points in starts.items():
        seen = sorted({v for _, v in points})
        for n, began in enumerate(seen[1:]):
            mine = steps.get(replica, [])
            before = _at(steps.get(head, mine), began)
            after = [(t, v) for t, v in mine if t >= began]
            first = after[0][1] if after else None
            trained = next((t for t, v in after if first is not None and v > first), None)
            out.append(Recovery(
                replica=replica, reason=reasons[replica][n] if n < len(reasons[replica]) else "",
                exit_code=None, failed_at=began, failed_step=int(before) if before is not None else None,
                resumed_step=int(first) if first is not None else None,
                recovery_seconds=trained - began if trained is not None else None))
    return sorted(out, key=lambda r: r.failed_at)
