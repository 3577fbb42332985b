"""What `spec.podTemplate` may not take from kubetrain (its own volumes, mounts, variables and ports) or ask of the node.

The pods' builder (`engine/children.py`) names its volumes, mount paths and the
trainer container from the constants here; `pod_template_problems` (run by
`Spec.check()`, so by `kubetrain validate` and by the operator) refuses a
template that reuses one of them; `crd.py` turns the same tables and messages
into CEL rules, so the API server refuses it too. The template's lists merge
with kubetrain's by name, so without this check a user's volume `data` would
silently replace the checkpoint volume (and training would resume from, and
write to, whatever that volume holds), and a user's `KUBETRAIN_RUN_DIR` would
point the trainer somewhere the operator never looks.

The names the plan gives the trainer's environment and ports (`engine/plan.py`)
are checked against `ENV_PREFIX`, `ENV_NAMES` and `PORTS` by a test, so a new
variable or port there cannot slip past this check.

The second half (`SECURITY_CHECKS`, `pod_security_problems`) keeps a template
within Pod Security `restricted`'s bounds: privileged containers, the node's
namespaces, hostPath volumes, added capabilities, root and another
ServiceAccount are refused unless the installation allows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from . import quantity
from .names import annotations_problems, labels_problems
from .schema import type_name

CONTAINER = "trainer"  # the container kubetrain runs the trainer in

CONFIG_VOLUME = "config"
DATA_VOLUME = "data"
TMP_VOLUME = "tmp"
MODEL_VOLUME = "model"
PRETRAINED_VOLUME = "pretrained"
CONFIG_MOUNT = "/etc/kubetrain"
DATA_MOUNT = "/kubetrain/data"
TMP_MOUNT = "/tmp"
MODEL_MOUNT = "/kubetrain/model"  # kubetrain.shared.launch.MODEL_MOUNT
PRETRAINED_MOUNT = "/kubetrain/pretrained"  # kubetrain.shared.launch.PRETRAINED_CLAIM_MOUNT
MODEL_INIT = "model-init"
"""The init container that fetches and checks spec.model.pretrained (engine/children.py)."""
INIT_CONTAINER_MESSAGE = f"'{MODEL_INIT}' is the name of kubetrain's own init container (spec.model.pretrained)"
TRAINER_INIT_MESSAGE = (f"'{CONTAINER}' is the name of kubetrain's trainer container: an init container of that name "
                        "would be a second container of one name in the pod, which the API server refuses")
RESERVED_CONTAINER_NAMES: dict[str, dict[str, str]] = {
    # Container names are unique across a pod's containers and init containers: a template's container named
    # model-init passed once (only init containers were checked) and rendered a pod the API server refused.
    "containers": {MODEL_INIT: INIT_CONTAINER_MESSAGE},
    "initContainers": {MODEL_INIT: INIT_CONTAINER_MESSAGE, CONTAINER: TRAINER_INIT_MESSAGE},
}
"""The names a template's container may not take, by list, and why (the CRD's rules use the same table)."""

# kubetrain's volumes: name -> (what it holds, where the trainer mounts it).
VOLUMES: dict[str, tuple[str, str]] = {
    CONFIG_VOLUME: ("the job's configuration", CONFIG_MOUNT),
    DATA_VOLUME: ("the checkpoint volume", DATA_MOUNT),
    TMP_VOLUME: ("the trainer's writable scratch space", TMP_MOUNT),
    MODEL_VOLUME: ("the pretrained model's copy", MODEL_MOUNT),
    PRETRAINED_VOLUME: ("the pretrained model's claim", PRETRAINED_MOUNT),
}
MOUNTS: dict[str, str] = {path: name for name, (_, path) in VOLUMES.items()}  # mountPath -> volume

# The trainer's variables: every KUBETRAIN_ one (the plan adds new ones over
# time; reserving the prefix keeps a user's manifest valid when it does), HOME
# (the root filesystem is read-only, so HOME points at the writable /tmp) and
# the two that make Python's logs unbuffered and its imports safe.
ENV_PREFIX = "KUBETRAIN_"
ENV_NAMES: tuple[str, ...] = ("HOME", "PYTHONUNBUFFERED", "PYTHONSAFEPATH")
PORTS: tuple[str, ...] = ("metrics", "grpc", "ps-data", "rendezvous", "lighthouse")

# Bounds on the lists the CRD declares inside podTemplate. The API server
# estimates a CEL rule's worst case before it accepts the CRD and refuses a
# rule over a list without maxItems (its cost is unbounded), so every list a
# rule walks needs one; a rule on each container walks its env, mounts and
# ports, so its cost grows with MAX_CONTAINERS x MAX_ENV. The bounds are far
# above real pods (a trainer and a few sidecars, tens of variables) and far
# below the budget: a template beyond them is refused by the API server and by
# `kubetrain validate` alike, with the bound in the message.
MAX_CONTAINERS = 64
MAX_VOLUMES = 256
MAX_ENV = 256
MAX_VOLUME_MOUNTS = 256
MAX_PORTS = 64  # per container; few open more than a handful
# The env rule's message names the offending variable, and the cost of
# building that string grows with the longest name the schema allows (without
# a bound the API server assumes a name as long as a whole request, ~3 MB).
# Kubernetes itself sets no bound; no real variable name comes near this one.
MAX_ENV_NAME_LENGTH = 1024


def volume_message(name: str) -> str:
    what, _ = VOLUMES[name]
    return f"'{name}' is kubetrain's own volume ({what}); choose another name"


def mount_name_message(name: str) -> str:
    what, path = VOLUMES[name]
    return (f"'{name}' is kubetrain's own volume ({what}), which it mounts at {path} in the "
            f"{CONTAINER} container; choose another name")


def mount_path_message(path: str) -> str:
    name = MOUNTS[path]
    what, _ = VOLUMES[name]
    return (f"'{path}' is where kubetrain mounts its own volume '{name}' ({what}) in the {CONTAINER} "
            "container; choose another mountPath")


ENV_REASON = (f"is set by kubetrain in the {CONTAINER} container (it reserves {', '.join(ENV_NAMES)} "
              f"and every name starting with {ENV_PREFIX}); choose another name")


def env_message(name: str) -> str:
    return f"'{name}' {ENV_REASON}"


def port_message(name: str) -> str:
    return f"'{name}' is the name of kubetrain's own port in the {CONTAINER} container; choose another name"


def reserved_env(name: str) -> bool:
    return name.startswith(ENV_PREFIX) or name in ENV_NAMES


def mount_path_spellings(path: str) -> tuple[str, str]:
    """The ways a manifest names one of kubetrain's mount paths: '/tmp' and '/tmp/' mount at the same place."""
    return (path, path + "/")


