"""One reconcile round of a job, in phases: read its spec (a spec that does not parse is refused),
judge what the installation refuses, observe its replicas and progress, ask its queue, let the pure
core decide (`core.reconcile`, over `core.engine`), carry the decisions out, count them, write the
status. The engine is the only writer of the status: each phase only gathers its inputs or carries
out what it decided."""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from typing import Any

from kubetrain.api import InvalidSpec, TrainingJob, from_spec_dict
from kubetrain.api.status import JobStatus
from kubetrain.engine import engine
from kubetrain.engine.conditions import TERMINAL
from kubetrain.engine.engine import ProgressReading, ProgressUnknown, Refusal, ReplicaObservation
from kubetrain.engine.plan import chief
from kubetrain.engine.reconcile import ClusterActions, reconcile
from . import kube, metrics, observe, queueing, refusals, scrapes
from .budget import render_weight
from .index import Key
from .reporting import last_status, write_status
from .state import Controller, JobState

log = logging.getLogger("kubetrain.operator")

EXPECTATION_SECONDS = 30.0
"""A pod this operator created is taken as Pending for up to this long before the watch shows it,
so a round that runs before the watch event does not take it for deleted."""


def reconcile_once(ctl: Controller, body: dict[str, Any], state: JobState) -> float | None:
    """One round of the job `body`; the seconds after which it wants another (None: only on an event)."""
    meta = body["metadata"]
    key, uid = (meta["namespace"], meta["name"]), meta["uid"]
    old = last_status(body, state)
    try:
        job = _parse(body)
    except InvalidSpec as err:
        return _refuse_spec(ctl, body, state, old, err)
    refusal = refusals.refusal(ctl, job, state)
    if refusal is not None and old.state not in TERMINAL:
        _refuse(ctl, body, state, job, old, refusal)
        return None
    _count_created(state, job, fresh=state.status is None and not body.get("status"))
    pods, progress = _observe(ctl, job, state, old)
    pvc_pending = ctl.index.pending_claims(key) if old.state == "Created" and pods else None
    workload, admission, placements, job = queueing.queue(ctl, job, uid, state, old, pods)
    # The pods this round renders are held until they are created: their bytes come out of the budget
    # every round shares (budget.py); a round whose pods all exist weighs nothing.
    with ctl.render_budget.hold(render_weight(job, len(pods))):
        act = reconcile(job, uid, state.token, pods, old, time.time(), progress, ctl.config.settings, pvc_pending,
                        state.existing, admission, placements, safety_net=ctl.safety_net())
        _carry_out(ctl, body, job, state, pods, act, started=old.start_time is not None)
        act.create, act.replace = [], []  # created: nothing rendered outlives its share of the budget
    _count_outcome(job, old, act)
    write_status(ctl, key, state, old, act.status)
    state.problem = None
    if workload is not None:
        queueing.tell_kueue(workload, admission, act.status, pods, act.delete_pods)
    if act.delete_job:
        kube.delete_job(*key)
    return act.requeue_after


def _parse(body: dict[str, Any]) -> TrainingJob:
    """The job's spec, read (InvalidSpec for one kubetrain refuses)."""
    meta = body["metadata"]
    job = from_spec_dict(meta["name"], dict(body["spec"]), meta["namespace"])
    job.metadata.generation = meta.get("generation", 0)
    job.metadata.uid = meta["uid"]
    job.metadata.labels = dict(meta.get("labels") or {})
    return job


