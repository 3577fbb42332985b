"""The Kubernetes objects a TrainingJob owns, as plain dicts: the plan rendered for a cluster.

Pure: the job, its uid and the operator's settings in; ConfigMap, Secret,
Services, PVCs, Pods and (DDP) a StatefulSet out, each owned by the job so
deleting the job garbage-collects them (checkpoint claims too, unless
`checkpoint.storage.whenDeleted` is Retain). The replicas, commands and
environment come from `plan.plan_replicas`, the same plan the local backend
executes; `spec.podTemplate` is merged over each pod.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubetrain.shared import __version__
from kubetrain.shared.checkpoints import RUN_CHECKPOINTS
from kubetrain.shared.launch import (
    CHECKPOINT_URI_VAR, FT_GROUP_VAR, FT_STORE_VAR, JOB_TOKEN_VAR, LIGHTHOUSE, NODE_RANK_VAR, RDZV_PORT, REPLICA_VAR,
    TERMINATION_LOG_VAR, MODEL_MOUNT, PRETRAINED_CLAIM_MOUNT,
)
from kubetrain.shared.tls_files import FILES as TLS_FILES, SUBDIR as TLS_SUBDIR, TLS_DIR_VAR

from kubetrain.api.spec import FT_PORT

from kubetrain.api import API_VERSION, KIND, TrainingJob, dump_manifest, quantity
from kubetrain.api.podtemplate import (
    CONFIG_MOUNT,
    CONFIG_VOLUME,
    CONTAINER,
    DATA_MOUNT,
    DATA_VOLUME,
    MODEL_INIT,
    MODEL_VOLUME,
    PRETRAINED_VOLUME,
    TMP_MOUNT,
    TMP_VOLUME,
    reserved_key,
)
from . import gang
from .plan import DATA_PORT, GRPC_PORT, Replica, plan_replicas, shared_checkpoints
from .certificates import ps_hosts_of, secret_certificates, uses_tls

TLS_MOUNT = f"{CONFIG_MOUNT}/{TLS_SUBDIR}"
"""Where a pod finds its job's certificates: in its read-only `config` volume, which projects the job's
ConfigMap (job.yaml) and the certificate keys of the job's Secret (under TLS_SUBDIR), so no volume or
path of their own."""

LABEL_JOB = "kubetrain.dev/job-name"
LABEL_ROLE = "kubetrain.dev/role"
LABEL_REPLICA = "kubetrain.dev/replica"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "kubetrain"
TOKEN_KEY = "token"
RUN_AS_USER = 1000
TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class Settings:
    """What the operator adds to every job: its default trainer image and pull policy."""

    image: str = f"kubetrain/trainer:{__version__}"
    pull_policy: str = "IfNotPresent"
    grace_seconds: int = 60
    pod_security_allow: frozenset[str] = frozenset()
    """What spec.podTemplate may ask of the node beyond Pod Security `restricted` (`--pod-security-allow`,
    the chart's podSecurity.allow); api/podtemplate.pod_security_problems judges a job by it."""
    object_store_secrets: frozenset[str] = frozenset()
    """The Secrets of their namespace that jobs may name as object-storage credentials (spec.dataset.secretRef,
    spec.checkpoint.storage.secretRef): `--object-store-secrets`, the chart's objectStorage.secrets. The
    `secrets` allowance lets a job name any (engine/podsecurity.secret_ref_problems)."""
    network_policy: bool = False
    """Give every job a NetworkPolicy (`network_policy`). The operator's `--no-network-policy` (the
    chart's networkPolicy.enabled) turns it off; off here, so that a caller of these pure functions
    asks for it."""
    metrics_from: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    """NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock) that may reach the trainers'
    metrics port besides the job's own pods (`--metrics-from-json`): the chart passes the operator's
    own pods and networkPolicy.metricsFrom (Prometheus). Empty: nothing else may."""
    gang_schedulers: tuple[tuple[str, str], ...] = ()
    """The gang schedulers whose PodGroups this operator makes, as (kind, the pods' schedulerName),
    the first the default of a job that names none (`--gang-scheduler`, the chart's gangScheduling).
    Empty: a job with spec.runPolicy.schedulingPolicy fails with GangSchedulingDisabled (engine/gang.py)."""
    volcano_queues: frozenset[str] = frozenset()
    """The Volcano queues jobs may name in spec.runPolicy.schedulingPolicy.queue (`--volcano-queues`, the
    chart's gangScheduling.volcano.queues); empty: none, a PodGroup goes to Volcano's default queue
    (engine/gang.policy_problems)."""


@dataclass
class ClusterEndpoints:
    """Service names, fixed ports and volume mounts (see plan.Endpoints)."""

    job: TrainingJob

    def ps_address(self, index: int) -> str:
        return f"{self.job.name}-ps-{index}:{GRPC_PORT}"

    def ps_port(self, index: int) -> int:
        return GRPC_PORT

    def ps_data_address(self, index: int) -> str:
        return f"{self.job.name}-ps-{index}:{DATA_PORT}"

    def ps_data_port(self, index: int) -> int:
        return DATA_PORT

    def rendezvous(self) -> str:
        return f"{self.job.name}-ddp-0.{self.job.name}-ddp:{RDZV_PORT}"

    def group_rendezvous(self, index: int) -> str:
        # In the pod itself: the agent's store listens on every interface, so the other groups reach
        # it at the pod's IP (advertise_address) and its own ranks on loopback.
        return f"127.0.0.1:{RDZV_PORT}"

    def advertise_address(self, index: int) -> str:
        return f"$({POD_IP_VAR})"  # the pod's IP, from the downward API (statefulset)

    def lighthouse_address(self) -> str:
        return f"{lighthouse_name(self.job)}:{FT_PORT}"

    def lighthouse_port(self) -> int:
        return FT_PORT

    def metrics_port(self, replica: str) -> int:
        return self.job.spec.metrics.port

    def job_file(self) -> str:
        return f"{CONFIG_MOUNT}/job.yaml"

    def run_dir(self, replica: str) -> str:
        if self.job.spec.checkpoint.storage.existing_claim:
            return f"{DATA_MOUNT}/{self.job.name}"
        return f"{DATA_MOUNT}/run"

    def checkpoint_dir(self, replica: str) -> str:
        """The replica's own directory on the checkpoint volume.

        A claim kubetrain creates belongs to one replica (Single, each PS
        shard, each DDP pod), so the checkpoints are at its top. An
        existingClaim is shared by every replica, and may be by other jobs:
        one `checkpoints` directory there made ps-0 resume from ps-1's files
        (their names are the same steps). So each replica gets
        `<job>/checkpoints/<replica>`, the layout of a local run directory
        (`kubetrain checkpoints verify|export` read a copy of `<job>/` as one).
        DDP's pods share one template, so every node gets rank 0's directory
        (`ddp-0`): the one the group's writer writes and every node's reader
        offers from, as the group agrees on the newest checkpoint any holds.
        """
        if self.job.spec.checkpoint.storage.existing_claim:
            return f"{self.run_dir(replica)}/{RUN_CHECKPOINTS}/{replica}"
        return f"{DATA_MOUNT}/checkpoints"

    def data_cache_dir(self) -> str:
        return f"{TMP_MOUNT}/kubetrain/data-cache"  # the pod's own disk (its tmp emptyDir)

    def model_dir(self, pretrained: str) -> str:
        if pretrained.startswith("pvc://"):
            return f"{PRETRAINED_CLAIM_MOUNT}/{pretrained.removeprefix('pvc://').partition('/')[2]}".rstrip("/")
        return MODEL_MOUNT

    def local_addr(self) -> str | None:
        return None

    def code_dir(self) -> str | None:
        return None  # the container's working directory: the image's, or spec.script.workingDir

    def listen_address(self) -> str:
        return "0.0.0.0"  # the pod's own network namespace: its IP is what Services and scrapes reach


POD_IP_VAR = "KUBETRAIN_POD_IP"


def lighthouse_name(job: TrainingJob) -> str:
    """A fault-tolerant DDP job's Lighthouse: its pod and its Service."""
    return pod_name(job, LIGHTHOUSE)


def config_name(job: TrainingJob) -> str:
    return f"{job.name}-config"


def token_name(job: TrainingJob) -> str:
    """The job's token Secret. Its name carries the job's uid: the operator never reads Secrets,
    so it cannot check who owns one of a taken name, and a job re-created under the same name
    must not take over the Secret of the old one that garbage collection is about to delete."""
    uid = job.metadata.uid or ""
    return f"{job.name}-token-{uid[:8]}" if uid else f"{job.name}-token"


def pod_name(job: TrainingJob, replica: str) -> str:
    return f"{job.name}-{replica}"


def selector(job: TrainingJob) -> str:
    """The pods the scale subresource counts (status.selector): the workers, the DDP nodes, the Single pod."""
    role = {"Single": "single", "ParameterServer": "worker", "DDP": "ddp"}[job.spec.mode]
    return f"{LABEL_JOB}={job.name},{LABEL_ROLE}={role}"


def claim_name(job: TrainingJob, replica: str) -> str:
    return f"{job.name}-ckpt-{replica}"


def owner_reference(job: TrainingJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(
    job: TrainingJob, uid: str, name: str, labels: dict[str, str] | None = None, owned: bool = True
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {LABEL_JOB: job.name, LABEL_MANAGED: MANAGER, **(labels or {})},
    }
    if owned:
        meta["ownerReferences"] = [owner_reference(job, uid)]
    return meta


def config_map(job: TrainingJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, uid, config_name(job)),
        "data": {"job.yaml": dump_manifest(job)},
    }


def token_secret(job: TrainingJob, uid: str, token: str) -> dict[str, Any]:
    """The job's token and, with parameter servers, its CA and replica certificate (engine/certificates.py,
    docs/parameter-server.md#encryption): made when the Secret is first rendered, created once."""
    data = {TOKEN_KEY: token}
    if uses_tls(job):
        assert job.spec.parameter_server is not None
        hosts = tuple(ps_hosts_of(job.name, job.spec.parameter_server.replicas))
        data.update(secret_certificates(job.name, job.metadata.namespace, uid, hosts))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, uid, token_name(job)),
        "type": "Opaque",
        "stringData": data,
    }


