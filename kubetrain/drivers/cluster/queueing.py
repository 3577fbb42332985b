"""The operator's side of Kueue (engine/kueue.py decides, this module talks to the API): a queued job's
Workload made on its first round, Kueue's admission and its placements read each round, and what Kueue
expects back (the quota of an evicted Workload, Finished)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.api.status import JobStatus
from kubetrain.engine import kueue
from kubetrain.engine.conditions import TERMINAL
from kubetrain.engine.engine import QueueAdmission, ReplicaObservation
from kubetrain.engine.plan import replica_names
from kubetrain.shared.timestamps import iso
from . import kube
from .state import Controller, JobState

log = logging.getLogger("kubetrain.operator")

Queued = tuple[dict[str, Any] | None, QueueAdmission | None, dict[str, Any] | None, TrainingJob]


def queue(ctl: Controller, job: TrainingJob, uid: str, state: JobState, old: JobStatus,
          pods: dict[str, ReplicaObservation]) -> Queued:
    """(the job's Workload, Kueue's admission, the admission's placements, the job as the engine runs it) for a
    job in a Kueue queue; (None, None, None, job) for any other. The Workload is created on the first round.
    A fault-tolerant job resized while admitted, with --kueue-workload-slices, runs at its admitted size until
    Kueue admits the slice of the new one (`_resize_by_slices`)."""
    if not ctl.config.kueue or kueue.queue_name(job) is None:
        return None, None, None, job
    key = (job.metadata.namespace, job.name)
    wl_name = kueue.workload_name(job, uid)
    slicing = ctl.config.kueue_slices and kueue.slices_apply(job)
    workload = kueue.current(ctl.index.workloads_of(key)) if slicing else ctl.index.workload(key, wl_name)
    if old.state in TERMINAL:
        return workload, None, None, job
    if workload is not None and kueue.resized(workload, job):
        plan = kueue.slice_plan(workload, job) if slicing and kueue.admission(workload).admitted else None
        if plan is None:
            return (*_resize(key, job, kueue_name(workload), workload, pods), job)
        job = _resize_by_slices(ctl, key, job, uid, state, workload, plan, pods)
    if workload is None and ("Workload", wl_name) not in state.existing:
        _create_workload(ctl, job, uid, state, wl_name)
    admission = kueue.admission(workload)
    placements = None
    if admission.admitted and workload is not None:
        placements = _placements(workload, state)
    return workload, admission, placements, job


def kueue_name(workload: dict[str, Any]) -> str:
    return (workload.get("metadata") or {}).get("name", "")


def _resize_by_slices(ctl: Controller, key: tuple[str, str], job: TrainingJob, uid: str, state: JobState,
                      workload: dict[str, Any], plan: str, pods: dict[str, ReplicaObservation]) -> TrainingJob:
    """Smaller: the engine stops the groups above the size at once; once they are gone the admitted Workload's
    counts are lowered in place. Larger: a slice at the new counts replaces the admitted Workload, and the job
    runs at its admitted size until Kueue admits the slice (the old Workload then Finished, the slice the
    job's). Returns the job as the engine runs it."""
    name = kueue_name(workload)
    if plan == "shrink":
        wanted = {f"{role}-{i}" for role, i in replica_names(job)}
        if not any(p.phase in ("Pending", "Running") for n, p in pods.items() if n not in wanted):
            kube.patch_workload(key[0], name, kueue.shrunk(workload, job))
            log.info("%s/%s: Workload %s lowered to %s in place (a live resize)", key[0], key[1], name,
                     kueue.pod_counts(job))
        return job
    if kueue.pending_slice(ctl.index.workloads_of(key), workload) is None \
            and ("Workload", kueue.slice_name(job, uid)) not in state.existing:
        pc = kueue.priority_class(job)
        found = kube.get_kueue_object("workloadpriorityclasses", pc) if pc else None
        priority = int(found["value"]) if found and "value" in found else None
        kube.create(kueue.workload_slice(job, uid, ctl.config.settings, workload, priority))
        state.existing.add(("Workload", kueue.slice_name(job, uid)))
        log.info("%s/%s: Workload slice %s asks Kueue for %s, replacing %s", key[0], key[1],
                 kueue.slice_name(job, uid), kueue.pod_counts(job), name)
    return kueue.admitted_size(job, workload)


def _resize(key: tuple[str, str], job: TrainingJob, wl_name: str, workload: dict[str, Any],
            pods: dict[str, ReplicaObservation]) -> tuple[None, QueueAdmission, None]:
    """The Workload of a resized job is made again at the new size; the watch's DELETED event lets the
    round after it create the new one. Deleted once the replicas of the old size are gone (the engine
    stops them meanwhile): Kueue frees the quota at once, and another job must not be admitted into it
    while they still checkpoint."""
    stopped = not any(p.phase in ("Pending", "Running") for p in pods.values())
    if stopped and not (workload.get("metadata") or {}).get("deletionTimestamp"):
        kube.delete_workload(key[0], wl_name)
        log.info("%s/%s: Workload %s deleted: the job was resized to %d", key[0], key[1], wl_name, job.spec.size)
    return None, kueue.resizing(job), None


def _create_workload(ctl: Controller, job: TrainingJob, uid: str, state: JobState, wl_name: str) -> None:
    # Kueue's WorkloadPriorityClass controller sets spec.priority only when the class changes;
    # a Workload created after it gets its value from its creator, as Kueue's own jobs do.
    pc = kueue.priority_class(job)
    priority = None
    if pc:
        found = kube.get_kueue_object("workloadpriorityclasses", pc)
        priority = int(found["value"]) if found and "value" in found else None
    kube.create(kueue.workload(job, uid, ctl.config.settings, priority))
    state.existing.add(("Workload", wl_name))


def _placements(workload: dict[str, Any], state: JobState) -> dict[str, Any]:
    """role -> kueue.Placement of an admitted Workload, read again only when its admission changes."""
    assigned = json.dumps((workload.get("status") or {}).get("admission"), sort_keys=True)
    if state.placements is None or state.placements[0] != assigned:
        flavors = {}
        for flavor in kueue.flavor_names(workload):
            found = kube.get_kueue_object("resourceflavors", flavor)
            flavors[flavor] = (found or {}).get("spec") or {}
        state.placements = (assigned, kueue.placements(workload, flavors))
    return state.placements[1]


def tell_kueue(workload: dict[str, Any], admission: QueueAdmission | None, status: JobStatus,
               pods: dict[str, ReplicaObservation], deleting: list[str]) -> None:
    """What Kueue expects back: an evicted Workload's quota once the job's replicas are gone, and
    Finished once the job ended."""
    meta = workload["metadata"]
    patch = None
    now = iso(time.time())
    if status.state in TERMINAL:
        observed = next((c for c in status.conditions if c.type == status.state), None)
        patch = kueue.finish(workload, status.state, observed.message if observed else "", now)
    elif admission is not None and admission.evicted and not deleting and not any(
            p.phase in ("Pending", "Running") for p in pods.values()):
        patch = kueue.release_quota(workload, now)
    if patch is not None:
        kube.patch_workload_status(meta["namespace"], meta["name"], patch)
