"""The operator's workers: threads that take jobs from the work queue and run their rounds
(rounds.py), retrying a failed round with backoff and reporting what failed; and the resync, the
safety net that lists every job's pods afresh in case a watch missed an event."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any

from . import kube, metrics, rounds
from .index import Key, job_of, observed_pod
from .reporting import report_api_error, report_forbidden, report_problem
from .state import Controller

log = logging.getLogger("kubetrain.operator")

URGENT_WORKERS = 1
"""Workers that take urgent keys only (a replica to replace), beside the WORKERS that take both: a
replacement never waits for a worker busy with a long routine round (a large job's creation)."""
RESYNC_SECONDS = 300.0
"""Every job's pods are listed afresh this often, in case the watch missed an event: one paged LIST
for the operator, not one per job (at 1,000 running jobs that was 3.3 requests a second, more than
all the rest of a quiet cluster's)."""
RESYNC_PAGE_PAUSE_SECONDS = 1.0
"""Between two pages (kube.LIST_PAGE pods each) of a resync: 15,000 pods take 30 pages over 30 s
instead of one burst."""


def start_workers(ctl: Controller, count: int) -> None:
    for n in range(URGENT_WORKERS + count - len(ctl.workers)):
        urgent_only = len(ctl.workers) < URGENT_WORKERS
        worker = threading.Thread(target=work, args=(ctl, urgent_only), daemon=True,
                                  name=f"reconcile-urgent-{n}" if urgent_only else f"reconcile-{n}")
        worker.start()
        ctl.workers.append(worker)


def work(ctl: Controller, urgent_only: bool = False) -> None:
    while True:
        key = ctl.queue.get(urgent_only=urgent_only)
        if key is None:
            return
        try:
            with kube.urgent() if ctl.queue.handed_urgent(key) else nullcontext():
                process(ctl, key)  # type: ignore[arg-type]  # the queue holds (namespace, name) keys
        finally:
            ctl.queue.done(key)


def process(ctl: Controller, key: Key) -> None:
    """One round of the job `key`; a failed one is reported (reporting.py) and retried with backoff."""
    body = ctl.index.job(key)
    if body is None:
        return  # deleted meanwhile
    state = ctl.job_state(key)
    start = time.monotonic()
    try:
        delay = rounds.reconcile_once(ctl, body, state)
    except (kube.KubeError, kube.NotOurs, kube.NotServed) as err:
        metrics.RECONCILE_ERRORS.inc()
        _report(ctl, body, key, err)
        ctl.queue.add_after(key, ctl.queue.backoff(key))
    except Exception:  # a bug must not stop the worker: log it and retry the job later
        metrics.RECONCILE_ERRORS.inc()
        log.exception("%s/%s: reconciliation failed; retrying", *key)
        ctl.queue.add_after(key, ctl.queue.backoff(key))
    else:
        ctl.queue.forget(key)
        if delay is not None:
            ctl.queue.add_after(key, delay)
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - start)


def _report(ctl: Controller, body: dict[str, Any], key: Key,
            err: kube.KubeError | kube.NotOurs | kube.NotServed) -> None:
    state = ctl.job_state(key)
    if isinstance(err, kube.NotOurs):
        report_problem(ctl, body, state, "ChildConflict", str(err))
    elif isinstance(err, kube.NotServed):
        # The PodGroup's CRD is missing: nothing of the job past its PodGroup is made (no pod runs
        # ungrouped). Retried with backoff, so installing the scheduler lets the job go on by itself.
        report_problem(ctl, body, state, "PodGroupCRDMissing",
                       f"{err} Install it, or remove spec.runPolicy.schedulingPolicy; retrying with backoff.")
    elif err.status == 403:
        report_forbidden(ctl, body, state, err)
    else:
        report_api_error(ctl, body, state, key, err)


def resync_loop(ctl: Controller) -> None:
    """The safety net: every job's pods listed afresh each RESYNC_SECONDS, the jobs a watch left stale
    queued (routine). A failed LIST is logged and tried again next period."""
    while not ctl.queue.wait_closed(RESYNC_SECONDS):
        try:
            resync(ctl)
        except Exception:  # noqa: BLE001 - the thread must live on; the watches still carry the truth
            log.exception("pod resync failed; trying again in %.0f s", RESYNC_SECONDS)


def resync(ctl: Controller) -> set[Key]:
    started = time.monotonic()
    listed: dict[Key, dict[str, Any]] = {}
    for raw in kube.list_labelled("pods", ctl.config.namespaces, pause=RESYNC_PAGE_PAUSE_SECONDS):
        found = job_of(raw)
        if found is not None:
            key, name = found
            listed.setdefault(key, {})[name] = (observed_pod(raw), (raw.get("metadata") or {}).get("resourceVersion", ""))
    changed = ctl.index.resync({k: {n: v for n, v in pods.items() if v[0] is not None} for k, pods in listed.items()},
                               started)
    for key in changed:
        log.info("%s/%s: pods corrected by the resync (a watch event was missed)", *key)
        ctl.queue.add(key)
    return changed
