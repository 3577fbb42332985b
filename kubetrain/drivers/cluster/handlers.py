"""The kopf handlers: thin. Watch events feed an index and a work queue; a bounded pool of
workers reconciles the jobs that changed. `register(ctl)` hands them the operator's state
(state.Controller), made once at start-up by drivers/cluster/run.py.

- Pods and checkpoint claims come from the operator's watch streams into an index by job
  (index.py): no per-job LIST ever. One LIST at start-up before any job is reconciled, and, as a
  safety net for an event a watch missed, one paged LIST of every job's pods each RESYNC_SECONDS,
  its pages spread over RESYNC_PAGE_PAUSE_SECONDS each (workers.resync).
- A job that changed (its spec, one of its pods, a claim) is queued once however many
  events arrived (`workqueue.WorkQueue`); WORKERS threads take jobs from it (workers.py), and a job
  is never reconciled by two workers at once. A running job is queued again when the engine
  asks (at most every 60 s); a finished one costs nothing until its TTL deletes it.
- A round (rounds.py) runs in phases; the engine decides the job's status, refusals included.
- A running job's progress comes from its chief's /metrics, read by a pool of its own
  (scrapes.py): a round takes the latest result and never waits for a tenant's answer.
- A pod is a job's when the job (its uid) or its StatefulSet owns it, not by its labels alone.
- Every API call has a timeout (kube.API_TIMEOUT). A failed round is retried with an
  exponential backoff; after REPORT_AFTER_FAILURES failures in a row the problem (422
  invalid, 429 throttled, 5xx and others) is shown on the job: a condition and an Event (reporting.py).
- What the engine remembers is in the job's status (`status.memory`): a restarted operator,
  or a standby taking over, continues where the last one stopped.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf

from kubetrain.api import GROUP, PLURAL, VERSION
from kubetrain.api.status import to_dict
from kubetrain.engine import kueue
from kubetrain.engine.children import LABEL_JOB
from . import kube, observe
from .state import Controller, JobState
from .workers import resync_loop, start_workers

DOMAIN = "kubetrain.dev"
FINALIZER = f"{DOMAIN}/finalizer"


class EssenceFreeDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base without the object's essence. kopf builds, for every event of every job, the
    "essence" its change handlers compare, with `copy.deepcopy` of the whole object: a job whose spec
    nested a few hundred levels (the API server stores up to 10,000) raised RecursionError there, in
    every event of that job, before any handler of ours could refuse it. kubetrain has no change
    handlers (events only feed the index and the work queue, and the engine reads the spec itself),
    so no essence is ever compared or stored: it is empty, and costs nothing."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}


def register(ctl: Controller) -> None:
    """Register the operator's kopf handlers, each given `ctl`; with Kueue on (ctl.config.kueue), the
    Workloads' watch too (only then: an operator without it neither needs Kueue's CRDs nor asks for
    permissions on them)."""

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        startup(ctl, settings)

    @kopf.on.cleanup()
    def stop_workers(**_: Any) -> None:
        ctl.close()

    # The event handlers are coroutines: kopf runs a plain function in its executor's threads, a hop
    # per watch event (tens of thousands while thousands of jobs start) that waits for a free thread
    # and for the GIL twice. These only index and queue, under locks held for microseconds, so they
    # run on kopf's event loop itself.
    @kopf.on.event(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # kopf's WatchingFn protocol names every keyword
    async def job_event(event: dict[str, Any], **_: Any) -> None:
        on_job(ctl, event)

    @kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # kopf's WatchingFn protocol names every keyword
    async def pod_event(event: dict[str, Any], **_: Any) -> None:
        raw = event.get("object") or {}
        key = ctl.index.index_pod(event.get("type"), raw)
        if key is not None:
            # A pod that died or went is handled ahead of routine rounds (a creation burst, status to follow).
            ctl.queue.add(key, urgent=observe.urgent(event.get("type"), raw))

    @kopf.on.event("", "v1", "persistentvolumeclaims", labels={LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # kopf's WatchingFn protocol names every keyword
    async def claim_event(event: dict[str, Any], **_: Any) -> None:
        key = ctl.index.index_claim(event.get("type"), event.get("object") or {})
        if key is not None:
            ctl.queue.add(key)

    @kopf.on.probe(id="jobs")
    def jobs_probe(**_: Any) -> int:
        return len(ctl.job_states())

    if ctl.config.kueue:
        @kopf.on.event(kueue.GROUP, kueue.VERSION, "workloads", labels={LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # kopf's WatchingFn protocol names every keyword
        async def workload_event(event: dict[str, Any], **_: Any) -> None:
            on_workload(ctl, event)


def startup(ctl: Controller, settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=DOMAIN)
    settings.persistence.diffbase_storage = EssenceFreeDiffBaseStorage(prefix=DOMAIN, key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER  # jobs of the daemon era carry it: kopf removes it
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not a line per watch event
    settings.execution.max_workers = 4  # the sync handlers left (start-up, clean-up, probe); the work is on WORKERS
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    kube.load_config()
    # The pods and claims that exist before any job is reconciled: a round that ran on an empty
    # index would take every running replica for deleted.
    namespaces = ctl.config.namespaces
    for raw in kube.list_labelled("pods", namespaces):
        ctl.index.index_pod("ADDED", raw)
    for raw in kube.list_labelled("persistentvolumeclaims", namespaces):
        ctl.index.index_claim("ADDED", raw)
    if ctl.config.kueue:
        for raw in kube.list_workloads(namespaces):
            ctl.index.index_workload("ADDED", raw)
    kube.set_routine_gate(ctl.queue.wait_urgent_clear)
    start_workers(ctl, ctl.config.workers)
    threading.Thread(target=resync_loop, args=(ctl,), name="resync", daemon=True).start()


def on_job(ctl: Controller, event: dict[str, Any]) -> None:
    raw = event.get("object") or {}
    meta = raw.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event.get("type") == "DELETED":
        ctl.index.forget(key)
        ctl.queue.discard(key)
        ctl.scrapes.forget(key)
        ctl.forget_job(key)
        return
    before = ctl.index.job(key)
    ctl.index.set_job(key, raw)
    state = ctl.known_job(key)
    if before is not None and state is not None and own_status_echo(before, raw, state):
        return
    ctl.queue.add(key)


ECHO_FREE_FIELDS = ("resourceVersion", "managedFields")
"""What a status write changes in a job's metadata: nothing else may differ for its event to be an echo."""


def own_status_echo(before: dict[str, Any], after: dict[str, Any], state: JobState) -> bool:
    """Whether a job's event only shows the status this operator last wrote, and nothing else changed (its
    spec, labels, annotations, deletion, finalizers): the event of the round's own write, which would
    otherwise bring one more round that finds nothing to do. Anything else, or a status someone else
    changed, is queued as usual."""
    if state.status is None or after.get("status") != to_dict(state.status):
        return False

    def rest(body: dict[str, Any]) -> dict[str, Any]:
        meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in ECHO_FREE_FIELDS}
        return {**{k: v for k, v in body.items() if k != "status"}, "metadata": meta}

    return rest(before) == rest(after)


def on_workload(ctl: Controller, event: dict[str, Any]) -> None:
    found = ctl.index.index_workload(event.get("type"), event.get("object") or {})
    if found is None:
        return
    key, name = found
    if event.get("type") == "DELETED":
        # Deleted from outside (the job's own deletion removes the job first): the next round
        # creates it again and the job waits for its admission, as Kueue's own jobs do.
        state = ctl.known_job(key)
        if state is not None:
            state.existing.discard(("Workload", name))
    ctl.queue.add(key)
