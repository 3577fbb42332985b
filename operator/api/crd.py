"""The TrainingJob CustomResourceDefinition, generated from the API model.

`python -m kubetrain_operator.api.crd` prints it; deploy/crd.yaml and the
chart's copy are this output, and a test fails when either drifts. Defaults,
enums, ranges, patterns and docs come from `spec.py`; the cross-field rules
(`__rules__`) and immutable fields become CEL rules with the same messages
the Python validator prints.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from . import schema
from .schema import AtMostOne, ExactlyOne, OnlyWhen, TypeInfo
from .spec import GROUP, KIND, PLURAL, VERSION, Spec

SHORT_NAMES = ["tj"]
CATEGORIES = ["all", "kubetrain"]

# Spec.check() in CEL: the same rules, the same messages.
SPEC_CEL = [
    {
        "rule": "self.mode != 'DDP' || !has(self.ddp) || !has(self.ddp.backend) || self.ddp.backend != 'nccl' "
        "|| !has(self.training) || !has(self.training.device) || self.training.device != 'cpu'",
        "message": "ddp.backend: nccl needs GPUs; use gloo with training.device cpu",
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
    if isinstance(rule, OnlyWhen):
        name, when = names[rule.name], names[rule.when]
        return {
            "rule": f"!has(self.{name}) || self.{when} == '{rule.value}'",
            "message": f"{name} may be set only when {when} is {rule.value}",
        }
    raise TypeError(f"no CEL for {rule!r}")


# Objects the API server creates when absent, so their children's defaults apply.
OBJECT_DEFAULTS: dict[str, Any] = {
    "model": {"name": "mlp"},
    "dataset": {"name": "digits"},
}
NO_DEFAULT = {"parameterServer", "ddp"}  # present only with their mode


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
            if name in OBJECT_DEFAULTS:
                prop["default"] = OBJECT_DEFAULTS[name]
            elif name not in NO_DEFAULT:
                prop["default"] = {}
        elif info.kind in ("map", "any"):
            prop = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        else:
            prop = _scalar_schema(info, meta)
            if f.default is not schema.MISSING and f.default is not None:
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
        rules += SPEC_CEL
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def _key_order(key: str) -> tuple[int, str]:
    order = ["type", "description", "enum", "default", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"]
    return (order.index(key) if key in order else len(order), key)


def _status_schema() -> dict[str, Any]:
    counts = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in ("active", "succeeded", "failed")},
    }
    return {
        "type": "object",
        "description": "Observed state, written by the operator.",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "state": {"type": "string", "description": "Created, Running, Restarting, Suspended, Succeeded or Failed."},
            "workers": {"type": "integer", "description": "Processes that train (workers or ranks)."},
            "startTime": {"type": "string", "format": "date-time"},
            "completionTime": {"type": "string", "format": "date-time"},
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status", "lastTransitionTime", "reason", "message"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer"},
                    },
                },
            },
            "replicaStatuses": {"type": "object", "additionalProperties": counts},
            "restarts": {"type": "integer"},
            "restartsWithoutProgress": {"type": "integer"},
            "lastCheckpoint": {
                "type": "object",
                "properties": {"step": {"type": "integer"}, "time": {"type": "string", "format": "date-time"}},
            },
            "progress": {
                "type": "object",
                "properties": {
                    "step": {"type": "integer"},
                    "totalSteps": {"type": "integer"},
                    "loss": {"type": "number"},
                    "evalAccuracy": {"type": "number"},
                    "samplesPerSecond": {"type": "number"},
                    "updateTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    }


PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Workers", "type": "integer", "jsonPath": ".status.workers"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "State", "type": "string", "jsonPath": ".status.state"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    spec_schema = object_schema(Spec)
    spec_schema["description"] = "The desired state of a TrainingJob."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
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
                    "subresources": {"status": {}},
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
                                "status": _status_schema(),
                            },
                            "x-kubernetes-validations": ROOT_CEL,
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `python -m kubetrain_operator.api.crd` from operator/api/spec.py: do not edit.\n"


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