def reserved_mount_path(path: str) -> str | None:
    """kubetrain's mountPath that `path` names, or None."""
    return next((p for p in MOUNTS if path in mount_path_spellings(p)), None)


def is_trainer(container: dict[str, Any]) -> bool:
    # The merge sends a container without a name to the trainer (children._merge).
    return bool(container.get("name", CONTAINER) == CONTAINER)


def pod_template_problems(template: dict[str, Any]) -> list[tuple[str, str]]:
    """(path under spec, message) for every place the template takes one of kubetrain's names.

    Only the shapes this check reads are checked here (and declared in the
    CRD); the rest of the template is the Kubernetes API's to validate when
    the pods are created.
    """
    problems = _metadata_problems(template.get("metadata"))
    spec = template.get("spec")
    if spec is None:
        return problems
    if not isinstance(spec, dict):
        return problems + [("podTemplate.spec", f"must be an object, got {type_name(spec)}")]
    path = "podTemplate.spec"
    problems += [(where, NULL_MESSAGE) for where in null_paths(spec, path)]
    for i, volume in _items(spec, "volumes", MAX_VOLUMES, path, problems):
        name = _name(volume, f"{path}.volumes[{i}]", problems)
        if name in VOLUMES:
            problems.append((f"{path}.volumes[{i}].name", volume_message(name)))
    for i, container in _items(spec, "containers", MAX_CONTAINERS, path, problems):
        name = _name(container, f"{path}.containers[{i}]", problems)
        if name in RESERVED_CONTAINER_NAMES["containers"]:
            problems.append((f"{path}.containers[{i}].name", RESERVED_CONTAINER_NAMES["containers"][name]))
        problems += _container_problems(container, f"{path}.containers[{i}]")
    problems += _shape_problems(spec, path)
    problems += _resource_problems(spec, path)
    return problems


# What the renderer (engine/children.py) reads or writes in a template besides kubetrain's names: the
# security fields it applies after the template, the tolerations it adds to, the init containers it
# hardens. A wrong shape there once raised in every round of its job (`tolerations: {}`, found by
# tests/api/test_fuzz_manifests.py); refused here, naming the field, it fails the job once.
POD_SHAPES: tuple[tuple[str, type], ...] = (("securityContext", dict), ("tolerations", list),
                                            ("nodeSelector", dict))
CONTAINER_SHAPES: tuple[tuple[tuple[str, ...], type], ...] = (
    (("securityContext",), dict), (("securityContext", "capabilities"), dict),
    (("securityContext", "capabilities", "drop"), list), (("securityContext", "capabilities", "add"), list))


