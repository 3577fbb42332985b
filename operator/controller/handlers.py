"""The kopf handlers: thin. Watch events feed an index and a work queue; a bounded pool of
workers reconciles the jobs that changed.

- Pods and checkpoint claims come from the operator's watch streams into an index by job
  (`Index`): no per-job LIST ever. One LIST at start-up before any job is reconciled, and, as a
  safety net for an event a watch missed, one paged LIST of every job's pods each RESYNC_SECONDS,
  its pages spread over RESYNC_PAGE_PAUSE_SECONDS each (`resync`).
- A job that changed (its spec, one of its pods, a claim) is queued once however many
  events arrived (`workqueue.WorkQueue`); WORKERS threads take jobs from it, and a job is
  never reconciled by two workers at once. A running job is queued again when the engine
  asks (at most every 10 s); a finished one costs nothing until its TTL deletes it.
- A running job's progress comes from its chief's /metrics, read by a pool of its own
  (scrapes.py): a round takes the latest result and never waits for a tenant's answer.
- A pod is a job's when the job (its uid) or its StatefulSet owns it, not by its labels alone.
- Every API call has a timeout (kube.API_TIMEOUT). A failed round is retried with an
  exponential backoff; after REPORT_AFTER_FAILURES failures in a row the problem (422
  invalid, 429 throttled, 5xx and others) is shown on the job: a condition and an Event.
- What the engine remembers is in the job's status (`status.memory`): a restarted operator,
  or a standby taking over, continues where the last one stopped.
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kopf

from ..api import GROUP, PLURAL, VERSION, InvalidSpec, from_spec_dict
from ..api.podtemplate import SECURITY_CHECKS
from ..core import kueue, podsecurity
from ..core.children import LABEL_JOB, Settings
from ..api.status import read_status, to_dict
from ..core import engine
from ..core.engine import WAITING_REASONS, Refusal, ReplicaObservation
from ..core.gang import gang_problem
from ..core.plan import chief
from ..core.reconcile import reconcile
from ..core.conditions import TERMINAL
from . import kube, metrics, observe, scrapes
from .workqueue import WorkQueue

log = logging.getLogger("kubetrain.operator")

DOMAIN = "kubetrain.dev"
FINALIZER = f"{DOMAIN}/finalizer"

WORKERS = 8
"""Reconcile workers. A round is a few API calls at most (milliseconds each), so 8 keep up with
thousands of jobs; more would only multiply concurrent calls against the API server."""
MAX_WORKERS = 64
"""The most `--workers` takes: the rounds share one interpreter (the GIL), and each worker holds an
API connection of its own; beyond this they only contend."""
RESYNC_SECONDS = 300.0
"""Every job's pods are listed afresh this often, in case the watch missed an event: one paged LIST
for the operator, not one per job (at 1,000 running jobs that was 3.3 requests a second, more than
all the rest of a quiet cluster's)."""
RESYNC_PAGE_PAUSE_SECONDS = 1.0
"""Between two pages (kube.LIST_PAGE pods each) of a resync: 15,000 pods take 30 pages over 30 s
instead of one burst."""
EXPECTATION_SECONDS = 30.0
"""A pod this operator created is taken as Pending for up to this long before the watch shows it,
so a round that runs before the watch event does not take it for deleted."""
REPORT_AFTER_FAILURES = 3
"""Rounds that failed in a row on an API error before the error is shown on the job."""
API_PROBLEMS = {422: "ApiInvalid", 429: "ApiThrottled"}  # others: ApiError (5xx: the server's own trouble)


@dataclass
class OperatorConfig:
    settings: Settings = field(default_factory=Settings)
    scrape_networks: list[str] = field(default_factory=list)  # empty: scrape any pod IP
    scrape: bool = True
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    workers: int = WORKERS
    kueue: bool = False  # jobs labelled kueue.x-k8s.io/queue-name wait for Kueue's admission (enable_kueue)


CONFIG = OperatorConfig()


@dataclass
class JobState:
    """What this operator process remembers of a job beyond its status (rebuilt after a restart)."""

    status: dict[str, Any] | None = None  # the last status written: the watch's copy may lag behind
    existing: set[tuple[str, str]] = field(default_factory=set)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    counted_created: bool = False
    expected: dict[str, float] = field(default_factory=dict)  # replica -> when its pod was created (monotonic)
    problem: str | None = None  # the API problem reason shown on the job, if any
    placements: tuple[str, dict[str, Any]] | None = None  # (the Workload's admission as JSON, role -> Placement)
    pod_security: tuple[tuple[str, int], list[str]] | None = None  # ((uid, generation), its refusals)


Key = tuple[str, str]  # (namespace, job name)


class Index:
    """Jobs, their pods and their claims as the watches last showed them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.pods: dict[Key, dict[str, tuple[observe.Owner, ReplicaObservation]]] = {}  # job -> pod name -> (its owner, observation)
        self.versions: dict[Key, dict[str, tuple[str, float]]] = {}  # job -> pod name -> (resourceVersion, indexed at)
        self.claims: dict[Key, dict[str, str]] = {}  # job -> claim name -> phase
        self.workloads: dict[Key, dict[str, dict[str, Any]]] = {}  # job -> Kueue Workload name -> object

    def job(self, key: Key) -> dict[str, Any] | None:
        with self.lock:
            return self.jobs.get(key)

    def replicas(self, key: Key, uid: str) -> dict[str, ReplicaObservation]:
        """The replicas of the job `key` whose uid is `uid`: pods labelled with its name and owned by it
        (or by its StatefulSet). A label is anyone's to set; a pod another job's template (or another
        tenant) labelled as this job's replica once made the job Succeeded, or restarted."""
        with self.lock:
            return {o.replica: o for owner, o in (self.pods.get(key) or {}).values()
                    if observe.owned_by(owner, key[1], uid)}

    def set_pod(self, key: Key, name: str, seen: tuple[observe.Owner, ReplicaObservation] | None,
                version: str = "") -> None:
        with self.lock:
            self._set_pod(key, name, seen, version)

    def _set_pod(self, key: Key, name: str, seen: tuple[observe.Owner, ReplicaObservation] | None,
                 version: str) -> None:
        pods, versions = self.pods.setdefault(key, {}), self.versions.setdefault(key, {})
        if seen is None:
            pods.pop(name, None)
            versions.pop(name, None)
        else:
            pods[name] = seen
            versions[name] = (version, time.monotonic())
        if not pods:
            del self.pods[key]
            self.versions.pop(key, None)

    def resync(self, listed: dict[Key, dict[str, tuple[tuple[observe.Owner, ReplicaObservation] | None, str]]],
               started: float) -> set[Key]:
        """Correct the index from a LIST begun at `started` (monotonic): what a watch missed. Returns the
        jobs whose pods changed.

        A pod the list has and the index lacks is added; one whose resourceVersion differs is taken from
        the list; one the index has and the list lacks is removed; but an entry the watch wrote after the
        list began is newer than the list and stays (a pod just created or changed).
        """
        changed: set[Key] = set()
        with self.lock:
            for key in set(listed) | set(self.pods):
                mine, versions = self.pods.get(key) or {}, self.versions.get(key) or {}
                theirs = listed.get(key) or {}
                for name, (seen, version) in theirs.items():
                    have = versions.get(name)
                    if name not in mine or (have is not None and have[0] != version and have[1] < started):
                        self._set_pod(key, name, seen, version)
                        changed.add(key)
                for name in [n for n in mine if n not in theirs]:
                    if versions.get(name, ("", 0.0))[1] < started:
                        self._set_pod(key, name, None, "")
                        changed.add(key)
        return changed

    def pending_claims(self, key: Key) -> list[str]:
        with self.lock:
            return sorted(n for n, phase in (self.claims.get(key) or {}).items() if phase == "Pending")

    def claim_holder(self, namespace: str, claim: str) -> str | None:
        """The job whose checkpoint claim `claim` is (by its label), in `namespace`; None for a claim
        kubetrain did not make (or has not seen)."""
        with self.lock:
            return next((job for (ns, job), claims in self.claims.items() if ns == namespace and claim in claims),
                        None)

    def set_claim(self, key: Key, name: str, phase: str | None) -> None:
        with self.lock:
            claims = self.claims.setdefault(key, {})
            if phase is None:
                claims.pop(name, None)
            else:
                claims[name] = phase

    def workload(self, key: Key, name: str) -> dict[str, Any] | None:
        with self.lock:
            return (self.workloads.get(key) or {}).get(name)

    def set_workload(self, key: Key, name: str, raw: dict[str, Any] | None) -> None:
        with self.lock:
            workloads = self.workloads.setdefault(key, {})
            if raw is None:
                workloads.pop(name, None)
                if not workloads:
                    del self.workloads[key]
            else:
                workloads[name] = raw

    def forget(self, key: Key) -> None:
        with self.lock:
            self.jobs.pop(key, None)


INDEX = Index()
QUEUE = WorkQueue(on_wait=lambda lane, seconds: metrics.WORKQUEUE_WAIT_SECONDS.labels(lane).observe(seconds))
for _lane in ("urgent", "routine"):
    metrics.WORKQUEUE_DEPTH.labels(_lane).set_function(lambda lane=_lane: QUEUE.depth()[lane])
SCRAPES = scrapes.Scrapes(on_change=QUEUE.add)
JOBS: dict[Key, JobState] = {}
JOBS_LOCK = threading.Lock()
_WORKERS: list[threading.Thread] = []


def job_state(namespace: str, name: str) -> JobState:
    with JOBS_LOCK:
        return JOBS.setdefault((namespace, name), JobState())


class EssenceFreeDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base without the object's essence. kopf builds, for every event of every job, the
    "essence" its change handlers compare, with `copy.deepcopy` of the whole object: a job whose spec
    nested a few hundred levels (the API server stores up to 10,000) raised RecursionError there, in
    every event of that job, before any handler of ours could refuse it. kubetrain has no change
    handlers (events only feed the index and the work queue, and the engine reads the spec itself),
    so no essence is ever compared or stored: it is empty, and costs nothing."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=DOMAIN)
    settings.persistence.diffbase_storage = EssenceFreeDiffBaseStorage(prefix=DOMAIN, key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER  # jobs of the daemon era carry it: kopf removes it
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not a line per watch event
    settings.execution.max_workers = 4  # the handlers only index and queue; the work is on WORKERS
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    kube.load_config()
    # The pods and claims that exist before any job is reconciled: a round that ran on an empty
    # index would take every running replica for deleted.
    for raw in kube.list_labelled("pods", CONFIG.namespaces):
        _index_pod("ADDED", raw)
    for raw in kube.list_labelled("persistentvolumeclaims", CONFIG.namespaces):
        _index_claim("ADDED", raw)
    if CONFIG.kueue:
        for raw in kube.list_workloads(CONFIG.namespaces):
            _index_workload("ADDED", raw)
    start_workers(CONFIG.workers)
    threading.Thread(target=_resync_loop, name="resync", daemon=True).start()


def _resync_loop() -> None:
    """The safety net: every job's pods listed afresh each RESYNC_SECONDS, the jobs a watch left stale
    queued (routine). A failed LIST is logged and tried again next period."""
    while not QUEUE.wait_closed(RESYNC_SECONDS):
        try:
            resync()
        except Exception:  # noqa: BLE001 - the thread must live on; the watches still carry the truth
            log.exception("pod resync failed; trying again in %.0f s", RESYNC_SECONDS)


def resync() -> set[Key]:
    started = time.monotonic()
    listed: dict[Key, dict[str, Any]] = {}
    for raw in kube.list_labelled("pods", CONFIG.namespaces, pause=RESYNC_PAGE_PAUSE_SECONDS):
        found = _job_of(raw)
        if found is not None:
            key, name = found
            listed.setdefault(key, {})[name] = (_observed_pod(raw), (raw.get("metadata") or {}).get("resourceVersion", ""))
    changed = INDEX.resync({k: {n: v for n, v in pods.items() if v[0] is not None} for k, pods in listed.items()},
                           started)
    for key in changed:
        log.info("%s/%s: pods corrected by the resync (a watch event was missed)", *key)
        QUEUE.add(key)
    return changed


URGENT_WORKERS = 1
"""Workers that take urgent keys only (a replica to replace), beside the WORKERS that take both: a
replacement never waits for a worker busy with a long routine round (a large job's creation)."""


def start_workers(count: int) -> None:
    for n in range(URGENT_WORKERS + count - len(_WORKERS)):
        urgent_only = len(_WORKERS) < URGENT_WORKERS
        worker = threading.Thread(target=_work, args=(urgent_only,), daemon=True,
                                  name=f"reconcile-urgent-{n}" if urgent_only else f"reconcile-{n}")
        worker.start()
        _WORKERS.append(worker)


@kopf.on.cleanup()
def stop_workers(**_: Any) -> None:
    QUEUE.close()
    SCRAPES.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(event: dict[str, Any], **_: Any) -> None:
    raw = event.get("object") or {}
    meta = raw.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event.get("type") == "DELETED":
        INDEX.forget(key)
        QUEUE.discard(key)
        SCRAPES.forget(key)
        with JOBS_LOCK:
            JOBS.pop(key, None)
        _update_state_gauge()
        return
    with INDEX.lock:
        INDEX.jobs[key] = raw
    QUEUE.add(key)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_event(event: dict[str, Any], **_: Any) -> None:
    raw = event.get("object") or {}
    key = _index_pod(event.get("type"), raw)
    if key is not None:
        # A pod that died or went is handled ahead of routine rounds (a creation burst, status to follow).
        QUEUE.add(key, urgent=observe.urgent(event.get("type"), raw))


@kopf.on.event("", "v1", "persistentvolumeclaims", labels={LABEL_JOB: kopf.PRESENT})
def claim_event(event: dict[str, Any], **_: Any) -> None:
    key = _index_claim(event.get("type"), event.get("object") or {})
    if key is not None:
        QUEUE.add(key)


def enable_kueue() -> None:
    """Kueue admission on (`--kueue`): watch the jobs' Workloads. Registered only then, so that an
    operator without it neither needs Kueue's CRDs nor asks for permissions on them."""
    CONFIG.kueue = True
    kopf.on.event(kueue.GROUP, kueue.VERSION, "workloads", labels={LABEL_JOB: kopf.PRESENT})(workload_event)


def workload_event(event: dict[str, Any], **_: Any) -> None:
    key = _index_workload(event.get("type"), event.get("object") or {})
    if key is not None:
        QUEUE.add(key)


def _index_workload(kind: str | None, raw: dict[str, Any]) -> Key | None:
    found = _job_of(raw)
    if found is None:
        return None
    key, name = found
    INDEX.set_workload(key, name, None if kind == "DELETED" else raw)
    if kind == "DELETED":
        # Deleted from outside (the job's own deletion removes the job first): the next round
        # creates it again and the job waits for its admission, as Kueue's own jobs do.
        with JOBS_LOCK:
            state = JOBS.get(key)
        if state is not None:
            state.existing.discard(("Workload", name))
    return key


def _job_of(raw: dict[str, Any]) -> tuple[Key, str] | None:
    """(the job's key, the object's name) of a pod or claim labelled with its job; None otherwise."""
    meta = raw.get("metadata") or {}
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    return ((meta.get("namespace", ""), job), meta.get("name", "")) if job else None


def _index_pod(kind: str | None, raw: dict[str, Any]) -> Key | None:
    found = _job_of(raw)
    if found is None:
        return None
    key, name = found
    INDEX.set_pod(key, name, None if kind == "DELETED" else _observed_pod(raw),
                  (raw.get("metadata") or {}).get("resourceVersion", ""))
    return key


def _observed_pod(raw: dict[str, Any]) -> tuple[observe.Owner, ReplicaObservation] | None:
    seen = observe.pod_observation(raw)
    return None if seen is None else (observe.owner_of(raw), seen)


def _index_claim(kind: str | None, raw: dict[str, Any]) -> Key | None:
    found = _job_of(raw)
    if found is None:
        return None
    key, name = found
    INDEX.set_claim(key, name, None if kind == "DELETED" else ((raw.get("status") or {}).get("phase") or "Pending"))
    return key


def _work(urgent_only: bool = False) -> None:
    while True:
        key = QUEUE.get(urgent_only=urgent_only)
        if key is None:
            return
        try:
            _process(key)
        finally:
            QUEUE.done(key)


def _process(key: Key) -> None:
    body = INDEX.job(key)
    if body is None:
        return  # deleted meanwhile
    ns, name = key
    state = job_state(ns, name)
    start = time.monotonic()
    try:
        delay = reconcile_once(body, state)
    except kube.KubeError as err:
        metrics.RECONCILE_ERRORS.inc()
        if err.status == 403:
            _report_forbidden(body, state, err)
        else:
            _report_api_error(body, state, key, err)
        QUEUE.add_after(key, QUEUE.backoff(key))
    except kube.NotOurs as err:
        metrics.RECONCILE_ERRORS.inc()
        _report_problem(body, state, "ChildConflict", str(err))
        QUEUE.add_after(key, QUEUE.backoff(key))
    except kube.NotServed as err:
        # The PodGroup's CRD is missing: nothing of the job past its PodGroup is made (no pod runs
        # ungrouped). Retried with backoff, so installing the scheduler lets the job go on by itself.
        metrics.RECONCILE_ERRORS.inc()
        _report_problem(body, state, "PodGroupCRDMissing",
                        f"{err} Install it, or remove spec.runPolicy.schedulingPolicy; retrying with backoff.")
        QUEUE.add_after(key, QUEUE.backoff(key))
    except Exception:  # a bug must not stop the worker: log it and retry the job later
        metrics.RECONCILE_ERRORS.inc()
        log.exception("%s/%s: reconciliation failed; retrying", ns, name)
        QUEUE.add_after(key, QUEUE.backoff(key))
    else:
        QUEUE.forget(key)
        if delay is not None:
            QUEUE.add_after(key, delay)
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - start)


def _report_api_error(body: dict[str, Any], state: JobState, key: Key, err: kube.KubeError) -> None:
    """Retried with backoff; shown on the job once it failed REPORT_AFTER_FAILURES rounds in a row."""
    ns, name = key
    failures = QUEUE.failures(key) + 1
    log.warning("%s/%s: %s (failure %d in a row); retrying", ns, name, err, failures)
    if failures < REPORT_AFTER_FAILURES:
        return
    reason = API_PROBLEMS.get(err.status or 0, "ApiError")
    _report_problem(body, state, reason, f"{err}; failed {failures} times in a row, retrying with backoff.")


def _report_problem(body: dict[str, Any], state: JobState, reason: str, message: str) -> None:
    meta = body["metadata"]
    log.error("%s/%s: %s", meta["namespace"], meta["name"], message)
    if state.problem == reason:
        return  # shown already
    old = _last_status(body, state)
    try:
        noted = engine.note(read_status(old), engine.Problem(reason, message), _now(), meta.get("generation", 0))
        _write_status(meta["namespace"], meta["name"], state, old, to_dict(noted))
        kube.record_event(body, "Warning", reason, message)
        state.problem = reason
    except kube.KubeError as second:
        log.error("%s/%s: cannot report that in the status either: %s", meta["namespace"], meta["name"], second)


def _report_forbidden(body: dict[str, Any], state: JobState, err: kube.KubeError) -> None:
    """RBAC refused an operation: say which, in the log and (where still allowed) the job's status."""
    message = (f"{err}. The operator's ServiceAccount lacks this permission: the chart's Role or ClusterRole "
               "(charts/kubetrain/templates/rbac.yaml) grants it; retrying.")
    _report_problem(body, state, "Forbidden", message)


def _last_status(body: dict[str, Any], state: JobState) -> dict[str, Any]:
    """The job's status as last written (the API's copy may lag behind), to change freely."""
    return copy.deepcopy(state.status if state.status is not None else dict(body.get("status") or {}))


def _now() -> float:
    return time.time()


def observed_replicas(key: Key, uid: str, state: JobState) -> dict[str, ReplicaObservation]:
    """The job's replicas from the index, with the pods this operator just created and the watch
    has not shown yet taken as Pending."""
    now = time.monotonic()
    replicas = INDEX.replicas(key, uid)
    for replica, created in list(state.expected.items()):
        if replica in replicas or now - created > EXPECTATION_SECONDS:
            del state.expected[replica]
        else:
            replicas[replica] = ReplicaObservation(replica, "Pending")
    return replicas


def reconcile_once(body: dict[str, Any], state: JobState) -> float | None:
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    old_status = _last_status(body, state)
    try:
        job = from_spec_dict(name, dict(body["spec"]), ns)
    except InvalidSpec as err:
        # The CRD's schema catches nearly all of this; what is left is reported, not retried.
        refused = engine.refuse(read_status(old_status), Refusal("InvalidSpec", "; ".join(err.shown())), _now(),
                                meta.get("generation", 0))
        for type_, reason, message in refused.actions.events:
            kube.record_event(body, type_, reason, message)
        _write_status(ns, name, state, old_status, to_dict(refused.status))
        return None
    job.metadata.generation = meta.get("generation", 0)
    job.metadata.uid = uid
    job.metadata.labels = dict(meta.get("labels") or {})
    refusal = _refusal(job, state)
    if refusal is not None and old_status.get("state") not in TERMINAL:
        act = reconcile(job, uid, state.token, INDEX.replicas((ns, name), uid), old_status, _now(),
                        settings=CONFIG.settings, existing=state.existing, refusal=refusal)
        for pod in act.delete_pods:
            kube.delete_pod(ns, pod)
        if act.scale_statefulset is not None:
            kube.scale_statefulset(ns, f"{name}-ddp", act.scale_statefulset)
        for type_, reason, message in act.events:
            kube.record_event(body, type_, reason, message)
        _write_status(ns, name, state, old_status, act.status)
        return None
    if not state.counted_created:
        state.counted_created = True
        if not old_status:
            metrics.start_counting(ns, job.spec.mode)
            metrics.JOBS_CREATED.labels(ns, job.spec.mode).inc()
    if old_status.get("state") in TERMINAL:
        pods: dict[str, ReplicaObservation] = INDEX.replicas((ns, name), uid)
        progress = None
        SCRAPES.unfollow((ns, name))
    else:
        pods = observed_replicas((ns, name), uid, state)
        progress = _progress(job, pods)
    pvc_pending = INDEX.pending_claims((ns, name)) if old_status.get("state") in (None, "Created") and pods else None
    workload, admission, placements = _queue(job, uid, state, old_status, pods)
    act = reconcile(
        job, uid, state.token, pods, old_status, _now(), progress, CONFIG.settings, pvc_pending, state.existing,
        admission, placements,
    )
    for restarted in act.restarted:  # before its pod goes: tests/e2e time the operator's reaction from here
        log.info("%s/%s: %s failed (%s); restarting it in %.1f s", ns, name, restarted.replica, restarted.reason,
                 restarted.delay_seconds)
    for obj in act.replace:  # a resize: the job file and StatefulSet at the new size, before its pods
        kube.replace(obj)
        state.existing.add((obj["kind"], obj["metadata"]["name"]))
        log.info("%s/%s: %s %s rendered again at size %s", ns, name, obj["kind"], obj["metadata"]["name"],
                 act.status.get("replicas"))
    for pod, annotations in act.annotate_pods.items():  # after the job file: the kubelet remounts it
        kube.annotate_pod(ns, pod, annotations)
        log.info("%s/%s: annotated pod %s with %s", ns, name, pod,
                 ", ".join(f"{k}={v}" for k, v in sorted(annotations.items())))
    for obj, created in _create_all(act.create):
        if obj["kind"] == "Pod":
            state.expected[obj["metadata"]["name"][len(name) + 1 :]] = time.monotonic()
            if created:
                log.info("%s/%s: created pod %s", ns, name, obj["metadata"]["name"])
        else:
            state.existing.add((obj["kind"], obj["metadata"]["name"]))
    for pod in act.delete_pods:
        seen = pods.get(pod[len(name) + 1 :])
        # A dead trainer (not a DDP rank: its StatefulSet pod restarts in place) needs no grace.
        dead = job.spec.mode != "DDP" and seen is not None and seen.exit_code is not None
        kube.delete_pod(ns, pod, force=dead)
    for pod in act.force_delete_pods:
        kube.delete_pod(ns, pod, force=True)
    if act.scale_statefulset is not None:
        kube.scale_statefulset(ns, f"{name}-ddp", act.scale_statefulset)
    for type_, reason, message in act.events:
        kube.record_event(body, type_, reason, message)
    for restarted in act.restarted:
        metrics.REPLICA_RESTARTS.labels(ns, job.spec.mode, restarted.reason).inc()
    before, after = old_status.get("state"), act.status.get("state")
    if after != before and after == "Succeeded":
        metrics.JOBS_SUCCEEDED.labels(ns, job.spec.mode).inc()
    if after != before and after == "Failed":
        metrics.JOBS_FAILED.labels(ns, job.spec.mode).inc()
    _write_status(ns, name, state, old_status, act.status)
    state.problem = None
    if workload is not None:
        _tell_kueue(workload, admission, act.status, pods, act.delete_pods)
    if act.delete_job:
        kube.delete_job(ns, name)
    return act.requeue_after


CREATE_THREADS = 16
"""Threads that create a round's objects side by side, shared by every worker: a job's Secret,
NetworkPolicy, Services and claims at once, then its pods at once, instead of one round trip after
another (a ParameterServer job of 8 workers is a dozen creates). With 8 workers at most 16 creates
are in flight, far below the API server's default of 400 requests in flight; beyond that a round
waits for a thread."""
_CREATORS = ThreadPoolExecutor(max_workers=CREATE_THREADS, thread_name_prefix="create")


def _create_all(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bool]]:
    """Create `objs` in two waves, each side by side: everything but pods, then the pods (the job's
    NetworkPolicy and Secret exist before any pod that they guard or that mounts them). Returns
    (object, created) in order; the first failure is raised once its wave is done."""
    done: list[tuple[dict[str, Any], bool]] = []
    for wave in ([o for o in objs if o["kind"] != "Pod"], [o for o in objs if o["kind"] == "Pod"]):
        if len(wave) == 1:
            done.append((wave[0], kube.create(wave[0])))
            continue
        futures = [_CREATORS.submit(kube.create, obj) for obj in wave]
        for obj, future in zip(wave, futures):
            done.append((obj, future.result()))  # raises the first failure, after waiting for it
        # (the wave's other creates still finish: a later round finds them existing)
    return done


