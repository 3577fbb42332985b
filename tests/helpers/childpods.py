"""Every pod a job brings into its namespace, judged by one set of rules: those its trainer pods carry.

A job's children are more than its trainers: a fine-tuning pod's `model-init` init container, a
fault-tolerant job's Lighthouse, the client's export pod. Each new kind once came without a rule the
trainers had (model-init unbounded, the Lighthouse without limits, a model's copy without a bound), so
`judge` applies the same rules to whatever pod it is given, and `child_pods` gives it every one a job
makes. A rule names the pod's field and what is wrong; an empty list is a pod that holds them all.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from kubetrain.api import TrainingJob, quantity
from kubetrain.api.podtemplate import MODEL_VOLUME, pod_security_violations
from kubetrain.client.exportpod import export_pod
from kubetrain.engine.children import children
from kubetrain.engine.gang import pod_requests

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
FILLED_FROM_OUTSIDE = (MODEL_VOLUME,)
"""kubetrain's emptyDirs that a download fills (a model of any size): each must be bounded."""
OWN_REFERENCES = frozenset({"secrets", "claims"})
"""The security checks left to their own rules here: kubetrain's own pods name the job's token Secret, its
object-storage credentials and its claims (judged by engine/podsecurity's secretRef, pretrained-claim and
existingClaim rules), which a template may not."""


def child_pods(job: TrainingJob) -> dict[str, dict[str, Any]]:
    """Every pod the job makes, by name: its pods (a StatefulSet's as its template), and the client's export pod."""
    pods = {}
    for obj in children(job, "uid", "token"):
        if obj["kind"] == "Pod":
            pods[obj["metadata"]["name"]] = obj
        elif obj["kind"] == "StatefulSet":
            pods[obj["metadata"]["name"]] = obj["spec"]["template"]
    pods[f"{job.name}-export"] = export_pod(job, f"{job.name}-export", "kubetrain/trainer:test")
    return pods


def judge(pod: dict[str, Any], quota: tuple[str, ...] = ()) -> list[str]:
    """"<field>: <what is wrong>" for every rule of the trainers' pods that `pod` breaks: Pod Security `restricted`
    as kubetrain renders it, unique and valid container names, claims and paths that stay what they name,
    the limits a namespace's ResourceQuota counts (`quota`: its resource names), and a bounded, requested disk
    for what a download fills."""
    spec = pod["spec"]
    containers = [c for key in ("containers", "initContainers") for c in spec.get(key) or []]
    found = [f"{path}: {check.message}"
             for check, path in pod_security_violations(pod, OWN_REFERENCES, {"spec": {}})]
    for key in ("automountServiceAccountToken", "enableServiceLinks"):
        if spec.get(key) is not False:
            found.append(f"spec.{key}: must be false, got {spec.get(key)!r}")
    names = [c.get("name") for c in containers]
    for name in names:
        if names.count(name) > 1:
            found.append(f"spec.containers[{name}].name: two containers of one name")
        if not isinstance(name, str) or len(name) > 63 or not DNS1123_LABEL.fullmatch(name):
            found.append(f"spec.containers[{name}].name: not a DNS-1123 label")
    for volume in spec.get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and (len(claim) > 253 or not DNS1123_SUBDOMAIN.fullmatch(claim)):
            found.append(f"spec.volumes[{volume['name']}].persistentVolumeClaim.claimName: not a DNS-1123 "
                         f"subdomain of at most 253 characters ({len(claim)})")
    for container in containers:
        where = f"spec.containers[{container['name']}]"
        paths = [(f"{where}.volumeMounts[{m['name']}].mountPath", m["mountPath"])
                 for m in container.get("volumeMounts") or []]
        paths += [(f"{where}.env[{e['name']}]", e["value"]) for e in container.get("env") or []
                  if e["name"].startswith("KUBETRAIN_") and e["name"].endswith("_DIR") and "value" in e]
        for field, path in paths:
            if not path.startswith("/") or any(s in ("", ".", "..") for s in path[1:].split("/")):
                found.append(f"{field}: {path!r} is not an absolute path without '.', '..' or empty segments")
        resources = container.get("resources") or {}
        for name in quota:
            if name not in (resources.get("limits") or {}):
                found.append(f"{where}.resources.limits.{name}: none, which the namespace's quota requires")
    sized = Decimal(0)
    for volume in spec.get("volumes") or []:
        if "emptyDir" not in volume:
            continue
        limit = (volume["emptyDir"] or {}).get("sizeLimit")
        if limit is None and volume["name"] in FILLED_FROM_OUTSIDE:
            found.append(f"spec.volumes[{volume['name']}].emptyDir.sizeLimit: none, for a volume a download fills")
        sized += quantity.parse(limit) if limit is not None else 0
    asked = pod_requests(spec).get("ephemeral-storage", Decimal(0))
    if asked < sized:
        found.append(f"spec: ephemeral-storage requested {asked} bytes, less than its emptyDirs' sizeLimits ({sized})")
    return found
