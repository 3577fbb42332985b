"""What the operator sees, turned into the pure core's observations: pods and metrics text."""

from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kubetrain.shared.timestamps import parse_iso

from kubetrain.api import KIND

from kubetrain.api.schema import INT64_MAX, INT64_MIN
from kubetrain.api.spec import MAX_REPORTED_METRICS

from kubetrain.api.podtemplate import MODEL_INIT
from kubetrain.api.podtemplate import CONTAINER
from kubetrain.engine.children import LABEL_REPLICA
from kubetrain.engine.engine import ProgressReading
from kubetrain.engine.reconcile import PodObservation

STS_INDEX_LABEL = "apps.kubernetes.io/pod-index"
REPORTED = "kubetrain_reported_metric"
NAME_LABEL = re.compile(r'[{,]name="([A-Za-z_][A-Za-z0-9_]{0,63})"')
NODE_LOST_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})
"""The reasons of a pod's DisruptionTarget condition that say its node is gone: the taint manager
evicts it once its toleration of the node's not-ready/unreachable taint ran out (any other NoExecute
taint reads the same: a node being taken away), and the pod garbage collector deletes a pod whose
Node object is gone. What the operator sees of a lost node from the pod alone: it has no grant to read
Nodes (a namespace-scoped installation cannot have one)."""


@dataclass(frozen=True)
class Owner:
    """A pod's controller, as its ownerReferences name it."""

    kind: str = ""
    name: str = ""
    uid: str = ""


def owner_of(pod: dict[str, Any]) -> Owner:
    """The controller among a pod's ownerReferences (the operator's pods are owned by their job, a DDP
    job's by its StatefulSet); an empty Owner when none is marked controller."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller") is True:
            return Owner(str(ref.get("kind") or ""), str(ref.get("name") or ""), str(ref.get("uid") or ""))
    return Owner()


def owned_by(owner: Owner, job: str, uid: str, statefulset: str = "") -> bool:
    """Whether a pod with this controller is one of job `job`'s (uid `uid`): made by the job itself,
    or by its StatefulSet `<job>-ddp` of uid `statefulset` (as the API server answered the operator,
    index.Index.statefulsets; "" while it is not known: then no StatefulSet's pod is the job's). The
    StatefulSet's name is not enough: anyone who may create pods can name `<victim>-ddp` as a pod's
    owner, with any uid and an apiVersion no API serves, which the garbage collector never resolves
    and so never deletes; such a pod, labelled as rank 0, was filed as the victim's ddp-0 (its forged
    success ended the victim; its forged failures spent its restarts).
    The pod's labels say which job it claims to be; this says whether the claim holds."""
    if owner.kind == KIND:
        return bool(uid) and owner.uid == uid
    return owner.kind == "StatefulSet" and owner.name == statefulset_name(job) and bool(statefulset) \
        and owner.uid == statefulset


def statefulset_name(job: str) -> str:
    """The name of a DDP job's StatefulSet (engine/children.statefulset)."""
    return f"{job}-ddp"


def names_its_replica(pod: str, job: str, replica: str) -> bool:
    """Whether a pod's name is the one the job gives that replica's pod, `<job>-<replica>`
    (engine/children.pod_name; a StatefulSet's rank n is `<job>-ddp-n`). A pod name is unique in its
    namespace: while the replica's own pod exists, another pod, whoever owns it, cannot pass for it."""
    return pod == f"{job}-{replica}"


