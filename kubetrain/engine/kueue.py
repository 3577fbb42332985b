"""Kueue admission for a TrainingJob, pure: the Workload to create, what its status says, and the
status writes Kueue expects of an external framework's controller.

Kueue (sigs.k8s.io/kueue) admits jobs as one unit against a ClusterQueue's quota. For a custom
resource it offers "external frameworks" (`integrations.externalFrameworks:
["TrainingJob.v1alpha1.kubetrain.dev"]` in its Configuration): Kueue then admits, preempts and
evicts the Workloads such a job owns, and the job's own controller does what Kueue's built-in
integrations do for theirs (sigs.k8s.io/kueue pkg/controller/jobframework/reconciler.go, v0.17.0):

1. create one Workload per job, owned by it (controller reference), in the queue the job's
   `kueue.x-k8s.io/queue-name` label names, one pod set per replica role with its count and pod
   template (the resources Kueue counts against quota), the WorkloadPriorityClass's value in
   `spec.priority`;
2. keep the job suspended until the Workload is Admitted, then start every replica with the
   admission's node selectors and tolerations (the assigned ResourceFlavors' `nodeLabels` and
   `tolerations`, and any admission check's podSetUpdates);
3. when the Workload is Evicted (preempted, its queue stopped, ...): stop the replicas, and once
   none is left, give the quota back: QuotaReserved False (reason Pending), `status.admission`
   cleared, Admitted False, Requeued (True after a preemption or node failure). Kueue then
   queues the Workload again and admits it when quota frees up;
4. when the job finishes: the Workload's Finished condition (reason Succeeded or Failed).

Nothing here talks to the API server: `controller.handlers` reads the Workload, the
ResourceFlavors and the WorkloadPriorityClass and writes what these functions return.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kubetrain.api import API_VERSION, KIND, TrainingJob
from .children import LABEL_JOB, LABEL_MANAGED, MANAGER, children, owner_reference, pod_name, representatives
from .engine import QueueAdmission
from .plan import replica_names

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOAD_API = f"{GROUP}/{VERSION}"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
EXTERNAL_FRAMEWORK = f"{KIND}.{API_VERSION.split('/')[1]}.{API_VERSION.split('/')[0]}"
"""What Kueue's Configuration lists in integrations.externalFrameworks: Kind.version.group."""
MAX_WORKLOAD_NAME = 253
"""A Workload's name is a DNS subdomain; a job's name is far shorter (the CRD limits it)."""
MAX_CONDITION_MESSAGE = 32768
"""metav1.Condition.message's limit (the API server refuses longer)."""
SLICE_FOR = f"{GROUP}/workload-slice-replacement-for"
"""A Workload slice's annotation: `<namespace>/<name>` of the slice it replaces (Kueue's
pkg/workloadslicing, ElasticJobsViaWorkloadSlices)."""
ELASTIC = f"{GROUP}/elastic-job"

ROLES = ("single", "ps", "worker", "standby", "ddp")


def queue_name(job: TrainingJob) -> str | None:
    """The LocalQueue the job asks for, or None: a job without the label is not Kueue's."""
    return (job.metadata.labels or {}).get(QUEUE_LABEL) or None


def priority_class(job: TrainingJob) -> str | None:
    return (job.metadata.labels or {}).get(PRIORITY_LABEL) or None


def workload_name(job: TrainingJob, uid: str) -> str:
    """Unique per incarnation: a job re-created under the same name must not take the Workload of
    the old one, which garbage collection is about to delete (as the token Secret's name)."""
    return f"trainingjob-{job.name}-{uid[:8]}"[:MAX_WORKLOAD_NAME] if uid else f"trainingjob-{job.name}"


