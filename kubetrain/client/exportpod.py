"""The short-lived pod through which the client takes a cluster job's model out. Pure: the job in, the pod out.

It mounts every claim that holds the job's checkpoints read-only, under
`/kubetrain/export/<replica>` (the layout `kubetrain checkpoints export`
reads as "a directory holding replica directories"), or, for a job whose
checkpoints are in object storage, carries the job's credentials (its
secretRef, as the job's own pods) and reads the URI; it runs the job's own image
(so the checkpoint is read by the kubetrain that wrote it) and only sleeps:
the client runs the export in it and copies the file out (`kubectl exec`'s
API), then deletes it. It complies with Pod Security `restricted`, and it
carries no job label, so the operator never takes it for a replica.
"""

from __future__ import annotations

from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.api.podtemplate import CONTAINER, PRETRAINED_MOUNT, PRETRAINED_VOLUME, TMP_MOUNT, TMP_VOLUME
from kubetrain.engine.children import RUN_AS_USER, claim_name, credential_env

EXPORT_ROOT = "/kubetrain/export"
LABEL_EXPORT = "kubetrain.dev/export-of"
POD_SECONDS = 3600
"""The export pod's whole life (its activeDeadlineSeconds, and what it sleeps): a client that dies before it
deletes the pod leaves it at most this long. An export of a model that fits on the machine (the file is
copied whole) takes seconds to minutes."""


def checkpoint_claims(job: TrainingJob) -> list[tuple[str, str, str]]:
    """(replica, claim, path in the claim) of every replica that holds checkpoints (engine/children.py's layout)."""
    spec = job.spec
    if spec.mode == "ParameterServer":
        assert spec.parameter_server is not None
        holders = [f"ps-{i}" for i in range(spec.parameter_server.replicas)]
    elif spec.mode == "DDP":
        assert spec.ddp is not None
        holders = [f"ddp-{i}" for i in range(spec.ddp.nodes)]
    else:
        holders = ["single-0"]
    storage = spec.checkpoint.storage
    if storage.uri:  # in object storage: no claim; the pod reads the URI with the job's credentials
        return []
    if storage.existing_claim:  # <job>/checkpoints/<replica>; every DDP node uses ddp-0's
        holders = holders[:1] if spec.mode == "DDP" else holders
        return [(r, storage.existing_claim, f"{job.name}/checkpoints/{r}") for r in holders]
    if spec.mode == "DDP":
        if storage.access_mode == "ReadWriteMany":
            return [("ddp-0", claim_name(job, "ddp"), "checkpoints")]
        return [(r, f"data-{job.name}-{r}", "checkpoints") for r in holders]
    return [(r, claim_name(job, r), "checkpoints") for r in holders]


def export_pod(job: TrainingJob, name: str, image: str, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    template = (job.spec.pod_template or {}).get("spec") or {}
    claims = checkpoint_claims(job)
    volumes: list[dict[str, Any]] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": TMP_VOLUME, "mountPath": TMP_MOUNT}]
    for claim in sorted({c for _, c, _ in claims}):
        volumes.append({"name": f"c{len(volumes)}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    volume_of = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in volumes[1:]}
    for replica, claim, sub_path in claims:
        mounts.append({"name": volume_of[claim], "mountPath": f"{EXPORT_ROOT}/{replica}", "subPath": sub_path,
                       "readOnly": True})
    pretrained = job.spec.model.pretrained if job.spec.model is not None else None
    if pretrained and pretrained.startswith("pvc://"):  # a Hugging Face export copies its config and tokenizer
        volumes.append({"name": PRETRAINED_VOLUME, "persistentVolumeClaim": {
            "claimName": pretrained.removeprefix("pvc://").partition("/")[0], "readOnly": True}})
        mounts.append({"name": PRETRAINED_VOLUME, "mountPath": PRETRAINED_MOUNT, "readOnly": True})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": POD_SECONDS,
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": CONTAINER,
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": ["sleep", str(POD_SECONDS)],
            "env": [{"name": "HOME", "value": TMP_MOUNT}, {"name": "PYTHONSAFEPATH", "value": "1"},
                    *credential_env(job)],
            "volumeMounts": mounts,
            "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                                "seccompProfile": {"type": "RuntimeDefault"}},
        }],
        "volumes": volumes,
    }
    # Where the job's pods may run, this one may: the same nodes (its claims may be bound to one), the same
    # pull secrets.
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        if template.get(key):
            pod_spec[key] = template[key]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": job.metadata.namespace, "labels": {LABEL_EXPORT: job.name}},
        "spec": pod_spec,
    }