def pod_observation(pod: dict[str, Any]) -> PodObservation | None:
    """A pod (as a dict, the API's camelCase shape) as the core sees it; None if not ours."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    replica = labels.get(LABEL_REPLICA)
    if replica is None and STS_INDEX_LABEL in labels:
        replica = f"ddp-{labels[STS_INDEX_LABEL]}"
    if replica is None:
        return None
    status = pod.get("status") or {}
    exit_code = last_exit = None
    waiting_reason = waiting_message = ""
    restarts = 0
    final = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != CONTAINER:
            continue
        restarts = cs.get("restartCount") or 0
        state = cs.get("state") or {}
        if state.get("terminated"):
            exit_code = state["terminated"].get("exitCode")
        if state.get("waiting"):
            waiting_reason = state["waiting"].get("reason") or ""
            waiting_message = state["waiting"].get("message") or ""
        last = (cs.get("lastState") or {}).get("terminated")
        if last:
            last_exit = last.get("exitCode")
        for ended in (state.get("terminated"), last):
            if final is None and ended and ended.get("exitCode") == 0:
                final = termination_results(ended.get("message"))
    init_code, message = _initializer_failure(status)
    if init_code is not None and exit_code is None:
        # The pretrained model failed its fetch or check: the trainer never started, and in a StatefulSet's
        # pod (restartPolicy Always) the kubelet would only run the same check again.
        exit_code, phase_failed = init_code, True
    else:
        phase_failed, message = False, ""
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "the scheduler found no node for it"
    disruption = conditions.get("DisruptionTarget") or {}
    node_lost = disruption.get("status") == "True" and disruption.get("reason") in NODE_LOST_DISRUPTIONS
    phase = "Failed" if phase_failed else status.get("phase") or "Pending"
    if phase in ("Pending", "Running") and exit_code not in (None, 0) and \
            (pod.get("spec") or {}).get("restartPolicy") == "Never":
        # The trainer is dead and will not come back in this pod: it has failed, though the
        # kubelet marks the pod Failed only once its sandbox is torn down, 1.2 s later on the
        # e2e node (seen by tests/e2e's recovery break-down). Its replacement need not wait.
        phase = "Failed"
    return PodObservation(
        replica=replica,
        phase=phase,
        exit_code=exit_code,
        reason=status.get("reason") or "",
        waiting_reason=waiting_reason,
        waiting_message=waiting_message,
        terminating=meta.get("deletionTimestamp") is not None,
        restart_count=restarts,
        last_exit_code=last_exit,
        node=(pod.get("spec") or {}).get("nodeName") or "",
        ip=status.get("podIP") or "",
        uid=meta.get("uid") or "",
        final=final,
        unschedulable=unschedulable,
        node_lost=node_lost,
        deletion_due=parse_iso(meta.get("deletionTimestamp")),
        message=message,
        image=trainer_image(pod),
    )


def trainer_image(pod: dict[str, Any]) -> str:
    """The image of the pod's `trainer` container, as its spec names it (what the engine records as a job's
    trainer when an older operator started it); "" when the pod has none."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if isinstance(container, dict) and container.get("name") == CONTAINER:
            image = container.get("image")
            return image if isinstance(image, str) else ""
    return ""


INIT_MESSAGE_BYTES = 512
"""Of the model-init container's termination message (its log's tail: kubetrain's own error line), what a
failure's message in the job's status keeps."""


def _initializer_failure(status: dict[str, Any]) -> tuple[int | None, str]:
    """(exit code, its error line) of the model-init container when it ended with a non-zero code (now or in
    its last run), else (None, "")."""
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") != MODEL_INIT:
            continue
        for ended in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")):
            if ended and ended.get("exitCode") not in (0, None):
                lines = [line for line in str(ended.get("message") or "").splitlines() if "error:" in line]
                said = lines[-1].split("error: ", 1)[1] if lines else ""
                return int(ended["exitCode"]), said[:INIT_MESSAGE_BYTES]
    return None, ""


def termination_results(message: str | None) -> dict[str, Any] | None:
    """The final results a trainer wrote as its termination message (a JSON object), else None.

    The message is the pod's (a tenant's code writes it), so only what the status can hold is
    kept: strings, booleans, finite numbers within int64, and one level of objects of those (the
    reported metrics). A 400-digit integer once raised OverflowError in every round of its job;
    deep nesting raises RecursionError in the JSON decoder (the kubelet keeps 4 KiB of message,
    room for 2,000 levels): both are dropped, never raised.
    """
    if not message:
        return None
    try:
        found = json.loads(message)
    except (ValueError, RecursionError):
        return None  # the log's tail (FallbackToLogsOnError), not ours; or nested past the decoder
    if not isinstance(found, dict):
        return None
    kept = {}
    for key, value in found.items():
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if _status_value(v)}
        elif not _status_value(value):
            continue
        kept[key] = value
    return kept