def _role_templates(job: TrainingJob, uid: str, settings: Any) -> dict[str, dict[str, Any]]:
    """One pod template per role, as the operator renders that role's pods (its first replica)."""
    out: dict[str, dict[str, Any]] = {}
    first = {pod_name(job, r.name) for r in representatives(job)}
    for obj in children(job, uid, "", settings, lambda kind, name: kind == "StatefulSet" or name in first):
        if obj["kind"] == "Pod":
            role = obj["metadata"]["labels"]["kubetrain.dev/role"]
            if role not in out:
                out[role] = {"metadata": {"labels": dict(obj["metadata"].get("labels") or {})},
                             "spec": copy.deepcopy(obj["spec"])}
        elif obj["kind"] == "StatefulSet":
            out["ddp"] = copy.deepcopy(obj["spec"]["template"])
    return out


def pod_counts(job: TrainingJob) -> dict[str, int]:
    """The pods of each role at the job's size: its Workload's pod sets' counts."""
    counts: dict[str, int] = {}
    for role, _ in replica_names(job):
        counts[role] = counts.get(role, 0) + 1
    return counts


def workload(job: TrainingJob, uid: str, settings: Any, priority: int | None = None) -> dict[str, Any]:
    """The job's Workload: a pod set per role (count, the pods' template), owned by the job."""
    templates = _role_templates(job, uid, settings)
    pod_sets = [{"name": role, "count": n, "template": templates[role]} for role, n in pod_counts(job).items()]
    spec: dict[str, Any] = {"queueName": queue_name(job), "podSets": pod_sets}
    pc = priority_class(job)
    if pc:
        spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": pc}
        if priority is not None:
            spec["priority"] = priority
    labels = {LABEL_JOB: job.name, LABEL_MANAGED: MANAGER, QUEUE_LABEL: queue_name(job) or ""}
    if uid:
        labels[f"{GROUP}/job-uid"] = uid
    if pc:
        labels[PRIORITY_LABEL] = pc
    ref = owner_reference(job, uid)
    return {
        "apiVersion": WORKLOAD_API,
        "kind": "Workload",
        "metadata": {"name": workload_name(job, uid), "namespace": job.metadata.namespace, "labels": labels,
                     "ownerReferences": [ref]},
        "spec": spec,
    }


# --- workload slices: a fault-tolerant job resized while admitted, live -------------------------------------
#
# With Kueue's ElasticJobsViaWorkloadSlices gate (alpha in v0.17: `--kueue-workload-slices`), a fault-tolerant
# DDP job in a queue resizes without stopping its groups. Smaller: its admitted Workload's counts are lowered in
# place once the groups above the size are gone. Larger: a new Workload (a slice) at the new counts replaces the
# admitted one; Kueue admits it for the difference in quota and marks the old one Finished
# (WorkloadSliceReplaced), and until then the job keeps running at the size it was admitted at
# (`admitted_size`). Kueue's job framework does this for its own integrations; for an external framework's
# Workload its scheduler does the same (docs/scheduling.md#a-fault-tolerant-job-in-a-queue-live-resizes-by-workload-slices).


def slices_apply(job: TrainingJob) -> bool:
    """A job that resizes live (a fault-tolerant DDP job): its queue resizes it by slices."""
    return job.spec.fault_tolerant