def ps_services(job: TrainingJob, uid: str) -> list[dict[str, Any]]:
    """One Service per shard, so workers reach `<job>-ps-<i>` by name, at an address that outlives the pod.

    A ClusterIP Service, not a headless one: the name resolves to the Service's
    virtual address for the job's whole life, and kube-proxy sends a new
    connection to whichever pod backs it now. With a headless Service the name
    resolved to the pod's own address, which a replaced shard changes, and
    every cache on the way (the cluster DNS's, 5 s with CoreDNS's defaults and
    30 s as kubeadm configures it) kept handing the workers the dead pod's
    address: 5.4-5.6 s of a shard's recovery went to the workers finding the
    new one (docs/benchmarks-history.md, Recovery). publishNotReadyAddresses: a shard
    is reachable as soon as it listens (it has no readiness probe to wait for).
    """
    assert job.spec.parameter_server is not None
    # The shard's ports reached by the Service's name: gRPC, and /metrics where it is on (the name
    # reached it when it resolved to the pod's own address; the operator scrapes by pod IP).
    ports = [{"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT},
             {"name": "ps-data", "port": DATA_PORT, "targetPort": DATA_PORT}]
    if job.spec.metrics.port:
        ports.append({"name": "metrics", "port": job.spec.metrics.port, "targetPort": job.spec.metrics.port})
    out = []
    for i in range(job.spec.parameter_server.replicas):
        replica = f"ps-{i}"
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(job, uid, pod_name(job, replica), {LABEL_ROLE: "ps"}),
                "spec": {
                    "publishNotReadyAddresses": True,
                    "selector": {LABEL_JOB: job.name, LABEL_REPLICA: replica},
                    "ports": ports,
                },
            }
        )
    return out