def _pod_security(job, state: JobState) -> list[str]:
    """The pod-security refusals of the pods the job would create (core/podsecurity.py), judged once
    per generation of its spec: rendering every pod of a large job each round would cost more than
    the rest of the round."""
    key = (job.metadata.uid, job.metadata.generation)
    if state.pod_security is None or state.pod_security[0] != key:
        state.pod_security = (key, podsecurity.problems(job, CONFIG.settings))
    return state.pod_security[1]


def _refusal(job, state: JobState) -> Refusal | None:
    """Why the installation refuses the job (engine.Refusal), if it does: pods beyond its pod-security
    allowances (the chart's admission policy refuses these at the API; a cluster without it still gets
    no such pod), or a gang no scheduler of the cluster serves (its pods, without their PodGroup, would
    be scheduled one by one: the gang the job asked for would not hold, so none is made)."""
    refused = _pod_security(job, state) + _claim_problems(job)
    if refused:
        return Refusal("PodSecurity", "; ".join(refused))
    unserved = gang_problem(job, CONFIG.settings.gang_schedulers)
    if unserved:
        return Refusal("GangSchedulingDisabled", unserved)
    return None


def _claim_problems(job) -> list[str]:
    """checkpoint.storage.existingClaim naming another job's checkpoint claim (the pods would mount its
    checkpoints, to read them or to write over them) is refused unless the installation allows claims:
    the same allowance as a claim in the template (api/podtemplate.py), judged here because only the
    operator sees which job a claim belongs to."""
    claim = job.spec.checkpoint.storage.existing_claim
    if not claim or "claims" in CONFIG.settings.pod_security_allow:
        return []
    holder = INDEX.claim_holder(job.metadata.namespace, claim)
    if holder is None or holder == job.name:
        return []
    return [f"spec.checkpoint.storage.existingClaim: {claim!r} is job {holder}'s checkpoint claim; "
            f"{CLAIMS_CHECK.message}"]