def current(workloads: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The job's Workload now: of those not Finished, the newest that holds quota, else the newest; with every
    one Finished, the newest (a finished job's)."""
    def newest(found: list[dict[str, Any]]) -> dict[str, Any] | None:
        return max(found, key=lambda wl: ((wl.get("metadata") or {}).get("creationTimestamp") or "",
                                          (wl.get("metadata") or {}).get("name") or ""), default=None)

    open_ = [wl for wl in workloads.values() if not _true(wl.get("status") or {}, "Finished")]
    holding = [wl for wl in open_ if _true(wl.get("status") or {}, "QuotaReserved")]
    # Kueue finishes the slice it replaces before it reserves the replacement's quota (scheduler.go,
    # replaceWorkloadSlice, then admit): in between, the replaced one is still the job's Workload.
    holding += [wl for wl in workloads.values() if _replaced(wl) and not any(
        _true(other.get("status") or {}, "QuotaReserved") for other in _replacements(workloads, wl))]
    return newest(holding) or newest(open_) or newest(list(workloads.values()))


def _replaced(wl: dict[str, Any]) -> bool:
    finished = _condition(wl.get("status") or {}, "Finished") or {}
    return finished.get("status") == "True" and finished.get("reason") == "WorkloadSliceReplaced"


def _replacements(workloads: dict[str, dict[str, Any]], wl: dict[str, Any]) -> list[dict[str, Any]]:
    meta = wl.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    return [other for other in workloads.values()
            if ((other.get("metadata") or {}).get("annotations") or {}).get(SLICE_FOR) == key]


def counts(wl: dict[str, Any]) -> dict[str, int]:
    return {ps.get("name"): ps.get("count") for ps in (wl.get("spec") or {}).get("podSets") or []}


def slice_plan(wl: dict[str, Any], job: TrainingJob) -> str | None:
    """How an admitted Workload follows its resized job: "shrink" (its counts lowered in place), "grow" (a slice
    replaces it), None (no resize, or roles that differ: made again, as without slices)."""
    have, want = counts(wl), pod_counts(job)
    if have == want or set(have) != set(want):
        return None
    if all(want[r] <= have[r] for r in want):
        return "shrink"
    if all(want[r] >= have[r] for r in want):
        return "grow"
    return None


def shrunk(wl: dict[str, Any], job: TrainingJob) -> dict[str, Any]:
    """The merge patch that lowers an admitted Workload's counts to the job's (Kueue's webhook allows lowering a
    count with the gate on; its scheduler gives the quota back)."""
    want = pod_counts(job)
    pod_sets = [{**ps, "count": want.get(ps.get("name"), ps.get("count"))}
                for ps in (wl.get("spec") or {}).get("podSets") or []]
    return {"spec": {"podSets": pod_sets}}


def slice_name(job: TrainingJob, uid: str) -> str:
    """A slice's name: the job's Workload name and the job's generation (each resize is a new one)."""
    return f"{workload_name(job, uid)}-g{job.metadata.generation}"[:MAX_WORKLOAD_NAME]


def workload_slice(job: TrainingJob, uid: str, settings: Any, replaces: dict[str, Any],
                   priority: int | None = None) -> dict[str, Any]:
    """The slice that replaces the admitted Workload `replaces` at the job's new counts: the same pod sets in the
    same order (Kueue matches them by position), the same queue and priority."""
    wl = workload(job, uid, settings, priority)
    meta = replaces.get("metadata") or {}
    wl["metadata"]["name"] = slice_name(job, uid)
    wl["metadata"]["annotations"] = {SLICE_FOR: f"{meta.get('namespace')}/{meta.get('name')}", ELASTIC: "true"}
    order = [ps.get("name") for ps in (replaces.get("spec") or {}).get("podSets") or []]
    wl["spec"]["podSets"].sort(key=lambda ps: order.index(ps["name"]) if ps["name"] in order else len(order))
    return wl


def pending_slice(workloads: dict[str, dict[str, Any]], wl: dict[str, Any]) -> dict[str, Any] | None:
    """The slice that replaces `wl`, not Finished, if one was made."""
    return next((other for other in _replacements(workloads, wl)
                 if not _true(other.get("status") or {}, "Finished")), None)


def admitted_size(job: TrainingJob, wl: dict[str, Any]) -> TrainingJob:
    """`job` at the size its admitted Workload counts (a slice for the new size waits for Kueue): the engine runs
    the groups it was admitted for and starts the others once the slice is admitted."""
    assert job.spec.ddp is not None
    groups = counts(wl).get("ddp")
    spares = job.spec.ddp.groups - job.spec.ddp.nodes
    if groups is None or groups - spares == job.spec.ddp.nodes:
        return job
    held = copy.deepcopy(job)
    assert held.spec.ddp is not None
    held.spec.ddp.nodes = groups - spares
    held.spec.replicas = groups - spares if held.spec.replicas is not None else None
    return held


def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == ctype), None)