def ddp_service(job: TrainingJob, uid: str) -> dict[str, Any]:
    """The StatefulSet's headless Service: rank 0's pod is `<job>-ddp-0.<job>-ddp`."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, uid, f"{job.name}-ddp", {LABEL_ROLE: "ddp"}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name, LABEL_ROLE: "ddp"},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
        },
    }


def lighthouse_service(job: TrainingJob, uid: str) -> dict[str, Any]:
    """The Lighthouse's Service: a ClusterIP, so that the groups reach `<job>-lighthouse-0` at one address
    for the job's whole life, whichever pod backs it (as ps_services, for the same reason: a replaced
    Lighthouse pod has another IP, and DNS caches would keep the old one)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, uid, lighthouse_name(job), {LABEL_ROLE: "lighthouse"}),
        "spec": {
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name, LABEL_REPLICA: LIGHTHOUSE},
            "ports": [{"name": "lighthouse", "port": FT_PORT, "targetPort": FT_PORT}],
        },
    }


def _claim_spec(job: TrainingJob) -> dict[str, Any]:
    storage = job.spec.checkpoint.storage
    spec: dict[str, Any] = {
        "accessModes": [storage.access_mode],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name:
        spec["storageClassName"] = storage.storage_class_name
    return spec


def claims(job: TrainingJob, uid: str) -> list[dict[str, Any]]:
    """A checkpoint PVC per stateful pod (Single, each PS shard); none with existingClaim.

    One ReadWriteOnce volume per shard works on any default StorageClass;
    workers keep nothing (their cursors live in ps-0's checkpoints). DDP's
    volumes come from the StatefulSet's claim template, a volume per node,
    except with accessMode ReadWriteMany: then one claim, `<job>-ckpt-ddp`,
    that every node mounts (sharded checkpoints need every rank to read every
    shard; plan.shared_checkpoints).

    With `whenDeleted: Retain` a claim has no owner, so the garbage collector
    leaves it when the job is deleted; its labels stay, so `kubectl get pvc -l
    kubetrain.dev/job-name=<job>` finds it. A job created again under the same
    name asks for the same claim names and gets 409 Conflict: it mounts a kept
    claim only once its owner made the new job the claim's owner (kube._check_ours:
    an unowned claim may be anyone's, made for the job to write its checkpoints to).
    """
    storage = job.spec.checkpoint.storage
    if storage.uri or storage.existing_claim or (job.spec.mode == "DDP" and not shared_checkpoints(job)):
        return []
    if job.spec.mode == "DDP":
        replicas = ["ddp"]
    elif job.spec.mode == "Single":
        replicas = ["single-0"]
    else:
        assert job.spec.parameter_server is not None  # validated: a ParameterServer job has its section
        replicas = [f"ps-{i}" for i in range(job.spec.parameter_server.replicas)]
    owned = storage.when_deleted == "Delete"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(job, uid, claim_name(job, r), {LABEL_REPLICA: r}, owned=owned),
            "spec": _claim_spec(job),
        }
        for r in replicas
    ]


def _security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# The keys of a job's object-storage Secret (spec.*.secretRef), each an environment variable of the same
# name in the job's pods, as every S3 tool reads them; required ones first.
CREDENTIAL_KEYS: tuple[tuple[str, bool], ...] = (
    ("AWS_ACCESS_KEY_ID", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_SESSION_TOKEN", False),
    ("AWS_REGION", False), ("AWS_ENDPOINT_URL", False),
)


def credential_env(job: TrainingJob) -> list[dict[str, Any]]:
    """The job's object-storage credentials as variables taken from its secretRef by the kubelet: the
    operator never reads the Secret, and the values appear in no object it writes. A missing required
    key keeps the pod from starting (CreateContainerConfigError), naming the key."""
    refs = set(job.spec.secret_refs().values())
    if not refs:
        return []
    [name] = refs  # validation: every secretRef of a job names the same Secret
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key, "optional": not required}}}
            for key, required in CREDENTIAL_KEYS]


