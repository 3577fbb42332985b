"""The cluster's half of a round: the engine's neutral actions as Kubernetes objects and calls.

Pure: the job, what the operator observed of its pods (and, for DDP, of its
StatefulSet's pods), the progress read from the chief's metrics, the old
status and the time go in; `engine.step` decides; this module renders what to
create (`children`), which pods to delete, how to scale the DDP StatefulSet,
and the status to write (memory included). The kopf handlers only gather the
observation and carry this out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..api import TrainingJob
from ..api.status import to_dict
from . import engine
from .children import Settings, children, pod_name
from .engine import IMAGE_PULL_REASONS, Restarted, iso, parse_iso  # noqa: F401  (re-exported)

PodObservation = engine.ReplicaObservation  # a pod, as the engine sees a replica
Progress = engine.ProgressReading
PS_DRAIN_SECONDS = engine.PS_DRAIN_SECONDS


@dataclass
class Actions:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)  # pod names, deleted gracefully
    scale_statefulset: int | None = None
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    restarted: list[Restarted] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None


def reconcile(
    job: TrainingJob,
    uid: str,
    token: str,
    pods: dict[str, PodObservation],
    old_status: dict[str, Any],
    now: float,
    progress: Progress | None = None,
    settings: Settings = Settings(),
    pvc_pending: list[str] | None = None,
    existing: set[tuple[str, str]] | None = None,
) -> Actions:
    """`existing` names the (kind, name) of non-pod children known to exist; they
    are not created again (None: create all, the I/O layer ignores its own)."""
    done = engine.step(job, old_status, pods, now, progress, pvc_pending)
    act = done.actions
    out = Actions(
        delete_job=act.delete_job,
        events=act.events,
        restarted=act.restarted,
        status=to_dict(done.status),
        requeue_after=act.requeue_after,
    )
    if done.status.state in ("Succeeded", "Failed") and act.hold is False and not act.stop and not act.start:
        return out
    is_ddp = job.spec.mode == "DDP"
    if is_ddp:
        # The StatefulSet owns the ranks' pods: the whole group held is a scale to 0, a
        # rank stopped (hung) is its pod deleted (the StatefulSet makes it again), and
        # ranks to start are the StatefulSet at full size.
        if act.hold:
            out.scale_statefulset = 0
        else:
            out.delete_pods = [pod_name(job, r) for r in act.stop]
            if act.start and existing is not None and ("StatefulSet", f"{job.name}-ddp") in existing:
                out.scale_statefulset = job.spec.ddp.nodes
    else:
        out.delete_pods = [pod_name(job, r) for r in act.stop]
    if act.hold or done.status.state in ("Succeeded", "Failed"):
        return out
    start = set(act.start)
    for obj in children(job, uid, token, settings):
        if obj["kind"] == "Pod":
            if obj["metadata"]["name"][len(job.name) + 1 :] in start:
                out.create.append(obj)
        elif existing is None or (obj["kind"], obj["metadata"]["name"]) not in existing:
            out.create.append(obj)
    return out
