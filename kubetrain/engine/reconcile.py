"""The cluster's half of a round: the engine's neutral actions as Kubernetes objects and calls.

Pure: the job, what the operator observed of its pods (and, for DDP, of its
StatefulSet's pods), the progress read from the chief's metrics, the old
status and the time go in; `engine.step` decides; this module renders what to
create (`children`), which pods to delete, how to scale the DDP StatefulSet,
and the status to write (memory included). The kopf handlers only gather the
observation and carry this out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kubetrain.shared import __version__
from kubetrain.api import TrainingJob, versions
from kubetrain.api.status import JobStatus, TrainerImage
from . import engine, kueue
from .children import LABEL_ROLE, Settings, children, pod_name
from .engine import Restarted

PodObservation = engine.ReplicaObservation  # a pod, as the engine sees a replica
PS_DRAIN_SECONDS = engine.PS_DRAIN_SECONDS
FORCE_DELETE_AFTER_SECONDS = 10.0
"""A pod evicted from a lost node (`node_lost`) that still exists this long after its grace period
ended is deleted forcibly. A kubelet that answers kills the container at the end of the grace period
and reports it within a few seconds, so a pod left beyond that has no kubelet to finish it: it would
stay Terminating for ever, and its replacement (the same name: a PS replica's pod, a StatefulSet's
ordinal) could never start. A kubelet that comes back afterwards finds the pod gone and kills what
is left of it."""


@dataclass
class ClusterActions:
    """A round's decisions (engine.Actions) as Kubernetes objects and calls, and the status to write."""

    create: list[dict[str, Any]] = field(default_factory=list)
    replace: list[dict[str, Any]] = field(default_factory=list)  # existing children rendered again (a resize)
    delete_pods: list[str] = field(default_factory=list)  # pod names, deleted gracefully
    force_delete_pods: list[str] = field(default_factory=list)  # pod names, deleted at once (lost nodes)
    annotate_pods: dict[str, dict[str, str]] = field(default_factory=dict)  # pod name -> annotations to patch on
    scale_statefulset: int | None = None
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    restarted: list[Restarted] = field(default_factory=list)
    status: JobStatus = field(default_factory=JobStatus)
    requeue_after: float | None = None


def reconcile(
    job: TrainingJob,
    uid: str,
    token: str,
    pods: dict[str, PodObservation],
    old_status: JobStatus,
    now: float,
    progress: engine.ProgressReading | engine.ProgressUnknown | None = None,
    settings: Settings = Settings(),
    pvc_pending: list[str] | None = None,
    existing: set[tuple[str, str]] | None = None,
    admission: engine.QueueAdmission | None = None,
    placements: dict[str, Any] | None = None,
    refusal: engine.Refusal | None = None,
    safety_net: float = engine.MAX_REQUEUE_SECONDS,
) -> ClusterActions:
    """`existing` names the (kind, name) of non-pod children known to exist; they
    are not created again (None: create all, the I/O layer ignores its own).
    `admission` is what the job's queue (Kueue) says, None outside any queue; `placements`
    (role -> kueue.Placement) what its admission adds to the pods it lets start; `refusal` why the job
    may not run at all (engine.Refusal: it fails); `safety_net` the longest a running job goes without a
    round (engine.step).

    The job's pods are rendered with its recorded trainer (status.trainer, which the engine records from
    `settings.image` when the job first starts): an operator upgraded since starts them with the trainer the
    job's other pods run, not with its own (spec.image, when set, still comes first)."""
    done = engine.step(job, old_status, pods, now, progress, pvc_pending, admission, refusal, safety_net,
                       trainer=operator_trainer(settings))
    recorded = done.status.trainer
    if recorded is not None and recorded.image and recorded.image != settings.image:
        settings = dataclasses.replace(settings, image=recorded.image)
    act = done.actions
    out = ClusterActions(
        delete_job=act.delete_job,
        events=act.events,
        restarted=act.restarted,
        status=done.status,
        requeue_after=act.requeue_after,
    )
    _force_deletes(job, pods, now, out)
    if done.status.state in ("Succeeded", "Failed") and act.hold is False and not act.stop and not act.start:
        return out
    is_ddp = job.spec.mode == "DDP"
    if is_ddp:
        # The StatefulSet owns the ranks' pods: the whole group held is a scale to 0, a
        # rank stopped (hung) is its pod deleted (the StatefulSet makes it again), and
        # ranks to start are the StatefulSet at full size.
        if act.hold:
            out.scale_statefulset = 0
            # A pod beside the StatefulSet (a fault-tolerant job's Lighthouse) goes by its own deletion.
            out.delete_pods = [pod_name(job, r) for r in act.stop if not r.startswith("ddp-")]
        else:
            out.delete_pods = [pod_name(job, r) for r in act.stop]
            if act.start and existing is not None and ("StatefulSet", f"{job.name}-ddp") in existing:
                assert job.spec.ddp is not None  # validated: a DDP job has its section
                out.scale_statefulset = job.spec.ddp.groups
    else:
        out.delete_pods = [pod_name(job, r) for r in act.stop]
    if act.hold or done.status.state in ("Succeeded", "Failed"):
        return out
    if act.resized and not is_ddp:
        out.annotate_pods = _size_annotations(job, pods, act.stop)
    start = set(act.start)

    def wanted(kind: str, name: str) -> bool:
        # What this round creates or replaces; the rest is not rendered (children.children).
        if kind == "Pod":
            return name[len(job.name) + 1 :] in start
        if act.resized and kind in RESIZED_KINDS:
            return True
        return existing is None or (kind, name) not in existing

    for obj in children(job, uid, token, settings, wanted):
        if obj["kind"] in ("Pod", "StatefulSet") and placements:
            placement = placements.get(obj["metadata"]["labels"].get(LABEL_ROLE, ""))
            if placement is not None:
                obj = kueue.place(obj, placement)
        if obj["kind"] == "Pod":
            if obj["metadata"]["name"][len(job.name) + 1 :] in start:
                out.create.append(obj)
        elif act.resized and obj["kind"] in RESIZED_KINDS:
            # Whether or not `existing` knows it: an operator that started (or took over as leader)
            # while the old replicas stopped has seen no round create it, and a create would meet the
            # old one (409) and leave it at the old size: the DDP group back with the old --nnodes.
            out.replace.append(obj)
        elif existing is None or (obj["kind"], obj["metadata"]["name"]) not in existing:
            out.create.append(obj)
    return out