def _status_value(value: Any) -> bool:
    """A scalar a status can hold: a string, a boolean, a finite float, an integer within int64."""
    if isinstance(value, (str, bool)):
        return True
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    return isinstance(value, float) and math.isfinite(value)


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value for the unlabelled-by-extra-dimension kubetrain_ gauges we need.

    A script's reported values (`kubetrain_reported_metric{name="x"}`) come as
    `kubetrain_reported_metric/x`, for at most MAX_REPORTED_METRICS names.
    """
    out: dict[str, float] = {}
    reported = 0
    for line in text.splitlines():
        if not line.startswith("kubetrain_"):
            continue
        try:
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if name == REPORTED:
                match = NAME_LABEL.search(name_labels)
                if match is None or reported >= MAX_REPORTED_METRICS:
                    continue
                name = f"{REPORTED}/{match.group(1)}"
                reported += 1
            out[name] = float(value)
        except ValueError:
            continue
    return out


def progress_from(samples: dict[str, float], checkpoint_samples: dict[str, float] | None = None) -> ProgressReading | None:
    """Progress from the chief's samples (and, for a PS job, the shard that counts steps)."""
    head = checkpoint_samples or samples
    if "kubetrain_training_step" not in head:
        return None

    def get(src: dict[str, float], key: str) -> float | None:
        value = src.get(f"kubetrain_{key}")
        # NaN: not measured yet; an infinity is no JSON number and cannot go into the status.
        return None if value is None or not math.isfinite(value) else value

    ckpt_time = get(head, "checkpoint_last_success_timestamp_seconds")
    ckpt_step = get(head, "last_checkpoint_step")
    total = get(head, "total_steps") or get(samples, "total_steps")
    prefix = f"{REPORTED}/"
    reported = {k[len(prefix):]: v for k, v in samples.items() if k.startswith(prefix) and math.isfinite(v)}
    quorum = get(samples, "ft_quorum_participants")  # fault-tolerant DDP only
    set_aside = get(head, "checkpoints_set_aside_total")
    return ProgressReading(
        step=int(get(head, "training_step") or 0),
        total_steps=int(total) if total else None,
        loss=get(samples, "loss"),
        eval_accuracy=get(samples, "eval_accuracy"),
        eval_loss=get(samples, "eval_loss"),
        eval_perplexity=get(samples, "eval_perplexity"),
        samples_per_second=get(samples, "samples_per_second"),
        checkpoint_step=int(ckpt_step) if ckpt_step else None,
        checkpoint_time=ckpt_time if ckpt_time else None,
        metrics=reported or None,
        quorum=int(quorum) if quorum is not None else None,
        set_aside=int(set_aside) if set_aside else None,
    )


def scrape_allowed(ip: str, networks: list[str]) -> bool:
    """Whether the operator may connect to this pod IP (an allow-list; empty allows all)."""
    if not ip:
        return False
    if not networks:
        return True
    addr = ipaddress.ip_address(ip)
    return any(addr in ipaddress.ip_network(n, strict=False) for n in networks)


def urgent(kind: str | None, pod: dict[str, Any]) -> bool:
    """Whether a pod event may need a replacement made (the work queue's urgent lane): the pod went
    (DELETED, or being deleted), failed, or its trainer container ended with a non-zero code (a DDP
    pod's container restarts in place). A pod that starts, runs or succeeds is routine."""
    if kind == "DELETED" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return True
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return True
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            ended = (cs.get("state") or {}).get("terminated")
            if ended and ended.get("exitCode") not in (0, None):
                return True
    return _initializer_failure(status)[0] is not None