CLAIMS_CHECK = next(c for c in SECURITY_CHECKS if c.allowance == "claims")


def _queue(job, uid: str, state: JobState, old_status: dict[str, Any], pods: dict[str, ReplicaObservation]):
    """(the job's Workload, Kueue's admission, the admission's placements) for a job in a Kueue
    queue; (None, None, None) for any other. The Workload is created on the first round."""
    if not CONFIG.kueue or kueue.queue_name(job) is None:
        return None, None, None
    key = (job.metadata.namespace, job.name)
    wl_name = kueue.workload_name(job, uid)
    workload = INDEX.workload(key, wl_name)
    if old_status.get("state") in TERMINAL:
        return workload, None, None
    if workload is not None and kueue.resized(workload, job):
        # Made again at the new size; the watch's DELETED event lets the round after it create the new one.
        # Deleted once the replicas of the old size are gone (the engine stops them meanwhile): Kueue frees
        # the quota at once, and another job must not be admitted into it while they still checkpoint.
        stopped = not any(p.phase in ("Pending", "Running") for p in pods.values())
        if stopped and not (workload.get("metadata") or {}).get("deletionTimestamp"):
            kube.delete_workload(key[0], wl_name)
            log.info("%s/%s: Workload %s deleted: the job was resized to %d", key[0], key[1], wl_name, job.spec.size)
        return None, kueue.resizing(job), None
    if workload is None and ("Workload", wl_name) not in state.existing:
        # Kueue's WorkloadPriorityClass controller sets spec.priority only when the class changes;
        # a Workload created after it gets its value from its creator, as Kueue's own jobs do.
        pc = kueue.priority_class(job)
        priority = None
        if pc:
            found = kube.get_kueue_object("workloadpriorityclasses", pc)
            priority = int(found["value"]) if found and "value" in found else None
        kube.create(kueue.workload(job, uid, CONFIG.settings, priority))
        state.existing.add(("Workload", wl_name))
    admission = kueue.admission(workload)
    placements = None
    if admission.admitted and workload is not None:
        assigned = json.dumps((workload.get("status") or {}).get("admission"), sort_keys=True)
        if state.placements is None or state.placements[0] != assigned:
            flavors = {}
            for flavor in kueue.flavor_names(workload):
                found = kube.get_kueue_object("resourceflavors", flavor)
                flavors[flavor] = (found or {}).get("spec") or {}
            state.placements = (assigned, kueue.placements(workload, flavors))
        placements = state.placements[1]
    return workload, admission, placements


