"""The kopf handlers: thin. Each job gets a daemon that observes, calls the pure core, acts.

One daemon thread per TrainingJob serialises that job's reconciliations (no
two rounds race on its pods or status); pod events wake the job's daemon at
once, so a failed replica is replaced within a round trip rather than a
timer period. Jobs reconcile concurrently, one thread each.
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from ..api import GROUP, PLURAL, VERSION, InvalidSpec, from_spec_dict
from ..core.children import LABEL_JOB, Settings
from ..core.plan import chief
from ..core.reconcile import reconcile
from ..core.status import Observed, conditions
from . import kube, metrics, observe

log = logging.getLogger("kubetrain.operator")

DOMAIN = "kubetrain.dev"
FINALIZER = f"{DOMAIN}/finalizer"
MAX_SLEEP_SECONDS = 5.0


@dataclass
class OperatorConfig:
    settings: Settings = field(default_factory=Settings)
    scrape_networks: list[str] = field(default_factory=list)  # empty: scrape any pod IP
    scrape: bool = True


CONFIG = OperatorConfig()


@dataclass
class JobState:
    """What the operator remembers of a job between rounds (lost on restart, rebuilt from the API)."""

    wake: threading.Event = field(default_factory=threading.Event)
    status: dict[str, Any] | None = None  # the last status written: the API's copy may lag behind
    existing: set[tuple[str, str]] = field(default_factory=set)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    counted_created: bool = False


JOBS: dict[tuple[str, str], JobState] = {}
JOBS_LOCK = threading.Lock()


def job_state(namespace: str, name: str) -> JobState:
    with JOBS_LOCK:
        return JOBS.setdefault((namespace, name), JobState())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=DOMAIN)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=DOMAIN, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 512  # one per job daemon, plus handlers
    settings.watching.server_timeout = 300
    kube.load_config()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0, initial_delay=0)
def supervise(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    state = job_state(ns, name)
    try:
        while not stopped:
            delay = MAX_SLEEP_SECONDS
            start = time.monotonic()
            try:
                delay = reconcile_once(body, state) or MAX_SLEEP_SECONDS
            except kube.KubeError as err:
                metrics.RECONCILE_ERRORS.inc()
                if err.status == 403:
                    _report_forbidden(body, state, err)
                else:
                    log.warning("%s/%s: %s; retrying", ns, name, err)
            except Exception:  # a bug must not kill the job's daemon: log it and retry
                metrics.RECONCILE_ERRORS.inc()
                log.exception("%s/%s: reconciliation failed; retrying", ns, name)
            finally:
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - start)
            _sleep(state, stopped, min(delay, MAX_SLEEP_SECONDS))
    finally:
        with JOBS_LOCK:
            if JOBS.get((ns, name)) is state:
                del JOBS[(ns, name)]
        _update_state_gauge()


def _report_forbidden(body: kopf.Body, state: JobState, err: kube.KubeError) -> None:
    """RBAC refused an operation: say which, in the log and (where still allowed) the job's status."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    message = (f"{err}. The operator's ServiceAccount lacks this permission: the chart's Role or ClusterRole "
               "(charts/kubetrain/templates/rbac.yaml) grants it; retrying.")
    log.error("%s/%s: %s", ns, name, message)
    old = _last_status(body, state)
    try:
        _write_condition(body, state, old, Observed(old.get("state") or "Created", "Forbidden", message))
    except kube.KubeError as second:
        log.error("%s/%s: cannot report that in the status either: %s", ns, name, second)


def _last_status(body: kopf.Body, state: JobState) -> dict[str, Any]:
    """The job's status as last written (the API's copy may lag behind), to change freely."""
    return copy.deepcopy(state.status if state.status is not None else dict(body.get("status") or {}))


def _write_condition(body: kopf.Body, state: JobState, old: dict[str, Any], observed: Observed, **fields: Any) -> None:
    """Write the status with `observed` on its conditions (and `fields` beside them)."""
    meta = body["metadata"]
    new = dict(old, **fields)
    new["conditions"] = conditions(old.get("conditions"), observed, _iso_now(), meta.get("generation", 0))
    _write_status(meta["namespace"], meta["name"], state, old, new)


