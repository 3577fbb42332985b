"""What `spec.podTemplate` may not take from kubetrain: its own volumes, mounts, variables and ports.

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
"""

from __future__ import annotations

from typing import Any

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
PORTS: tuple[str, ...] = ("metrics", "grpc", "rendezvous")

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