def _tell_kueue(workload: dict[str, Any], admission, status: dict[str, Any], pods: dict[str, ReplicaObservation],
                deleting: list[str]) -> None:
    """What Kueue expects back: an evicted Workload's quota once the job's replicas are gone, and
    Finished once the job ended."""
    meta = workload["metadata"]
    patch = None
    if status.get("state") in TERMINAL:
        observed = next((c for c in status.get("conditions") or [] if c.get("type") == status["state"]), {})
        patch = kueue.finish(workload, status["state"], observed.get("message", ""), _iso_now())
    elif admission is not None and admission.evicted and not deleting and not any(
            p.phase in ("Pending", "Running") for p in pods.values()):
        patch = kueue.release_quota(workload, _iso_now())
    if patch is not None:
        kube.patch_workload_status(meta["namespace"], meta["name"], patch)


def _write_status(ns: str, name: str, state: JobState, old: dict[str, Any], new: dict[str, Any]) -> None:
    if new != old:
        # A merge patch: keys we dropped must be sent as null to disappear.
        patch = dict(new)
        for key in old:
            if key not in new:
                patch[key] = None
        kube.patch_status(ns, name, patch)
    state.status = new
    _update_state_gauge()


def _update_state_gauge() -> None:
    counts: dict[tuple[str, str], int] = {}
    waiting: dict[tuple[str, str], int] = {}
    with JOBS_LOCK:
        items = list(JOBS.items())
    for (ns, _), st in items:
        s = (st.status or {}).get("state", "Created")
        counts[(ns, s)] = counts.get((ns, s), 0) + 1
        why = _waiting_reason(st.status or {})
        if why is not None:
            waiting[(ns, why)] = waiting.get((ns, why), 0) + 1
    metrics.JOBS_BY_STATE.clear()
    for (ns, s), n in counts.items():
        metrics.JOBS_BY_STATE.labels(ns, s).set(n)
    metrics.JOBS_WAITING.clear()
    for (ns, why), n in waiting.items():
        metrics.JOBS_WAITING.labels(ns, why).set(n)