def _container(job: TrainingJob, replica: Replica, settings: Settings) -> dict[str, Any]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in replica.env.items()]
    env.append({"name": JOB_TOKEN_VAR, "valueFrom": {"secretKeyRef": {"name": token_name(job), "key": TOKEN_KEY}}})
    env.append({"name": "HOME", "value": TMP_MOUNT})
    env.append({"name": TERMINATION_LOG_VAR, "value": TERMINATION_LOG})
    if uses_tls(job):
        env.append({"name": TLS_DIR_VAR, "value": TLS_MOUNT})  # in the config volume (_config_volume)
    if replica.role != "lighthouse":
        env += credential_env(job)
    ports = [{"name": name[:15], "containerPort": port} for name, port in replica.ports.items()]
    # A Lighthouse is a small server with no tensors: none of a trainer's resources (GPUs above all), its own
    # fixed ones after the template (_bound_lighthouse).
    role_resources = {"ps": job.spec.resources.ps, "lighthouse": {}}.get(replica.role, job.spec.resources.worker)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.spec.image or settings.image,
        "imagePullPolicy": settings.pull_policy,
        "command": list(replica.command),
        "env": env,
        "ports": ports,
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": DATA_VOLUME, "mountPath": DATA_MOUNT},
            {"name": TMP_VOLUME, "mountPath": TMP_MOUNT},
        ],
        "securityContext": _security_context(),
        # The trainer writes its final results there; the operator reads them back
        # from the container's terminated state (the log's tail when it wrote none).
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if role_resources:
        container["resources"] = copy.deepcopy(role_resources)
    script = job.spec.script
    if script is not None and script.working_dir:
        container["workingDir"] = script.working_dir
    return container


def _pod_spec(job: TrainingJob, replica: Replica, settings: Settings, data_volume: dict[str, Any] | None) -> dict[str, Any]:
    volumes = [
        _config_volume(job),
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    if data_volume is not None:
        volumes.insert(1, data_volume)
    trainer = _container(job, replica, settings)
    init = _model_initializer(job, replica, trainer, volumes)
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.grace_seconds,
        # Pod Security `restricted` (with _security_context): seccomp at the pod
        # level covers a template's sidecars and init containers too.
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        # A trainer never talks to the API server (the operator reads its
        # /metrics and termination message), so no token a user's code could use.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [trainer],
        "volumes": volumes,
        **({"initContainers": [init]} if init is not None else {}),
    }