def _refuse_spec(ctl: Controller, body: dict[str, Any], state: JobState, old: JobStatus,
                 err: InvalidSpec) -> float | None:
    """A spec kubetrain refuses: the engine fails the job (written, with an Event), and its TTL, if one can
    still be read from the spec, deletes it in time. The CRD's schema catches nearly all of this; what is
    left is reported, not retried."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    refused = engine.refuse(old, Refusal("InvalidSpec", "; ".join(err.shown())), time.time(),
                            meta.get("generation", 0), ttl=raw_ttl(body["spec"]))
    for type_, reason, message in refused.actions.events:
        kube.record_event(body, type_, reason, message)
    write_status(ctl, key, state, old, refused.status)
    if refused.actions.delete_job:
        kube.delete_job(*key)
    return refused.actions.requeue_after


def raw_ttl(spec: Any) -> int | None:
    """spec.runPolicy.ttlSecondsAfterFinished of a spec that does not parse as a whole, if that field alone
    is valid (a whole number of seconds, 0 or more); None otherwise."""
    policy = spec.get("runPolicy") if isinstance(spec, dict) else None
    ttl = policy.get("ttlSecondsAfterFinished") if isinstance(policy, dict) else None
    return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 0 else None


def _refuse(ctl: Controller, body: dict[str, Any], state: JobState, job: TrainingJob, old: JobStatus,
            refusal: Refusal) -> None:
    """A job the installation refuses: the engine fails it (its replicas, if any, stopped as any
    failed job's are); nothing is created."""
    key = (job.metadata.namespace, job.name)
    pods = replicas_of(ctl, key, job.metadata.uid)
    act = reconcile(job, job.metadata.uid, state.token, pods, old, time.time(), settings=ctl.config.settings,
                    existing=state.existing, refusal=refusal)
    _carry_out(ctl, body, job, state, pods, act, started=old.start_time is not None)
    write_status(ctl, key, state, old, act.status)


def _count_created(state: JobState, job: TrainingJob, fresh: bool) -> None:
    """The job's series start at 0, and a new job (no status yet) is counted created, once."""
    if not state.counted_created:
        state.counted_created = True
        if fresh:
            metrics.start_counting(job.metadata.namespace, job.spec.mode)
            metrics.JOBS_CREATED.labels(job.metadata.namespace, job.spec.mode).inc()


def _observe(ctl: Controller, job: TrainingJob, state: JobState,
             old: JobStatus) -> tuple[dict[str, ReplicaObservation], ProgressReading | ProgressUnknown | None]:
    """The job's replicas and its chief's progress; a finished job's replicas alone (nothing is scraped)."""
    key = (job.metadata.namespace, job.name)
    if old.state in TERMINAL:
        ctl.scrapes.unfollow(key)
        return replicas_of(ctl, key, job.metadata.uid), None
    pods = observed_replicas(ctl, key, job.metadata.uid, state)
    return pods, _progress(ctl, job, pods)


def observed_replicas(ctl: Controller, key: Key, uid: str, state: JobState) -> dict[str, ReplicaObservation]:
    """The job's replicas from the index, with the pods this operator just created and the watch
    has not shown yet taken as Pending."""
    now = time.monotonic()
    replicas = replicas_of(ctl, key, uid)
    for replica, created in list(state.expected.items()):
        if replica in replicas or now - created > EXPECTATION_SECONDS:
            del state.expected[replica]
        else:
            replicas[replica] = ReplicaObservation(replica, "Pending")
    return replicas


def replicas_of(ctl: Controller, key: Key, uid: str) -> dict[str, ReplicaObservation]:
    """The job's replicas from the index (index.Index.replicas). When a pod names the job's StatefulSet
    as its owner and the index holds no uid for it, the API server is asked first (kube.statefulset_uid):
    once per StatefulSet and operator, not per round, as no pod's owner reference can be taken at its word."""
    if ctl.index.statefulset_unknown(key, uid):
        ctl.index.set_statefulset(key, uid, kube.statefulset_uid(key[0], observe.statefulset_name(key[1]), uid))
    return ctl.index.replicas(key, uid)


def _carry_out(ctl: Controller, body: dict[str, Any], job: TrainingJob, state: JobState,
               pods: dict[str, ReplicaObservation], act: ClusterActions, started: bool = False) -> None:
    """What the round decided, done: children rendered again, pods annotated, created, deleted, the
    StatefulSet scaled, the Events recorded. `started`: the job's status says it started before (its
    startTime), so an earlier round made its children (kube.create)."""
    ns, name = job.metadata.namespace, job.name
    for restarted in act.restarted:  # before its pod goes: tests/e2e time the operator's reaction from here
        log.info("%s/%s: %s failed (%s); restarting it in %.1f s", ns, name, restarted.replica, restarted.reason,
                 restarted.delay_seconds)
    for obj in act.replace:  # a resize: the job file and StatefulSet at the new size, before its pods
        kube.replace(obj)
        state.existing.add((obj["kind"], obj["metadata"]["name"]))
        if obj["kind"] == "StatefulSet":  # made again if it was missing: a new uid, asked for when its pods show
            ctl.index.set_statefulset((ns, name), job.metadata.uid, None)
        log.info("%s/%s: %s %s rendered again at size %s", ns, name, obj["kind"], obj["metadata"]["name"],
                 act.status.replicas)
    for pod, wanted in act.annotate_pods.items():  # after the job file: the kubelet remounts it
        kube.annotate_pod(ns, pod, wanted)
        log.info("%s/%s: annotated pod %s with %s", ns, name, pod,
                 ", ".join(f"{k}={v}" for k, v in sorted(wanted.items())))
    for obj, created in _create_all(ctl, act.create, state, started):
        if obj["kind"] == "Pod":
            state.expected[obj["metadata"]["name"][len(name) + 1 :]] = time.monotonic()
            if created:
                log.info("%s/%s: created pod %s", ns, name, obj["metadata"]["name"])
        else:
            state.existing.add((obj["kind"], obj["metadata"]["name"]))
            if obj["kind"] == "StatefulSet" and created:  # a new uid, asked for when its pods show
                ctl.index.set_statefulset((ns, name), job.metadata.uid, None)
    _delete_pods(ctl, job, pods, act.delete_pods)
    for pod in act.force_delete_pods:
        seen = pods.get(pod[len(name) + 1 :])
        kube.delete_pod(ns, pod, force=True, uid=seen.uid if seen is not None else "")
        if seen is not None:
            # Gone from the API when the call returns: out of the index at once, or a round before the watch's
            # DELETED event would find it still Terminating and delete it (and say so) again (CI once counted
            # 4 forced deletions of 3 pods).
            ctl.index.forget_pod((ns, name), pod, seen.uid)
    if act.scale_statefulset is not None:
        kube.scale_statefulset(ns, f"{name}-ddp", act.scale_statefulset)
    for type_, reason, message in act.events:
        kube.record_event(body, type_, reason, message)


def _delete_pods(ctl: Controller, job: TrainingJob, pods: dict[str, ReplicaObservation], names: list[str]) -> None:
    """Delete the round's pods to stop, each only as the incarnation the round saw (its uid). A dead trainer
    (not a DDP rank: its StatefulSet pod restarts in place) needs no grace: its pod is gone from the API
    when the call returns, out of the index at once, and its job queued urgent: the next round (after this
    one) makes its replacement, not the watch's DELETED event, a hop through the watch and the queue.

    Not in this same round: the API server removes a pod bound to a node in two steps (deletionTimestamp
    set, then the object deleted), and a node agent that deletes the pod by name once it sees the first
    step (kwok's pod-delete stage does; a kubelet deletes with the pod's uid as a precondition) deleted
    a replacement made within milliseconds (kwok-controller's log, under tests/operator/test_lifecycle.py).
    A pod that is somehow still there makes the create answer 409, and its DELETED
    event brings the round that makes it."""
    ns, name = job.metadata.namespace, job.name
    for pod in names:
        seen = pods.get(pod[len(name) + 1 :])
        dead = job.spec.mode != "DDP" and seen is not None and seen.exit_code is not None
        kube.delete_pod(ns, pod, force=dead, uid=seen.uid if seen is not None else "")
        if dead and seen is not None:  # dead: seen, and ended
            ctl.index.forget_pod((ns, name), pod, seen.uid)
            ctl.queue.add((ns, name), urgent=True)


def _count_outcome(job: TrainingJob, old: JobStatus, act: ClusterActions) -> None:
    """The restarts the round decided, and the job's end if it ended in this round."""
    ns, mode = job.metadata.namespace, job.spec.mode
    for restarted in act.restarted:
        metrics.REPLICA_RESTARTS.labels(ns, mode, restarted.reason).inc()
    before, after = old.state, act.status.state
    if after != before and after == "Succeeded":
        metrics.JOBS_SUCCEEDED.labels(ns, mode).inc()
    if after != before and after == "Failed":
        metrics.JOBS_FAILED.labels(ns, mode).inc()


def _create_all(ctl: Controller, objs: list[dict[str, Any]], state: JobState,
                started: bool) -> list[tuple[dict[str, Any], bool]]:
    """Create `objs` in two waves, each side by side (state.CREATE_THREADS): everything but pods, then the
    pods (the job's NetworkPolicy and Secret exist before any pod that they guard or that mounts them).
    Returns (object, created) in order; the first failure is raised once its wave is done.

    Every child that the wave made (or found to be the job's) is remembered in `state.existing` even when
    another of the wave failed, so that no later round asks for it again: before the job first started,
    kube.create takes a token Secret that is there already for someone else's, and a claim (one refused
    by a quota) that failed beside the Secret would have made the job's own Secret look foreign."""
    done: list[tuple[dict[str, Any], bool]] = []
    create = kube.carrying_urgency(kube.create)  # an urgent round's creates do not wait at the routine gate
    for wave in ([o for o in objs if o["kind"] != "Pod"], [o for o in objs if o["kind"] == "Pod"]):
        if len(wave) == 1:
            results = [(wave[0], _now(kube.create, wave[0], started))]
        else:
            results = list(zip(wave, [ctl.creators.submit(create, obj, started) for obj in wave]))
        failure: Exception | None = None
        for obj, future in results:
            try:
                created = future.result()  # waits for it
            except Exception as err:  # noqa: BLE001 - raised below, once the wave is done
                failure = failure or err
                continue
            if obj["kind"] != "Pod":
                state.existing.add((obj["kind"], obj["metadata"]["name"]))
            done.append((obj, created))
        if failure is not None:
            raise failure  # the first, in the wave's order
    return done


def _now(fn: Any, *args: Any) -> Future:
    """`fn(*args)` called here, as a finished Future (a wave of one needs no thread)."""
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except Exception as err:  # noqa: BLE001 - handed to whoever reads the result
        done.set_exception(err)
    return done


def _progress(ctl: Controller, job: TrainingJob,
              pods: dict[str, ReplicaObservation]) -> ProgressReading | ProgressUnknown | None:
    """Progress from the chief's metrics (and, for a PS job, ps-0, which counts the global step), as
    the job's latest scrape read them: scrapes run in a pool of their own (scrapes.py), so a round
    never waits for a tenant's /metrics. PROGRESS_UNKNOWN when the read timed out or is stale."""
    port = job.spec.metrics.port
    if not ctl.config.scrape or not port:
        return None
    heads = [chief(job)]
    if job.spec.fault_tolerant:  # the other groups in order, after the chief's (ddp-2 before ddp-10)
        heads += sorted((name for name in pods if name.startswith("ddp-") and name != heads[0]),
                        key=lambda name: (len(name), name))
    shard = "ps-0" if job.spec.mode == "ParameterServer" else None
    ips = {}
    for replica in heads + ([shard] if shard else []):
        p = pods.get(replica)
        if p is not None and p.phase == "Running" and observe.scrape_allowed(p.ip, ctl.config.scrape_networks):
            ips[replica] = p.ip
    if not ips:
        ctl.scrapes.unfollow((job.metadata.namespace, job.name))
        return None
    return ctl.scrapes.latest((job.metadata.namespace, job.name),
                              functools.partial(scrapes.read_progress, ips, port, heads, shard))