def _waiting_reason(status: dict[str, Any]) -> str | None:
    """Why the job's replicas wait (one of WAITING_REASONS, read from its state's condition), or None.
    A finished job waits for nothing, whatever its reason (Failed: Unschedulable)."""
    if status.get("state") in TERMINAL:
        return None
    for c in status.get("conditions") or []:
        if c.get("type") == status.get("state") and c.get("status") == "True" and c.get("reason") in WAITING_REASONS:
            return c["reason"]
    return None


def _iso_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _progress(job, pods):
    """Progress from the chief's metrics (and, for a PS job, ps-0, which counts the global step), as
    the job's latest scrape read them: scrapes run in a pool of their own (scrapes.py), so a round
    never waits for a tenant's /metrics."""
    if not CONFIG.scrape:
        return None
    port = job.spec.metrics.port
    if not port:
        return None
    replicas = [chief(job)] + (["ps-0"] if job.spec.mode == "ParameterServer" else [])
    if job.spec.fault_tolerant:
        replicas += sorted(name for name in pods if name.startswith("ddp-") and name != replicas[0])
    ips = {}
    for replica in replicas:
        p = pods.get(replica)
        if p is not None and p.phase == "Running" and observe.scrape_allowed(p.ip, CONFIG.scrape_networks):
            ips[replica] = p.ip
    if not ips:
        SCRAPES.unfollow((job.metadata.namespace, job.name))
        return None

    def samples(replica: str) -> dict[str, float] | None:
        text = kube.scrape(ips[replica], port) if replica in ips else None
        return observe.parse_metrics(text) if text is not None else None

    def read():
        head = samples(replicas[0])
        if head is None and job.spec.fault_tolerant:
            # The chief's group is lost and the others train on: any live group speaks for the job.
            head = next((found for name in replicas[1:] if name in ips and (found := samples(name))), None)
        shard = samples("ps-0") if job.spec.mode == "ParameterServer" else None
        if head is None and shard is None:
            return None
        return observe.progress_from(head or {}, shard)

    return SCRAPES.latest((job.metadata.namespace, job.name), read)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    with JOBS_LOCK:
        return len(JOBS)