def _model_initializer(job: TrainingJob, replica: Replica, trainer: dict[str, Any],
                       volumes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """spec.model.pretrained: its volume (the claim of a pvc:// one, read-only; else the pod's own disk, bounded
    to spec.model.diskSize), appended to `volumes` and mounted read-only into the `trainer` container, and the
    init container that fetches (s3://, hf://) and checks it before the trainer starts (`python -m
    kubetrain.trainer initializer`, with the trainer's image, environment and security; its resources are the
    trainer's once the template is merged, `_bound_model`): a bad model fails the pod there, exit 3, with the
    URI named in its termination message. None without a pretrained model."""
    model = job.spec.model
    if model is None or not model.pretrained or replica.role == "lighthouse":
        return None
    if model.pretrained.startswith("pvc://"):
        claim = model.pretrained.removeprefix("pvc://").partition("/")[0]
        volumes.append({"name": PRETRAINED_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mount = {"name": PRETRAINED_VOLUME, "mountPath": PRETRAINED_CLAIM_MOUNT, "readOnly": True}
    else:
        # The copy lands on the node's disk: bounded, so that a model of any size cannot fill it and have the
        # kubelet evict other tenants' pods under disk pressure (past the limit it evicts this pod alone).
        volumes.append({"name": MODEL_VOLUME, "emptyDir": {"sizeLimit": model.disk_size}})
        mount = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}
    trainer["volumeMounts"].append({**mount, "readOnly": True})
    init = {
        "name": MODEL_INIT,
        "image": trainer["image"],
        "imagePullPolicy": trainer["imagePullPolicy"],
        "command": ["python", "-m", "kubetrain.trainer", "initializer"],
        "env": copy.deepcopy(trainer["env"]),
        "volumeMounts": [m for m in trainer["volumeMounts"] if m["name"] in (CONFIG_VOLUME, TMP_VOLUME)] + [mount],
        "securityContext": _security_context(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return init


EPHEMERAL_STORAGE = "ephemeral-storage"  # the resource of a pod's own disk: its emptyDirs, logs and writable layers


def _bound_model(spec: dict[str, Any], job: TrainingJob) -> None:
    """After the template: the resources of a fine-tuning pod's init container (`model-init`) are the trainer
    container's as merged, and a pod that copies its model onto its own disk asks for that disk. Copied before
    the merge, model-init had none when the trainer's came from the template: the step that downloads a
    many-gigabyte model ran unbounded, and a namespace whose ResourceQuota counts limits refused the pod.

    The model's copy (spec.model.diskSize, the `model` volume's sizeLimit) is added to the trainer's
    ephemeral-storage: its request (its limit when only that is set, as the API server defaults it) and its
    limit where it has one (the kubelet counts an emptyDir against the pod's limits). model-init then takes
    the same, so the pod's request covers the copy from the download to the end of training."""
    model = job.spec.model
    containers = spec.get("containers")
    init_containers = spec.get("initContainers")
    if model is None or not model.pretrained or not isinstance(containers, list) \
            or not isinstance(init_containers, list):
        return
    trainer = next((c for c in containers if isinstance(c, dict) and c.get("name") == CONTAINER), None)
    init = next((c for c in init_containers if isinstance(c, dict) and c.get("name") == MODEL_INIT), None)
    if trainer is None or init is None:
        return
    copied = any(isinstance(v, dict) and v.get("name") == MODEL_VOLUME and "emptyDir" in v
                 for v in spec.get("volumes") or [])
    if copied:
        resources = _with_disk(trainer.get("resources"), model.disk_size)
        if resources is not None:
            trainer["resources"] = resources
    if isinstance(trainer.get("resources"), dict):
        init["resources"] = copy.deepcopy(trainer["resources"])
    else:
        init.pop("resources", None)


def _with_disk(resources: Any, size: str) -> dict[str, Any] | None:
    """`resources` (a container's) with `size` more ephemeral-storage: added to the request (or to the limit
    when only that is set) and to the limit if there is one. None when a shape or a quantity is not one this
    can add to (validation refuses those; the renderer never raises on them)."""
    out = copy.deepcopy(resources) if resources is not None else {}
    if not isinstance(out, dict):
        return None
    requests, limits = out.setdefault("requests", {}), out.get("limits")
    if not isinstance(requests, dict) or not isinstance(limits, (dict, type(None))):
        return None
    try:
        amount = quantity.parse(size)
        request = requests.get(EPHEMERAL_STORAGE)
        limit = (limits or {}).get(EPHEMERAL_STORAGE)
        base = quantity.parse(request if request is not None else limit if limit is not None else 0)
        if limit is not None and limits is not None:
            limits[EPHEMERAL_STORAGE] = gang.format_quantity(quantity.parse(limit) + amount)
    except quantity.QuantityError:
        return None
    requests[EPHEMERAL_STORAGE] = gang.format_quantity(base + amount)
    return out


LIGHTHOUSE_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "100m", "memory": "64Mi"},
    "limits": {"cpu": "1", "memory": "256Mi"},
}
"""The Lighthouse's container, whatever the job's resources or template say (it holds no tensors: none of a
trainer's GPUs or memory). Fixed requests and limits, so that its Kueue pod set counts what it takes and a
namespace whose ResourceQuota requires limits admits it; without them its pod was refused there and the
fault-tolerant job waited for ever. Why these numbers: the process (Python, kubetrain's light imports,
prometheus-client and torchft's Rust server, loaded without torch) is 31 MiB resident serving, measured on
2026-12-06 with torchft 0.2.0; 64Mi requested is twice that, 256Mi the most, room for the connections of many
groups without a limit a leak could hide behind. It idles at about 1 % of a core; one whole core at most,
so a quorum round is never throttled past the groups' heartbeat timeout (1 s by default), and a tenth of one
requested. No ephemeral-storage: it writes two event lines and its log, and a request of it would keep the pod
off a node that reports none and out of a ClusterQueue that does not cover it."""


def _bound_lighthouse(spec: dict[str, Any]) -> None:
    """After the template: the Lighthouse's container gets LIGHTHOUSE_RESOURCES (a template's trainer resources,
    meant for the trainers, are not its)."""
    for container in spec.get("containers") or []:
        if isinstance(container, dict) and container.get("name") == CONTAINER:
            container["resources"] = copy.deepcopy(LIGHTHOUSE_RESOURCES)


def _config_volume(job: TrainingJob) -> dict[str, Any]:
    """The job's ConfigMap; with parameter servers, projected with the job's certificates from its
    Secret (`tls/`, the key readable by the pod's group only; not the token, which is a variable),
    so that the certificates need no volume or mount path of their own that a template could take."""
    if not uses_tls(job):
        return {"name": CONFIG_VOLUME, "configMap": {"name": config_name(job)}}
    certificates = [{"key": k, "path": f"{TLS_SUBDIR}/{k}", "mode": 0o440} for k in TLS_FILES]
    return {"name": CONFIG_VOLUME, "projected": {"sources": [
        {"configMap": {"name": config_name(job)}},
        {"secret": {"name": token_name(job), "items": certificates}},
    ]}}


def _data_volume(job: TrainingJob, replica: Replica) -> dict[str, Any]:
    storage = job.spec.checkpoint.storage
    if not replica.stateful or storage.uri:
        # Checkpoints in object storage: the pod's own disk stages them and keeps the newest.
        return {"name": DATA_VOLUME, "emptyDir": {}}
    if storage.existing_claim:
        return {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": storage.existing_claim}}
    return {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": claim_name(job, replica.name)}}


# Lists of the pod spec that merge item by item, and the key that names an item:
# a template's item with a new key is appended, one with the key of an item
# kubetrain put there replaces it (the validator refuses kubetrain's own names,
# see api/podtemplate.py, so that happens only to a caller of this function
# that skipped validation). Replacing a list whole would drop kubetrain's own
# items: a template's `volumes: [dataset]` used to remove `config`, `data` and
# `tmp`, and the API server refused the pod (its mounts named volumes that were
# gone); a template's `volumeMounts` unmounted the checkpoints. volumeMounts are
# keyed by mountPath, as in Kubernetes' strategic merge patch: one volume may be
# mounted at several paths (subPath), never two volumes at one path.
MERGE_KEYS = {"volumes": "name", "env": "name", "ports": "name", "volumeMounts": "mountPath", "initContainers": "name"}


def merge_pod_template(pod: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """`spec.podTemplate` over a pod: metadata labels/annotations and spec fields.

    Dicts merge recursively; `containers` merge by name (the trainer container is
    `trainer`; a container without a name is the trainer), the lists of MERGE_KEYS
    item by item; other lists (initContainers, tolerations, ...) are replaced.
    """
    pod = copy.deepcopy(pod)
    meta = template.get("metadata") or {}
    for key in ("labels", "annotations"):
        if meta.get(key):
            # kubetrain's own keys are kubetrain's alone: the operator, the Services and the NetworkPolicy
            # find a job's pods by them. The validator and the CRD refuse them in a template
            # (api/podtemplate.reserved_key); one that got here anyway is dropped, never merged.
            pod["metadata"].setdefault(key, {}).update({k: v for k, v in meta[key].items() if not reserved_key(k)})
    _merge(pod["spec"], template.get("spec") or {})
    _harden(pod["spec"])
    return pod


def _harden(spec: dict[str, Any]) -> None:
    """kubetrain's own security fields, applied after the template (Pod Security `restricted`): in the
    pod, runAsNonRoot, the RuntimeDefault seccomp profile and no ServiceAccount token; in every
    container, the trainer's, a sidecar's or an init container's, no privilege escalation and every
    capability dropped (those a container adds stay added).

    A value the template set stays (a null counts as none), so that the pod-security check, which
    judges this rendered pod (engine/podsecurity.py), sees what the template asked for: it refuses
    `runAsNonRoot: false` unless the installation allows root, and passes `runAsUser: 2000` or a
    Localhost seccomp profile. What a template cannot do is leave one of these out: a null once
    copied over kubetrain's value, and `capabilities: {drop: []}` replaced its drop of ALL.
    """
    pod_ctx = spec.get("securityContext")
    if pod_ctx is None:
        pod_ctx = spec["securityContext"] = {}
    containers = [c for key in ("containers", "initContainers") for c in spec.get(key) or [] if isinstance(c, dict)]
    if isinstance(pod_ctx, dict):
        # Not when a uid 0 is asked for (allowed by podSecurity.allow: root): the kubelet would refuse to start it.
        root = [ctx for ctx in [pod_ctx] + [c.get("securityContext") for c in containers]
                if isinstance(ctx, dict) and ctx.get("runAsUser") == 0]
        if pod_ctx.get("runAsNonRoot") is None and not root:
            pod_ctx["runAsNonRoot"] = True
        if pod_ctx.get("seccompProfile") is None:
            pod_ctx["seccompProfile"] = {"type": "RuntimeDefault"}
    if spec.get("automountServiceAccountToken") is None:
        spec["automountServiceAccountToken"] = False
    for container in containers:
        ctx = container.get("securityContext")
        if ctx is None:
            ctx = container["securityContext"] = {}
        if not isinstance(ctx, dict):
            continue  # Kubernetes refuses the pod
        # A privileged container (podSecurity.allow: privileged) may not also say false here.
        if ctx.get("allowPrivilegeEscalation") is None and ctx.get("privileged") is not True:
            ctx["allowPrivilegeEscalation"] = False
        caps = ctx.get("capabilities")
        if caps is None:
            caps = ctx["capabilities"] = {}
        if isinstance(caps, dict):
            drop = caps.get("drop")
            if drop is None:
                caps["drop"] = ["ALL"]
            elif isinstance(drop, list) and "ALL" not in drop:
                caps["drop"] = [*drop, "ALL"]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    for key, value in over.items():
        if key == "containers" and isinstance(value, list):
            by_name = {c.get("name"): c for c in base.get("containers", [])}
            for c in value:
                target = by_name.get(c.get("name", CONTAINER))
                if target is None:
                    base.setdefault("containers", []).append(copy.deepcopy(c))
                else:
                    _merge(target, c)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(base.get(key, []), list):
            _merge_keyed(base.setdefault(key, []), value, MERGE_KEYS[key])
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _merge_keyed(base: list[Any], over: list[Any], key: str) -> None:
    # Only kubetrain's items are looked up: two template items with one key both
    # go through, and the API server reports the duplicate rather than this
    # merge silently keeping one.
    index = {item[key]: i for i, item in enumerate(base) if isinstance(item, dict) and item.get(key) is not None}
    for item in over:
        k = item.get(key) if isinstance(item, dict) else None
        if k is not None and k in index:
            base[index[k]] = copy.deepcopy(item)
        else:
            base.append(copy.deepcopy(item))


NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
NODE_LOST_TOLERATION_SECONDS = 30
"""How long a pod stays on a node the control plane declared NotReady or unreachable before the taint
manager evicts it and the operator replaces it elsewhere (reason NodeLost). The node is declared so only
after the kube-controller-manager's node-monitor-grace-period (50 s by default) without a heartbeat, so a
kubelet that merely restarted is already forgiven; 30 s more lets a brief partition heal. Kubernetes'
own default (DefaultTolerationSeconds) is 300 s: five minutes in which every synchronous step of the job
waits for the lost replica, where a replacement costs at most the steps since the last checkpoint.
A template's own toleration for these taints (any tolerationSeconds, or none: forever) replaces this."""


def _tolerate_node_loss_briefly(spec: dict[str, Any]) -> None:
    """Tolerate NODE_LOST_TAINTS for NODE_LOST_TOLERATION_SECONDS, unless the template's tolerations
    already cover a taint (same key, or a key-less Exists; effect NoExecute or any)."""
    tolerations = spec.setdefault("tolerations", [])
    for key in NODE_LOST_TAINTS:
        covered = any(
            isinstance(t, dict) and (t.get("key") == key or (not t.get("key") and t.get("operator") == "Exists"))
            and t.get("effect") in (None, "", "NoExecute")
            for t in tolerations
        )
        if not covered:
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": NODE_LOST_TOLERATION_SECONDS})


def pod(job: TrainingJob, uid: str, replica: Replica, settings: Settings) -> dict[str, Any]:
    labels = {LABEL_ROLE: replica.role, LABEL_REPLICA: replica.name}
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(job, uid, pod_name(job, replica.name), labels),
        "spec": _pod_spec(job, replica, settings, _data_volume(job, replica)),
    }
    body["metadata"]["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(job.spec.metrics.port)}
    body = merge_pod_template(body, job.spec.pod_template)
    if replica.role == "lighthouse":
        _bound_lighthouse(body["spec"])
    else:
        _bound_model(body["spec"], job)
    _tolerate_node_loss_briefly(body["spec"])
    return body


def statefulset(job: TrainingJob, uid: str, replicas: list[Replica], settings: Settings) -> dict[str, Any]:
    """DDP: one StatefulSet of `nodes` pods, each a torchrun agent; node n reads its rank from its ordinal.

    The node rank comes from the pod's ordinal (the `apps.kubernetes.io/pod-index`
    label, exposed through the downward API), so one template serves every node.
    """
    first = replicas[0]
    fault_tolerant = job.spec.fault_tolerant
    # One template for every pod: node 0's argv without its is_host choice; the
    # agent derives it from the pod's ordinal (KUBETRAIN_NODE_RANK). A fault-tolerant
    # node hosts its own rendezvous: is_host on every one.
    command = list(first.command)
    if not fault_tolerant:
        i = command.index("--rdzv-conf")
        del command[i : i + 2]
    # What differs from node to node is rendered from the pod's ordinal (and IP) below.
    per_node = {"KUBETRAIN_REPLICA", FT_GROUP_VAR, FT_STORE_VAR, CHECKPOINT_URI_VAR}
    env = {k: v for k, v in first.env.items() if k not in per_node}
    template_replica = Replica(role="ddp", index=0, command=tuple(command), env=env, ports=first.ports)
    storage = job.spec.checkpoint.storage
    # Without existingClaim the StatefulSet adds each pod's `data` volume from
    # its claim template; with one, or with the job's own ReadWriteMany claim,
    # every node mounts that claim.
    # Checkpoints in object storage: no claim, each node stages on its own disk.
    shared_claim = storage.existing_claim or (claim_name(job, "ddp") if shared_checkpoints(job) else "")
    shared = {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": shared_claim}}
    own_disk = {"name": DATA_VOLUME, "emptyDir": {}}
    pod_spec = _pod_spec(job, template_replica, settings,
                         own_disk if storage.uri else shared if shared_claim else None)
    pod_spec["restartPolicy"] = "Always"  # the only policy a StatefulSet allows; the operator counts restarts
    container = pod_spec["containers"][0]
    container["env"][:0] = [
        {"name": NODE_RANK_VAR, "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
        {"name": "KUBETRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    container["env"].append({"name": REPLICA_VAR, "value": "ddp-$(KUBETRAIN_NODE_RANK)"})
    if CHECKPOINT_URI_VAR in first.env:
        # A fault-tolerant job's groups keep a prefix each (`<uri>/ddp-<node>/`), the others share ddp-0's.
        uri = first.env[CHECKPOINT_URI_VAR]
        node_uri = uri.removesuffix("ddp-0/") + "ddp-$(KUBETRAIN_NODE_RANK)/" if fault_tolerant else uri
        container["env"].append({"name": CHECKPOINT_URI_VAR, "value": node_uri})
    if fault_tolerant:
        container["env"][:0] = [{"name": POD_IP_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        container["env"] += [{"name": FT_GROUP_VAR, "value": "$(KUBETRAIN_NODE_RANK)"},
                             {"name": FT_STORE_VAR, "value": first.env[FT_STORE_VAR]}]
    labels = {LABEL_JOB: job.name, LABEL_ROLE: "ddp", LABEL_MANAGED: MANAGER}
    template = merge_pod_template(
        {
            "metadata": {
                "labels": dict(labels),
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(job.spec.metrics.port)},
            },
            "spec": pod_spec,
        },
        job.spec.pod_template,
    )
    _bound_model(template["spec"], job)
    _tolerate_node_loss_briefly(template["spec"])
    sts: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(job, uid, f"{job.name}-ddp", {LABEL_ROLE: "ddp"}),
        "spec": {
            "serviceName": f"{job.name}-ddp",
            "replicas": len(replicas),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {LABEL_JOB: job.name, LABEL_ROLE: "ddp"}},
            "template": template,
            # whenDeleted Retain: the StatefulSet controller gives the claims no
            # owner, so they outlive the job, and a job created again under the
            # same name (same StatefulSet, same claim names) mounts them again.
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": storage.when_deleted, "whenScaled": "Retain"},
        },
    }
    if not shared_claim and not storage.uri:
        sts["spec"]["volumeClaimTemplates"] = [
            {"metadata": {"name": DATA_VOLUME, "labels": {LABEL_JOB: job.name}}, "spec": _claim_spec(job)}
        ]
    return sts


def network_policy_name(job: TrainingJob) -> str:
    return f"{job.name}-isolation"


def network_policy(job: TrainingJob, uid: str, settings: Settings) -> dict[str, Any]:
    """The job's pods accept connections only from the job's own pods, and on the metrics port
    also from `settings.metrics_from` (the operator, Prometheus); everything else is refused.

    The job's pods get all TCP ports from each other, not only the parameter servers' (50051)
    and the rendezvous (29400): gloo's DDP pairs and torchrun's agents connect on ephemeral
    ports chosen at run time, so a list of ports would cut a running DDP group apart. Ingress
    only: what a trainer connects to (DNS, its peers, a dataset's server) is not limited. No
    metrics rule without a peer: a rule without `from` would admit every source.
    """
    own_pods = {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own_pods], "ports": [{"protocol": "TCP"}]}]
    port = job.spec.metrics.port
    if port and settings.metrics_from:
        ingress.append({"from": [copy.deepcopy(peer) for peer in settings.metrics_from],
                        "ports": [{"protocol": "TCP", "port": port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, uid, network_policy_name(job)),
        "spec": {
            # Every pod of the job: PS shards and workers, Single's pod, the StatefulSet's ranks.
            "podSelector": {"matchLabels": {LABEL_JOB: job.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


Wanted = Callable[[str, str], bool]
"""Which children to render, by (kind, name), asked before a pod or the StatefulSet is rendered."""


def children(job: TrainingJob, uid: str, token: str, settings: Settings = Settings(),
             wanted: Wanted | None = None) -> list[dict[str, Any]]:
    """Every object the job owns, in creation order (config first, the PodGroup before the pods,
    pods last); with `wanted`, only those it names. A round asks for what it will create or
    replace: rendering every pod of a 1,000-pod job each round cost more memory than the operator
    holds (reconcile.py), and a pod not wanted is not rendered at all."""
    want: Wanted = wanted if wanted is not None else (lambda kind, name: True)
    replicas = plan_replicas(job, ClusterEndpoints(job))
    objs = [config_map(job, uid), token_secret(job, uid, token)]
    if settings.network_policy:
        objs.append(network_policy(job, uid, settings))  # before any pod, so none runs unfenced
    if job.spec.mode == "ParameterServer":
        objs += ps_services(job, uid)
    objs += claims(job, uid)
    if job.spec.mode == "DDP":
        objs.append(ddp_service(job, uid))
        if job.spec.fault_tolerant:
            objs.append(lighthouse_service(job, uid))
    objs = [o for o in objs if want(o["kind"], o["metadata"]["name"])]
    group_wanted = job.spec.run_policy.scheduling_policy is not None and want("PodGroup", gang.podgroup_name(job))
    workload = workloads(job, uid, settings, replicas, want)
    # The PodGroup's minResources add up every member's requests: rendered in full when it is wanted
    # (its first round, a resize), which the pods rendered for this round alone do not give.
    whole = workload if not group_wanted or wanted is None else workloads(job, uid, settings, replicas)
    objs += _gang(job, uid, settings, workload, whole, group_wanted)
    return objs + workload


def representatives(job: TrainingJob) -> list[Replica]:
    """One replica of each role: what the template can change is the same in every pod of a role (the
    template is one; what differs from pod to pod, a name, an index, a claim, is kubetrain's own). Judging
    the security of every pod, rendered twice (engine/podsecurity.py), cost 647 MiB for a job of 1,096 pods
    and a 107 KB template."""
    first: dict[str, Replica] = {}
    for replica in plan_replicas(job, ClusterEndpoints(job)):
        first.setdefault(replica.role, replica)
    return list(first.values())


def _workload_name(job: TrainingJob, replica: Replica) -> tuple[str, str]:
    """The (kind, name) of the object a replica runs in: a DDP node's is the StatefulSet."""
    if job.spec.mode == "DDP" and replica.role == "ddp":
        return "StatefulSet", f"{job.name}-ddp"
    return "Pod", pod_name(job, replica.name)


def workloads(job: TrainingJob, uid: str, settings: Settings, replicas: list[Replica] | None = None,
              wanted: Wanted | None = None) -> list[dict[str, Any]]:
    """The job's pods, or (DDP) its StatefulSet: what runs its code; with `wanted`, those it names."""
    if replicas is None:
        replicas = plan_replicas(job, ClusterEndpoints(job))
    if wanted is not None:
        replicas = [r for r in replicas if wanted(*_workload_name(job, r))]
    if job.spec.mode == "DDP":
        # A fault-tolerant job's Lighthouse: a pod of its own beside the StatefulSet (one per job,
        # replaced under the job's restart policy), before the groups that connect to it.
        nodes = [r for r in replicas if r.role == "ddp"]
        return ([pod(job, uid, r, settings) for r in replicas if r.role == "lighthouse"]
                + ([statefulset(job, uid, nodes, settings)] if nodes else []))
    return [pod(job, uid, r, settings) for r in replicas]


def _gang(job: TrainingJob, uid: str, settings: Settings, workload: list[dict[str, Any]],
          whole: list[dict[str, Any]], group_wanted: bool = True) -> list[dict[str, Any]]:
    """The job's PodGroup (when `group_wanted`; its resources from `whole`, every member rendered),
    with the pods (or the StatefulSet's template) of `workload` joined to it in place; nothing
    without spec.runPolicy.schedulingPolicy. Created before the pods: a pod that names a
    group the scheduler cannot find yet waits for it, but one created without a group would be
    scheduled alone."""
    policy = job.spec.run_policy.scheduling_policy
    if policy is None:
        return []
    pick = gang.chosen(policy, settings.gang_schedulers)
    if pick is None:
        # The operator fails such a job before rendering (gang.gang_problem); a caller that did not
        # check gets this rather than pods that would be scheduled one by one.
        raise ValueError(gang.gang_problem(job, settings.gang_schedulers))
    scheduler, scheduler_name = pick

    def members(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # A DDP job's members are its StatefulSet's pods (one template); a Lighthouse pod stays out.
        return [o["spec"]["template"] if o["kind"] == "StatefulSet" else o for o in objs
                if job.spec.mode != "DDP" or o["kind"] == "StatefulSet"]

    out = []
    if group_wanted:
        specs: list[dict[str, Any]] = []
        for obj in whole:
            if obj["kind"] == "StatefulSet":
                specs += [obj["spec"]["template"]["spec"]] * obj["spec"]["replicas"]
            elif job.spec.mode != "DDP":
                specs.append(obj["spec"])
        out.append(gang.pod_group(job, _meta(job, uid, gang.podgroup_name(job)), scheduler, specs))
    for member in members(workload):
        gang.join_group(member, job, scheduler, scheduler_name)
    return out