def _true(status: dict[str, Any], ctype: str) -> bool:
    c = _condition(status, ctype)
    return c is not None and c.get("status") == "True"


@dataclass(frozen=True)
class Placement:
    """What the admission adds to one pod set's pods."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def admission(wl: dict[str, Any] | None) -> QueueAdmission:
    """Whether the Workload lets the job run now, and if not why, in Kueue's own words.

    No Workload yet: queued (it is about to be created). Evicted: stop, whatever the admission
    says (its quota is given back once the replicas are gone). Admitted: run.
    """
    if wl is None:
        # Its own reason: the condition (and an Event) change to QueuedForAdmission, with Kueue's
        # words, once Kueue has looked at the Workload.
        return QueueAdmission(False, "WorkloadPending", "Waiting for the job's Kueue Workload to be created.")
    status = wl.get("status") or {}
    queue = (wl.get("spec") or {}).get("queueName", "")
    if _true(status, "Finished"):
        return QueueAdmission(True, "Finished", "")
    evicted = _condition(status, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        reason = "Preempted" if evicted.get("reason") == "Preempted" else "Evicted"
        return QueueAdmission(False, reason, f"Kueue evicted the job ({evicted.get('reason', '')}): "
                                             f"{evicted.get('message', '')}".rstrip(": "), evicted=True)
    if _true(status, "Admitted"):
        return QueueAdmission(True, "Admitted", f"Admitted by Kueue in ClusterQueue "
                                                f"{(status.get('admission') or {}).get('clusterQueue', '')}")
    reserved = _condition(status, "QuotaReserved")
    why = (reserved or {}).get("message") or ""
    requeued = _condition(status, "Requeued")
    if not why and requeued is not None:
        why = requeued.get("message", "")
    message = f"Waiting for Kueue to admit the job in LocalQueue {queue}"
    return QueueAdmission(False, "QueuedForAdmission", f"{message}: {why}" if why else f"{message}.")


def resized(wl: dict[str, Any], job: TrainingJob) -> bool:
    """The Workload counts other pods than the job has at its size: the job was resized (`kubectl scale`).
    A Workload's pod sets are immutable once Kueue reserved quota for them, so it is made again (deleted,
    then created at the new counts), as Kueue's jobframework does with a Workload that no longer matches
    its job; the job is held meanwhile (`resizing`)."""
    have = {ps.get("name"): ps.get("count") for ps in (wl.get("spec") or {}).get("podSets") or []}
    return have != pod_counts(job)


def resizing(job: TrainingJob) -> QueueAdmission:
    """What a resized job in a queue waits for: its Workload made again at the new size and admitted. The
    replicas stop after a checkpoint (as for an eviction) and start at the new size once Kueue admits it:
    the quota the job holds must be the quota of its size."""
    unit = {"ParameterServer": "workers", "DDP": "nodes"}.get(job.spec.mode, "replicas")
    return QueueAdmission(False, "Resizing",
                          f"Resized to {job.spec.size} {unit}: the job's Kueue Workload is made again at the new size; "
                          "the replicas stop after a checkpoint and start at the new size once Kueue admits it.")


def placements(wl: dict[str, Any], flavors: dict[str, dict[str, Any]]) -> dict[str, Placement]:
    """Per pod set (role): the assigned flavors' nodeLabels and tolerations, then the admission
    checks' podSetUpdates, as Kueue's jobframework applies them when it starts a job.
    `flavors` maps a ResourceFlavor's name to its spec."""
    status = wl.get("status") or {}
    out: dict[str, Placement] = {}
    for assignment in (status.get("admission") or {}).get("podSetAssignments") or []:
        p = Placement()
        for flavor in sorted(set((assignment.get("flavors") or {}).values())):
            spec = flavors.get(flavor) or {}
            p.node_selector.update(spec.get("nodeLabels") or {})
            p.tolerations.extend(t for t in spec.get("tolerations") or [] if t not in p.tolerations)
        out[assignment.get("name", "")] = p
    for check in status.get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            p = out.setdefault(update.get("name", ""), Placement())
            p.node_selector.update(update.get("nodeSelector") or {})
            p.tolerations.extend(t for t in update.get("tolerations") or [] if t not in p.tolerations)
            p.labels.update(update.get("labels") or {})
            p.annotations.update(update.get("annotations") or {})
    return out