def _shape_problems(spec: dict[str, Any], path: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for key, kind in POD_SHAPES:
        value = spec.get(key)
        if value is not None and not isinstance(value, kind):
            problems.append((f"{path}.{key}", f"must be {_kind_name(kind)}, got {type_name(value)}"))
    tolerations = spec.get("tolerations")
    for i, item in enumerate(tolerations if isinstance(tolerations, list) else []):
        if not isinstance(item, dict):
            problems.append((f"{path}.tolerations[{i}]", f"must be an object, got {type_name(item)}"))
    for key in ("containers", "initContainers"):
        items = spec.get(key)
        if key == "initContainers":
            found = _items(spec, key, MAX_CONTAINERS, path, problems)
            reserved = RESERVED_CONTAINER_NAMES[key]
            problems += [(f"{path}.{key}[{i}].name", reserved[c["name"]]) for i, c in found
                         if isinstance(c.get("name"), str) and c["name"] in reserved]
            items = [c for _, c in found]
        for i, container in enumerate(items if isinstance(items, list) else []):
            if not isinstance(container, dict):
                continue
            for fields, kind in CONTAINER_SHAPES:
                node: Any = container
                for step in fields:
                    node = node.get(step) if isinstance(node, dict) else None
                if node is not None and not isinstance(node, kind):
                    problems.append((f"{path}.{key}[{i}].{'.'.join(fields)}",
                                     f"must be {_kind_name(kind)}, got {type_name(node)}"))
    return problems


def _resource_problems(spec: dict[str, Any], path: str) -> list[tuple[str, str]]:
    """Every container's requests and limits, read as quantities (api/quantity.py): the gang sums
    (engine/gang.py) add up each pod's containers, sidecars and init containers included."""
    problems: list[tuple[str, str]] = []
    for key in ("containers", "initContainers"):
        items = spec.get(key)
        for i, container in enumerate(items if isinstance(items, list) else []):
            resources = container.get("resources") if isinstance(container, dict) else None
            where = f"{path}.{key}[{i}].resources"
            if resources is not None and not isinstance(resources, dict):
                problems.append((where, f"must be an object, got {type_name(resources)}"))
            elif resources is not None:
                for kind in ("limits", "requests"):
                    problems += quantity.map_problems(resources.get(kind), f"{where}.{kind}")
    return problems


def _kind_name(kind: type) -> str:
    return "an object" if kind is dict else "a list"


# --- kubetrain's own labels and annotations ------------------------------------
#
# The operator finds a job's pods by these labels, the job's NetworkPolicy admits its pods by
# them, and the Services select by them. A template that set `kubetrain.dev/job-name: victim`
# once had its pods filed under another job of the namespace (counted as its replicas, let
# through its NetworkPolicy). Such keys are refused in a template, and the renderer applies
# kubetrain's own last (engine/children.merge_pod_template).

MAX_METADATA_KEYS = 256
"""Labels, and annotations, a template may set: the CRD's rule walks every key, and the API server
refuses a rule over a map without a bound (its cost would be unbounded). Far above real pods (a few
labels and annotations); the API server and `kubetrain validate` refuse more with the bound."""
RESERVED_KEY_DOMAIN = "kubetrain.dev"
GANG_KEYS: tuple[str, ...] = (
    "scheduling.k8s.io/group-name", "scheduling.volcano.sh/group-name", "scheduling.x-k8s.io/pod-group",
    "pod-group.scheduling.sigs.k8s.io", "scheduling.volcano.sh/queue-name", "volcano.sh/queue-name")
"""The keys by which Volcano and scheduler-plugins file a pod under a PodGroup or a queue: kubetrain sets a
gang job's (engine/gang.join_group). In a template they joined a job's pods to another job's PodGroup
(counted in its minMember, placed with its gang), or put pods without a PodGroup of kubetrain's into any
team's Volcano queue, past spec.runPolicy.schedulingPolicy.queue's list."""
RESERVED_KEYS: tuple[str, ...] = ("app.kubernetes.io/managed-by", *GANG_KEYS)


def reserved_key(key: str) -> bool:
    """Whether a label or annotation key is kubetrain's: prefixed kubetrain.dev/ (or a subdomain of it),
    app.kubernetes.io/managed-by, or a gang scheduler's PodGroup or queue key (GANG_KEYS)."""
    prefix, slash, _ = key.rpartition("/")
    return key in RESERVED_KEYS or bool(slash) and (prefix == RESERVED_KEY_DOMAIN
                                                   or prefix.endswith("." + RESERVED_KEY_DOMAIN))


RESERVED_KEY_REASON = (f"is kubetrain's own (it reserves every key prefixed {RESERVED_KEY_DOMAIN}/, and "
                       f"{', '.join(RESERVED_KEYS)}): choose another key")


def reserved_key_message(key: str) -> str:
    return f"'{key}' {RESERVED_KEY_REASON}"


def _metadata_problems(meta: Any) -> list[tuple[str, str]]:
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return [("podTemplate.metadata", f"must be an object, got {type_name(meta)}")]
    problems = []
    for key, check in (("labels", labels_problems), ("annotations", annotations_problems)):
        path = f"podTemplate.metadata.{key}"
        found = check(meta.get(key), path)
        problems += [(p.path, p.message) for p in found]
        if not found and isinstance(meta.get(key), dict):
            if len(meta[key]) > MAX_METADATA_KEYS:
                problems.append((path, f"must have at most {MAX_METADATA_KEYS} keys, got {len(meta[key])}"))
            problems += [(path, reserved_key_message(k)) for k in meta[key] if reserved_key(k)]
    return problems


# --- nulls -----------------------------------------------------------------------
#
# A null in the template used to remove kubetrain's value: the merge copied `runAsNonRoot: null`
# over kubetrain's `true`, and the checks (which ask "is it true?", "is it 0?") passed it. A
# null is refused wherever it is in podTemplate.spec, naming the field; the renderer also treats
# a null as absent when it applies kubetrain's own security fields (engine/children._harden).

NULL_MESSAGE = "must not be null: leave the field out (a null would remove kubetrain's own value)"


def null_paths(value: Any, path: str) -> list[str]:
    """The path of every null inside `value`, found without recursion (the walk keeps its own stack)."""
    found = []
    stack = [(path, value)]
    while stack:
        where, node = stack.pop()
        if node is None:
            found.append(where)
        elif isinstance(node, dict):
            stack += [(f"{where}.{k}", v) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(node)]
    return sorted(found)


def _container_problems(container: dict[str, Any], path: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    trainer = is_trainer(container)
    for i, env in _items(container, "env", MAX_ENV, path, problems):
        name = _name(env, f"{path}.env[{i}]", problems, MAX_ENV_NAME_LENGTH)
        if trainer and name is not None and reserved_env(name):
            problems.append((f"{path}.env[{i}].name", env_message(name)))
    for i, mount in _items(container, "volumeMounts", MAX_VOLUME_MOUNTS, path, problems):
        name = _name(mount, f"{path}.volumeMounts[{i}]", problems)
        mount_path = _string(mount, "mountPath", f"{path}.volumeMounts[{i}]", problems)
        if not trainer:
            continue  # a sidecar may mount kubetrain's volumes, e.g. to ship the checkpoints
        if name in VOLUMES:
            problems.append((f"{path}.volumeMounts[{i}].name", mount_name_message(name)))
        reserved = reserved_mount_path(mount_path) if mount_path is not None else None
        if reserved is not None:
            problems.append((f"{path}.volumeMounts[{i}].mountPath", mount_path_message(reserved)))
    for i, port in _items(container, "ports", MAX_PORTS, path, problems):
        name = _name(port, f"{path}.ports[{i}]", problems)
        if trainer and name in PORTS:
            problems.append((f"{path}.ports[{i}].name", port_message(name)))
    return problems


def _items(parent: dict[str, Any], key: str, bound: int, path: str,
           problems: list[tuple[str, str]]) -> list[tuple[int, dict[str, Any]]]:
    """(index, item) of a list of objects; its problems (not a list, too long, not objects) appended."""
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append((f"{path}.{key}", f"must be a list, got {type_name(value)}"))
        return []
    if len(value) > bound:
        problems.append((f"{path}.{key}", f"must have at most {bound} items, got {len(value)}"))
        return []
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            out.append((i, item))
        else:
            problems.append((f"{path}.{key}[{i}]", f"must be an object, got {type_name(item)}"))
    return out


def _name(item: dict[str, Any], path: str, problems: list[tuple[str, str]], max_length: int | None = None) -> str | None:
    return _string(item, "name", path, problems, max_length)


def _string(item: dict[str, Any], key: str, path: str, problems: list[tuple[str, str]],
            max_length: int | None = None) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append((f"{path}.{key}", f"must be a string, got {type_name(value)} {value!r}"))
        return None
    if max_length is not None and len(value) > max_length:
        problems.append((f"{path}.{key}", f"must be at most {max_length} characters, got {len(value)}"))
        return None
    return value


# --- Pod security: what a pod may not ask of the node ----------------------------
#
# kubetrain's own pods satisfy Pod Security `restricted` (engine/children.py). A template could undo
# that: a privileged sidecar, the node's PID namespace, a hostPath volume of `/`, root, another
# job's token Secret, a toleration of every taint, all in the hands of whoever may create a
# TrainingJob. So Kubernetes' Pod Security "baseline" and "restricted" rules, and the fields that
# choose where and how a pod runs (nodeName, tolerations of every taint, priorityClassName,
# runtimeClassName), are refused unless the cluster's kubetrain installation allows them (the
# chart's `podSecurity.allow`, one name per allowance below). One table, SECURITY_CHECKS, serves
# three places with the same messages:
#
# - `kubetrain validate` (`--allow`) and the operator (`--pod-security-allow`) judge the pods the
#   job would create, as rendered (engine/podsecurity.py): the template merged into kubetrain's pod
#   and kubetrain's own security fields applied after it, so that no way of writing the template
#   (a null, an empty list replacing kubetrain's) escapes the check;
# - the API server, through the chart's ValidatingAdmissionPolicy (generated in crd.py from the
#   same table), judges the template itself: it cannot render the pod, so the checks marked
#   `rendered_only` (what kubetrain's own fields guarantee) are not in it.

ALLOWANCES: dict[str, str] = {
    "privileged": "privileged containers, privilege escalation and Windows HostProcess containers "
                  "(securityContext.privileged, .allowPrivilegeEscalation, .windowsOptions.hostProcess)",
    "hostNamespaces": "the node's namespaces (hostPID, hostIPC, hostNetwork)",
    "hostPath": "hostPath volumes",
    "hostPorts": "ports of the node (ports[].hostPort)",
    "probeHosts": "probes and lifecycle hooks aimed at another host than the pod (httpGet.host, tcpSocket.host "
                  "of livenessProbe, readinessProbe, startupProbe, lifecycle.postStart, lifecycle.preStop): the "
                  "kubelet sends them from the node's network",
    "capabilities": "added capabilities (securityContext.capabilities.add)",
    "root": "running as root (securityContext.runAsUser 0, securityContext.runAsNonRoot false), "
            "in the pod or a container",
    "seccomp": "the Unconfined seccomp profile (securityContext.seccompProfile.type)",
    "appArmor": "the Unconfined AppArmor profile (securityContext.appArmorProfile.type, and the "
                "container.apparmor.security.beta.kubernetes.io/* annotations)",
    "seLinux": "SELinux options past the container types (securityContext.seLinuxOptions: a type other "
               "than container_t, container_init_t, container_kvm_t, container_engine_t; a user; a role)",
    "procMount": "an unmasked /proc (securityContext.procMount other than Default)",
    "sysctls": "sysctls outside Kubernetes' safe set (securityContext.sysctls)",
    "volumeTypes": "volume types outside Pod Security restricted's (nfs, gitRepo, iscsi, ...; restricted "
                   "allows configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, "
                   "secret)",
    "secrets": "the namespace's Secrets (secret volumes, secrets in projected volumes, env valueFrom.secretKeyRef, "
               "envFrom secretRef, a CSI volume's csi.nodePublishSecretRef)",
    "claims": "the namespace's PersistentVolumeClaims besides the job's own (volumes[].persistentVolumeClaim; an "
              "ephemeral volume's volumeClaimTemplate.spec.dataSource, .dataSourceRef or .volumeName: a copy of "
              "another claim or snapshot, or a chosen volume) and its ResourceClaims "
              "(resourceClaims[].resourceClaimName)",
    "serviceAccount": "another ServiceAccount than the namespace's default, and a ServiceAccount token "
                      "(serviceAccountName, serviceAccount, automountServiceAccountToken, a projected "
                      "serviceAccountToken)",
    "nodeName": "choosing the node (nodeName: the scheduler, its taints and its checks are bypassed)",
    "tolerations": "tolerating every taint (a toleration with operator Exists and no key)",
    "priorityClass": "a PriorityClass (priorityClassName: the job's pods may preempt other pods)",
    "runtimeClass": "another container runtime (runtimeClassName)",
}
# What "another ServiceAccount" is not: the pods' own (no name is the namespace's default).
DEFAULT_SERVICE_ACCOUNTS: tuple[str, ...] = ("", "default")
# The default's label in a path: the merge sends a container without a name to
# the trainer; a volume or init container without one is refused by Kubernetes.
UNNAMED = ""
EACH = "[]"
"""A step of a check's field into every item of a list: ("env", EACH, "valueFrom", "secretKeyRef")."""

# Pod Security's own lists (k8s.io/pod-security-admission, policy/check_*.go).
SAFE_SYSCTLS: tuple[str, ...] = (
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
)
SELINUX_TYPES: tuple[str, ...] = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
RESTRICTED_VOLUME_TYPES: tuple[str, ...] = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
)
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"

Refusal = Literal[
    # refused when the value is there and ...
    "true", "false", "zero", "nonzero", "nonempty", "present", "named", "string", "in", "not_in",
    "other_keys", "tolerates_all", "apparmor_annotations",
    # refused unless the value is there and ... (rendered pods only: kubetrain's own fields guarantee them)
    "not_true", "not_false", "required_in", "lacks",
]
REQUIRED: frozenset[str] = frozenset({"not_true", "not_false", "required_in", "lacks"})


@dataclass(frozen=True)
class SecurityCheck:
    """One field a pod may not set to a value that reaches past the pod, or must set.

    `scope`: where the field is: the pod spec, each container (containers and
    initContainers), each volume, or the pod's metadata. `field`: the path from
    there, EACH stepping into every item of a list (an empty path: the item
    itself). `refused`: which values are refused (the Refusal kinds; `values`
    lists the names some of them compare with): `true`, `false`, `zero` and
    `nonzero` (a number), `nonempty` (anything but an empty list), `present`
    (the key at all), `named` (a ServiceAccount other than
    DEFAULT_SERVICE_ACCOUNTS), `string` (a non-empty string), `in` and `not_in`
    (a string in or outside `values`), `other_keys` (an object with a key
    outside `values`), `tolerates_all` (a toleration of every taint),
    `apparmor_annotations` (an AppArmor annotation neither runtime/default nor
    localhost/*); and, on rendered pods only, what must be there: `not_true`,
    `not_false`, `required_in` (refused unless one of `values`), `lacks`
    (refused unless a list holding values[0]). Anything else, a wrong type
    included, is left to Kubernetes, which refuses to create such a pod.
    """

    allowance: str
    scope: Literal["pod", "container", "volume", "metadata"]
    field: tuple[str, ...]
    refused: Refusal
    what: str
    """What is refused, the subject of "... not allowed"."""
    values: tuple[str, ...] = ()

    @property
    def rendered_only(self) -> bool:
        """Judged on rendered pods only: a template need not repeat what kubetrain sets."""
        return self.refused in REQUIRED

    @property
    def message(self) -> str:
        return (f"{self.what} not allowed (the cluster's kubetrain installation allows this with "
                f"podSecurity.allow: [{self.allowance}])")

    @property
    def path(self) -> str:
        """The field as a path: ("env", EACH, "valueFrom") is env[].valueFrom."""
        out = ""
        for step in self.field:
            out += step if step == EACH else (f".{step}" if out else step)
        return out


def _checks() -> tuple[SecurityCheck, ...]:
    C = SecurityCheck
    ctx = "securityContext"
    out = [
        C("privileged", "container", (ctx, "privileged"), "true", "privileged containers are"),
        C("privileged", "container", (ctx, "allowPrivilegeEscalation"), "true", "privilege escalation is"),
        C("privileged", "container", (ctx, "windowsOptions", "hostProcess"), "true",
          "Windows HostProcess containers are"),
        C("privileged", "pod", (ctx, "windowsOptions", "hostProcess"), "true", "Windows HostProcess containers are"),
        C("capabilities", "container", (ctx, "capabilities", "add"), "nonempty", "added capabilities are"),
        C("root", "container", (ctx, "runAsUser"), "zero", "running as root (uid 0) is"),
        C("root", "container", (ctx, "runAsNonRoot"), "false", "runAsNonRoot: false (running as root) is"),
        C("root", "pod", (ctx, "runAsUser"), "zero", "running as root (uid 0) is"),
        C("root", "pod", (ctx, "runAsNonRoot"), "false", "runAsNonRoot: false (running as root) is"),
        C("hostNamespaces", "pod", ("hostPID",), "true", "the node's process namespace (hostPID) is"),
        C("hostNamespaces", "pod", ("hostIPC",), "true", "the node's IPC namespace (hostIPC) is"),
        C("hostNamespaces", "pod", ("hostNetwork",), "true", "the node's network namespace (hostNetwork) is"),
        C("hostPath", "volume", ("hostPath",), "present", "hostPath volumes are"),
        C("hostPorts", "container", ("ports", EACH, "hostPort"), "nonzero", "ports of the node (hostPort) are"),
        C("procMount", "container", (ctx, "procMount"), "not_in", "an unmasked /proc (procMount other than "
          "Default) is", ("Default",)),
        C("sysctls", "pod", (ctx, "sysctls", EACH, "name"), "not_in", "sysctls outside Kubernetes' safe set are",
          SAFE_SYSCTLS),
        C("volumeTypes", "volume", (), "other_keys", "volume types outside Pod Security restricted's ("
          + ", ".join(RESTRICTED_VOLUME_TYPES) + ") are", ("name", *RESTRICTED_VOLUME_TYPES, "hostPath")),
        C("secrets", "volume", ("secret",), "present", "Secret volumes are"),
        C("secrets", "volume", ("projected", "sources", EACH, "secret"), "present", "Secrets in projected volumes are"),
        # A CSI volume is within `restricted`, but its driver is handed the named Secret of the namespace when it
        # mounts the volume: another job's token, or object-storage keys, to a driver the job chose.
        C("secrets", "volume", ("csi", "nodePublishSecretRef", "name"), "string",
          "Secrets handed to a CSI driver (csi.nodePublishSecretRef) are"),
        C("secrets", "container", ("env", EACH, "valueFrom", "secretKeyRef"), "present",
          "variables from Secrets (valueFrom.secretKeyRef) are"),
        C("secrets", "container", ("envFrom", EACH, "secretRef"), "present",
          "variables from Secrets (envFrom secretRef) are"),
        C("claims", "volume", ("persistentVolumeClaim",), "present",
          "PersistentVolumeClaims besides the job's own are"),
        # An ephemeral volume is a new claim, but one cloned from another claim (dataSource), filled from a
        # VolumeSnapshot or a populator (dataSourceRef) or bound to a chosen PersistentVolume (volumeName)
        # holds another job's data: its checkpoints, read or resumed from, with no claim volume in sight.
        C("claims", "volume", ("ephemeral", "volumeClaimTemplate", "spec", "dataSource"), "present",
          "ephemeral volumes cloned from another claim or a snapshot (volumeClaimTemplate.spec.dataSource) are"),
        C("claims", "volume", ("ephemeral", "volumeClaimTemplate", "spec", "dataSourceRef"), "present",
          "ephemeral volumes filled from another claim, a snapshot or a populator "
          "(volumeClaimTemplate.spec.dataSourceRef) are"),
        C("claims", "volume", ("ephemeral", "volumeClaimTemplate", "spec", "volumeName"), "string",
          "ephemeral volumes bound to a chosen PersistentVolume (volumeClaimTemplate.spec.volumeName) are"),
        # A ResourceClaim by name is shared with whoever else names it: another job's devices (its GPUs, and
        # what they hold). A resourceClaimTemplateName makes the pod a claim of its own, as an ephemeral volume does.
        C("claims", "pod", ("resourceClaims", EACH, "resourceClaimName"), "string",
          "ResourceClaims of the namespace (resourceClaims[].resourceClaimName: another pod's devices) are"),
        C("serviceAccount", "pod", ("serviceAccountName",), "named",
          "another ServiceAccount than the namespace's default is"),
        C("serviceAccount", "pod", ("serviceAccount",), "named",
          "another ServiceAccount than the namespace's default is"),
        C("serviceAccount", "pod", ("automountServiceAccountToken",), "true", "a ServiceAccount token in the pods is"),
        C("serviceAccount", "volume", ("projected", "sources", EACH, "serviceAccountToken"), "present",
          "ServiceAccount tokens in projected volumes are"),
        C("nodeName", "pod", ("nodeName",), "string", "choosing the node (nodeName, past the scheduler) is"),
        C("tolerations", "pod", ("tolerations", EACH), "tolerates_all",
          "a toleration of every taint (operator Exists without a key) is"),
        C("priorityClass", "pod", ("priorityClassName",), "string",
          "a PriorityClass (priorityClassName: its pods may preempt others) is"),
        C("runtimeClass", "pod", ("runtimeClassName",), "string", "another container runtime (runtimeClassName) is"),
        C("appArmor", "metadata", ("annotations",), "apparmor_annotations",
          "an AppArmor profile other than runtime/default or localhost/* is", (APPARMOR_ANNOTATION,)),
    ]
    for scope in ("pod", "container"):
        out += [
            C("seccomp", scope, (ctx, "seccompProfile", "type"), "in", "the Unconfined seccomp profile is",
              ("Unconfined",)),
            C("appArmor", scope, (ctx, "appArmorProfile", "type"), "in", "the Unconfined AppArmor profile is",
              ("Unconfined",)),
            C("seLinux", scope, (ctx, "seLinuxOptions", "type"), "not_in",
              "an SELinux type other than " + ", ".join(t for t in SELINUX_TYPES if t) + " is", SELINUX_TYPES),
            C("seLinux", scope, (ctx, "seLinuxOptions", "user"), "string", "an SELinux user is"),
            C("seLinux", scope, (ctx, "seLinuxOptions", "role"), "string", "an SELinux role is"),
        ]
    # Pod Security baseline's "Host Probes / Lifecycle Hooks" (Kubernetes 1.34+, check_hostProbesAndHostLifecycle.go):
    # a probe's or a lifecycle hook's httpGet.host and tcpSocket.host may be absent or "" (the pod's IP), nothing
    # else, not even localhost or 127.0.0.1 (the node's own loopback to the kubelet). The kubelet sends these from
    # the node's network: to the cloud's metadata address, the node's own ports, whatever the node reaches.
    out += [C("probeHosts", "container", (probe, handler, "host"), "string",
              "a probe's host (the kubelet would connect to it from the node's network) is")
            for probe in ("livenessProbe", "readinessProbe", "startupProbe") for handler in ("httpGet", "tcpSocket")]
    out += [C("probeHosts", "container", ("lifecycle", hook, handler, "host"), "string",
              "a lifecycle hook's host (the kubelet would connect to it from the node's network) is")
            for hook in ("postStart", "preStop") for handler in ("httpGet", "tcpSocket")]
    # Pod Security `restricted`'s requirements: kubetrain's own fields (engine/children._harden, applied
    # after the template) meet them, so only a rendered pod is judged by them.
    out += [
        C("privileged", "container", (ctx, "allowPrivilegeEscalation"), "not_false",
          "a container without allowPrivilegeEscalation: false is"),
        C("capabilities", "container", (ctx, "capabilities", "drop"), "lacks",
          "a container that keeps its capabilities (capabilities.drop without ALL) is", ("ALL",)),
        C("root", "pod", (ctx, "runAsNonRoot"), "not_true", "a pod without runAsNonRoot: true is"),
        C("seccomp", "pod", (ctx, "seccompProfile", "type"), "required_in",
          "a pod without the RuntimeDefault or a Localhost seccomp profile is", ("RuntimeDefault", "Localhost")),
        C("serviceAccount", "pod", ("automountServiceAccountToken",), "not_false",
          "a pod without automountServiceAccountToken: false is"),
    ]
    return tuple(out)


SECURITY_CHECKS: tuple[SecurityCheck, ...] = _checks()
# The lists each scope walks, and the label of an item without a name.
SCOPE_LISTS: dict[str, tuple[tuple[str, str], ...]] = {
    "container": (("containers", CONTAINER), ("initContainers", UNNAMED)),
    "volume": (("volumes", UNNAMED),),
}


def parse_allowances(values: Any) -> frozenset[str]:
    """The allowances of comma-separated lists ("privileged,hostPath"); ValueError names an unknown one."""
    names = {n.strip() for v in values for n in str(v).split(",") if n.strip()}
    unknown = sorted(names - set(ALLOWANCES))
    if unknown:
        raise ValueError(f"unknown pod-security allowance {', '.join(map(repr, unknown))}; "
                         f"expected some of {', '.join(ALLOWANCES)}")
    return frozenset(names)


_ABSENT = object()


def _refuses(check: SecurityCheck, value: Any) -> bool:
    """Whether `value` (_ABSENT when the field is not there, or null) is refused by `check`."""
    kind, values = check.refused, check.values
    if value is _ABSENT:
        return kind in REQUIRED
    number = type(value) in (int, float)
    if kind == "present":
        return True
    if kind == "true":
        return value is True
    if kind == "false":
        return value is False
    if kind == "zero":
        return number and value == 0
    if kind == "nonzero":
        return number and value != 0
    if kind == "nonempty":
        return bool(value != [])
    if kind == "named":
        return value not in DEFAULT_SERVICE_ACCOUNTS
    if kind == "string":
        return isinstance(value, str) and value != ""
    if kind == "in":
        return isinstance(value, str) and value in values
    if kind == "not_in":
        return isinstance(value, str) and value not in values
    if kind == "other_keys":
        return isinstance(value, dict) and any(k not in values for k in value)
    if kind == "tolerates_all":
        return isinstance(value, dict) and value.get("operator") == "Exists" and not value.get("key")
    if kind == "apparmor_annotations":
        return isinstance(value, dict) and any(
            isinstance(k, str) and k.startswith(values[0]) and isinstance(v, str)
            and v != "runtime/default" and not v.startswith("localhost/") for k, v in value.items())
    if kind == "not_true":
        return value is not True
    if kind == "not_false":
        return value is not False
    if kind == "required_in":
        return value not in values
    if kind == "lacks":
        return not (isinstance(value, list) and values[0] in value)
    raise ValueError(f"no refusal {kind!r}")


def _found(check: SecurityCheck, node: Any, own: Any, steps: tuple[str, ...]) -> bool:
    """Whether the check refuses what `node` holds at `steps`. List items equal to one of `own`'s
    (kubetrain's own, at the same place of the pod rendered without a template) are not judged.
    Malformed shapes refuse nothing here (Kubernetes refuses such a pod); the recursion follows
    the table's path, a few steps, never the input's depth."""
    if not steps:
        return _refuses(check, _ABSENT if node is None else node)
    step, rest = steps[0], steps[1:]
    if step == EACH:
        if not isinstance(node, list):
            return False
        mine = own if isinstance(own, list) else []
        return any(_found(check, item, None, rest) for item in node if item not in mine)
    if not isinstance(node, dict):
        return False
    value = node.get(step)
    if value is None:  # absent (or a null, which pod_template_problems refuses)
        return EACH not in rest and _refuses(check, _ABSENT)
    return _found(check, value, own.get(step) if isinstance(own, dict) else None, rest)


def _places(check: SecurityCheck, pod: dict[str, Any], own: dict[str, Any],
            base: str) -> Iterator[tuple[str, Any, Any]]:
    """(path, item, kubetrain's own counterpart) of every place `check` looks at in `pod`."""
    spec: dict[str, Any] = pod["spec"] if isinstance(pod.get("spec"), dict) else {}
    own_spec: dict[str, Any] = own["spec"] if isinstance(own.get("spec"), dict) else {}
    if check.scope == "pod":
        yield f"{base}.spec", spec, own_spec
        return
    if check.scope == "metadata":
        meta = pod.get("metadata")
        yield f"{base}.metadata", meta if isinstance(meta, dict) else {}, own.get("metadata")
        return
    for key, unnamed in SCOPE_LISTS[check.scope]:
        items = spec.get(key)
        theirs = [i for i in own_spec.get(key) or [] if isinstance(i, dict)]
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict) or item in theirs:
                continue  # kubetrain's own volume, as it renders it
            counterpart = next((i for i in theirs if i.get("name") == item.get("name", unnamed)), None)
            yield f"{base}.spec.{key}[{item.get('name', unnamed)}]", item, counterpart


