"""The TrainingJob CustomResourceDefinition, generated from the API model.

`python -m kubetrain.api.crd` prints it; deploy/crd.yaml and the
chart's copy are this output, and a test fails when either drifts. Defaults,
enums, ranges, patterns and docs come from `spec.py`; the cross-field rules
(`__rules__`) and immutable fields become CEL rules with the same messages
the Python validator prints; so do podTemplate's reserved names (podtemplate.py).
`--pod-security` prints the rules of the chart's ValidatingAdmissionPolicy
(podTemplate's pod-security bounds) instead.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

from kubetrain.shared import __version__

from . import podtemplate, quantity, schema
from .schema import AtMostOne, ExactlyOne, Excludes, OnlyWhen, TypeInfo
from .spec import (DISK_SIZE_MESSAGE, GROUP, KIND, MAX_CLAIM_NAME, MAX_REPORTED_METRICS, MODEL_DISK_MAX,
                   MODEL_DISK_MIN, PLURAL, PVC_CLAIM_MESSAGE, PVC_PATH_MESSAGE, SCRIPT_MODEL_MESSAGE,
                   SPARE_RANGE_MESSAGE, STANDBY_SIZE_MESSAGE, VERSION, Resources, SchedulingPolicy, Spec)
from .status import JobStatus
from .versions import VERSION_ANNOTATION

SHORT_NAMES = ["tj"]
CATEGORIES = ["all", "kubetrain"]

# Spec.check() in CEL: the same rules, the same messages.
SPEC_CEL = [
    {
        "rule": "self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.backend) || self.ddp.backend != 'nccl' "
        "|| !has(self.training) || !has(self.training.device) || self.training.device != 'cpu'",
        "message": "ddp.backend: nccl needs GPUs; use gloo with training.device cpu",
    },
    {
        "rule": "self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.faultTolerance) || !has(self.ddp.commHook) "
        "|| self.ddp.commHook == 'None'",
        "message": "ddp.commHook: faultTolerance averages gradients through torchft's Manager, not DDP's "
        "communication hooks: use None",
    },
    {
        "rule": "self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.faultTolerance) || !has(self.checkpoint) "
        "|| !has(self.checkpoint.storage) || !has(self.checkpoint.storage.accessMode) "
        "|| self.checkpoint.storage.accessMode != 'ReadWriteMany' "
        "|| (has(self.checkpoint.storage.uri) && self.checkpoint.storage.uri != '')",
        "message": "checkpoint.storage.accessMode: with faultTolerance every replica group writes its own "
        "checkpoints on its own volume: use ReadWriteOnce",
    },
    {
        "rule": "!has(self.checkpoint) || !has(self.checkpoint.storage) || !has(self.checkpoint.storage.uri) "
        "|| self.checkpoint.storage.uri == '' || !has(self.checkpoint.storage.existingClaim) "
        "|| self.checkpoint.storage.existingClaim == ''",
        "message": "checkpoint.storage.uri: checkpoints go to a uri or to a claim (existingClaim), not both",
    },
    {
        "rule": "!has(self.checkpoint) || !has(self.checkpoint.storage) || !has(self.checkpoint.storage.secretRef) "
        "|| self.checkpoint.storage.secretRef == '' "
        "|| (has(self.checkpoint.storage.uri) && self.checkpoint.storage.uri != '')",
        "message": "checkpoint.storage.secretRef: applies to a uri (the credentials of its store); set uri or drop it",
    },
    {
        "rule": "!has(self.dataset) || !has(self.dataset.secretRef) || self.dataset.secretRef == '' "
        "|| has(self.dataset.uri)",
        "message": "dataset.secretRef: applies to a uri (the credentials of its store); set uri or drop it",
    },
    {
        "rule": "!has(self.dataset) || !has(self.dataset.secretRef) || self.dataset.secretRef == '' "
        "|| !has(self.checkpoint) || !has(self.checkpoint.storage) || !has(self.checkpoint.storage.secretRef) "
        "|| self.checkpoint.storage.secretRef == '' || self.checkpoint.storage.secretRef == self.dataset.secretRef",
        "message": "dataset.secretRef: must name the same Secret as checkpoint.storage.secretRef: a pod holds one "
        "set of AWS_* credentials (put both stores' in one Secret, or use one store)",
    },
    {
        "rule": "!has(self.script) || !has(self.model) || (has(self.model.pretrained) "
        "&& !has(self.model.entrypoint) && !has(self.model.args))",
        "message": f"model: {SCRIPT_MODEL_MESSAGE}",
    },
    # Model.check's bounds: diskSize within MODEL_DISK_MIN..MODEL_DISK_MAX (the schema's pattern makes it a
    # quantity, or empty), a pvc:// model's claim name a DNS-1123 subdomain's length and its path one that stays
    # inside the claim (no '.', '..' or empty segment).
    {
        "rule": "!has(self.model) || !has(self.model.diskSize) || (isQuantity(self.model.diskSize) "
        f"&& quantity(self.model.diskSize).compareTo(quantity('{MODEL_DISK_MIN}')) >= 0 "
        f"&& quantity(self.model.diskSize).compareTo(quantity('{MODEL_DISK_MAX}')) <= 0)",
        "message": f"model.diskSize: {DISK_SIZE_MESSAGE}",
    },
    {
        "rule": "!has(self.model) || !has(self.model.pretrained) || !self.model.pretrained.startsWith('pvc://') "
        f"|| !self.model.pretrained.matches('^pvc://[^/]{{{MAX_CLAIM_NAME + 1}}}')",
        "message": f"model.pretrained: {PVC_CLAIM_MESSAGE}",
    },
    {
        "rule": "!has(self.model) || !has(self.model.pretrained) || !self.model.pretrained.startsWith('pvc://') "
        "|| !(self.model.pretrained.matches('^pvc://.*//') "
        "|| self.model.pretrained.matches('^pvc://[^/]*(/.*)?/[.][.]?(/.*)?$'))",
        "message": f"model.pretrained: {PVC_PATH_MESSAGE}",
    },
    {
        "rule": "!has(self.script) || self.mode != 'ParameterServer'",
        "message": "script: script jobs run in mode Single or DDP, got ParameterServer (a parameter server "
        "needs the built-in loop's model, dataset and training)",
    },
]
_NODES = "(has(self.ddp) && has(self.ddp.nodes) ? self.ddp.nodes : 2)"
_MIN_NODES = f"(has(self.ddp) && has(self.ddp.minNodes) ? self.ddp.minNodes : {_NODES})"
_MAX_NODES = f"(has(self.ddp) && has(self.ddp.maxNodes) ? self.ddp.maxNodes : {_NODES})"
SIZE_CEL = [
    # spec.Spec._size_problems, for what `kubectl scale` writes: the scale subresource's update is
    # validated as the whole object's, so a size out of range is refused before the operator sees it.
    {
        "rule": "self.mode != 'Single' || !has(self.replicas) || self.replicas == 1",
        "message": "replicas: a Single job has one replica",
    },
    {
        "rule": f"self.mode != 'DDP' || !has(self.replicas) || "
        f"({_MIN_NODES} <= self.replicas && self.replicas <= {_MAX_NODES})",
        "message": "replicas: a DDP job runs between ddp.minNodes and ddp.maxNodes nodes (each ddp.nodes when unset)",
    },
    {
        "rule": f"self.mode != 'DDP' || {_MIN_NODES} <= {_NODES} && {_NODES} <= {_MAX_NODES}",
        "message": "ddp.nodes: must be between ddp.minNodes and ddp.maxNodes",
    },
    {
        "rule": f"self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.faultTolerance) "
        f"|| !has(self.ddp.faultTolerance.minReplicas) || self.ddp.faultTolerance.minReplicas <= {_MIN_NODES}",
        "message": "ddp.faultTolerance.minReplicas: must be at most ddp.minNodes (ddp.nodes when unset): a quorum "
        "that needs more groups than the job may have never forms",
    },
    {
        "rule": "self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.faultTolerance) "
        "|| !has(self.ddp.faultTolerance.spareGroups) || self.ddp.faultTolerance.spareGroups == 0 "
        "|| (!has(self.ddp.minNodes) && !has(self.ddp.maxNodes))",
        "message": SPARE_RANGE_MESSAGE,
    },
    {
        "rule": "!has(self.replicas) || !has(self.parameterServer) || !has(self.parameterServer.standbyWorkers) "
        "|| self.parameterServer.standbyWorkers == 0",
        "message": STANDBY_SIZE_MESSAGE,
    },
]
ROOT_CEL = [
    {
        "rule": "size(self.metadata.name) <= 45",
        "message": "metadata.name: must be at most 45 characters so that child names such as "
        "'<name>-worker-1023' stay valid",
    },
    {
        "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "message": "metadata.name: must be a DNS-1035 label (lower-case letters, digits and '-', "
        "starting with a letter)",
    },
]


def _has_count(fields: tuple[str, ...], names: dict[str, str]) -> str:
    return " + ".join(f"(has(self.{names[f]}) ? 1 : 0)" for f in fields)


def _rule_cel(rule: Any, names: dict[str, str]) -> dict[str, str]:
    listed = ", ".join(names[f] for f in getattr(rule, "fields", ()))
    if isinstance(rule, ExactlyOne):
        return {"rule": f"{_has_count(rule.fields, names)} == 1", "message": f"exactly one of {listed} must be set"}
    if isinstance(rule, AtMostOne):
        return {"rule": f"{_has_count(rule.fields, names)} <= 1", "message": f"only one of {listed} may be set"}
    if isinstance(rule, Excludes):
        name, others = names[rule.name], " || ".join(f"has(self.{names[f]})" for f in rule.fields)
        listed = ", ".join(names[f] for f in rule.fields)
        return {"rule": f"!has(self.{name}) || !({others})", "message": f"{listed} do not apply when {name} is set"}
    if isinstance(rule, OnlyWhen):
        name, when = names[rule.name], names[rule.when]
        return {
            "rule": f"!has(self.{name}) || self.{when} == '{rule.value}'",
            "message": f"{name} may be set only when {when} is {rule.value}",
        }
    raise TypeError(f"no CEL for {rule!r}")


# Objects the API server does not create when absent. parameterServer and ddp
# belong to their mode; model, dataset and training to the built-in loops, so
# a script job must be able to leave them out (the CEL rule of Excludes would
# refuse a defaulted one). kubetrain fills their defaults when it reads a job.
NO_DEFAULT = {"parameterServer", "ddp", "script", "model", "dataset", "training"}


def _scalar_schema(info: TypeInfo, meta: schema.Meta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if info.kind == "enum":
        out["type"] = "string"
        out["enum"] = list(info.choices)
    elif info.kind == "int":
        out["type"] = "integer"
    elif info.kind == "float":
        out["type"] = "number"
    elif info.kind == "bool":
        out["type"] = "boolean"
    elif info.kind == "str":
        out["type"] = "string"
        if meta.pattern:
            # An empty string means "not set" for the optional string fields.
            out["pattern"] = f"^({meta.pattern})?$"
        if meta.max_length is not None:
            out["maxLength"] = meta.max_length
    if meta.minimum is not None:
        out["minimum"] = meta.minimum if info.kind == "float" else int(meta.minimum)
        if meta.exclusive_minimum:
            out["exclusiveMinimum"] = True
    if meta.maximum is not None:
        out["maximum"] = meta.maximum if info.kind == "float" else int(meta.maximum)
        if meta.exclusive_maximum:
            out["exclusiveMaximum"] = True
    return out


def object_schema(cls: type) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    names = {}
    for f, info in schema.fields_of(cls):
        meta = schema.meta_of(f)
        name = schema.yaml_name(f)
        names[f.name] = name
        if info.kind == "object":
            assert info.cls is not None
            prop = object_schema(info.cls)
            # An optional block (default None) means "not asked for": defaulting it to {} would ask
            # for it in every job (spec.runPolicy.schedulingPolicy would give each a PodGroup).
            if name not in NO_DEFAULT and f.default is not None and meta.since is None:
                prop["default"] = {}
        elif cls is Spec and name == "podTemplate":
            prop = pod_template_schema()
        elif cls is Resources:
            prop = container_resources_schema()
        elif cls is SchedulingPolicy and name == "minResources":
            prop = quantity_map_schema()
        elif info.kind == "map" and info.value is not None and info.value.kind != "any":
            value = info.value
            prop = {"type": "object", "additionalProperties":
                    object_schema(value.cls) if value.kind == "object" and value.cls else _scalar_schema(value, meta)}
        elif info.kind in ("map", "any"):
            prop = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        elif info.kind == "list":
            assert info.value is not None
            value = info.value
            items = object_schema(value.cls) if value.kind == "object" and value.cls else _scalar_schema(value, meta)
            prop = {"type": "array", "items": items}
            if meta.min_items is not None:
                prop["minItems"] = meta.min_items
            if meta.max_items is not None:
                prop["maxItems"] = meta.max_items
            if f.default_factory is not schema.MISSING and meta.since is None:
                prop["default"] = f.default_factory()
        else:
            prop = _scalar_schema(info, meta)
            # A field added since the first release has its default in the model only (schema.Meta.since).
            if f.default is not schema.MISSING and f.default is not None and meta.since is None:
                prop["default"] = f.default
        if info.nullable and info.kind != "object":
            prop["nullable"] = True
        prop["description"] = meta.doc
        if meta.immutable:
            prop["x-kubernetes-validations"] = [{"rule": "self == oldSelf", "message": f"{name} is immutable"}]
        # Keys in a stable, readable order.
        props[name] = {k: prop[k] for k in sorted(prop, key=_key_order)}
        if f.default is schema.MISSING and f.default_factory is schema.MISSING:
            required.append(name)
    out: dict[str, Any] = {"type": "object"}
    if cls.__doc__:
        out["description"] = cls.__doc__.strip().splitlines()[0]
    out["properties"] = props
    if required:
        out["required"] = required
    rules = [_rule_cel(r, names) for r in getattr(cls, "__rules__", ())]
    if cls is Spec:
        rules += SPEC_CEL + SIZE_CEL
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


# --- spec.podTemplate: kubetrain's own names are refused ----------------------
#
# podTemplate is a pod template of any shape, so the schema keeps every level
# `x-kubernetes-preserve-unknown-fields` (nothing the user wrote is pruned) and
# declares only what the CEL rules read: CEL sees no field the schema leaves
# undeclared. The rules and messages are api/podtemplate.py's, which
# `kubetrain validate` prints too. A rule on a container cannot name the index
# of the offending item (fieldPath is static), so the API server's path stops
# at the list (`...containers[0].env`) where the validator's names the item.


def _cel_string(text: str) -> str:
    return json.dumps(text)  # a JSON string of ASCII text is a CEL string literal


def _cel_list(items: Any) -> str:
    return "[" + ", ".join(_cel_string(i) for i in items) + "]"


def _preserved(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": properties, **extra}


def _named_list(max_items: int, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "maxItems": max_items, "items": _preserved(properties)}


# --- resource quantities: read as Kubernetes reads them, within its bounds -----
#
# api/quantity.py in CEL, with its message: the grammar (`matches`, which also keeps the exponent to
# two digits, so Kubernetes' int32 truncation of a longer one never comes into play), then
# Kubernetes' own parser (`isQuantity`, `quantity()`) compared with the bound. The values are
# int-or-string, as corev1's ResourceList holds them; a float is refused by the schema's type.

QUANTITY_CEL = (f"type(self) == int ? self >= 0 && self <= {quantity.MAX_INTEGER} : "
                f"size(self) <= {quantity.MAX_LENGTH} && self.matches({_cel_string('^(' + quantity.PATTERN + ')$')}) "
                f"&& isQuantity(self) && quantity(self).compareTo(quantity({_cel_string(quantity.MAX_TEXT)})) <= 0")


def quantity_map_schema() -> dict[str, Any]:
    """A requests, limits or minResources map: resource names to quantities."""
    return {"type": "object", "maxProperties": quantity.MAX_NAMES, "additionalProperties": {
        "x-kubernetes-int-or-string": True, "maxLength": quantity.MAX_LENGTH,
        "x-kubernetes-validations": [{"rule": QUANTITY_CEL, "message": quantity.MESSAGE}]}}


def container_resources_schema() -> dict[str, Any]:
    """corev1 ResourceRequirements (a role's, a template container's): its requests and limits declared,
    the rest (claims) kept as written."""
    return _preserved({kind: quantity_map_schema() for kind in ("limits", "requests")})


def _container_rules() -> list[dict[str, str]]:
    # A sidecar may use any name; a container without a name is the trainer
    # (the merge sends it there).
    other = f"(has(self.name) && self.name != {_cel_string(podtemplate.CONTAINER)})"
    reserved_env = (f"e.name.startsWith({_cel_string(podtemplate.ENV_PREFIX)}) || "
                    f"e.name in {_cel_list(podtemplate.ENV_NAMES)}")
    # env_message(name), naming the first reserved variable.
    first = f"self.env.filter(e, has(e.name) && ({reserved_env}))[0].name"
    opening, rest = _cel_string("'"), _cel_string("' " + podtemplate.ENV_REASON)
    rules = [
        {
            "rule": f"{other} || !has(self.env) || self.env.all(e, !has(e.name) || !({reserved_env}))",
            "messageExpression": f"{opening} + {first} + {rest}",
            "message": f"a variable in env {podtemplate.ENV_REASON}",
            "fieldPath": ".env",
        }
    ]
    for name in podtemplate.VOLUMES:
        rules.append({
            "rule": f"{other} || !has(self.volumeMounts) || "
            f"!self.volumeMounts.exists(m, has(m.name) && m.name == {_cel_string(name)})",
            "message": podtemplate.mount_name_message(name),
            "fieldPath": ".volumeMounts",
        })
    for path in podtemplate.MOUNTS:
        rules.append({
            "rule": f"{other} || !has(self.volumeMounts) || !self.volumeMounts.exists(m, has(m.mountPath) && "
            f"m.mountPath in {_cel_list(podtemplate.mount_path_spellings(path))})",
            "message": podtemplate.mount_path_message(path),
            "fieldPath": ".volumeMounts",
        })
    for name in podtemplate.PORTS:
        rules.append({
            "rule": f"{other} || !has(self.ports) || !self.ports.exists(p, has(p.name) && p.name == {_cel_string(name)})",
            "message": podtemplate.port_message(name),
            "fieldPath": ".ports",
        })
    return rules


def pod_template_schema() -> dict[str, Any]:
    volume_name = {
        "type": "string",
        "x-kubernetes-validations": [
            {"rule": f"self != {_cel_string(name)}", "message": podtemplate.volume_message(name)}
            for name in podtemplate.VOLUMES
        ],
    }
    container = _preserved(
        {
            "name": _container_name("containers"),
            "env": _named_list(
                podtemplate.MAX_ENV, {"name": {"type": "string", "maxLength": podtemplate.MAX_ENV_NAME_LENGTH}}
            ),
            "volumeMounts": _named_list(
                podtemplate.MAX_VOLUME_MOUNTS, {"name": {"type": "string"}, "mountPath": {"type": "string"}}
            ),
            "ports": _named_list(podtemplate.MAX_PORTS, {"name": {"type": "string"}}),
            "resources": container_resources_schema(),
        },
        **{"x-kubernetes-validations": _container_rules()},
    )
    spec = _preserved(
        {
            "volumes": _named_list(podtemplate.MAX_VOLUMES, {"name": volume_name}),
            "containers": {"type": "array", "maxItems": podtemplate.MAX_CONTAINERS, "items": container},
            "initContainers": {"type": "array", "maxItems": podtemplate.MAX_CONTAINERS, "items": _preserved({
                "name": _container_name("initContainers"),
                "resources": container_resources_schema()})},
        }
    )
    return _preserved({"metadata": _preserved({"labels": _string_map("labels"),
                                               "annotations": _string_map("annotations")}),
                       "spec": spec})


def _container_name(key: str) -> dict[str, Any]:
    """A template container's name in `key` (containers, initContainers): none of the names kubetrain gives its own
    containers there (podtemplate.RESERVED_CONTAINER_NAMES)."""
    return {"type": "string", "x-kubernetes-validations": [
        {"rule": f"self != {_cel_string(name)}", "message": message}
        for name, message in podtemplate.RESERVED_CONTAINER_NAMES[key].items()]}


def _string_map(what: str) -> dict[str, Any]:
    """A template's labels or annotations: strings, none of kubetrain's own keys (podtemplate.reserved_key)."""
    domain = podtemplate.RESERVED_KEY_DOMAIN.replace(".", "\\.")
    reserved = f"k.matches({_cel_string(f'^([^/]*[.])?{domain}/')}) || k in {_cel_list(podtemplate.RESERVED_KEYS)}"
    return {
        "type": "object",
        "maxProperties": podtemplate.MAX_METADATA_KEYS,
        "additionalProperties": {"type": "string"},
        "x-kubernetes-validations": [{
            "rule": f"self.all(k, !({reserved}))",
            # reserved_key_message(key), naming the first of kubetrain's keys.
            "messageExpression": f"\"'\" + self.filter(k, {reserved})[0] + "
                                 f"{_cel_string(chr(39) + ' ' + podtemplate.RESERVED_KEY_REASON)}",
            "message": f"a key of {what} {podtemplate.RESERVED_KEY_REASON}",
        }],
    }


# --- Pod security: the chart's ValidatingAdmissionPolicy ----------------------
#
# The CRD is cluster-wide and Helm installs a chart's crds/ as they are (never
# templated, never upgraded), so a rule in the CRD could not follow the chart's
# `podSecurity.allow`. The pod-security rules are a ValidatingAdmissionPolicy
# instead, which the chart renders from `pod_security_rules()` (written to
# charts/kubetrain/files/pod-security.yaml, each validation tagged with the
# allowance that lifts it) and binds to the namespaces its operator watches.
# Its messages are podtemplate.py's, which `kubetrain validate` and the
# operator print too. The CRD declares none of these fields: the policy reads
# them from the stored object whatever the schema says (and the schema keeps
# them, podTemplate preserves unknown fields).

POD_SECURITY_FILE = "charts/kubetrain/files/pod-security.yaml"
POD_SECURITY_NAME = "kubetrain-pod-security"  # the chart's is "<release fullname>-pod-security"


_CEL_VARS = "xyzuvw"  # loop variables, one per level of a check's path (EACH steps)


def _cel_test(check: podtemplate.SecurityCheck, value: str) -> str:
    """CEL true when `value` (present) is refused by `check`."""
    values = _cel_list(check.values)
    return {
        "present": "true",
        "true": f"{value} == true",
        "false": f"{value} == false",
        "zero": f"{value} == 0",
        "nonzero": f"type({value}) == int && {value} != 0",
        "nonempty": f"size({value}) > 0",
        "named": f"{value} != null && !({value} in {_cel_list(podtemplate.DEFAULT_SERVICE_ACCOUNTS)})",
        "string": f"type({value}) == string && {value} != \"\"",
        "in": f"type({value}) == string && {value} in {values}",
        "not_in": f"type({value}) == string && !({value} in {values})",
        "other_keys": f"{value}.exists(k, !(k in {values}))",
        "tolerates_all": f"has({value}.operator) && {value}.operator == \"Exists\" && "
                         f"(!has({value}.key) || {value}.key == \"\")",
        "apparmor_annotations": f"{value}.exists(k, k.startsWith({_cel_string((check.values or ('',))[0])}) && "
                                f"!({value}[k] == \"runtime/default\" || {value}[k].startsWith(\"localhost/\")))",
    }[check.refused]


def _cel_refusal(check: podtemplate.SecurityCheck, var: str, steps: tuple[str, ...] | None = None,
                 depth: int = 0) -> str:
    """CEL true when `var` (the pod spec, a container, a volume or the metadata) holds a refused value
    of `check`; an EACH step of its path becomes an `exists` over that list."""
    steps = check.field if steps is None else steps
    head = steps.index(podtemplate.EACH) if podtemplate.EACH in steps else len(steps)
    paths = [f"{var}.{'.'.join(steps[: i + 1])}" for i in range(head)]
    present = [f"has({p})" for p in paths]
    value = paths[-1] if paths else var
    if head == len(steps):
        test = _cel_test(check, value)
        return " && ".join(present + ([] if test == "true" else [test])) or test
    item = _CEL_VARS[depth + 1]
    inner = _cel_refusal(check, item, steps[head + 1:], depth + 1)
    return " && ".join(present + [f"{value}.exists({item}, {inner})"])


def _validations(check: podtemplate.SecurityCheck) -> list[dict[str, str]]:
    field = check.path
    if check.scope in ("pod", "metadata"):
        var, base = ("variables.pod", "spec.podTemplate.spec") if check.scope == "pod" else \
            ("variables.meta", "spec.podTemplate.metadata")
        return [{
            "allow": check.allowance,
            "expression": f"!({_cel_refusal(check, var)})",
            "message": f"{base}.{field}: {check.message}",
        }]
    out = []
    for key, unnamed in podtemplate.SCOPE_LISTS[check.scope]:
        refused = _cel_refusal(check, "x")
        first = f"variables.{key}.filter(x, {refused}).map(x, has(x.name) ? string(x.name) : {_cel_string(unnamed)})[0]"
        tail = f".{field}" if field else ""
        out.append({
            "allow": check.allowance,
            "expression": f"!variables.{key}.exists(x, {refused})",
            # The path names the item, as pod_security_problems does; `message`
            # stands in should the expression fail (a name that is no string).
            "messageExpression": f"{_cel_string(f'spec.podTemplate.spec.{key}[')} + {first} + "
                                 f"{_cel_string(f']{tail}: {check.message}')}",
            "message": f"spec.podTemplate.spec.{key}[]{tail}: {check.message}",
        })
    return out


def pod_security_rules() -> dict[str, Any]:
    """The policy's spec, each validation tagged `allow` with the allowance that lifts it. The checks
    of rendered pods only (what kubetrain's own fields guarantee) are not here: a template need not
    repeat them."""
    pod = "object.spec.podTemplate"
    variables = [{"name": "pod", "expression": f"has({pod}) && has({pod}.spec) ? {pod}.spec : {{}}"},
                 {"name": "meta", "expression": f"has({pod}) && has({pod}.metadata) ? {pod}.metadata : {{}}"}]
    for key, _ in (*podtemplate.SCOPE_LISTS["container"], *podtemplate.SCOPE_LISTS["volume"]):
        variables.append({"name": key, "expression": f"has(variables.pod.{key}) ? variables.pod.{key} : []"})
    return {
        "matchConstraints": {
            "resourceRules": [{
                "apiGroups": [GROUP],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": [PLURAL],  # not trainingjobs/status: the operator's status writes pass
            }]
        },
        # Only a new spec is judged: a job admitted before the policy changed
        # keeps its finalizers and annotations writable (the operator refuses
        # it at its next reconcile instead).
        "matchConditions": [{
            "name": "spec-changed",
            "expression": "request.operation == 'CREATE' || oldObject == null || object.spec != oldObject.spec",
        }],
        "variables": variables,
        "validations": [v for check in podtemplate.SECURITY_CHECKS if not check.rendered_only
                        for v in _validations(check)] + secret_ref_validations() + scheduling_validations()
                       + [PRETRAINED_CLAIM_VALIDATION],
    }


SECRETS_PLACEHOLDER = "OBJECT_STORE_SECRETS"
"""In a secretRef rule's expression: the list of Secrets jobs may name (the chart's objectStorage.secrets)."""
SECRET_REF_MESSAGE = ("not a Secret this kubetrain installation lets jobs name as object-storage credentials (the "
                      "chart's objectStorage.secrets lists them; podSecurity.allow: [secrets] allows any)")


def secret_ref_validations() -> list[dict[str, str]]:
    """The object-storage credentials a job names (spec.*.secretRef) must be in the installation's list, as
    engine/podsecurity.secret_ref_problems judges; the list stands as SECRETS_PLACEHOLDER, which the chart and
    `pod_security_policy` fill in."""
    out = []
    for path in SECRET_REF_PATHS:
        parts = path.split(".")
        guard = " || ".join(f"!has(object.spec.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))
        field = f"object.spec.{path}.secretRef"
        out.append({"allow": "secrets",
                    "expression": f"{guard} || !has({field}) || {field} == '' || {field} in {SECRETS_PLACEHOLDER}",
                    "message": f"spec.{path}.secretRef: {SECRET_REF_MESSAGE}"})
    return out


SECRET_REF_PATHS = ("checkpoint.storage", "dataset", "model")
SCHEDULING_POLICY = "spec.runPolicy.schedulingPolicy"
QUEUES_PLACEHOLDER = "VOLCANO_QUEUES"
"""In the queue rule's expression: the Volcano queues jobs may name (the chart's gangScheduling.volcano.queues)."""
QUEUE_MESSAGE = ("not a Volcano queue this kubetrain installation lets jobs name (the chart's "
                 "gangScheduling.volcano.queues lists them; unset, the PodGroup waits in Volcano's default queue)")
PRIORITY_CLASS_CHECK = next(c for c in podtemplate.SECURITY_CHECKS if c.field == ("priorityClassName",))


def scheduling_validations() -> list[dict[str, Any]]:
    """engine/gang.policy_problems in CEL: the PodGroup's priorityClass needs the allowance the pods' own
    priorityClassName needs (Volcano orders and preempts whole gangs by it); its queue must be one the
    installation lists (QUEUES_PLACEHOLDER), which no allowance lifts: a queue is a team's share of the
    cluster, given by name."""
    policy = f"object.{SCHEDULING_POLICY}"
    unset = (f"!has(object.spec.runPolicy) || !has({policy}) || {policy} == null || !has({policy}.{{0}}) "
             f"|| {policy}.{{0}} == ''")
    return [
        {"allow": PRIORITY_CLASS_CHECK.allowance, "expression": unset.format("priorityClass"),
         "message": f"{SCHEDULING_POLICY}.priorityClass: {PRIORITY_CLASS_CHECK.message}"},
        {"allow": None, "expression": f"{unset.format('queue')} || {policy}.queue in {QUEUES_PLACEHOLDER}",
         "message": f"{SCHEDULING_POLICY}.queue: {QUEUE_MESSAGE}"},
    ]
PRETRAINED_CLAIM_MESSAGE = ("a pvc:// pretrained model mounts a claim of the namespace besides the job's own: this "
                            "kubetrain installation does not allow it (podSecurity.allow: [claims]); put the model "
                            "in object storage (s3://)")
PRETRAINED_CLAIM_VALIDATION = {
    "allow": "claims",
    "expression": "!has(object.spec.model) || !has(object.spec.model.pretrained) "
                  "|| !object.spec.model.pretrained.startsWith('pvc://')",
    "message": f"spec.model.pretrained: {PRETRAINED_CLAIM_MESSAGE}",
}
"""engine/podsecurity.pretrained_claim_problems in CEL."""


def pod_security_policy(allowed: Any = (), name: str = POD_SECURITY_NAME, namespace: str | None = None,
                        secrets: Any = (), queues: Any = ()) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy and its binding as the chart renders them (none when no rule is left).

    `namespace`: bind to that namespace only (the chart's `operator.namespaced`); `secrets`: the Secrets jobs
    may name as object-storage credentials (the chart's objectStorage.secrets); `queues`: the Volcano queues
    they may name (gangScheduling.volcano.queues). The queue rule is lifted by no allowance: with every
    allowance given, the policy holds it alone.
    """
    rules = pod_security_rules()
    names = json.dumps(sorted(secrets), separators=(",", ":"))
    queue_names = json.dumps(sorted(queues), separators=(",", ":"))
    validations = [{k: v.replace(SECRETS_PLACEHOLDER, names).replace(QUEUES_PLACEHOLDER, queue_names)
                    if k == "expression" else v for k, v in rule.items() if k != "allow"}
                   for rule in rules.pop("validations") if rule["allow"] not in allowed]
    if not validations:
        return []
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", **rules, "validations": validations},
    }
    binding: dict[str, Any] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    if namespace is not None:
        binding["spec"]["matchResources"] = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        }
    return [policy, binding]