def operator_trainer(settings: Settings) -> TrainerImage:
    """What the operator starts a new job's replicas with: its trainer image (`--trainer-image`), whose version is
    its tag, or, for an image whose tag says none, the operator's own version (the chart gives the operator the
    trainer of its own appVersion)."""
    return TrainerImage(image=settings.image, version=versions.image_version(settings.image) or __version__)


RESIZED_KINDS = ("ConfigMap", "StatefulSet", "PodGroup")
"""What carries the job's size besides its pods: the job file every trainer reads (workers, nodes),
the DDP StatefulSet (its replicas, torchrun's --nnodes in its template) and the gang's PodGroup (its
minMember and minResources). Rendered again when a resize is done, before the replicas of the new size
start (made when missing: drivers/cluster/kube.replace)."""

SIZE_ANNOTATION = "kubetrain.dev/size"
"""Set on a ParameterServer job's running shards at a live resize, to the new size. A pod's mounted
ConfigMap (its job file, which ps-0 re-reads about once a second) is refreshed by the kubelet only when
it syncs the pod: at its periodic sync (60 s by default, plus the ConfigMap cache's TTL) or when the pod
changes. Changing the pod makes the kubelet sync it, and remount the projected file, within seconds."""


def _size_annotations(job: TrainingJob, pods: dict[str, PodObservation], stopping: list[str]) -> dict[str, dict[str, str]]:
    """The size annotation for every shard that runs (or is about to) and stays: those the resize round
    creates read the new job file anyway."""
    size = {SIZE_ANNOTATION: str(job.spec.size)}
    return {pod_name(job, name): dict(size) for name, seen in sorted(pods.items())
            if name.startswith("ps-") and seen.phase in ("Pending", "Running") and not seen.terminating
            and name not in stopping}


def _force_deletes(job: TrainingJob, pods: dict[str, PodObservation], now: float, out: ClusterActions) -> None:
    """Pods stuck Terminating on a lost node, FORCE_DELETE_AFTER_SECONDS past their grace period: deleted
    at once, with an Event; the others are looked at again when they are due."""
    for seen in pods.values():
        if not (seen.node_lost and seen.terminating and seen.deletion_due is not None):
            continue
        left = seen.deletion_due + FORCE_DELETE_AFTER_SECONDS - now
        if left > 0:
            out.requeue_after = left if out.requeue_after is None else min(out.requeue_after, left)
            continue
        name = pod_name(job, seen.replica)
        out.force_delete_pods.append(name)
        out.events.append(("Warning", "NodeLost",
                           f"Pod {name} stayed Terminating on node {seen.node or '(unknown)'}, which does not answer, "
                           f"{FORCE_DELETE_AFTER_SECONDS:.0f} s past its grace period: deleted it forcibly so that its "
                           "replacement can start."))
