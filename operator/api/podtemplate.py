"""What `spec.podTemplate` may not take from kubetrain (its own volumes, mounts, variables and ports) or ask of the node.

The pods' builder (`core/children.py`) names its volumes, mount paths and the
trainer container from the constants here; `pod_template_problems` (run by
`Spec.check()`, so by `kubetrain validate` and by the operator) refuses a
template that reuses one of them; `crd.py` turns the same tables and messages
into CEL rules, so the API server refuses it too. The template's lists merge
with kubetrain's by name, so without this check a user's volume `data` would
silently replace the checkpoint volume (and training would resume from, and
write to, whatever that volume holds), and a user's `KUBETRAIN_RUN_DIR` would
point the trainer somewhere the operator never looks.

The names the plan gives the trainer's environment and ports (`core/plan.py`)
are checked against `ENV_PREFIX`, `ENV_NAMES` and `PORTS` by a test, so a new
variable or port there cannot slip past this check.

The second half (`SECURITY_CHECKS`, `pod_security_problems`) keeps a template
within Pod Security `restricted`'s bounds: privileged containers, the node's
namespaces, hostPath volumes, added capabilities, root and another
ServiceAccount are refused unless the installation allows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .schema import _type_name

CONTAINER = "trainer"  # the container kubetrain runs the trainer in

CONFIG_VOLUME = "config"
DATA_VOLUME = "data"
TMP_VOLUME = "tmp"
CONFIG_MOUNT = "/etc/kubetrain"
DATA_MOUNT = "/kubetrain/data"
TMP_MOUNT = "/tmp"

# kubetrain's volumes: name -> (what it holds, where the trainer mounts it).
VOLUMES: dict[str, tuple[str, str]] = {
    CONFIG_VOLUME: ("the job's configuration", CONFIG_MOUNT),
    DATA_VOLUME: ("the checkpoint volume", DATA_MOUNT),
    TMP_VOLUME: ("the trainer's writable scratch space", TMP_MOUNT),
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
    return container.get("name", CONTAINER) == CONTAINER


def pod_template_problems(template: dict[str, Any]) -> list[tuple[str, str]]:
    """(path under spec, message) for every place the template takes one of kubetrain's names.

    Only the shapes this check reads are checked here (and declared in the
    CRD); the rest of the template is the Kubernetes API's to validate when
    the pods are created.
    """
    problems: list[tuple[str, str]] = []
    spec = template.get("spec")
    if spec is None:
        return problems
    if not isinstance(spec, dict):
        return [("podTemplate.spec", f"must be an object, got {_type_name(spec)}")]
    path = "podTemplate.spec"
    for i, volume in _items(spec, "volumes", MAX_VOLUMES, path, problems):
        name = _name(volume, f"{path}.volumes[{i}]", problems)
        if name in VOLUMES:
            problems.append((f"{path}.volumes[{i}].name", volume_message(name)))
    for i, container in _items(spec, "containers", MAX_CONTAINERS, path, problems):
        _name(container, f"{path}.containers[{i}]", problems)
        problems += _container_problems(container, f"{path}.containers[{i}]")
    return problems


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


def _items(parent: dict[str, Any], key: str, bound: int, path: str, problems: list[tuple[str, str]]):
    """(index, item) of a list of objects; its problems (not a list, too long, not objects) appended."""
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append((f"{path}.{key}", f"must be a list, got {_type_name(value)}"))
        return []
    if len(value) > bound:
        problems.append((f"{path}.{key}", f"must have at most {bound} items, got {len(value)}"))
        return []
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            out.append((i, item))
        else:
            problems.append((f"{path}.{key}[{i}]", f"must be an object, got {_type_name(item)}"))
    return out


def _name(item: dict[str, Any], path: str, problems: list[tuple[str, str]], max_length: int | None = None) -> str | None:
    return _string(item, "name", path, problems, max_length)


def _string(item: dict[str, Any], key: str, path: str, problems: list[tuple[str, str]],
            max_length: int | None = None) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append((f"{path}.{key}", f"must be a string, got {_type_name(value)} {value!r}"))
        return None
    if max_length is not None and len(value) > max_length:
        problems.append((f"{path}.{key}", f"must be at most {max_length} characters, got {len(value)}"))
        return None
    return value


# --- Pod security: what a template may not ask of the node -------------------
#
# kubetrain's own pods satisfy Pod Security `restricted` (core/children.py).
# A template could undo that: a privileged sidecar, the node's PID namespace,
# a hostPath volume of `/`, root, or a ServiceAccount with rights in the
# cluster, all in the hands of whoever may create a TrainingJob. So these are
# refused unless the cluster's kubetrain installation allows them (the chart's
# `podSecurity.allow`, one name per allowance below). Three places refuse, with
# one table and the same messages: `kubetrain validate` (`--allow`), the API
# server (the chart's ValidatingAdmissionPolicy, generated in crd.py from
# SECURITY_CHECKS) and the operator at reconcile time, from its own flag, so a
# cluster without the policy (a CRD applied by hand) is safe too.

ALLOWANCES: dict[str, str] = {
    "privileged": "privileged containers and privilege escalation (securityContext.privileged, "
                  "securityContext.allowPrivilegeEscalation)",
    "hostNamespaces": "the node's namespaces (hostPID, hostIPC, hostNetwork)",
    "hostPath": "hostPath volumes",
    "capabilities": "added capabilities (securityContext.capabilities.add)",
    "root": "running as root (securityContext.runAsUser 0, securityContext.runAsNonRoot false), "
            "in the pod or a container",
    "serviceAccount": "another ServiceAccount than the namespace's default, and a ServiceAccount token "
                      "(serviceAccountName, serviceAccount, automountServiceAccountToken)",
}
# What "another ServiceAccount" is not: the pods' own (no name is the namespace's default).
DEFAULT_SERVICE_ACCOUNTS: tuple[str, ...] = ("", "default")
# The default's label in a path: the merge sends a container without a name to
# the trainer; a volume or init container without one is refused by Kubernetes.
UNNAMED = ""


@dataclass(frozen=True)
class SecurityCheck:
    """One field a template may not set to a value that reaches past the pod.

    `scope`: where the field is: the pod spec, each container (containers and
    initContainers) or each volume. `refused`: which values are refused:
    `true`, `false`, `zero` (a number equal to 0), `nonempty` (anything but an
    empty list), `present` (the key at all), `named` (a ServiceAccount other
    than DEFAULT_SERVICE_ACCOUNTS). Anything else, a wrong type included, is
    left to Kubernetes, which refuses to create such a pod.
    """

    allowance: str
    scope: Literal["pod", "container", "volume"]
    field: tuple[str, ...]
    refused: Literal["true", "false", "zero", "nonempty", "present", "named"]
    what: str
    """What is refused, the subject of "... not allowed"."""

    @property
    def message(self) -> str:
        return (f"{self.what} not allowed (the cluster's kubetrain installation allows this with "
                f"podSecurity.allow: [{self.allowance}])")


SECURITY_CHECKS: tuple[SecurityCheck, ...] = (
    SecurityCheck("privileged", "container", ("securityContext", "privileged"), "true", "privileged containers are"),
    SecurityCheck("privileged", "container", ("securityContext", "allowPrivilegeEscalation"), "true",
                  "privilege escalation is"),
    SecurityCheck("capabilities", "container", ("securityContext", "capabilities", "add"), "nonempty",
                  "added capabilities are"),
    SecurityCheck("root", "container", ("securityContext", "runAsUser"), "zero", "running as root (uid 0) is"),
    SecurityCheck("root", "container", ("securityContext", "runAsNonRoot"), "false",
                  "runAsNonRoot: false (running as root) is"),
    SecurityCheck("root", "pod", ("securityContext", "runAsUser"), "zero", "running as root (uid 0) is"),
    SecurityCheck("root", "pod", ("securityContext", "runAsNonRoot"), "false", "runAsNonRoot: false (running as root) is"),
    SecurityCheck("hostNamespaces", "pod", ("hostPID",), "true", "the node's process namespace (hostPID) is"),
    SecurityCheck("hostNamespaces", "pod", ("hostIPC",), "true", "the node's IPC namespace (hostIPC) is"),
    SecurityCheck("hostNamespaces", "pod", ("hostNetwork",), "true", "the node's network namespace (hostNetwork) is"),
    SecurityCheck("hostPath", "volume", ("hostPath",), "present", "hostPath volumes are"),
    SecurityCheck("serviceAccount", "pod", ("serviceAccountName",), "named",
                  "another ServiceAccount than the namespace's default is"),
    SecurityCheck("serviceAccount", "pod", ("serviceAccount",), "named",
                  "another ServiceAccount than the namespace's default is"),
    SecurityCheck("serviceAccount", "pod", ("automountServiceAccountToken",), "true",
                  "a ServiceAccount token in the pods is"),
)
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


def _refused(check: SecurityCheck, parent: dict[str, Any]) -> bool:
    value: Any = parent
    for key in check.field:
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    kind = check.refused
    if kind == "present":
        return True
    if kind == "true":
        return value is True
    if kind == "false":
        return value is False
    if kind == "zero":
        return type(value) in (int, float) and value == 0
    if kind == "nonempty":
        return value is not None and value != []
    if kind == "named":
        return value is not None and value not in DEFAULT_SERVICE_ACCOUNTS
    raise ValueError(f"no refusal {kind!r}")


def pod_security_violations(template: Any, allowed: Any = ()) -> list[tuple[SecurityCheck, str]]:
    """(check, path) of every field of `spec.podTemplate` that reaches past the pod and is not allowed.

    Paths name list items by name, as the API server's policy does
    (`spec.podTemplate.spec.containers[trainer].securityContext.privileged`).
    Malformed shapes are pod_template_problems' to report; here they refuse nothing.
    """
    spec = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(spec, dict):
        return []
    out: list[tuple[SecurityCheck, str]] = []
    base = "spec.podTemplate.spec"
    for check in SECURITY_CHECKS:
        if check.allowance in allowed:
            continue
        field = ".".join(check.field)
        if check.scope == "pod":
            if _refused(check, spec):
                out.append((check, f"{base}.{field}"))
            continue
        for key, unnamed in SCOPE_LISTS[check.scope]:
            items = spec.get(key)
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and _refused(check, item):
                    out.append((check, f"{base}.{key}[{item.get('name', unnamed)}].{field}"))
    return out


def pod_security_problems(spec: Any, allowed: Any = ()) -> list[str]:
    """"<path>: <message>" for every pod-security refusal of a job's spec (a Spec, or its podTemplate dict).

    For the operator at reconcile time, with its allowances (`--pod-security-allow`), and
    for `kubetrain validate`; an empty list means the template stays within bounds.
    """
    template = getattr(spec, "pod_template", spec)
    return [f"{path}: {check.message}" for check, path in sorted(pod_security_violations(template, allowed),
                                                                   key=lambda v: v[1])]