POD_SECURITY_HEADER = ("# Generated by `python -m kubetrain.api.crd --pod-security` from "
                       "kubetrain/api/podtemplate.py: do not edit.\n"
                       "# templates/pod-security.yaml renders it, leaving out the validations whose `allow` is in "
                       "podSecurity.allow.\n")


def render_pod_security() -> str:
    rules: str = yaml.safe_dump(pod_security_rules(), sort_keys=False, width=120)
    return POD_SECURITY_HEADER + rules


def _key_order(key: str) -> tuple[int, str]:
    order = ["type", "description", "enum", "default", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"]
    return (order.index(key) if key in order else len(order), key)


DATE_TIME_FIELDS = ("startTime", "completionTime", "lastTransitionTime", "time", "updateTime")


def status_schema() -> dict[str, Any]:
    """The status schema, generated from `status.JobStatus` (what the operator writes, memory included)."""
    out = object_schema(JobStatus)
    _status_details(out)
    conditions = out["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    out["properties"]["progress"]["properties"]["metrics"]["maxProperties"] = MAX_REPORTED_METRICS
    return out


def _status_details(node: dict[str, Any]) -> None:
    """No defaults in a status (the operator writes every field it means); RFC 3339 times marked as such."""
    node.pop("default", None)
    for name, prop in (node.get("properties") or {}).items():
        if name in DATE_TIME_FIELDS and prop.get("type") == "string":
            prop["format"] = "date-time"
        _status_details(prop)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _status_details(node[key])


PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Workers", "type": "integer", "jsonPath": ".status.workers"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "ETA", "type": "integer", "jsonPath": ".status.progress.etaSeconds",
     "description": "Seconds until totalSteps at the recent steps per second."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "State", "type": "string", "jsonPath": ".status.state"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # Fault-tolerant DDP: the replica groups in the current quorum (`kubectl get tj -o wide`).
    {"name": "Quorum", "type": "integer", "jsonPath": ".status.quorum.participants", "priority": 1},
    # The kubetrain version of the job's trainer (status.trainer: one for its whole life, docs/operating.md#upgrades).
    {"name": "Trainer", "type": "string", "jsonPath": ".status.trainer.version", "priority": 1},
]


def crd() -> dict[str, Any]:
    spec_schema = object_schema(Spec)
    spec_schema["description"] = "The desired state of a TrainingJob."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # The version of kubetrain whose model this is: `kubetrain version` compares it with the operator's
        # (Helm never upgrades a chart's crds/: docs/operating.md#upgrades).
        "metadata": {"name": f"{PLURAL}.{GROUP}", "annotations": {VERSION_ANNOTATION: __version__}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": CATEGORIES,
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale trainingjob NAME --replicas N` (and a HorizontalPodAutoscaler):
                    # spec.replicas is the size asked for, status.replicas the size running.
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A distributed PyTorch training job: Single, ParameterServer or DDP.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema(),
                            },
                            "x-kubernetes-validations": ROOT_CEL,
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `python -m kubetrain.api.crd` from kubetrain/api/spec.py: do not edit.\n"


def render() -> str:
    text: str = yaml.safe_dump(crd(), sort_keys=False, width=120)
    return HEADER + text


if __name__ == "__main__":
    sys.stdout.write(render_pod_security() if sys.argv[1:] == ["--pod-security"] else render())
