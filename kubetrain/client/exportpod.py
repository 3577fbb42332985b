"""The short-lived pod through which the client takes a cluster job's model out. Pure: the job in, the pod out.

It mounts every claim that holds the job's checkpoints read-only, under
`/kubetrain/export/<replica>` (the layout `kubetrain checkpoints export`
reads as "a directory holding replica directories"), or, for a job whose
checkpoints are in object storage, carries the job's credentials (its
secretRef, as the job's own pods) and reads the URI; it runs the job's own image
(so the checkpoint is read by the kubetrain that wrote it) and only sleeps:
the client runs the export in it and copies the file out (`kubectl exec`'s
API), then deletes it. It complies with Pod Security `restricted`, and it
carries no job label, so the operator never takes it for a replica. Before it
is made, the client applies the operator's rule on the claim it would mount
(`claim_problems`): no other job's checkpoint claim by way of an export.
"""

from __future__ import annotations

from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.api.podtemplate import CONTAINER, PRETRAINED_MOUNT, PRETRAINED_VOLUME, TMP_MOUNT, TMP_VOLUME
from kubetrain.engine.children import (EPHEMERAL_STORAGE, RUN_AS_USER, ClusterEndpoints, Settings, claim_name,
                                      credential_env, workloads)
from kubetrain.engine.plan import chief, plan_replicas
from kubetrain.engine.podsecurity import existing_claim_problems

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


EXPORT_RESOURCES = ("cpu", "memory", EPHEMERAL_STORAGE)
"""What the export pod takes of the chief's trainer container's resources: what reading a checkpoint and writing
the model out use. Not its accelerators: an export runs on CPU, and a GPU held for it could keep it Pending beside
the running job."""


def trainer_resources(job: TrainingJob) -> dict[str, Any]:
    """The resources of the job's chief's trainer container as its pod has them (spec.resources.worker with the
    template merged, and a fine-tuning job's model disk), EXPORT_RESOURCES only: the export reads as much as the
    chief holds (the whole model; a shard of it under FSDP) and writes about the model's size to its own disk. So a
    namespace whose ResourceQuota counts limits admits the export pod wherever it admits the job's."""
    name = chief(job)
    replicas = [r for r in plan_replicas(job, ClusterEndpoints(job)) if r.name == name]
    [obj] = workloads(job, "export", Settings(), replicas)
    pod = obj["spec"]["template"] if obj["kind"] == "StatefulSet" else obj
    trainer = next(c for c in pod["spec"]["containers"] if c.get("name") == CONTAINER)
    resources = trainer.get("resources")
    out: dict[str, Any] = {}
    for kind in ("limits", "requests"):
        amounts = resources.get(kind) if isinstance(resources, dict) else None
        kept = {k: v for k, v in amounts.items() if k in EXPORT_RESOURCES} if isinstance(amounts, dict) else {}
        if kept:
            out[kind] = kept
    return out


def claim_problems(job: TrainingJob, holder: str | None) -> list[str]:
    """The operator's refusal of a checkpoint.storage.existingClaim that is another job's checkpoint claim, named
    or labelled so (`holder`: the job the claim's kubetrain.dev/job-name label names, None when it has none or does
    not exist), with its message (engine/podsecurity.existing_claim_problems). Judged as an installation without
    the `claims` allowance judges it, the chart's default: the client cannot read the installation's
    podSecurity.allow, and an export pod made past the rule would mount what the operator refused the job."""
    return existing_claim_problems(job, frozenset(), holder)


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
            **({"resources": resources} if (resources := trainer_resources(job)) else {}),
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