def pod_security_violations(pod: Any, allowed: Any = (), own: Any = None) -> list[tuple[SecurityCheck, str]]:
    """(check, path) of every field of a pod (`{"metadata": ..., "spec": ...}`) that reaches past it
    and is not allowed.

    `own`: None judges a template as the API server's policy does (what kubetrain would add
    is not there yet, so the rendered-only checks are left out). A rendered pod is judged
    with `own`, the same pod rendered without a template, whose list items are kubetrain's
    own and not judged (its config volume projects the job's own Secret). Paths name list
    items by name, as the API server's policy does
    (`spec.podTemplate.spec.containers[trainer].securityContext.privileged`).
    """
    if not isinstance(pod, dict):
        return []
    rendered = own is not None
    out: list[tuple[SecurityCheck, str]] = []
    for check in SECURITY_CHECKS:
        if check.allowance in allowed or (check.rendered_only and not rendered):
            continue
        for where, item, theirs in _places(check, pod, own or {}, "spec.podTemplate"):
            if _found(check, item, theirs, check.field):
                out.append((check, f"{where}.{check.path}" if check.field else where))
    return out


def pod_security_problems(spec: Any, allowed: Any = ()) -> list[str]:
    """"<path>: <message>" for every pod-security refusal of a job's template (a Spec, or its
    podTemplate dict), as the API server's policy judges it. The operator and `kubetrain
    validate` judge the rendered pods instead (engine/podsecurity.py), with `rendered_pod_problems`."""
    template = getattr(spec, "pod_template", spec)
    return _problems(pod_security_violations(template, allowed))


def rendered_pod_problems(pod: dict[str, Any], own: dict[str, Any], allowed: Any = ()) -> list[str]:
    """"<path>: <message>" for every pod-security refusal of a rendered pod (or a StatefulSet's
    pod template), `own` being the same pod rendered without the job's podTemplate."""
    return _problems(pod_security_violations(pod, allowed, own))


def _problems(violations: list[tuple[SecurityCheck, str]]) -> list[str]:
    return sorted({f"{path}: {check.message}" for check, path in violations})