def _sleep(state: JobState, stopped: kopf.DaemonStopped, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stopped and time.monotonic() < deadline:
        if state.wake.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            break
    state.wake.clear()


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_changed(meta: kopf.Meta, **_: Any) -> None:
    job = meta.get("labels", {}).get(LABEL_JOB)
    with JOBS_LOCK:
        state = JOBS.get((meta["namespace"], job))
    if state is not None:
        state.wake.set()


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def spec_changed(meta: kopf.Meta, **_: Any) -> None:
    """suspend and other mutable fields take effect at once."""
    with JOBS_LOCK:
        state = JOBS.get((meta["namespace"], meta["name"]))
    if state is not None:
        state.wake.set()


def _now() -> float:
    return time.time()


def reconcile_once(body: kopf.Body, state: JobState) -> float | None:
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    old_status = _last_status(body, state)
    try:
        job = from_spec_dict(name, dict(body["spec"]), ns)
    except InvalidSpec as err:
        # The CRD's schema catches nearly all of this; what is left is reported, not retried.
        message = "; ".join(str(p) for p in err.problems)
        _write_condition(body, state, old_status, Observed("Failed", "InvalidSpec", message), state="Failed")
        return None
    job.metadata.generation = meta.get("generation", 0)
    job.metadata.uid = uid
    if not state.counted_created:
        state.counted_created = True
        if not old_status:
            metrics.JOBS_CREATED.labels(ns, job.spec.mode).inc()

    pods: dict[str, Any] = {}
    raw_pods = kube.list_pods(ns, name)
    for raw in raw_pods:
        obs = observe.pod_observation(raw)
        if obs is not None:
            pods[obs.replica] = obs
    progress = _progress(job, pods)
    pvc_pending = kube.pending_claims(ns, name) if old_status.get("state") in (None, "Created") and pods else None
    act = reconcile(
        job, uid, state.token, pods, old_status, _now(), progress, CONFIG.settings, pvc_pending, state.existing
    )
    for obj in act.create:
        kube.create(obj)
        if obj["kind"] != "Pod":
            state.existing.add((obj["kind"], obj["metadata"]["name"]))
    for pod in act.delete_pods:
        kube.delete_pod(ns, pod)
    if act.scale_statefulset is not None:
        kube.scale_statefulset(ns, f"{name}-ddp", act.scale_statefulset)
    for type_, reason, message in act.events:
        kube.record_event(body, type_, reason, message)
        if type_ == "Warning" and act.status.get("state") == "Restarting":
            metrics.REPLICA_RESTARTS.labels(ns, job.spec.mode, reason).inc()
    before, after = old_status.get("state"), act.status.get("state")
    if after != before and after == "Succeeded":
        metrics.JOBS_SUCCEEDED.labels(ns, job.spec.mode).inc()
    if after != before and after == "Failed":
        metrics.JOBS_FAILED.labels(ns, job.spec.mode).inc()
    _write_status(ns, name, state, old_status, act.status)
    if act.delete_job:
        kube.delete_job(ns, name)
    return act.requeue_after


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
    with JOBS_LOCK:
        items = list(JOBS.items())
    for (ns, _), st in items:
        s = (st.status or {}).get("state", "Created")
        counts[(ns, s)] = counts.get((ns, s), 0) + 1
    metrics.JOBS_BY_STATE.clear()
    for (ns, s), n in counts.items():
        metrics.JOBS_BY_STATE.labels(ns, s).set(n)


def _iso_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _progress(job, pods):
    """Progress from the chief's metrics (and, for a PS job, ps-0, which counts the global step)."""
    if not CONFIG.scrape:
        return None
    port = job.spec.metrics.port
    if not port:
        return None

    def samples(replica: str) -> dict[str, float] | None:
        p = pods.get(replica)
        if p is None or p.phase != "Running" or not observe.scrape_allowed(p.ip, CONFIG.scrape_networks):
            return None
        text = kube.scrape(p.ip, port)
        return observe.parse_metrics(text) if text is not None else None

    head = samples(chief(job))
    shard = samples("ps-0") if job.spec.mode == "ParameterServer" else None
    if head is None and shard is None:
        return None
    return observe.progress_from(head or {}, shard)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    with JOBS_LOCK:
        return len(JOBS)

