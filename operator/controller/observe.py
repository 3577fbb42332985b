"""What the operator sees, turned into the pure core's observations: pods and metrics text."""

from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any

from ..api.spec import MAX_REPORTED_METRICS

from ..core.children import CONTAINER, LABEL_REPLICA
from ..core.reconcile import PodObservation, Progress, parse_iso

STS_INDEX_LABEL = "apps.kubernetes.io/pod-index"
REPORTED = "kubetrain_reported_metric"
NAME_LABEL = re.compile(r'[{,]name="([A-Za-z_][A-Za-z0-9_]{0,63})"')
NODE_LOST_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})
"""The reasons of a pod's DisruptionTarget condition that say its node is gone: the taint manager
evicts it once its toleration of the node's not-ready/unreachable taint ran out (any other NoExecute
taint reads the same: a node being taken away), and the pod garbage collector deletes a pod whose
Node object is gone. What the operator sees of a lost node from the pod alone: it has no grant to read
Nodes (a namespace-scoped installation cannot have one)."""


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
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "the scheduler found no node for it"
    disruption = conditions.get("DisruptionTarget") or {}
    node_lost = disruption.get("status") == "True" and disruption.get("reason") in NODE_LOST_DISRUPTIONS
    phase = status.get("phase") or "Pending"
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
    )


def termination_results(message: str | None) -> dict[str, Any] | None:
    """The final results a trainer wrote as its termination message (a JSON object), else None."""
    if not message:
        return None
    try:
        found = json.loads(message)
    except ValueError:
        return None  # the log's tail (FallbackToLogsOnError), not ours
    return found if isinstance(found, dict) else None


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


def progress_from(samples: dict[str, float], checkpoint_samples: dict[str, float] | None = None) -> Progress | None:
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
    return Progress(
        step=int(get(head, "training_step") or 0),
        total_steps=int(total) if total else None,
        loss=get(samples, "loss"),
        eval_accuracy=get(samples, "eval_accuracy"),
        samples_per_second=get(samples, "samples_per_second"),
        checkpoint_step=int(ckpt_step) if ckpt_step else None,
        checkpoint_time=ckpt_time if ckpt_time else None,
        metrics=reported or None,
        quorum=int(quorum) if quorum is not None else None,
    )


def scrape_allowed(ip: str, networks: list[str]) -> bool:
    """Whether the operator may connect to this pod IP (an allow-list; empty allows all)."""
    if not ip:
        return False
    if not networks:
        return True
    addr = ipaddress.ip_address(ip)
    return any(addr in ipaddress.ip_network(n, strict=False) for n in networks)