def flavor_names(wl: dict[str, Any]) -> list[str]:
    """The ResourceFlavors the admission assigned, for the controller to read."""
    names: set[str] = set()
    for assignment in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        names.update((assignment.get("flavors") or {}).values())
    return sorted(names)


def place(obj: dict[str, Any], placement: Placement) -> dict[str, Any]:
    """A Pod, or a StatefulSet's template, with the admission's placement merged in."""
    obj = copy.deepcopy(obj)
    template = obj["spec"]["template"] if obj["kind"] == "StatefulSet" else obj
    spec = template["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        spec["tolerations"] = list(spec.get("tolerations") or []) + [
            t for t in placement.tolerations if t not in (spec.get("tolerations") or [])]
    meta = template.setdefault("metadata", {})
    if placement.labels:
        meta["labels"] = {**(meta.get("labels") or {}), **placement.labels}
    if placement.annotations:
        meta["annotations"] = {**(meta.get("annotations") or {}), **placement.annotations}
    return obj


def _set(conds: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str, now: str,
         generation: int) -> None:
    new = {"type": ctype, "status": status, "reason": reason, "message": message[:MAX_CONDITION_MESSAGE],
           "lastTransitionTime": now, "observedGeneration": generation}
    for i, c in enumerate(conds):
        if c.get("type") == ctype:
            if c.get("status") == status:
                new["lastTransitionTime"] = c.get("lastTransitionTime", now)
            conds[i] = new
            return
    conds.append(new)


def release_quota(wl: dict[str, Any], now: str) -> dict[str, Any] | None:
    """The status patch that gives an evicted Workload's quota back once its replicas stopped
    (jobframework's UnsetQuotaReservationWithCondition): None when there is nothing to give back.
    The patch carries the resourceVersion it was computed from: a Workload Kueue changed in
    between is refused (409) and the next round computes it again."""
    status = wl.get("status") or {}
    evicted = _condition(status, "Evicted")
    if evicted is None or evicted.get("status") != "True" or not _true(status, "QuotaReserved"):
        return None
    generation = (wl.get("metadata") or {}).get("generation", 0)
    conds = copy.deepcopy(status.get("conditions") or [])
    reason, message = evicted.get("reason", ""), evicted.get("message", "")
    requeued = "True" if reason in ("Preempted", "NodeFailures") else "False"
    _set(conds, "Requeued", requeued, reason, message, now, generation)
    _set(conds, "QuotaReserved", "False", "Pending", message, now, generation)
    _set(conds, "Admitted", "False", "NoReservation", "The workload has no reservation", now, generation)
    return {"metadata": {"resourceVersion": (wl.get("metadata") or {}).get("resourceVersion")},
            "status": {"conditions": conds, "admission": None}}


def finish(wl: dict[str, Any], state: str, message: str, now: str) -> dict[str, Any] | None:
    """The status patch that marks the Workload Finished when the job ended (its quota is then
    free for the next Workload); None once it is."""
    status = wl.get("status") or {}
    if _true(status, "Finished"):
        return None
    conds = copy.deepcopy(status.get("conditions") or [])
    reason = "Succeeded" if state == "Succeeded" else "Failed"
    _set(conds, "Finished", "True", reason, message or f"The job {state.lower()}.", now,
         (wl.get("metadata") or {}).get("generation", 0))
    return {"metadata": {"resourceVersion": (wl.get("metadata") or {}).get("resourceVersion")},
            "status": {"conditions": conds}}
